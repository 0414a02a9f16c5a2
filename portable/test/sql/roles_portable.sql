-- The portable edition's API does its work as the table's owner, for the
-- role whose code calls it (a token that only that role's code can make).
-- No application role holds a privilege on the table or on any relation
-- over it: it cannot read, write or lock the records but through the API,
-- nor plan a query (EXPLAIN ANALYZE) that visits another role's; it
-- cannot make a token that names another role.
CREATE EXTENSION IF NOT EXISTS idempotency;
CREATE ROLE idem_pr_alice LOGIN;
CREATE ROLE idem_pr_bob LOGIN;
CREATE ROLE idem_pr_alice_worker LOGIN IN ROLE idem_pr_alice;
CREATE ROLE idem_pr_monitor IN ROLE pg_monitor;
GRANT USAGE ON SCHEMA idempotency TO idem_pr_alice, idem_pr_bob, idem_pr_alice_worker;
SET ROLE idem_pr_bob;
SELECT fence AS bob_fence FROM idempotency.claim('pr-1', '\x01', scope => 'pr') \gset
SELECT idempotency.complete('pr-1', :bob_fence, 200, 'bob''s', scope => 'pr');
SET ROLE idem_pr_alice;
SELECT fence AS alice_fence FROM idempotency.claim('pr-2', '\x01', scope => 'pr') \gset

-- no relation of the schema is open to her, nor to a pg_monitor member but
-- the two views of the statistics
SELECT c.relname FROM pg_class c
WHERE c.relnamespace = 'idempotency'::regnamespace
  AND (has_table_privilege(c.oid, 'SELECT, INSERT, UPDATE, DELETE, TRUNCATE, REFERENCES, TRIGGER')
	   OR has_any_column_privilege(c.oid, 'SELECT, INSERT, UPDATE, REFERENCES'))
ORDER BY 1;
SET ROLE idem_pr_monitor;
SELECT c.relname FROM pg_class c
WHERE c.relnamespace = 'idempotency'::regnamespace
  AND (has_table_privilege(c.oid, 'SELECT, INSERT, UPDATE, DELETE, TRUNCATE, REFERENCES, TRIGGER')
	   OR has_any_column_privilege(c.oid, 'SELECT, INSERT, UPDATE, REFERENCES'))
ORDER BY 1;
SET ROLE idem_pr_alice;
-- so she plans no query over the records: not over bob's key (which the
-- plan's rows removed by a filter would tell), and a call's plan shows
-- nothing of the queries inside it
EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF)
SELECT key FROM idempotency._own_keys WHERE key = 'pr-1' AND scope = 'pr';
EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF)
SELECT key FROM idempotency.keys WHERE key = 'pr-1' AND scope = 'pr';
EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF)
SELECT * FROM idempotency.lookup('pr-1', scope => 'pr');
-- claim is one expression, which the planner puts in the calling query:
-- a call runs one function, its work, and no wrapper of its own
EXPLAIN (COSTS OFF)
SELECT * FROM idempotency.claim('pr-1', '\x01', scope => 'pr');
-- nor can she lock them, in any mode (a lock held idle would stall every
-- role's calls and the reap); a pg_monitor member neither
BEGIN;
LOCK TABLE idempotency.keys IN ACCESS SHARE MODE;
ROLLBACK;
BEGIN;
LOCK TABLE idempotency.keys IN ACCESS EXCLUSIVE MODE;
ROLLBACK;
SET ROLE idem_pr_monitor;
BEGIN;
LOCK TABLE idempotency.keys IN ACCESS EXCLUSIVE MODE;
ROLLBACK;
BEGIN;
LOCK TABLE idempotency.in_flight IN ACCESS EXCLUSIVE MODE;
ROLLBACK;
SET ROLE idem_pr_alice;
-- nor write the table, nor the fence sequence
TRUNCATE idempotency.keys;
SELECT setval('idempotency.fence_seq', 1);

-- through the API she sees her records, never bob's
SELECT key, state FROM idempotency.lookup('pr-2', scope => 'pr');
SELECT count(*) FROM idempotency.lookup('pr-1', scope => 'pr');
SELECT idempotency.release('pr-1', :bob_fence, scope => 'pr');
-- a member of hers sees hers, never bob's
SET ROLE idem_pr_alice_worker;
SELECT key, state FROM idempotency.lookup('pr-2', scope => 'pr');
SELECT count(*) FROM idempotency.lookup('pr-1', scope => 'pr');
SET ROLE idem_pr_alice;

-- she cannot act as bob: a token names the role of the code that made it,
-- in the statement that made it (the API's work refuses another)
SELECT oid AS bob_oid FROM pg_roles WHERE rolname = 'idem_pr_bob' \gset
SELECT * FROM idempotency._lookup(ARRAY[:bob_oid, pg_backend_pid(),
	(extract(epoch FROM statement_timestamp()) * 1000000)::bigint], 'pr-1', 'pr');
SELECT idempotency._release(ARRAY[:bob_oid, pg_backend_pid(), 0]::bigint[], 'pr-1', :bob_fence, 'pr');
SELECT idempotency._me() AS old_token \gset
SELECT * FROM idempotency._lookup(:'old_token', 'pr-2', 'pr');
SELECT * FROM idempotency._lookup(NULL, 'pr-2', 'pr');
SELECT idempotency._claim(idempotency._me(), 'pr-3', '\x01', 'pr', NULL, NULL, NULL, NULL);
RESET ROLE;
-- bob's record is as he left it
SELECT owner, key, state, body FROM idempotency.keys WHERE scope = 'pr' ORDER BY key, owner::text;

DELETE FROM idempotency.keys WHERE scope = 'pr';
REVOKE ALL ON SCHEMA idempotency FROM idem_pr_alice, idem_pr_bob, idem_pr_alice_worker;
DROP ROLE idem_pr_alice_worker, idem_pr_alice, idem_pr_bob, idem_pr_monitor;
