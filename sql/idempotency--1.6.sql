/* idempotency--1.6.sql */

-- complain if script is sourced in psql, rather than via CREATE EXTENSION
\echo Use "CREATE EXTENSION idempotency" to load this file. \quit

-- The extension makes its own schema, and fails if one by that name exists:
-- objects someone else put there (an operator, a function) could otherwise
-- be bound into ours.  For the same reason every name below is qualified,
-- operators included.
CREATE SCHEMA idempotency;
COMMENT ON SCHEMA idempotency IS
	'Idempotency keys for HTTP APIs; grant USAGE to the roles that use the API';

CREATE TYPE idempotency.state AS ENUM ('in_progress', 'completed');
COMMENT ON TYPE idempotency.state IS 'State of an idempotency record';

-- Fences come from here: never reused, also not after release or reaping.
CREATE SEQUENCE idempotency.fence_seq AS bigint;
COMMENT ON SEQUENCE idempotency.fence_seq IS
	'Fencing tokens: each claim and takeover takes a new, larger one';

-- The reaper's index key: expires_at in whole seconds.  Records that expire
-- in the same second share one index entry (btree deduplication), which
-- makes the index a third of one on expires_at itself.
CREATE FUNCTION idempotency._expiry_second(expires_at timestamptz)
RETURNS bigint
AS 'MODULE_PATHNAME', 'idempotency_expiry_second'
LANGUAGE C IMMUTABLE STRICT PARALLEL SAFE;
COMMENT ON FUNCTION idempotency._expiry_second(timestamptz) IS
	'internal: the second in which a record expires, the key of the reaper''s index';

-- The order of the columns: fixed-width ones first, so that the row has no
-- alignment padding; the ones complete() changes in the middle, so that its
-- WAL record holds only them (an update logs what differs between the old
-- and new row after their common beginning and end).  No index reads a
-- column complete() changes, so its update is HOT where the page has room
-- (1.3 to 1.5 had an index of the records in progress, which made it write
-- every index; the library keeps those figures in shared memory instead).
-- lease and lease_expires_at are NULL
-- once the record is completed, and so is token (claim's token, kept only
-- while in progress): it sits among the columns
-- complete() changes, so that clearing it adds nothing to complete's WAL
-- record (last, it would break the common end and log the scope, key and
-- fingerprint again).
-- A record belongs to the role that claimed it (owner): other roles see it
-- only when they have that role's privileges, so owner is part of the key.
-- The key comes first in it: comparisons in its descents then mostly stop
-- at the first column, as keys differ and scopes often do not.
CREATE TABLE idempotency.keys (
	fence            bigint NOT NULL,
	created_at       timestamptz NOT NULL,
	expires_at       timestamptz NOT NULL,
	attempt          integer NOT NULL,
	owner            regrole NOT NULL,
	lease            interval,
	lease_expires_at timestamptz,
	token            uuid,
	completed_at     timestamptz,
	status_code      integer,
	state            idempotency.state NOT NULL,
	headers          jsonb,
	body             bytea,
	recovery_point   text,
	recovery_state   jsonb,
	scope            text NOT NULL COLLATE pg_catalog."C",
	key              text NOT NULL COLLATE pg_catalog."C",
	fingerprint      bytea NOT NULL,
	PRIMARY KEY (key, scope, owner)
);
COMMENT ON TABLE idempotency.keys IS
	'Idempotency records, one per (scope, key, owner role); read and written only through the API';

CREATE INDEX keys_expiry_second_idx ON idempotency.keys (idempotency._expiry_second(expires_at));

REVOKE ALL ON idempotency.keys FROM PUBLIC;
REVOKE ALL ON idempotency.fence_seq FROM PUBLIC;

SELECT pg_catalog.pg_extension_config_dump('idempotency.keys', '');
SELECT pg_catalog.pg_extension_config_dump('idempotency.fence_seq', '');

-- claim's row.  A named type rather than OUT parameters: the executor then
-- takes the row's descriptor from the type cache at each call, instead of
-- building it from the function's catalog entry (a tenth of a replay's cost).
CREATE TYPE idempotency.claim_result AS (
	outcome        text,
	fence          bigint,
	attempt        integer,
	status_code    integer,
	headers        jsonb,
	body           bytea,
	recovery_point text,
	recovery_state jsonb,
	retry_after    integer,
	created_at     timestamptz);
COMMENT ON TYPE idempotency.claim_result IS 'The answer of idempotency.claim()';

CREATE FUNCTION idempotency.claim(
	key text,
	fingerprint bytea,
	scope text DEFAULT NULL,
	lease interval DEFAULT NULL,
	retention interval DEFAULT NULL,
	wait interval DEFAULT NULL,
	token uuid DEFAULT NULL)
RETURNS idempotency.claim_result
AS 'MODULE_PATHNAME', 'idempotency_claim'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
COMMENT ON FUNCTION idempotency.claim(text, bytea, text, interval, interval, interval, uuid) IS
	'Claims an idempotency key: new (run the request), replay, in_progress or mismatch; the same token resumes its own claim';

CREATE FUNCTION idempotency.complete(
	key text,
	fence bigint,
	status_code integer,
	body bytea DEFAULT NULL,
	headers jsonb DEFAULT NULL,
	scope text DEFAULT NULL)
RETURNS text
AS 'MODULE_PATHNAME', 'idempotency_complete'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
COMMENT ON FUNCTION idempotency.complete(text, bigint, integer, bytea, jsonb, text) IS
	'Stores the response of a claim (stored), or releases it for a 5xx (released)';

CREATE FUNCTION idempotency.release(
	key text,
	fence bigint,
	scope text DEFAULT NULL)
RETURNS boolean
AS 'MODULE_PATHNAME', 'idempotency_release'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
COMMENT ON FUNCTION idempotency.release(text, bigint, text) IS
	'Deletes a claim so that the next retry runs again; false when the fence no longer owns it';

CREATE FUNCTION idempotency.extend(
	key text,
	fence bigint,
	lease interval DEFAULT NULL,
	scope text DEFAULT NULL)
RETURNS timestamptz
AS 'MODULE_PATHNAME', 'idempotency_extend'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
COMMENT ON FUNCTION idempotency.extend(text, bigint, interval, text) IS
	'Renews the lease of a claim; returns when it now ends';

CREATE FUNCTION idempotency.checkpoint(
	key text,
	fence bigint,
	recovery_point text,
	recovery_state jsonb DEFAULT NULL,
	scope text DEFAULT NULL)
RETURNS void
AS 'MODULE_PATHNAME', 'idempotency_checkpoint'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
COMMENT ON FUNCTION idempotency.checkpoint(text, bigint, text, jsonb, text) IS
	'Saves the progress of multi-step work, handed to the next attempt after a takeover, and renews the lease';

-- VOLATILE: it reads the clock, so two calls in one statement may differ.
CREATE FUNCTION idempotency.lookup(
	key text,
	scope text DEFAULT NULL,
	OUT scope text,
	OUT key text,
	OUT fingerprint bytea,
	OUT state text,
	OUT attempt integer,
	OUT lease interval,
	OUT lease_expires_at timestamptz,
	OUT recovery_point text,
	OUT recovery_state jsonb,
	OUT status_code integer,
	OUT headers jsonb,
	OUT body bytea,
	OUT created_at timestamptz,
	OUT completed_at timestamptz,
	OUT expires_at timestamptz)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'idempotency_lookup'
LANGUAGE C VOLATILE PARALLEL SAFE ROWS 1;
COMMENT ON FUNCTION idempotency.lookup(text, text) IS
	'Shows the record of a key as claim sees it, without its fence; read-only, works on a standby';

CREATE FUNCTION idempotency.fingerprint(
	method text,
	path text,
	body bytea DEFAULT NULL,
	query text DEFAULT NULL)
RETURNS bytea
AS 'MODULE_PATHNAME', 'idempotency_fingerprint'
LANGUAGE C IMMUTABLE PARALLEL SAFE;
COMMENT ON FUNCTION idempotency.fingerprint(text, text, bytea, text) IS
	'SHA-256 of a request: method, path, body and query';

CREATE FUNCTION idempotency.fingerprint_json(
	method text,
	path text,
	body jsonb,
	query text DEFAULT NULL)
RETURNS bytea
AS 'MODULE_PATHNAME', 'idempotency_fingerprint_json'
LANGUAGE C IMMUTABLE PARALLEL SAFE;
COMMENT ON FUNCTION idempotency.fingerprint_json(text, text, jsonb, text) IS
	'SHA-256 of a request with a JSON body, whatever its key order and whitespace';

CREATE FUNCTION idempotency.reap(batch integer DEFAULT NULL)
RETURNS bigint
AS 'MODULE_PATHNAME', 'idempotency_reap'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
COMMENT ON FUNCTION idempotency.reap(integer) IS
	'Deletes up to batch expired records of the roles whose privileges the caller has (every role''s for a superuser or the table''s owner), oldest first; returns how many';

CREATE FUNCTION idempotency._stats_counters(
	OUT claims_new bigint,
	OUT claims_replay bigint,
	OUT claims_in_progress bigint,
	OUT claims_mismatch bigint,
	OUT takeovers bigint,
	OUT waits bigint,
	OUT completes_stored bigint,
	OUT completes_released bigint,
	OUT releases bigint,
	OUT fence_rejections bigint,
	OUT reaped bigint,
	OUT reaper_runs bigint,
	OUT last_reap_at timestamptz,
	OUT stats_reset_at timestamptz,
	OUT last_reap_error text,
	OUT claims_resumed bigint)
RETURNS record
AS 'MODULE_PATHNAME', 'idempotency_stats_counters'
LANGUAGE C VOLATILE PARALLEL SAFE;
COMMENT ON FUNCTION idempotency._stats_counters() IS
	'The counters behind idempotency.stats';

CREATE FUNCTION idempotency.stats_reset()
RETURNS void
AS 'MODULE_PATHNAME', 'idempotency_stats_reset'
LANGUAGE C VOLATILE PARALLEL SAFE;
COMMENT ON FUNCTION idempotency.stats_reset() IS
	'Zeroes the counters of idempotency.stats';

-- The live figures of idempotency.stats as the library keeps them in shared
-- memory, from the API's own writes, applied at commit: the records in
-- progress of this database's table relid, the earliest end of their
-- leases, and whether those are exact (a recount since start, and nothing
-- since that could make them wrong); NULLs where the library keeps none
-- (not preloaded, on a standby before promotion).
CREATE FUNCTION idempotency._stats_gauges(
	relid pg_catalog.regclass,
	OUT rows_in_progress bigint,
	OUT oldest_lease_expires_at timestamptz,
	OUT exact boolean)
RETURNS record
AS 'MODULE_PATHNAME', 'idempotency_stats_gauges'
LANGUAGE C VOLATILE PARALLEL SAFE;
COMMENT ON FUNCTION idempotency._stats_gauges(pg_catalog.regclass) IS
	'internal: the records in progress as the library counts them in shared memory';

CREATE FUNCTION idempotency.stats_recount()
RETURNS boolean
AS 'MODULE_PATHNAME', 'idempotency_stats_recount'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
COMMENT ON FUNCTION idempotency.stats_recount() IS
	'Counts the records in progress again for idempotency.stats (one scan of the table); returns whether the figures are exact now';

-- Whether Citus distributes idempotency.keys (where Citus is installed).
CREATE FUNCTION idempotency._keys_distributed()
RETURNS boolean
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
	distributed boolean := false;
BEGIN
	IF pg_catalog.to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL THEN
		EXECUTE 'SELECT EXISTS (SELECT FROM pg_catalog.pg_dist_partition p'
			' WHERE p.logicalrelid OPERATOR(pg_catalog.=) ''idempotency.keys''::pg_catalog.regclass)'
		INTO distributed;
	END IF;
	RETURN distributed;
END
$$;
COMMENT ON FUNCTION idempotency._keys_distributed() IS
	'internal: whether Citus distributes idempotency.keys';

-- The live figures of idempotency.stats, at a cost that does not grow with
-- the table.  rows_in_progress and oldest_lease_expires_at come from the
-- library's shared memory (_stats_gauges), exact once counted since start.
-- Until then (and without preloading, or on a standby) a table of up to
-- 10,000 rows is counted (a scan that stops there), and a larger one's
-- rows_in_progress is an estimate from the planner's statistics (the share
-- of rows with a lease), with oldest_lease_expires_at NULL and
-- live_figures_exact false.  With
-- Citus, where idempotency.keys is distributed, each worker's memory knows
-- only its own writes: the figures come from a distributed query of the
-- cluster's records in progress, through the index that citus_distribute
-- makes (keys_in_progress_idx).  rows_total is an estimate: the cumulative
-- statistics' live rows, or pg_class.reltuples when those are empty (after
-- a crash or a reset), never below the records in progress.
CREATE FUNCTION idempotency._stats_figures(
	OUT rows_total bigint,
	OUT rows_in_progress bigint,
	OUT oldest_lease_expires_at timestamptz,
	OUT live_figures_exact boolean)
RETURNS record
LANGUAGE plpgsql STABLE SECURITY DEFINER PARALLEL SAFE
SET search_path TO pg_catalog, pg_temp
SET enable_seqscan TO off
AS $$
DECLARE
	small_table constant bigint := 10000;
	estimate bigint;
	scanned bigint;
BEGIN
	SELECT CASE WHEN pg_catalog.pg_stat_get_live_tuples(c.oid) OPERATOR(pg_catalog.>) 0
				THEN pg_catalog.pg_stat_get_live_tuples(c.oid)
				ELSE GREATEST(c.reltuples, 0)::bigint END
	INTO estimate
	FROM pg_catalog.pg_class c
	WHERE c.oid OPERATOR(pg_catalog.=) 'idempotency.keys'::pg_catalog.regclass;
	IF idempotency._keys_distributed() THEN
		SELECT pg_catalog.count(*), pg_catalog.min(k.lease_expires_at), true
		INTO rows_in_progress, oldest_lease_expires_at, live_figures_exact
		FROM ONLY idempotency.keys k
		WHERE k.state OPERATOR(pg_catalog.=) 'in_progress'::idempotency.state;
	ELSE
		SELECT g.rows_in_progress, g.oldest_lease_expires_at, g.exact
		INTO rows_in_progress, oldest_lease_expires_at, live_figures_exact
		FROM idempotency._stats_gauges('idempotency.keys'::pg_catalog.regclass) g;
		IF NOT live_figures_exact OR live_figures_exact IS NULL THEN
			SELECT pg_catalog.count(*) FILTER (WHERE t.state OPERATOR(pg_catalog.=) 'in_progress'::idempotency.state),
				pg_catalog.min(t.lease_expires_at) FILTER (WHERE t.state OPERATOR(pg_catalog.=) 'in_progress'::idempotency.state),
				pg_catalog.count(*)
			INTO rows_in_progress, oldest_lease_expires_at, scanned
			FROM (SELECT k.state, k.lease_expires_at FROM ONLY idempotency.keys k
				  LIMIT small_table OPERATOR(pg_catalog.+) 1) t;
			live_figures_exact := scanned OPERATOR(pg_catalog.<=) small_table;
		END IF;
		IF NOT live_figures_exact THEN
			SELECT (estimate OPERATOR(pg_catalog.*) (1 OPERATOR(pg_catalog.-) s.null_frac))::bigint
			INTO rows_in_progress
			FROM pg_catalog.pg_stats s
			WHERE s.schemaname OPERATOR(pg_catalog.=) 'idempotency'
			  AND s.tablename OPERATOR(pg_catalog.=) 'keys'
			  AND s.attname OPERATOR(pg_catalog.=) 'lease_expires_at';
			oldest_lease_expires_at := NULL;
		END IF;
	END IF;
	rows_total := GREATEST(rows_in_progress, estimate);
END
$$;
COMMENT ON FUNCTION idempotency._stats_figures() IS
	'The live figures behind idempotency.stats, without a scan of the records';

-- Counters from shared memory, live figures from _stats_figures.
-- claims_resumed (1.2) and live_figures_exact (1.6) come last: an update
-- can only add a view's columns at its end.
CREATE VIEW idempotency.stats AS
SELECT c.claims_new, c.claims_replay, c.claims_in_progress, c.claims_mismatch,
	c.takeovers, c.waits, c.completes_stored, c.completes_released, c.releases,
	c.fence_rejections, c.reaped, c.reaper_runs, c.last_reap_at, c.stats_reset_at,
	c.last_reap_error, l.rows_total, l.rows_in_progress, l.oldest_lease_expires_at,
	c.claims_resumed, l.live_figures_exact
FROM idempotency._stats_counters() c, idempotency._stats_figures() l;
COMMENT ON VIEW idempotency.stats IS
	'Counters of the API since start or stats_reset(), and live figures of the records';
COMMENT ON COLUMN idempotency.stats.rows_total IS
	'Estimate of the records: live rows from the cumulative statistics (pg_class.reltuples when they have none)';
COMMENT ON COLUMN idempotency.stats.rows_in_progress IS
	'Records in progress (exact when live_figures_exact, else an estimate)';
COMMENT ON COLUMN idempotency.stats.oldest_lease_expires_at IS
	'The earliest end of a lease of a record in progress (exact when live_figures_exact, else NULL)';
COMMENT ON COLUMN idempotency.stats.live_figures_exact IS
	'Whether rows_in_progress and oldest_lease_expires_at are exact: on a table of over 10,000 records, false until the reaper or stats_recount() counted them since the server started';

-- The records in progress whose lease, as committed, ended in a window,
-- from ended_from to ended_to (both included), as the library counts them
-- in shared memory; NULL where its figures are not exact (see
-- _stats_gauges).
CREATE FUNCTION idempotency._stats_gauges_leases_ended(
	relid pg_catalog.regclass,
	ended_from timestamptz,
	ended_to timestamptz)
RETURNS bigint
AS 'MODULE_PATHNAME', 'idempotency_stats_leases_ended'
LANGUAGE C VOLATILE STRICT PARALLEL SAFE;
COMMENT ON FUNCTION idempotency._stats_gauges_leases_ended(pg_catalog.regclass, timestamptz, timestamptz) IS
	'internal: the records in progress whose lease ended in a window, as the library counts them in shared memory';

-- For alerting on stuck requests (contrib/prometheus/queries.yaml): the
-- records in progress whose lease ended between newer_than and older_than
-- ago (both included), at a cost that does not grow with the table, as
-- _stats_figures counts: from the library's shared memory when its figures
-- are exact; else a table of up to 10,000 records counted, NULL for a
-- larger one; with Citus a distributed count through keys_in_progress_idx.
-- What has committed counts: a record that a transaction is writing now
-- (an uncommitted takeover, complete or extend) counts until it commits.
CREATE FUNCTION idempotency.leases_ended(older_than interval, newer_than interval)
RETURNS bigint
LANGUAGE plpgsql STABLE SECURITY DEFINER PARALLEL SAFE
SET search_path TO pg_catalog, pg_temp
SET enable_seqscan TO off
AS $$
DECLARE
	small_table constant bigint := 10000;
	ended_from timestamptz := pg_catalog.now() OPERATOR(pg_catalog.-) newer_than;
	ended_to timestamptz := pg_catalog.now() OPERATOR(pg_catalog.-) older_than;
	ended bigint;
	scanned bigint;
BEGIN
	IF older_than IS NULL OR newer_than IS NULL THEN
		RAISE EXCEPTION 'argument "%" must not be null', CASE WHEN older_than IS NULL
			THEN 'older_than' ELSE 'newer_than' END
			USING ERRCODE = 'null_value_not_allowed';
	END IF;
	IF older_than OPERATOR(pg_catalog.<) '0'::interval THEN
		RAISE EXCEPTION 'argument "older_than" must not be negative'
			USING ERRCODE = 'invalid_parameter_value';
	END IF;
	IF newer_than OPERATOR(pg_catalog.<) older_than THEN
		RAISE EXCEPTION 'argument "newer_than" must not be shorter than argument "older_than"'
			USING ERRCODE = 'invalid_parameter_value',
				  HINT = 'The window runs from newer_than ago to older_than ago, e.g. older_than => ''1 minute'', newer_than => ''15 minutes''.';
	END IF;
	IF idempotency._keys_distributed() THEN
		SELECT pg_catalog.count(*) INTO ended
		FROM ONLY idempotency.keys k
		WHERE k.state OPERATOR(pg_catalog.=) 'in_progress'::idempotency.state
		  AND k.lease_expires_at OPERATOR(pg_catalog.>=) ended_from
		  AND k.lease_expires_at OPERATOR(pg_catalog.<=) ended_to;
		RETURN ended;
	END IF;
	ended := idempotency._stats_gauges_leases_ended('idempotency.keys'::pg_catalog.regclass,
													ended_from, ended_to);
	IF ended IS NULL THEN
		SELECT pg_catalog.count(*) FILTER (WHERE t.state OPERATOR(pg_catalog.=) 'in_progress'::idempotency.state
				AND t.lease_expires_at OPERATOR(pg_catalog.>=) ended_from
				AND t.lease_expires_at OPERATOR(pg_catalog.<=) ended_to),
			pg_catalog.count(*)
		INTO ended, scanned
		FROM (SELECT k.state, k.lease_expires_at FROM ONLY idempotency.keys k
			  LIMIT small_table OPERATOR(pg_catalog.+) 1) t;
		IF scanned OPERATOR(pg_catalog.>) small_table THEN
			ended := NULL;
		END IF;
	END IF;
	RETURN ended;
END
$$;
COMMENT ON FUNCTION idempotency.leases_ended(interval, interval) IS
	'The records in progress whose lease ended between newer_than and older_than ago, without a scan of the records (NULL when that cannot be exact)';

-- The records in progress, oldest first, for whoever monitors the server
-- (a scan of the table: no index of them makes complete's update non-HOT):
-- which requests are stuck, since when, on which attempt.  writing: a
-- transaction that is still running holds the record (an uncommitted
-- complete, checkpoint, extend or takeover, or a row lock), told by the
-- row's xmax being the id of a transaction in pg_locks.  A function under
-- the view, so that the view does not pin the table's column types (with
-- Citus, scope has the tenant's type: citus_distribute).
CREATE FUNCTION idempotency._in_flight()
RETURNS TABLE (scope text, key text, owner name, attempt integer, claimed_at timestamptz,
			   lease_expires_at timestamptz, recovery_point text, writing boolean)
LANGUAGE sql VOLATILE SECURITY DEFINER PARALLEL SAFE
SET search_path TO pg_catalog, pg_temp
AS $$
SELECT k.scope::pg_catalog.text, k.key, pg_catalog.pg_get_userbyid(k.owner::pg_catalog.oid),
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

-- Statistics are for whoever monitors the server, without the API (the
-- functions refuse a role whose USAGE on the schema is pg_monitor's only);
-- resetting them for superusers.
GRANT USAGE ON SCHEMA idempotency TO pg_monitor;
REVOKE ALL ON idempotency.stats FROM PUBLIC;
GRANT SELECT ON idempotency.stats TO pg_monitor;
REVOKE ALL ON FUNCTION idempotency._stats_counters() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION idempotency._stats_counters() TO pg_monitor;
REVOKE ALL ON FUNCTION idempotency._stats_figures() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION idempotency._stats_figures() TO pg_monitor;
REVOKE ALL ON FUNCTION idempotency._stats_gauges(pg_catalog.regclass) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.stats_recount() FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency._keys_distributed() FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency._stats_gauges_leases_ended(pg_catalog.regclass, timestamptz, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.leases_ended(interval, interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION idempotency.leases_ended(interval, interval) TO pg_monitor;
REVOKE ALL ON FUNCTION idempotency._in_flight() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION idempotency._in_flight() TO pg_monitor;
REVOKE ALL ON idempotency.in_flight FROM PUBLIC;
GRANT SELECT ON idempotency.in_flight TO pg_monitor;
REVOKE ALL ON FUNCTION idempotency.stats_reset() FROM PUBLIC;

CREATE FUNCTION idempotency.shard_hash(scope text)
RETURNS integer
AS 'MODULE_PATHNAME', 'idempotency_shard_hash'
LANGUAGE C IMMUTABLE PARALLEL SAFE;

COMMENT ON FUNCTION idempotency.shard_hash(text) IS
'the first 4 bytes of SHA-256 of the scope''s UTF-8 bytes, as a signed big-endian integer: PL/Proxy''s RUN ON hash';

CREATE FUNCTION idempotency.shard_of(scope text, shards integer)
RETURNS integer
AS 'MODULE_PATHNAME', 'idempotency_shard_of'
LANGUAGE C IMMUTABLE PARALLEL SAFE;

COMMENT ON FUNCTION idempotency.shard_of(text, integer) IS
'the shard, 0 to shards - 1, that holds the scope in a cluster of shards (a power of two): shard_hash(scope) & (shards - 1)';

-- Draws a fence of at least at_least, raising idempotency.fence_seq when it
-- is behind, under the lock every fence is drawn under (so that it never
-- moves a sequence back below a fence another backend just drew).
CREATE FUNCTION idempotency._fence_at_least(at_least bigint)
RETURNS bigint
AS 'MODULE_PATHNAME', 'idempotency_fence_at_least'
LANGUAGE C STRICT VOLATILE PARALLEL UNSAFE;

COMMENT ON FUNCTION idempotency._fence_at_least(bigint) IS
'draws a fence of at least the argument, raising idempotency.fence_seq when it is behind (citus_distribute)';

REVOKE ALL ON FUNCTION idempotency._fence_at_least(bigint) FROM PUBLIC;

-- Distributes the records beside the tenant's rows: idempotency.keys by
-- scope, which takes the type and collation of colocate_with's tenant
-- column, colocated with colocate_with, and the API functions delegated by
-- their scope argument, to the node that holds the scope's shard.  Run on
-- the Citus coordinator after CREATE EXTENSION idempotency; running it again
-- changes nothing (and puts back what someone changed).  Every check comes
-- before the first change.  See docs/citus.md.
CREATE FUNCTION idempotency.citus_distribute(colocate_with regclass)
RETURNS void
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
	-- Every API function that takes a scope.
	api constant text[] := ARRAY[
		'idempotency.claim(text,bytea,text,interval,interval,interval,uuid)',
		'idempotency.complete(text,bigint,integer,bytea,jsonb,text)',
		'idempotency.release(text,bigint,text)',
		'idempotency.extend(text,bigint,interval,text)',
		'idempotency.checkpoint(text,bigint,text,jsonb,text)',
		'idempotency.lookup(text,text)'];
	fn text;
	tenant_column text;
	tenant_type regtype;
	tenant_collation oid;
	tenant_decl text;
	scope_alter text;
	keys_colocation int;
	table_colocation int;
	misconfigured text;
	failed text;
	fence_top bigint;
BEGIN
	IF colocate_with IS NULL THEN
		RAISE EXCEPTION 'argument "colocate_with" must not be null'
			USING ERRCODE = 'null_value_not_allowed';
	END IF;
	IF NOT EXISTS (SELECT FROM pg_extension WHERE extname OPERATOR(pg_catalog.=) 'citus') THEN
		RAISE EXCEPTION 'Citus is not installed in this database'
			USING ERRCODE = 'object_not_in_prerequisite_state',
				  HINT = 'Run CREATE EXTENSION citus first.';
	END IF;
	IF NOT citus_is_coordinator() THEN
		RAISE EXCEPTION 'idempotency.citus_distribute() must run on the Citus coordinator'
			USING ERRCODE = 'object_not_in_prerequisite_state';
	END IF;

	-- The library must be preloaded after citus on every node: it refuses a
	-- NULL scope before Citus's planner would crash on it.
	SELECT string_agg(format('node %s (%s)', nodeid, result), ', ') INTO misconfigured
	FROM (SELECT nodeid, result, success,
				 string_to_array(replace(result, ' ', ''), ',') AS libs
		  FROM run_command_on_all_nodes('SHOW shared_preload_libraries')) n
	WHERE NOT success
	   OR NOT libs OPERATOR(pg_catalog.@>) ARRAY['citus', 'idempotency']
	   OR array_position(libs, 'idempotency') OPERATOR(pg_catalog.<) array_position(libs, 'citus');
	IF misconfigured IS NOT NULL THEN
		RAISE EXCEPTION 'idempotency is not preloaded after citus on every node'
			USING ERRCODE = 'object_not_in_prerequisite_state',
				  DETAIL = format('shared_preload_libraries on %s.', misconfigured),
				  HINT = 'Set shared_preload_libraries = ''citus,idempotency'' on every node and restart it.';
	END IF;

	-- A record names its owner by role OID, and a role has another OID on
	-- every node: when shards move, Citus must copy records as text, which
	-- names roles by name.
	SELECT string_agg(format('node %s (%s)', nodeid, result), ', ') INTO misconfigured
	FROM run_command_on_all_nodes('SHOW citus.enable_binary_protocol')
	WHERE NOT success OR result OPERATOR(pg_catalog.<>) 'off';
	IF misconfigured IS NOT NULL THEN
		RAISE EXCEPTION 'Citus copies records between nodes in binary'
			USING ERRCODE = 'object_not_in_prerequisite_state',
				  DETAIL = format('citus.enable_binary_protocol on %s: a binary copy keeps the OID of the role that owns a record, which is another role, or none, on another node.', misconfigured),
				  HINT = 'Set citus.enable_binary_protocol = off on every node and reload.';
	END IF;

	-- The business table: hash-distributed.  The records take the type and
	-- collation of its distribution column (Citus colocates only tables
	-- whose distribution columns agree in both): their scope column gets
	-- them, and the scope names the tenant, written as text.
	SELECT a.attname, a.atttypid, a.attcollation
	INTO tenant_column, tenant_type, tenant_collation
	FROM pg_dist_partition p
	JOIN pg_attribute a ON a.attrelid OPERATOR(pg_catalog.=) p.logicalrelid
		AND a.attname OPERATOR(pg_catalog.=) column_to_column_name(p.logicalrelid, p.partkey)
	WHERE p.logicalrelid OPERATOR(pg_catalog.=) colocate_with
	  AND p.partmethod OPERATOR(pg_catalog.=) 'h';
	IF NOT FOUND THEN
		RAISE EXCEPTION 'table % is not hash-distributed', colocate_with
			USING ERRCODE = 'invalid_parameter_value',
				  HINT = format('Distribute it by its tenant column first: SELECT create_distributed_table(%L, ''tenant'').',
								colocate_with::text);
	END IF;
	tenant_decl := format_type(tenant_type, NULL) OPERATOR(pg_catalog.||) coalesce(
		(SELECT format(' COLLATE %I.%I', n.nspname, c.collname)
		 FROM pg_collation c JOIN pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.collnamespace
		 WHERE c.oid OPERATOR(pg_catalog.=) tenant_collation), '');
	IF tenant_type OPERATOR(pg_catalog.<>) ALL (ARRAY['bigint', 'integer', 'uuid', 'text',
			'character varying']::regtype[]) THEN
		RAISE EXCEPTION 'table % is distributed by column "%" of type %, which the records cannot take',
			colocate_with, tenant_column, tenant_decl
			USING ERRCODE = 'datatype_mismatch',
				  DETAIL = 'The records take the type and collation of the tenant column, which must be bigint, integer, uuid, text or varchar.';
	END IF;

	-- One placement per shard: Citus delegates no call to a replicated shard.
	IF (SELECT c.replicationfactor FROM pg_dist_partition p
		JOIN pg_dist_colocation c ON c.colocationid OPERATOR(pg_catalog.=) p.colocationid
		WHERE p.logicalrelid OPERATOR(pg_catalog.=) colocate_with)
	   OPERATOR(pg_catalog.<>) 1 THEN
		RAISE EXCEPTION 'table % has more than one placement per shard', colocate_with
			USING ERRCODE = 'invalid_parameter_value',
				  DETAIL = 'Citus does not delegate function calls to replicated shards.';
	END IF;

	SELECT colocationid INTO keys_colocation
	FROM pg_dist_partition WHERE logicalrelid OPERATOR(pg_catalog.=) 'idempotency.keys'::regclass;
	SELECT colocationid INTO table_colocation
	FROM pg_dist_partition WHERE logicalrelid OPERATOR(pg_catalog.=) colocate_with;
	IF keys_colocation OPERATOR(pg_catalog.<>) table_colocation THEN
		RAISE EXCEPTION 'idempotency.keys is already distributed, colocated with other tables than %',
			colocate_with
			USING ERRCODE = 'object_not_in_prerequisite_state',
				  HINT = 'Pass a table of the colocation group idempotency.keys belongs to.';
	END IF;

	-- The scope column gets the tenant's type and collation, on every node,
	-- before the records are distributed (Citus cannot change the type of a
	-- distribution column); the records the coordinator holds keep their
	-- scope, read as a value of that type.  Each worker's table is altered
	-- where it differs: a node added since has the extension's own.
	scope_alter := format('ALTER TABLE idempotency.keys ALTER COLUMN scope TYPE %s USING scope::%s',
						  tenant_decl, format_type(tenant_type, NULL));
	IF keys_colocation IS NULL AND (SELECT atttypid OPERATOR(pg_catalog.<>) tenant_type
									OR attcollation OPERATOR(pg_catalog.<>) tenant_collation
									FROM pg_attribute
									WHERE attrelid OPERATOR(pg_catalog.=) 'idempotency.keys'::regclass
									  AND attname OPERATOR(pg_catalog.=) 'scope') THEN
		BEGIN
			EXECUTE scope_alter;
		EXCEPTION WHEN invalid_text_representation OR numeric_value_out_of_range THEN
			GET STACKED DIAGNOSTICS failed = MESSAGE_TEXT;
			RAISE EXCEPTION 'idempotency.keys holds records whose scope is not a value of type %',
				format_type(tenant_type, NULL)
				USING ERRCODE = 'invalid_text_representation',
					  DETAIL = failed OPERATOR(pg_catalog.||) '.',
					  HINT = 'Release or reap those records first: after the call, the scope names a tenant of the table.';
		END;
	END IF;
	SELECT string_agg(format('node %s:%s (%s)', nodename, nodeport, result), ', ') INTO failed
	FROM run_command_on_workers(format(
		'DO $do$ BEGIN SET LOCAL search_path TO pg_catalog, pg_temp;'
		' IF NOT EXISTS (SELECT FROM pg_catalog.pg_attribute'
		' WHERE attrelid OPERATOR(pg_catalog.=) %L::pg_catalog.regclass AND attname OPERATOR(pg_catalog.=) %L'
		' AND atttypid OPERATOR(pg_catalog.=) %L::pg_catalog.regtype'
		' AND attcollation OPERATOR(pg_catalog.=) %s) THEN'
		' SET LOCAL citus.enable_ddl_propagation TO off; %s; END IF; END $do$',
		'idempotency.keys', 'scope', format_type(tenant_type, NULL),
		CASE WHEN tenant_collation OPERATOR(pg_catalog.=) 0 THEN '0'
			 ELSE format('%L::pg_catalog.regcollation',
						 (SELECT format('%I.%I', n.nspname, c.collname)
						  FROM pg_collation c JOIN pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.collnamespace
						  WHERE c.oid OPERATOR(pg_catalog.=) tenant_collation)) END,
		scope_alter))
	WHERE NOT success;
	IF failed IS NOT NULL THEN
		RAISE EXCEPTION 'could not give the records'' scope the type % on every node', tenant_decl
			USING ERRCODE = 'object_not_in_prerequisite_state',
				  DETAIL = format('On %s.', failed);
	END IF;

	-- idempotency.keys, colocated with the business table; once.
	IF keys_colocation IS NULL THEN
		-- A node's shared memory knows only its own writes: on a cluster,
		-- idempotency.stats counts the records in progress through this
		-- index (_stats_figures), at the cost of complete's HOT update.
		CREATE INDEX IF NOT EXISTS keys_in_progress_idx ON idempotency.keys (created_at)
			WHERE state OPERATOR(pg_catalog.=) 'in_progress'::idempotency.state;
		PERFORM create_distributed_table('idempotency.keys', 'scope',
										 colocate_with => colocate_with::text);
		-- The coordinator's own rows were copied into the shards: drop them,
		-- so that no stale response stays readable there.
		PERFORM truncate_local_data_after_distributing_table('idempotency.keys');
	END IF;

	-- Calls run on the node that holds the scope's shard, inside the
	-- caller's transaction (force_delegation), every time.
	FOREACH fn IN ARRAY api LOOP
		PERFORM create_distributed_function(fn::regprocedure, 'scope',
											colocate_with => colocate_with::text,
											force_delegation => true);
	END LOOP;

	-- Fences: every node's sequence at least at every fence handed out
	-- anywhere so far (each node had its own sequence, and the
	-- coordinator's records came with fences from its own).
	SELECT string_agg(format('node %s (%s)', nodeid, result), ', ')
		   FILTER (WHERE NOT success),
		   greatest(coalesce(max(result::bigint) FILTER (WHERE success), 0),
					(SELECT coalesce(max(fence), 0) FROM idempotency.keys))
	INTO failed, fence_top
	FROM run_command_on_all_nodes('SELECT last_value FROM idempotency.fence_seq');
	IF failed IS NULL THEN
		SELECT string_agg(format('node %s (%s)', nodeid, result), ', ') INTO failed
		FROM run_command_on_all_nodes(format('SELECT idempotency._fence_at_least(%s)', fence_top))
		WHERE NOT success;
	END IF;
	IF failed IS NOT NULL THEN
		RAISE EXCEPTION 'could not raise the fence sequence of every node'
			USING ERRCODE = 'object_not_in_prerequisite_state',
				  DETAIL = format('On %s.', failed);
	END IF;
END
$$;

COMMENT ON FUNCTION idempotency.citus_distribute(regclass) IS
'with Citus: distributes idempotency.keys by scope, of the type of the table''s tenant column, colocated with the table, and runs the API on the node that holds the scope';

REVOKE ALL ON FUNCTION idempotency.citus_distribute(regclass) FROM PUBLIC;
