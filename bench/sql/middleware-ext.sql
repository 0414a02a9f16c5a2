-- middleware, extension: what a client's middleware sends for a fresh key in
-- its one-transaction mode (the Rust layer's statements, bound): BEGIN with
-- the claim of a caller's scope with a token, the route's INSERT, complete
-- with the response's headers, COMMIT.  pgbench reads text, so the claim's
-- columns are those of the layer's text queries (its prepared claim reads
-- body and created_at as stored, in binary).  For bench/instructions only.
\set seq :seq + 1
\set key permute(:P * 1000000000000 + :client_id * 1000000000 + :seq, 1000000000000000000, 42)
BEGIN;
SELECT outcome, fence, attempt, status_code, headers, encode(body, 'hex'), recovery_point,
	recovery_state, retry_after, (extract(epoch FROM created_at) * 1000000)::int8
	FROM idempotency.claim((:key)::text, (:fp)::bytea, 'scope0123456789abcdef'::text,
		NULL::interval, NULL::interval, NULL::interval,
		token => 'a81bc81b-dead-4e5d-abff-90865d1e13b1'::uuid) \gset
INSERT INTO charges (amount) VALUES ('19.99'::text::numeric) RETURNING id;
SELECT idempotency.complete((:key)::text, (:fence)::int8, 201, (:body)::bytea,
	'{"content-type": "application/json"}'::jsonb, 'scope0123456789abcdef'::text);
COMMIT;
