-- an application role with USAGE on the schema uses every function and cannot read the table
CREATE EXTENSION IF NOT EXISTS idempotency;
CREATE ROLE idem_app LOGIN;
GRANT USAGE ON SCHEMA idempotency TO idem_app;
SET ROLE idem_app;

SELECT fence AS f FROM idempotency.claim('priv-1', idempotency.fingerprint('POST', '/x')) \gset
SELECT outcome FROM idempotency.claim('priv-1', idempotency.fingerprint('POST', '/x'));
SELECT idempotency.checkpoint('priv-1', :f, 'p1');
SELECT idempotency.extend('priv-1', :f) > now() AS extended;
SELECT idempotency.complete('priv-1', :f, 200, 'ok');
SELECT outcome, body FROM idempotency.claim('priv-1', idempotency.fingerprint('POST', '/x'));
SELECT key, state FROM idempotency.lookup('priv-1');
SELECT fence AS g FROM idempotency.claim('priv-2', '\x01') \gset
SELECT idempotency.release('priv-2', :g);
SELECT idempotency.reap() >= 0 AS reaped;

-- no direct access to the records, the fence sequence or the statistics
SELECT * FROM idempotency.keys;
DELETE FROM idempotency.keys;
SELECT nextval('idempotency.fence_seq');
SELECT * FROM idempotency.stats;
SELECT idempotency.stats_reset();

-- the caller's search_path cannot redirect the plans: a hostile = is never used
RESET ROLE;
CREATE SCHEMA evil;
GRANT CREATE, USAGE ON SCHEMA evil TO idem_app;
SET ROLE idem_app;
CREATE FUNCTION evil.texteq(text, text) RETURNS boolean LANGUAGE sql
  AS $$ SELECT true $$;
CREATE OPERATOR evil.= (LEFTARG = text, RIGHTARG = text, FUNCTION = evil.texteq);
SET search_path = evil, pg_catalog;
SELECT outcome FROM idempotency.claim('priv-3', '\x01');
SELECT outcome FROM idempotency.claim('priv-4', '\x01');
RESET search_path;
RESET ROLE;

-- a pg_monitor member may read the statistics (rows_total is an estimate
-- from the cumulative statistics: flush this session's first)
SELECT pg_stat_force_next_flush();
GRANT pg_monitor TO idem_app;
SET ROLE idem_app;
SELECT rows_total > 0 AS has_rows FROM idempotency.stats;
RESET ROLE;

-- the records and the sequence are dumped with the extension
SELECT c.relname, array_length(e.extconfig, 1) IS NOT NULL AS dumped
FROM pg_extension e, unnest(e.extconfig) AS r(oid) JOIN pg_class c ON c.oid = r.oid
WHERE e.extname = 'idempotency' ORDER BY 1;
SELECT relacl IS NULL OR NOT relacl::text LIKE '%=r%' AS no_public_read
FROM pg_class WHERE oid = 'idempotency.keys'::regclass;

DROP SCHEMA evil CASCADE;
REVOKE ALL ON SCHEMA idempotency FROM idem_app;
REVOKE pg_monitor FROM idem_app;
DROP ROLE idem_app;
