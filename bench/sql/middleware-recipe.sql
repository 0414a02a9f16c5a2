-- middleware, the hand-written recipe of the client packages' bench/overhead
-- for a fresh key: in one transaction INSERT ... ON CONFLICT DO NOTHING into
-- a (scope, key) table, the route's INSERT, the UPDATE that stores the
-- response.  For bench/instructions only.
\set seq :seq + 1
\set key permute(:P * 1000000000000 + :client_id * 1000000000 + :seq, 1000000000000000000, 42)
BEGIN;
INSERT INTO recipe_keys (scope, key, request_hash)
	VALUES ('scope0123456789abcdef', :key, :fp) ON CONFLICT DO NOTHING;
INSERT INTO charges (amount) VALUES ('19.99'::text::numeric) RETURNING id;
UPDATE recipe_keys SET status = 'completed', response_code = 201, response_body = :body
	WHERE scope = 'scope0123456789abcdef' AND key = :key;
COMMIT;
