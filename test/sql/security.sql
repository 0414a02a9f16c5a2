-- The security review's findings: a schema made by someone else, records of
-- other roles, the statistics for pg_monitor, the DBA's settings.
CREATE EXTENSION IF NOT EXISTS idempotency;

-- A role that may create schemas pre-creates schema idempotency with its
-- own = operator, hoping the extension binds to it: the install fails.
SELECT current_database() AS regress_db \gset
CREATE ROLE idem_owner LOGIN;
CREATE DATABASE idem_attacked OWNER idem_owner;
\c idem_attacked
SET ROLE idem_owner;
CREATE SCHEMA idempotency;
CREATE FUNCTION idempotency.always(anyenum, text) RETURNS boolean LANGUAGE sql
  AS $$ SELECT true $$;
CREATE OPERATOR idempotency.= (LEFTARG = anyenum, RIGHTARG = text,
                               FUNCTION = idempotency.always);
RESET ROLE;
CREATE EXTENSION idempotency;
SELECT count(*) AS installed FROM pg_extension WHERE extname = 'idempotency';
DROP SCHEMA idempotency CASCADE;
-- without that schema it installs, and binds only pg_catalog's operators
CREATE EXTENSION idempotency;
SELECT count(*) AS foreign_operators
FROM pg_depend e
JOIN pg_rewrite r ON e.classid = 'pg_class'::regclass AND r.ev_class = e.objid
JOIN pg_depend d ON d.classid = 'pg_rewrite'::regclass AND d.objid = r.oid
JOIN pg_operator o ON d.refclassid = 'pg_operator'::regclass AND o.oid = d.refobjid
WHERE e.refclassid = 'pg_extension'::regclass AND e.deptype = 'e'
  AND e.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'idempotency')
  AND o.oprnamespace <> 'pg_catalog'::regnamespace;
-- the schema is the extension's own: dropped with it
DROP EXTENSION idempotency;
SELECT count(*) AS schema_left FROM pg_namespace WHERE nspname = 'idempotency';
\c :regress_db
DROP DATABASE idem_attacked;
DROP ROLE idem_owner;

-- Records belong to the role that claimed them.
CREATE ROLE idem_alice LOGIN;
CREATE ROLE idem_bob LOGIN;
CREATE ROLE idem_alice_worker LOGIN IN ROLE idem_alice;
GRANT USAGE ON SCHEMA idempotency TO idem_alice, idem_bob, idem_alice_worker;
SET ROLE idem_alice;
SELECT fence AS alice_fence FROM idempotency.claim('own-1', '\x01', scope => 's') \gset
-- another role does not see it: no lookup, a claim of its own, no complete or release
SET ROLE idem_bob;
SELECT count(*) AS bob_sees FROM idempotency.lookup('own-1', 's');
SELECT outcome, attempt FROM idempotency.claim('own-1', '\x02', scope => 's');
\set VERBOSITY sqlstate
SELECT idempotency.complete('own-1', :alice_fence, 200, 'forged', scope => 's');
SELECT idempotency.extend('own-1', :alice_fence, scope => 's');
SELECT idempotency.checkpoint('own-1', :alice_fence, 'forged', scope => 's');
\set VERBOSITY default
SELECT idempotency.release('own-1', :alice_fence, scope => 's') AS bob_released;
-- a member of the owner sees it, and may complete it
SET ROLE idem_alice_worker;
SELECT state FROM idempotency.lookup('own-1', 's');
SELECT outcome FROM idempotency.claim('own-1', '\x01', scope => 's');
SELECT idempotency.complete('own-1', :alice_fence, 201, 'alice', scope => 's');
-- the owner replays it; the other role still has its own record
SET ROLE idem_alice;
SELECT outcome, status_code, body FROM idempotency.claim('own-1', '\x01', scope => 's');
SET ROLE idem_bob;
SELECT state, fingerprint FROM idempotency.lookup('own-1', 's');
RESET ROLE;
SELECT owner, state FROM idempotency.keys WHERE key = 'own-1' ORDER BY owner::text;

-- pg_monitor reads the statistics and gets no API (rows_total is an
-- estimate from the cumulative statistics: flush this session's first)
SELECT pg_stat_force_next_flush();
CREATE ROLE idem_monitor LOGIN IN ROLE pg_monitor;
SET ROLE idem_monitor;
SELECT rows_total >= 2 AS has_rows FROM idempotency.stats;
\set VERBOSITY sqlstate
SELECT outcome FROM idempotency.claim('mon-1', '\x01');
SELECT count(*) FROM idempotency.lookup('own-1', 's');
SELECT idempotency.reap();
\set VERBOSITY default
SELECT outcome FROM idempotency.claim('mon-1', '\x01');
RESET ROLE;

-- the DBA's limits are the DBA's: an application role cannot raise them
SET ROLE idem_alice;
\set VERBOSITY sqlstate
SET idempotency.max_response_bytes = '100MB';
SET idempotency.header_denylist = '';
\set VERBOSITY default
SET idempotency.lease = '5s';
SET idempotency.retention = '1h';
SET idempotency.store_server_errors = on;
SET idempotency.scope = 'tenant';
RESET ROLE;
RESET ALL;
ALTER ROLE idem_alice SET idempotency.max_response_bytes = '2MB';
SELECT setconfig FROM pg_db_role_setting WHERE setrole = 'idem_alice'::regrole;

-- every function, the view, the table and the schema explain themselves
SELECT count(*) AS undocumented
FROM pg_depend d
WHERE d.refclassid = 'pg_extension'::regclass AND d.deptype = 'e'
  AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'idempotency')
  AND d.classid IN ('pg_proc'::regclass, 'pg_class'::regclass, 'pg_namespace'::regclass)
  AND obj_description(d.objid, d.classid::regclass::name) IS NULL;
-- lookup reads the clock: VOLATILE
SELECT provolatile FROM pg_proc WHERE oid = 'idempotency.lookup(text, text)'::regprocedure;

DELETE FROM idempotency.keys WHERE key = 'own-1';
ALTER ROLE idem_alice RESET ALL;
REVOKE ALL ON SCHEMA idempotency FROM idem_alice, idem_bob, idem_alice_worker;
DROP ROLE idem_alice_worker, idem_alice, idem_bob, idem_monitor;
