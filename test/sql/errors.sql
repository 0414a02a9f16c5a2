-- every row of the design's error table, and bad input writes nothing
CREATE EXTENSION IF NOT EXISTS idempotency;
SELECT count(*) AS rows_before FROM idempotency.keys \gset
SELECT last_value AS seq_before FROM idempotency.fence_seq \gset

-- 22004: a required argument is NULL (no API function is STRICT)
SELECT * FROM idempotency.claim(NULL, '\x01');
SELECT * FROM idempotency.claim('k', NULL);
SELECT idempotency.complete(NULL, 1, 200);
SELECT idempotency.complete('k', NULL, 200);
SELECT idempotency.complete('k', 1, NULL);
SELECT idempotency.release(NULL, 1);
SELECT idempotency.release('k', NULL);
SELECT idempotency.extend(NULL, 1);
SELECT idempotency.extend('k', NULL);
SELECT idempotency.checkpoint('k', 1, NULL);
SELECT idempotency.checkpoint('k', NULL, 'p');
SELECT * FROM idempotency.lookup(NULL);
SELECT idempotency.fingerprint(NULL, '/p');
SELECT idempotency.fingerprint('POST', NULL);
SELECT idempotency.fingerprint_json(NULL, '/p', '{}');
SELECT idempotency.fingerprint_json('POST', NULL, '{}');

-- 22023: bad keys
SELECT * FROM idempotency.claim('', '\x01');
SELECT * FROM idempotency.claim(repeat('k', 256), '\x01');
SELECT * FROM idempotency.claim(E'bad\nkey', '\x01');
SELECT * FROM idempotency.claim(E'bad\x7fkey', '\x01');
SELECT * FROM idempotency.claim(E'tab\tkey', '\x01');
SELECT * FROM idempotency.lookup('');
-- 22023: bad scopes
SELECT * FROM idempotency.claim('k', '\x01', scope => repeat('s', 256));
SELECT * FROM idempotency.claim('k', '\x01', scope => E'a\rb');
-- 22023: bad fingerprints
SELECT * FROM idempotency.claim('k', '');
SELECT * FROM idempotency.claim('k', decode(repeat('ab', 65), 'hex'));
-- 22023: leases and retentions that are not positive, a negative wait
SELECT * FROM idempotency.claim('k', '\x01', lease => '0');
SELECT * FROM idempotency.claim('k', '\x01', lease => '-1s');
SELECT * FROM idempotency.claim('k', '\x01', retention => '0');
SELECT * FROM idempotency.claim('k', '\x01', retention => '-1 day');
SELECT * FROM idempotency.claim('k', '\x01', wait => '-1s');
SELECT idempotency.extend('k', 1, '0');
SELECT idempotency.reap(0);
-- 22023 for status codes and headers: see response.sql; 54000 too

-- IK001: the fence does not own the claim (no record at all here)
SELECT idempotency.complete('nobody', 12345, 200);
SELECT idempotency.extend('nobody', 12345);
SELECT idempotency.checkpoint('nobody', 12345, 'p');
SELECT idempotency.release('nobody', 12345);

-- the longest key and the largest fingerprint are accepted
SELECT outcome FROM idempotency.claim(repeat('k', 255), decode(repeat('ab', 64), 'hex'));
SELECT outcome FROM idempotency.claim('ключ-✓', '\x01', scope => repeat('s', 255));
-- a zero wait is no wait
SELECT outcome FROM idempotency.claim('ключ-✓', '\x01', scope => repeat('s', 255), wait => '0');

-- nothing but those two accepted claims was written
SELECT count(*) - :rows_before AS rows_added FROM idempotency.keys;

-- SQLSTATEs, for the record
\set VERBOSITY sqlstate
SELECT * FROM idempotency.claim(NULL, '\x01');
SELECT * FROM idempotency.claim('', '\x01');
SELECT idempotency.complete('nobody', 12345, 200);
BEGIN READ ONLY;
SELECT * FROM idempotency.claim('k', '\x01');
ROLLBACK;
SET idempotency.max_response_bytes = 1;
SELECT idempotency.complete('nobody', 1, 200, '\x0102');
RESET idempotency.max_response_bytes;
\set VERBOSITY default

-- settings are checked and reserved
SET idempotency.lease = 0;
SET idempotency.retention = '-1s';
SET idempotency.no_such_setting = 1;
SET idempotency.reaper_naptime = '10s';

-- positive means later than now, whatever months and days add up to (22023)
SELECT * FROM idempotency.claim('k', '\x01', lease => '-1 year 360 days 1 hour');
SELECT * FROM idempotency.claim('k', '\x01', retention => '-1 year 360 days 1 hour');
SELECT idempotency.extend('k', 1, '1 mon -31 days');
SELECT * FROM idempotency.claim('k', '\x01', wait => '1 mon -40 days');
-- representable: 22023, not an overflow from inside
SELECT * FROM idempotency.claim('k', '\x01', retention => '1000000 years');
SELECT * FROM idempotency.claim('k', '\x01', lease => '1000000 years');
SELECT * FROM idempotency.claim('k', '\x01', wait => '1000000 years');
-- far in the past: 22023 too, not 22008 (timestamp out of range)
SELECT * FROM idempotency.claim('k', '\x01', lease => '-10000 years');
SELECT * FROM idempotency.claim('k', '\x01', retention => '-10000 years');
SELECT * FROM idempotency.claim('k', '\x01', wait => '-10000 years');
SELECT idempotency.extend('k', 1, '-10000 years');
SELECT * FROM idempotency.claim('k', '\x01', lease => '-10000 years 1 second');
SELECT * FROM idempotency.claim('k', '\x01', wait => '-10000 years 10000 days');
SELECT * FROM idempotency.claim('k', '\x01', lease => '-6000 years 3000000 days');
-- a retention shorter than the lease would store a response already expired
SELECT * FROM idempotency.claim('k', '\x01', lease => '60s', retention => '1s');
SET idempotency.retention = '1s';
SELECT * FROM idempotency.claim('k', '\x01');
RESET idempotency.retention;
SELECT count(*) AS nothing_written FROM idempotency.keys WHERE key = 'k';
-- a malformed list of databases is refused when it is set
ALTER SYSTEM SET idempotency.reaper_databases = 'db1,,db2';
