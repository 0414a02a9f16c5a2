/* idempotency--1.5--1.6.sql */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.6'" to load this file. \quit

-- 1.6: complete's update is HOT again.  The index of records in progress
-- (1.3) goes: the library keeps rows_in_progress and
-- oldest_lease_expires_at in shared memory, from the API's own writes
-- applied at commit, and idempotency.stats says in live_figures_exact
-- whether they are exact (they are once the reaper or stats_recount()
-- counted them since the server started).  Where Citus distributes the
-- table the index stays: there the figures are a distributed count
-- through it, and citus_distribute() makes it.  idempotency.in_flight now
-- scans the table: leases_ended() gives the Prometheus queries the leases
-- that ended in a window from the same shared memory.

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

DO $$
BEGIN
	IF NOT idempotency._keys_distributed() THEN
		DROP INDEX IF EXISTS idempotency.keys_in_progress_idx;
	END IF;
END
$$;

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

-- The view keeps its columns (and the DBA's grants on it) and gains one at its end.
CREATE OR REPLACE VIEW idempotency.stats AS
SELECT c.claims_new, c.claims_replay, c.claims_in_progress, c.claims_mismatch,
	c.takeovers, c.waits, c.completes_stored, c.completes_released, c.releases,
	c.fence_rejections, c.reaped, c.reaper_runs, c.last_reap_at, c.stats_reset_at,
	c.last_reap_error, l.rows_total, l.rows_in_progress, l.oldest_lease_expires_at,
	c.claims_resumed, l.live_figures_exact
FROM idempotency._stats_counters() c, idempotency._stats_figures() l;
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

DROP FUNCTION idempotency._stats_live();
REVOKE ALL ON FUNCTION idempotency._stats_figures() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION idempotency._stats_figures() TO pg_monitor;
REVOKE ALL ON FUNCTION idempotency._stats_gauges(pg_catalog.regclass) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.stats_recount() FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency._keys_distributed() FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency._stats_gauges_leases_ended(pg_catalog.regclass, timestamptz, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.leases_ended(interval, interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION idempotency.leases_ended(interval, interval) TO pg_monitor;

-- citus_distribute() makes the index of records in progress before it distributes the table.
CREATE OR REPLACE FUNCTION idempotency.citus_distribute(colocate_with regclass)
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

