-- replay, the bare primary-key SELECT of the hand-written table.
\set key 1000000000000000000 + random(1, 100000)
SELECT request_hash, status, response_code, response_body FROM idempotency_keys
	WHERE key = :key;
