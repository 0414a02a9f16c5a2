-- fresh, the reference's statements: INSERT ... ON CONFLICT DO NOTHING, then
-- UPDATE to completed (two autocommit statements).
-- A key no run has used: the run number P, the client and its own counter,
-- spread over 18 digits by a fixed permutation (so, in random order).
\set seq :seq + 1
\set key permute(:P * 1000000000000 + :client_id * 1000000000 + :seq, 1000000000000000000, 42)
INSERT INTO idempotency_keys (key, request_hash, status)
	VALUES (:key, :hash, 'started') ON CONFLICT (key) DO NOTHING;
UPDATE idempotency_keys SET status = 'completed', response_code = 201, response_body = :body
	WHERE key = :key;
