-- reap(): deletes only expired records (an in_progress one only once its
-- lease has ended too), oldest expires_at first, at most batch per call, and
-- returns how many
CREATE EXTENSION IF NOT EXISTS idempotency;

-- batch must be positive
SELECT idempotency.reap(0);
SELECT idempotency.reap(-1);

-- Everything below runs in one transaction that is rolled back: the records
-- other tests left neither count here nor disappear for them.  reap() and
-- claim() read the clock, not the transaction's start time.
BEGIN;
DELETE FROM idempotency.keys;
SELECT reaped AS reaped_before FROM idempotency.stats \gset

-- nothing to reap
SELECT idempotency.reap() AS reaped;

-- one record of each kind; only the first two are expired
SELECT k, c.outcome, idempotency.complete(k, c.fence, 200) AS completed
FROM (VALUES ('completed-expired', interval '1 ms'),
             ('completed-live', interval '1 hour')) v(k, r),
     LATERAL idempotency.claim(k, '\x01', lease => r, retention => r) c;
-- a lease longer than the retention: extended after the claim
SELECT k, c.outcome,
       CASE WHEN l > r THEN idempotency.extend(k, c.fence, l) > clock_timestamp() END AS extended
FROM (VALUES ('in-progress-both-ended', interval '1 ms', interval '1 ms'),
             ('in-progress-lease-live', interval '1 hour', interval '1 ms'),
             ('in-progress-retention-live', interval '1 ms', interval '1 hour')) v(k, l, r),
     LATERAL idempotency.claim(k, '\x01', lease => LEAST(l, r), retention => r) c;
-- extend moves the expiry with the lease, so the API never leaves a record
-- expired under a live lease (claim.sql); a clock stepped back can: made so
-- here by hand, reap must still spare it
UPDATE idempotency.keys SET expires_at = created_at + interval '1 ms'
WHERE key = 'in-progress-lease-live';
SELECT pg_sleep(0.05);

-- the completed record past its retention, and the in_progress one past
-- both its retention and its lease
SELECT idempotency.reap() AS reaped;
SELECT key, state, expires_at < clock_timestamp() AS retention_ended,
       lease_expires_at < clock_timestamp() AS lease_ended
FROM idempotency.keys ORDER BY key;

-- nothing more to reap
SELECT idempotency.reap() AS reaped;

-- a reaped key is free again: new, attempt 1, whatever the fingerprint
SELECT outcome, attempt FROM idempotency.claim('completed-expired', '\x02');

-- batch bounds each call, and the oldest expires_at goes first: claimed in
-- this order, these expire in the reverse one
SELECT k, c.outcome, idempotency.complete(k, c.fence, 200) AS completed
FROM (VALUES ('expires-5th', interval '500 ms'), ('expires-4th', interval '400 ms'),
             ('expires-3rd', interval '300 ms'), ('expires-2nd', interval '200 ms'),
             ('expires-1st', interval '100 ms')) v(k, r),
     LATERAL idempotency.claim(k, '\x01', lease => r, retention => r) c;
SELECT pg_sleep(0.6);
SELECT idempotency.reap(2) AS reaped;
SELECT key FROM idempotency.keys WHERE key LIKE 'expires-%' ORDER BY key;
SELECT idempotency.reap(2) AS reaped;
SELECT key FROM idempotency.keys WHERE key LIKE 'expires-%' ORDER BY key;
SELECT idempotency.reap(2) AS reaped;
SELECT idempotency.reap(2) AS reaped;
SELECT count(*) AS expiring_left FROM idempotency.keys WHERE key LIKE 'expires-%';

-- NULL: a batch of idempotency.reaper_batch (10000 by default)
SELECT count(idempotency.claim('bulk-' || g, '\x01', lease => '1 ms', retention => '1 ms'))
FROM generate_series(1, 10005) g;
SELECT pg_sleep(0.05);
SELECT idempotency.reap(NULL) AS reaped;
SELECT idempotency.reap() AS reaped;

-- the counter of idempotency.stats adds up the returned counts: 2 + 5 + 10005
SELECT reaped - :reaped_before AS reaped_counted, last_reap_at > now() - interval '1 min' AS recent
FROM idempotency.stats;

-- what is left: the live records only
SELECT key, state FROM idempotency.keys ORDER BY key;
ROLLBACK;

-- a writing function: refused in a read-only transaction
BEGIN READ ONLY;
SELECT idempotency.reap();
ROLLBACK;
