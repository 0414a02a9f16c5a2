/* idempotency--1.0--1.1.sql */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.1'" to load this file. \quit

-- 1.1: which shard holds a scope, for clusters of several servers
-- (docs/sharding.md), and the records distributed with Citus
-- (docs/citus.md).  Nothing else changes.

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
-- scope, colocated with colocate_with, and the API functions delegated by
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
		'idempotency.claim(text,bytea,text,interval,interval,interval)',
		'idempotency.complete(text,bigint,integer,bytea,jsonb,text)',
		'idempotency.release(text,bigint,text)',
		'idempotency.extend(text,bigint,interval,text)',
		'idempotency.checkpoint(text,bigint,text,jsonb,text)',
		'idempotency.lookup(text,text)'];
	fn text;
	tenant_column text;
	tenant_type regtype;
	tenant_collation oid;
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

	-- The business table: hash-distributed by a text column of the
	-- collation of idempotency.keys.scope (Citus colocates only tables whose
	-- distribution columns agree in type and collation).
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
	IF tenant_type OPERATOR(pg_catalog.<>) 'text'::regtype
	   OR tenant_collation OPERATOR(pg_catalog.<>) (
		   SELECT attcollation FROM pg_attribute
		   WHERE attrelid OPERATOR(pg_catalog.=) 'idempotency.keys'::regclass
			 AND attname OPERATOR(pg_catalog.=) 'scope') THEN
		RAISE EXCEPTION 'table % is distributed by column "%" of type %, not text COLLATE "C"',
			colocate_with, tenant_column,
			format('%s%s', format_type(tenant_type, NULL),
				   (SELECT format(' COLLATE %I', collname) FROM pg_collation
					WHERE oid OPERATOR(pg_catalog.=) tenant_collation))
			USING ERRCODE = 'datatype_mismatch',
				  DETAIL = 'The records of a scope live beside the rows of the tenant of the same name: the scope is text in the C collation, and Citus colocates only distribution columns of the same type and collation.',
				  HINT = 'Distribute the business tables by a column declared "text COLLATE \"C\"" that holds the scope.';
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

	-- idempotency.keys, colocated with the business table; once.
	IF keys_colocation IS NULL THEN
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
'with Citus: distributes idempotency.keys by scope, colocated with the table, and runs the API on the node that holds the scope';

REVOKE ALL ON FUNCTION idempotency.citus_distribute(regclass) FROM PUBLIC;
