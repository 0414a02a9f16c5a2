-- The portable edition measures and bounds its arguments as the C edition
-- does: headers and recovery state by their size in memory (not as stored,
-- compressed, in a table they were read from); an interval's fields up to
-- 10000 years each; a span back beyond the first timestamp is not positive
-- (22023), not a timestamp out of range (22008).
CREATE EXTENSION IF NOT EXISTS idempotency;

-- 3 MB of headers and of recovery state, compressed to a few kB where they
-- are stored: over idempotency.max_response_bytes (1MB) all the same
CREATE TABLE public.idem_big (headers jsonb, state jsonb);
INSERT INTO public.idem_big
SELECT jsonb_build_object('x-big', repeat('a', 3000000)), jsonb_build_object('s', repeat('b', 3000000));
SELECT pg_column_size(headers) < 100000 AS headers_stored_small,
       pg_column_size(state) < 100000 AS state_stored_small
FROM public.idem_big;
SELECT fence AS big_fence FROM idempotency.claim('Big-1', '\x01', scope => 'limits') \gset
SELECT idempotency.complete('Big-1', :big_fence, 200, 'x', b.headers, scope => 'limits')
FROM public.idem_big b;
SELECT idempotency.checkpoint('Big-1', :big_fence, 'step', b.state, scope => 'limits')
FROM public.idem_big b;
-- nothing was written
SELECT state, recovery_point, headers IS NULL AS no_headers FROM idempotency.lookup('Big-1', 'limits');
-- within the limit, from the same table: stored
SET idempotency.max_response_bytes = '4MB';
SELECT idempotency.checkpoint('Big-1', :big_fence, 'step', b.state, scope => 'limits')
FROM public.idem_big b;
SELECT idempotency.complete('Big-1', :big_fence, 200, 'x', b.headers, scope => 'limits')
FROM public.idem_big b;
RESET idempotency.max_response_bytes;
SELECT state, recovery_point, octet_length(headers ->> 'x-big') AS header_bytes
FROM idempotency.lookup('Big-1', 'limits');
DROP TABLE public.idem_big;

-- the time part of an interval: up to 10000 years of 366 days
-- (87,840,000 hours); 87,841 hours is about ten years
SELECT outcome, attempt FROM idempotency.claim('Long-1', '\x01', scope => 'limits',
  lease => '87841 hours', retention => '87841 hours');
SELECT outcome FROM idempotency.claim('Long-2', '\x01', scope => 'limits',
  lease => '87840000 hours', retention => '87840000 hours');
\set VERBOSITY sqlstate
SELECT outcome FROM idempotency.claim('Long-3', '\x01', scope => 'limits',
  lease => '87840001 hours', retention => '87840001 hours');
\set VERBOSITY default

-- ten thousand years back: not positive (22023), not 22008
\set VERBOSITY sqlstate
SELECT outcome FROM idempotency.claim('Back-1', '\x01', scope => 'limits', lease => '-10000 years');
SELECT outcome FROM idempotency.claim('Back-1', '\x01', scope => 'limits', retention => '-10000 years');
SELECT outcome FROM idempotency.claim('Back-1', '\x01', scope => 'limits', wait => '-10000 years');
SELECT outcome FROM idempotency.claim('Back-1', '\x01', scope => 'limits', lease => '-87840000 hours');
SELECT outcome FROM idempotency.claim('Back-1', '\x01', scope => 'limits', wait => '-3660000 days');
SELECT fence AS long_fence FROM idempotency.keys WHERE key = 'Long-1' AND scope = 'limits' \gset
SELECT idempotency.extend('Long-1', :long_fence, '-10000 years', scope => 'limits');
\set VERBOSITY default
SELECT count(*) AS back_written FROM idempotency.keys WHERE scope = 'limits' AND key LIKE 'Back-%';
-- and the messages
SELECT outcome FROM idempotency.claim('Back-1', '\x01', scope => 'limits', lease => '-10000 years');
SELECT outcome FROM idempotency.claim('Back-1', '\x01', scope => 'limits', wait => '-10000 years');

DELETE FROM idempotency.keys WHERE scope = 'limits';

-- A wait beyond what lock_timeout can hold (about 24.8 days) is taken, as
-- the C edition takes it, on every path that may wait for another
-- transaction's write: a new key, a resumption with the token, a takeover,
-- a reset of an expired record.
SELECT outcome, attempt FROM idempotency.claim('Wait-1', '\x01', scope => 'limits', wait => '30 days',
	token => '00000000-0000-0000-0000-000000000001');
SELECT outcome, attempt FROM idempotency.claim('Wait-1', '\x01', scope => 'limits', wait => '10000 years',
	token => '00000000-0000-0000-0000-000000000001');
UPDATE idempotency.keys SET lease_expires_at = clock_timestamp() - interval '1 second'
WHERE key = 'Wait-1' AND scope = 'limits';
SELECT outcome, attempt FROM idempotency.claim('Wait-1', '\x01', scope => 'limits', wait => '30 days');
UPDATE idempotency.keys SET lease_expires_at = clock_timestamp() - interval '1 second',
	expires_at = clock_timestamp() - interval '1 second'
WHERE key = 'Wait-1' AND scope = 'limits';
SELECT outcome, attempt FROM idempotency.claim('Wait-1', '\x01', scope => 'limits', wait => '30 days');
DELETE FROM idempotency.keys WHERE scope = 'limits';
