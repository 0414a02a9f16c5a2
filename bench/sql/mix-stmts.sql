-- mix, the reference's statements: the same traffic as mix-ext.sql.  A fresh
-- key: INSERT ... ON CONFLICT DO NOTHING, then UPDATE to completed; a retry:
-- the INSERT finds the key, then the SELECT reads what is there.
\set r random(1, 1000)
\set seq :seq + 1
\if :r <= 980
\set key permute(:P * 1000000000000 + :client_id * 1000000000 + :seq, 1000000000000000000, 42)
INSERT INTO idempotency_keys (key, request_hash, status)
	VALUES (:key, :hash, 'started') ON CONFLICT (key) DO NOTHING;
UPDATE idempotency_keys SET status = 'completed', response_code = 201, response_body = :body
	WHERE key = :key;
\elif :r <= 995
\set key 1000000000000000000 + random(1, 100000)
INSERT INTO idempotency_keys (key, request_hash, status)
	VALUES (:key, :hash, 'started') ON CONFLICT (key) DO NOTHING;
SELECT request_hash, status, response_code, response_body FROM idempotency_keys
	WHERE key = :key;
\else
\set key 2000000000000000000 + random(1, 100000)
INSERT INTO idempotency_keys (key, request_hash, status)
	VALUES (:key, :hash, 'started') ON CONFLICT (key) DO NOTHING;
SELECT request_hash, status, response_code, response_body FROM idempotency_keys
	WHERE key = :key;
\endif
