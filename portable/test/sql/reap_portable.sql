-- reap() of the portable edition: what reap.sql proves, without its race
-- (records made to expire by moving their times back, not by sleeping).
CREATE EXTENSION IF NOT EXISTS idempotency;
BEGIN;
DELETE FROM idempotency.keys;
SELECT k, c.outcome FROM unnest(ARRAY['completed-expired', 'completed-live',
	'in-progress-both-ended', 'in-progress-lease-live', 'expires-1st', 'expires-2nd',
	'expires-3rd']) k, LATERAL idempotency.claim(k, '\x01') c ORDER BY k;
SELECT count(idempotency.complete(key, fence, 200)) AS completed
FROM idempotency.keys WHERE key LIKE 'completed-%' OR key LIKE 'expires-%';
-- expired: retention (and for in_progress, lease) over
UPDATE idempotency.keys SET expires_at = clock_timestamp() - interval '1 hour'
WHERE key IN ('completed-expired', 'in-progress-both-ended', 'in-progress-lease-live');
UPDATE idempotency.keys SET lease_expires_at = clock_timestamp() - interval '1 hour'
WHERE key = 'in-progress-both-ended';
UPDATE idempotency.keys SET expires_at = clock_timestamp() - CASE key
	WHEN 'expires-1st' THEN interval '3 hours' WHEN 'expires-2nd' THEN interval '2 hours'
	ELSE interval '90 minutes' END
WHERE key LIKE 'expires-%';
-- oldest first, batch bounds each call, live leases are spared
SELECT idempotency.reap(2) AS reaped;
SELECT key FROM idempotency.keys ORDER BY key;
SELECT idempotency.reap() AS reaped;
SELECT key, state FROM idempotency.keys ORDER BY key;
SELECT idempotency.reap() AS reaped;
-- a reaped key is free again: new, attempt 1, whatever the fingerprint
SELECT outcome, attempt FROM idempotency.claim('completed-expired', '\x02');
-- batch must be positive
SELECT idempotency.reap(0);
ROLLBACK;
BEGIN READ ONLY;
SELECT idempotency.reap();
ROLLBACK;
-- reap() called by a role deletes the expired records of the roles whose
-- privileges it has only, so that a reap left open holds no other role's
-- records; the table's owner (the scheduled reap) and superusers reap all.
CREATE ROLE idem_reap_alice;
CREATE ROLE idem_reap_bob;
GRANT USAGE ON SCHEMA idempotency TO idem_reap_alice, idem_reap_bob;
BEGIN;
DELETE FROM idempotency.keys;
SET LOCAL ROLE idem_reap_alice;
SELECT outcome FROM idempotency.claim('alice-1', '\x01');
SET LOCAL ROLE idem_reap_bob;
SELECT outcome FROM idempotency.claim('bob-1', '\x01');
RESET ROLE;
UPDATE idempotency.keys SET expires_at = clock_timestamp() - interval '1 hour',
	lease_expires_at = clock_timestamp() - interval '1 hour';
SET LOCAL ROLE idem_reap_alice;
SELECT idempotency.reap() AS reaped_by_alice;
RESET ROLE;
SELECT owner, key FROM idempotency.keys ORDER BY key;
SET LOCAL ROLE idem_reap_bob;
SELECT idempotency.reap() AS reaped_by_bob;
RESET ROLE;
SELECT count(*) AS left FROM idempotency.keys;
ROLLBACK;
REVOKE USAGE ON SCHEMA idempotency FROM idem_reap_alice, idem_reap_bob;
DROP ROLE idem_reap_alice, idem_reap_bob;
