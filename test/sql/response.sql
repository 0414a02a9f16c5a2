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

-- a 5xx is released whatever its body and headers: they are not stored, so not checked
SET idempotency.max_response_bytes = '1kB';
SELECT fence AS f FROM idempotency.claim('h-6', '\x01') \gset
SELECT idempotency.complete('h-6', :f, 502, convert_to(repeat('x', 2048), 'UTF8'));
SELECT outcome, attempt FROM idempotency.claim('h-6', '\x01');
SELECT fence AS f FROM idempotency.claim('h-7', '\x01') \gset
SELECT idempotency.complete('h-7', :f, 500, 'oops', '{"Retry-After": 5}');
SELECT outcome FROM idempotency.claim('h-7', '\x01');
RESET idempotency.max_response_bytes;

-- headers are HTTP: names are tokens, values hold no CR or LF (22023), and
-- nothing is stored
SELECT fence AS f FROM idempotency.claim('h-8', '\x01') \gset
SELECT idempotency.complete('h-8', :f, 200, NULL, '{"X-A\r\nSet-Cookie: s": "1"}');
SELECT idempotency.complete('h-8', :f, 200, NULL, '{"": "1"}');
SELECT idempotency.complete('h-8', :f, 200, NULL, '{"set-cookie ": "s=1"}');
SELECT idempotency.complete('h-8', :f, 200, NULL, '{"Location": "/a\r\nSet-Cookie: s=1"}');
SELECT idempotency.complete('h-8', :f, 200, NULL, '{"Link": ["<a>", "<b>\n"]}');
SELECT state FROM idempotency.keys WHERE key = 'h-8';
-- the denylist's names are trimmed and case-folded, like the headers'
SET idempotency.header_denylist = ' X-Secret , "X-Other" ';
SELECT idempotency.complete('h-8', :f, 200, NULL, '{"x-secret": "1", "X-OTHER": "2", "X-Kept": "3"}');
SELECT headers FROM idempotency.claim('h-8', '\x01');
RESET idempotency.header_denylist;
-- a malformed list is refused when it is set, not when it is used
SET idempotency.header_denylist = 'a, "b';
SET idempotency.header_denylist = 'a,,b';
SHOW idempotency.header_denylist;

-- everything a record stores is bounded: headers count with the body, and
-- checkpoint's recovery point and state (54000), and the claim stays
SET idempotency.max_response_bytes = '1kB';
SELECT fence AS f FROM idempotency.claim('h-9', '\x01') \gset
SELECT idempotency.complete('h-9', :f, 200, convert_to(repeat('x', 1000), 'UTF8'),
                            jsonb_build_object('X-Big', repeat('y', 100)));
SELECT idempotency.complete('h-9', :f, 200, NULL,
                            jsonb_build_object('X-Big', repeat('y', 2000)));
SELECT idempotency.checkpoint('h-9', :f, repeat('p', 2000));
SELECT idempotency.checkpoint('h-9', :f, 'step-2', jsonb_build_object('s', repeat('z', 2000)));
SELECT state, recovery_point FROM idempotency.keys WHERE key = 'h-9';
SELECT idempotency.checkpoint('h-9', :f, 'step-2', '{"s": 1}');
SELECT recovery_point, recovery_state FROM idempotency.keys WHERE key = 'h-9';
RESET idempotency.max_response_bytes;
-- the limit stays below what a text-format replay can send (hex doubles a body)
SET idempotency.max_response_bytes = '512MB';
SET idempotency.max_response_bytes = '511MB';
RESET idempotency.max_response_bytes;
