-- The portable edition's API runs with its caller's rights and reaches the
-- records through the view idempotency._own_keys.  What a role can do there
-- directly is what it may do to its own records (and to those of the roles
-- whose privileges it has), never to another role's; the table itself stays
-- closed to it.
CREATE EXTENSION IF NOT EXISTS idempotency;
CREATE ROLE idem_pr_alice LOGIN;
CREATE ROLE idem_pr_bob LOGIN;
CREATE ROLE idem_pr_alice_worker LOGIN IN ROLE idem_pr_alice;
GRANT USAGE ON SCHEMA idempotency TO idem_pr_alice, idem_pr_bob, idem_pr_alice_worker;
SET ROLE idem_pr_bob;
SELECT fence AS bob_fence FROM idempotency.claim('pr-1', '\x01', scope => 'pr') \gset
SELECT idempotency.complete('pr-1', :bob_fence, 200, 'bob''s', scope => 'pr');
SET ROLE idem_pr_alice;
SELECT fence AS alice_fence FROM idempotency.claim('pr-2', '\x01', scope => 'pr') \gset

-- alice sees her own records only
SELECT owner, key, state FROM idempotency._own_keys WHERE scope = 'pr' ORDER BY key;
-- a function of hers in the WHERE clause, however cheap, sees none of bob's
-- rows (a security barrier)
CREATE FUNCTION pg_temp.leak(k text, b bytea) RETURNS boolean LANGUAGE plpgsql COST 0.000001 AS $$
BEGIN
  RAISE NOTICE 'leak saw % %', k, b;
  RETURN true;
END $$;
SELECT count(*) FROM idempotency._own_keys WHERE pg_temp.leak(key, body) AND scope = 'pr';
-- she cannot change bob's, nor delete any record by hand (release and
-- reap delete, through idempotency._calls)
UPDATE idempotency._own_keys SET body = 'forged' WHERE key = 'pr-1';
DELETE FROM idempotency._own_keys WHERE key = 'pr-1';
-- nor write owner (hand hers to bob, write one as bob), key or scope
\set VERBOSITY sqlstate
UPDATE idempotency._own_keys SET owner = 'idem_pr_bob' WHERE key = 'pr-2';
UPDATE idempotency._own_keys SET key = 'pr-1' WHERE key = 'pr-2';
INSERT INTO idempotency._own_keys (fence, created_at, expires_at, attempt, owner, state, scope, key, fingerprint)
VALUES (1, now(), now() + interval '1 day', 1, 'idem_pr_bob', 'completed', 'pr', 'pr-1', '\x01');
\set VERBOSITY default
-- a row she inserts is hers: bob's record of the same key neither stops it
-- nor is touched (so an insert cannot tell whether bob has one)
INSERT INTO idempotency._own_keys (fence, created_at, expires_at, attempt, state, scope, key, fingerprint)
VALUES (1, now(), now() + interval '1 day', 1, 'in_progress', 'pr', 'pr-1', '\x02')
ON CONFLICT (key, scope, owner) DO NOTHING;
SELECT owner, key, fingerprint FROM idempotency._own_keys WHERE key = 'pr-1';
SELECT idempotency.release('pr-1', 1, scope => 'pr');
-- the table itself, and the fence sequence's values, stay closed
SELECT count(*) FROM idempotency.keys;
TRUNCATE idempotency.keys;
SELECT setval('idempotency.fence_seq', 1);
-- her own records she may write directly, as the API would not: here one
-- she completes herself, which claim then replays
UPDATE idempotency._own_keys SET state = 'completed', status_code = 299, body = 'direct',
  lease = NULL, lease_expires_at = NULL, completed_at = now(), token = NULL
WHERE key = 'pr-2' AND scope = 'pr';
SELECT outcome, status_code, body FROM idempotency.claim('pr-2', '\x01', scope => 'pr');
DROP FUNCTION pg_temp.leak(text, bytea);
-- a member of hers sees hers, never bob's
SET ROLE idem_pr_alice_worker;
SELECT owner, key FROM idempotency._own_keys WHERE scope = 'pr' ORDER BY key;
RESET ROLE;
-- No role can lock the records for the others (it holds column privileges
-- only, and LOCK TABLE takes none), in any mode: a lock that it held idle
-- would stall every role's calls and the reap.  A pg_monitor member too.
CREATE ROLE idem_pr_monitor IN ROLE pg_monitor;
SET ROLE idem_pr_alice;
BEGIN;
LOCK TABLE idempotency._own_keys IN ACCESS EXCLUSIVE MODE;
ROLLBACK;
BEGIN;
LOCK TABLE idempotency._own_keys IN ACCESS SHARE MODE;
ROLLBACK;
BEGIN;
LOCK TABLE idempotency._own_keys IN ROW EXCLUSIVE MODE;
ROLLBACK;
BEGIN;
LOCK TABLE idempotency._calls IN ACCESS EXCLUSIVE MODE;
ROLLBACK;
BEGIN;
LOCK TABLE idempotency.keys IN ACCESS SHARE MODE;
ROLLBACK;
SET ROLE idem_pr_monitor;
BEGIN;
LOCK TABLE idempotency._own_keys IN ACCESS EXCLUSIVE MODE;
ROLLBACK;
-- nor make a call for another role: the caller is current_user
SET ROLE idem_pr_alice;
INSERT INTO idempotency._calls (op, key, scope, fence, caller)
VALUES ('release', 'pr-1', 'pr', :bob_fence, 'idem_pr_bob');
SELECT idempotency._call();
RESET ROLE;
DROP ROLE idem_pr_monitor;
-- bob's record is as he left it
SELECT owner, key, state, body FROM idempotency.keys WHERE scope = 'pr' ORDER BY key, owner::text;

DELETE FROM idempotency.keys WHERE scope = 'pr';
REVOKE ALL ON SCHEMA idempotency FROM idem_pr_alice, idem_pr_bob, idem_pr_alice_worker;
DROP ROLE idem_pr_alice_worker, idem_pr_alice, idem_pr_bob;
