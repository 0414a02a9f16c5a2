-- Without Citus (docs/citus.md): citus_distribute is installed and refuses
-- to run; a NULL scope still means the setting idempotency.scope (the
-- guard against NULL scopes, preloaded here, lets it through); the fence
-- sequence is only ever raised.
CREATE EXTENSION IF NOT EXISTS idempotency;
CREATE TABLE citus_charges (tenant text COLLATE "C" NOT NULL);

\set VERBOSITY sqlstate
SELECT idempotency.citus_distribute('citus_charges');
SELECT idempotency.citus_distribute(NULL);
\set VERBOSITY default
\set SHOW_CONTEXT never
SELECT idempotency.citus_distribute('citus_charges');
\set SHOW_CONTEXT errors

-- Superusers only, like _fence_at_least.
CREATE ROLE regress_citus_app;
GRANT USAGE ON SCHEMA idempotency TO regress_citus_app;
SET ROLE regress_citus_app;
\set VERBOSITY sqlstate
SELECT idempotency.citus_distribute('citus_charges');
SELECT idempotency._fence_at_least(1);
\set VERBOSITY default
RESET ROLE;

-- The API as without the recipe: a NULL or omitted scope is the setting's.
SET idempotency.scope = 'acct_setting';
SELECT outcome FROM idempotency.claim('nocitus-1', '\x01');
SELECT outcome FROM idempotency.claim('nocitus-1', '\x01', NULL);
SELECT scope, state FROM idempotency.lookup('nocitus-1', NULL);
PREPARE nocitus(text) AS SELECT outcome FROM idempotency.claim('nocitus-1', '\x01', $1);
EXECUTE nocitus(NULL);
RESET idempotency.scope;

-- _fence_at_least raises the sequence and never lowers it; claims follow.
SELECT idempotency._fence_at_least(1000000) AS raised;
SELECT idempotency._fence_at_least(5) > 1000000 AS never_lowered;
SELECT fence > 1000001 AS claim_above FROM idempotency.claim('nocitus-2', '\x01');

DROP TABLE citus_charges;
DROP OWNED BY regress_citus_app;
DROP ROLE regress_citus_app;
