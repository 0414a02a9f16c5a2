-- complete: status codes, headers and the denylist, the size cap
CREATE EXTENSION IF NOT EXISTS idempotency;

-- denied headers are not stored, whatever their case; the rest are, arrays included
SELECT fence AS f FROM idempotency.claim('h-1', '\x01') \gset
SELECT idempotency.complete('h-1', :f, 200, 'ok', '{"Content-Type": "text/plain",
  "SET-COOKIE": "session=secret", "Authorization": "Bearer t", "cookie": "a=b",
  "Proxy-Authorization": "x", "WWW-Authenticate": "Basic", "Link": ["<a>", "<b>"]}');
SELECT headers FROM idempotency.claim('h-1', '\x01');

-- a custom denylist; '' stores every header
SET idempotency.header_denylist = 'x-internal';
SELECT fence AS f FROM idempotency.claim('h-2', '\x01') \gset
SELECT idempotency.complete('h-2', :f, 200, NULL, '{"X-Internal": "1", "Set-Cookie": "s=1"}');
SELECT headers, body FROM idempotency.claim('h-2', '\x01');
SET idempotency.header_denylist = '';
SELECT fence AS f FROM idempotency.claim('h-3', '\x01') \gset
SELECT idempotency.complete('h-3', :f, 204, NULL, '{"Set-Cookie": "s=1"}');
SELECT status_code, headers FROM idempotency.claim('h-3', '\x01');
RESET idempotency.header_denylist;

-- headers of the wrong shape: 22023, and the claim stays as it was
SELECT fence AS f FROM idempotency.claim('h-4', '\x01') \gset
\set VERBOSITY sqlstate
SELECT idempotency.complete('h-4', :f, 200, NULL, '["a"]');
SELECT idempotency.complete('h-4', :f, 200, NULL, '"text"');
SELECT idempotency.complete('h-4', :f, 200, NULL, '{"a": 1}');
SELECT idempotency.complete('h-4', :f, 200, NULL, '{"a": {"b": "c"}}');
SELECT idempotency.complete('h-4', :f, 200, NULL, '{"a": ["b", 2]}');
SELECT idempotency.complete('h-4', :f, 200, NULL, '{"a": null}');
-- status code out of range: 22023
SELECT idempotency.complete('h-4', :f, 99);
SELECT idempotency.complete('h-4', :f, 600);
\set VERBOSITY default
SELECT idempotency.complete('h-4', :f, 600);
SELECT idempotency.complete('h-4', :f, 200, NULL, '{"a": 1}');
SELECT state FROM idempotency.keys WHERE key = 'h-4';

-- the size cap: a body over max_response_bytes is 54000 and the claim stays
SET idempotency.max_response_bytes = '1kB';
SELECT idempotency.complete('h-4', :f, 200, convert_to(repeat('x', 1025), 'UTF8'));
SELECT state FROM idempotency.keys WHERE key = 'h-4';
SELECT idempotency.complete('h-4', :f, 200, convert_to(repeat('x', 1024), 'UTF8'));
SELECT length(body) FROM idempotency.claim('h-4', '\x01');
SHOW idempotency.max_response_bytes;
SET idempotency.max_response_bytes = '1025MB';
SET idempotency.max_response_bytes = '1GB';
RESET idempotency.max_response_bytes;

-- an empty body and NULL body are different and both replay as given
SELECT fence AS f FROM idempotency.claim('h-5', '\x01') \gset
SELECT idempotency.complete('h-5', :f, 200, '');
SELECT body, body IS NULL AS is_null FROM idempotency.claim('h-5', '\x01');
