-- replay, the reference's claim: the INSERT finds the key, then the SELECT.
\set key 1000000000000000000 + random(1, 100000)
INSERT INTO idempotency_keys (key, request_hash, status)
	VALUES (:key, :hash, 'started') ON CONFLICT (key) DO NOTHING;
SELECT request_hash, status, response_code, response_body FROM idempotency_keys
	WHERE key = :key;
