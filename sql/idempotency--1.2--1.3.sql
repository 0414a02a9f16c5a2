/* idempotency--1.2--1.3.sql */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.3'" to load this file. \quit

-- 1.3: idempotency.stats reads no more than the records in progress (its
-- live figures scanned the whole table), and idempotency.in_flight lists
-- those records for pg_monitor.  Nothing else changes.  Building the index
-- reads the table once and keeps claims waiting meanwhile (a minute per
-- ten million records or so): update at a quiet time.

-- The records in progress, oldest first: what idempotency.stats counts and
-- idempotency.in_flight lists, read without scanning the table.  complete()
-- takes a record out of it, which makes complete's update of the row no
-- longer HOT (bench/RESULTS.md measures what that costs); extend() and
-- checkpoint() change none of its columns.
CREATE INDEX keys_in_progress_idx ON idempotency.keys (created_at)
	WHERE state OPERATOR(pg_catalog.=) 'in_progress'::idempotency.state;

-- The live figures of idempotency.stats, at a cost that does not grow with
-- the table: rows_in_progress and oldest_lease_expires_at are exact, read
-- through keys_in_progress_idx (whatever the planner's statistics say,
-- hence enable_seqscan); rows_total is an estimate: the cumulative
-- statistics' live rows, or pg_class.reltuples when those are empty (after
-- a crash or a reset), never below the records in progress, as an exact
-- count would scan the table.
CREATE FUNCTION idempotency._stats_live(
	OUT rows_total bigint,
	OUT rows_in_progress bigint,
	OUT oldest_lease_expires_at timestamptz)
RETURNS record
LANGUAGE sql STABLE SECURITY DEFINER PARALLEL SAFE
SET search_path TO pg_catalog, pg_temp
SET enable_seqscan TO off
AS $$
SELECT GREATEST(pg_catalog.count(*), (
		SELECT CASE WHEN pg_catalog.pg_stat_get_live_tuples(c.oid) OPERATOR(pg_catalog.>) 0
					THEN pg_catalog.pg_stat_get_live_tuples(c.oid)
					ELSE GREATEST(c.reltuples, 0)::bigint END
		FROM pg_catalog.pg_class c
		WHERE c.oid OPERATOR(pg_catalog.=) 'idempotency.keys'::pg_catalog.regclass)),
	pg_catalog.count(*), pg_catalog.min(k.lease_expires_at)
FROM ONLY idempotency.keys k
WHERE k.state OPERATOR(pg_catalog.=) 'in_progress'::idempotency.state
$$;
COMMENT ON FUNCTION idempotency._stats_live() IS
	'The live figures behind idempotency.stats, without a scan of the records';

-- Counters from shared memory, live figures from _stats_live.
-- claims_resumed (1.2) comes last: an update can only add a view's columns
-- at its end.
CREATE OR REPLACE VIEW idempotency.stats AS
SELECT c.claims_new, c.claims_replay, c.claims_in_progress, c.claims_mismatch,
	c.takeovers, c.waits, c.completes_stored, c.completes_released, c.releases,
	c.fence_rejections, c.reaped, c.reaper_runs, c.last_reap_at, c.stats_reset_at,
	c.last_reap_error, l.rows_total, l.rows_in_progress, l.oldest_lease_expires_at,
	c.claims_resumed
FROM idempotency._stats_counters() c, idempotency._stats_live() l;
COMMENT ON COLUMN idempotency.stats.rows_total IS
	'Estimate of the records: live rows from the cumulative statistics (pg_class.reltuples when they have none)';
COMMENT ON COLUMN idempotency.stats.rows_in_progress IS
	'Records in progress (exact)';
COMMENT ON COLUMN idempotency.stats.oldest_lease_expires_at IS
	'The earliest end of a lease of a record in progress (exact)';

-- The records in progress, oldest first, for whoever monitors the server:
-- which requests are stuck, since when, on which attempt.  writing: a
-- transaction that is still running holds the record (an uncommitted
-- complete, checkpoint, extend or takeover, or a row lock), told by the
-- row's xmax being the id of a transaction in pg_locks.  A function under
-- the view, so that the view does not pin the table's column types.
CREATE FUNCTION idempotency._in_flight()
RETURNS TABLE (scope text, key text, owner name, attempt integer, claimed_at timestamptz,
			   lease_expires_at timestamptz, recovery_point text, writing boolean)
LANGUAGE sql VOLATILE SECURITY DEFINER PARALLEL SAFE
SET search_path TO pg_catalog, pg_temp
AS $$
SELECT k.scope, k.key, pg_catalog.pg_get_userbyid(k.owner::pg_catalog.oid),
	k.attempt, k.created_at, k.lease_expires_at, k.recovery_point,
	k.xmax OPERATOR(pg_catalog.=) ANY (ARRAY(
		SELECT l.transactionid FROM pg_catalog.pg_locks l
		WHERE l.locktype OPERATOR(pg_catalog.=) 'transactionid'
		  AND l.mode OPERATOR(pg_catalog.=) 'ExclusiveLock' AND l.granted))
FROM ONLY idempotency.keys k
WHERE k.state OPERATOR(pg_catalog.=) 'in_progress'::idempotency.state
$$;
COMMENT ON FUNCTION idempotency._in_flight() IS
	'The records behind idempotency.in_flight';

CREATE VIEW idempotency.in_flight AS
SELECT f.scope, f.key, f.owner, f.attempt, f.claimed_at, f.lease_expires_at,
	f.recovery_point, f.writing
FROM idempotency._in_flight() f
ORDER BY f.claimed_at, f.scope, f.key;
COMMENT ON VIEW idempotency.in_flight IS
	'The records in progress, oldest first, and whether a transaction is writing each now';

REVOKE ALL ON FUNCTION idempotency._stats_live() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION idempotency._stats_live() TO pg_monitor;
REVOKE ALL ON FUNCTION idempotency._in_flight() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION idempotency._in_flight() TO pg_monitor;
REVOKE ALL ON idempotency.in_flight FROM PUBLIC;
GRANT SELECT ON idempotency.in_flight TO pg_monitor;
