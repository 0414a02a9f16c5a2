-- fingerprint(): SHA-256 of an unambiguous encoding of the request
CREATE EXTENSION IF NOT EXISTS idempotency;

SELECT length(idempotency.fingerprint('POST', '/payments', '{"a":1}')) AS bytes;
-- a known value, so the encoding never changes silently
SELECT idempotency.fingerprint('POST', '/payments', '{"a":1}', 'x=1');
-- method is case-insensitive
SELECT idempotency.fingerprint('post', '/p', 'b') = idempotency.fingerprint('POST', '/p', 'b') AS method_case;
-- parts are length-prefixed: ('a','bc') and ('ab','c') differ
SELECT idempotency.fingerprint('a', 'bc') <> idempotency.fingerprint('ab', 'c') AS method_path;
SELECT idempotency.fingerprint('POST', '/p', 'ab', 'c') <> idempotency.fingerprint('POST', '/p', 'a', 'bc') AS body_query;
SELECT idempotency.fingerprint('POST', '/p', NULL, 'q') <> idempotency.fingerprint('POST', '/p', 'q') AS query_vs_body;
-- NULL body or query means none, distinct from empty
SELECT idempotency.fingerprint('POST', '/p', NULL) <> idempotency.fingerprint('POST', '/p', '') AS null_vs_empty_body;
SELECT idempotency.fingerprint('POST', '/p', 'b', NULL) <> idempotency.fingerprint('POST', '/p', 'b', '') AS null_vs_empty_query;
SELECT idempotency.fingerprint('POST', '/p') = idempotency.fingerprint('POST', '/p', NULL, NULL) AS defaults;
-- path and body are case-sensitive
SELECT idempotency.fingerprint('POST', '/P') <> idempotency.fingerprint('POST', '/p') AS path_case;
-- binary bodies with zero bytes
SELECT idempotency.fingerprint('POST', '/p', '\x00') <> idempotency.fingerprint('POST', '/p', '\x0000') AS zero_bytes;

-- fingerprint_json(): key order and whitespace do not matter
SELECT idempotency.fingerprint_json('POST', '/p', '{"a": 1, "b": [1, 2]}')
     = idempotency.fingerprint_json('POST', '/p', '{ "b":[1,2],"a":1 }') AS key_order;
SELECT idempotency.fingerprint_json('POST', '/p', '{"a": 1}')
    <> idempotency.fingerprint_json('POST', '/p', '{"a": 2}') AS values_matter;
SELECT idempotency.fingerprint_json('POST', '/p', '[1, 2]')
    <> idempotency.fingerprint_json('POST', '/p', '[2, 1]') AS array_order;
-- it is the fingerprint of the canonical text
SELECT idempotency.fingerprint_json('POST', '/p', '{"b":2,"a":1}', 'q')
     = idempotency.fingerprint('POST', '/p', convert_to('{"a": 1, "b": 2}', 'UTF8'), 'q') AS canonical;
SELECT idempotency.fingerprint_json('POST', '/p', NULL) = idempotency.fingerprint('POST', '/p') AS null_body;
