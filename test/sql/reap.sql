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
-- The test's clock: makes records look claimed d earlier (every timestamp
-- moved back), so that no step depends on how fast the previous one ran.
CREATE FUNCTION pg_temp.age(pattern text, d interval) RETURNS void LANGUAGE sql AS $$
	UPDATE idempotency.keys
	SET created_at = created_at - d, expires_at = expires_at - d,
		lease_expires_at = lease_expires_at - d, completed_at = completed_at - d
	WHERE key LIKE pattern
$$;

-- nothing to reap
SELECT idempotency.reap() AS reaped;

-- one record of each kind; only the first two are expired once two
-- minutes have passed
SELECT k, c.outcome, idempotency.complete(k, c.fence, 200) AS completed
FROM (VALUES ('completed-expired', interval '1 min'),
             ('completed-live', interval '1 hour')) v(k, r),
     LATERAL idempotency.claim(k, '\x01', lease => r, retention => r) c;
-- a lease longer than the retention: extended after the claim
SELECT k, c.outcome,
       CASE WHEN l > r THEN idempotency.extend(k, c.fence, l) > clock_timestamp() END AS extended
FROM (VALUES ('in-progress-both-ended', interval '1 min', interval '1 min'),
             ('in-progress-lease-live', interval '1 hour', interval '1 min'),
             ('in-progress-retention-live', interval '1 min', interval '1 hour')) v(k, l, r),
     LATERAL idempotency.claim(k, '\x01', lease => LEAST(l, r), retention => r) c;
SELECT pg_temp.age('%', '2 minutes');
-- extend moves the expiry with the lease, so the API never leaves a record
-- expired under a live lease (claim.sql); a clock stepped back can: made so
-- here by hand, reap must still spare it
UPDATE idempotency.keys SET expires_at = created_at + interval '1 min'
WHERE key = 'in-progress-lease-live';

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
FROM (VALUES ('expires-5th', interval '5 hours'), ('expires-4th', interval '4 hours'),
             ('expires-3rd', interval '3 hours'), ('expires-2nd', interval '2 hours'),
             ('expires-1st', interval '1 hour')) v(k, r),
     LATERAL idempotency.claim(k, '\x01', lease => r, retention => r) c;
SELECT pg_temp.age('expires-%', '6 hours');
SELECT idempotency.reap(2) AS reaped;
SELECT key FROM idempotency.keys WHERE key LIKE 'expires-%' ORDER BY key;
SELECT idempotency.reap(2) AS reaped;
SELECT key FROM idempotency.keys WHERE key LIKE 'expires-%' ORDER BY key;
SELECT idempotency.reap(2) AS reaped;
SELECT idempotency.reap(2) AS reaped;
SELECT count(*) AS expiring_left FROM idempotency.keys WHERE key LIKE 'expires-%';

-- NULL: a batch of idempotency.reaper_batch (10000 by default)
SELECT count(idempotency.claim('bulk-' || g, '\x01', lease => '1 min', retention => '1 min'))
FROM generate_series(1, 10005) g;
SELECT pg_temp.age('bulk-%', '2 minutes');
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
