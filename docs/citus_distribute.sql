-- Content for idempotency--1.0--1.1.sql (the Citus part; the lead merges
-- versions).  See docs/citus-design.md for what it does and why, and
-- docs/citus-notes.md for the experiments behind each check.
--
-- t/040_citus.pl loads this file into a database whose extension is still
-- 1.0, so that the recipe is tested before phase 2 ships it in 1.1.

-- Distributes the records beside the tenant's rows: idempotency.keys by
-- scope, colocated with colocate_with, and the API functions delegated by
-- their scope argument.  Run once on the Citus coordinator, after CREATE
-- EXTENSION idempotency; running it again with the same table changes
-- nothing.
CREATE FUNCTION idempotency.citus_distribute(colocate_with regclass)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	-- Every API function that takes a scope, with its signature.
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
	scope_collation oid;
	keys_colocation int;
	table_colocation int;
	not_preloaded text;
	fence_top bigint;
BEGIN
	IF colocate_with IS NULL THEN
		RAISE EXCEPTION 'argument "colocate_with" must not be null'
			USING ERRCODE = 'null_value_not_allowed';
	END IF;
	IF NOT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus') THEN
		RAISE EXCEPTION 'Citus is not installed in this database'
			USING ERRCODE = 'object_not_in_prerequisite_state',
				  HINT = 'Run CREATE EXTENSION citus first.';
	END IF;
	IF NOT citus_is_coordinator() THEN
		RAISE EXCEPTION 'idempotency.citus_distribute() must run on the Citus coordinator'
			USING ERRCODE = 'object_not_in_prerequisite_state';
	END IF;

	-- The guard against a NULL scope lives in the library: it must be
	-- preloaded, after citus, on every node (a NULL distribution argument
	-- would otherwise crash the node that plans the call).
	SELECT string_agg(format('node %s (%s)', nodeid, result), ', ') INTO not_preloaded
	FROM run_command_on_all_nodes('SHOW shared_preload_libraries')
	WHERE NOT success
	   OR NOT (string_to_array(replace(result, ' ', ''), ',') @> ARRAY['citus', 'idempotency'])
	   OR array_position(string_to_array(replace(result, ' ', ''), ','), 'idempotency')
		  < array_position(string_to_array(replace(result, ' ', ''), ','), 'citus');
	IF not_preloaded IS NOT NULL THEN
		RAISE EXCEPTION 'idempotency is not preloaded after citus on every node'
			USING ERRCODE = 'object_not_in_prerequisite_state',
				  DETAIL = format('shared_preload_libraries on %s.', not_preloaded),
				  HINT = 'Set shared_preload_libraries = ''citus,idempotency'' on every node and restart it.';
	END IF;

	-- The business table: hash-distributed by a text column whose
	-- collation is that of idempotency.keys.scope (Citus colocates only
	-- tables whose distribution columns agree in type and collation).
	SELECT a.attname, a.atttypid, a.attcollation
	INTO tenant_column, tenant_type, tenant_collation
	FROM pg_dist_partition p
	JOIN pg_attribute a ON a.attrelid = p.logicalrelid
		AND a.attname = column_to_column_name(p.logicalrelid, p.partkey)
	WHERE p.logicalrelid = colocate_with AND p.partmethod = 'h';
	IF NOT FOUND THEN
		RAISE EXCEPTION 'table % is not hash-distributed', colocate_with
			USING ERRCODE = 'invalid_parameter_value',
				  HINT = format('Distribute it by its tenant column first: SELECT create_distributed_table(%L, ''tenant'').',
								colocate_with::text);
	END IF;
	SELECT attcollation INTO scope_collation
	FROM pg_attribute WHERE attrelid = 'idempotency.keys'::regclass AND attname = 'scope';
	IF tenant_type <> 'text'::regtype OR tenant_collation <> scope_collation THEN
		RAISE EXCEPTION 'table % is distributed by column "%" of type %, not text COLLATE "C"',
			colocate_with, tenant_column,
			format_type(tenant_type, NULL)
			|| CASE WHEN tenant_collation <> 0 AND tenant_type = 'text'::regtype
					THEN ' COLLATE ' || (SELECT quote_ident(collname) FROM pg_collation
										  WHERE oid = tenant_collation)
					ELSE '' END
			USING ERRCODE = 'datatype_mismatch',
				  DETAIL = 'The records of a scope live beside the rows of the tenant of the same name: the scope is text in the C collation, and Citus colocates only distribution columns of the same type and collation.',
				  HINT = 'Distribute the business tables by a column declared "text COLLATE \"C\"" that holds the scope.';
	END IF;

	-- One placement per shard: Citus delegates no call to a replicated shard.
	IF (SELECT c.replicationfactor FROM pg_dist_partition p
		JOIN pg_dist_colocation c USING (colocationid)
		WHERE p.logicalrelid = colocate_with) <> 1 THEN
		RAISE EXCEPTION 'table % has more than one placement per shard', colocate_with
			USING ERRCODE = 'invalid_parameter_value',
				  DETAIL = 'Citus does not delegate function calls to replicated shards.';
	END IF;

	-- idempotency.keys, colocated with the business table; once.
	SELECT colocationid INTO keys_colocation
	FROM pg_dist_partition WHERE logicalrelid = 'idempotency.keys'::regclass;
	SELECT colocationid INTO table_colocation
	FROM pg_dist_partition WHERE logicalrelid = colocate_with;
	IF keys_colocation IS NULL THEN
		PERFORM create_distributed_table('idempotency.keys', 'scope',
										 colocate_with => colocate_with::text);
		-- The coordinator's own rows were copied into the shards: drop
		-- them, so that no stale response stays readable there.
		PERFORM truncate_local_data_after_distributing_table('idempotency.keys');
	ELSIF keys_colocation <> table_colocation THEN
		RAISE EXCEPTION 'idempotency.keys is already distributed, colocated with other tables than %',
			colocate_with
			USING ERRCODE = 'object_not_in_prerequisite_state',
				  HINT = 'Pass a table of the colocation group idempotency.keys belongs to.';
	END IF;

	-- Calls run on the node that holds the scope's shard, inside the
	-- caller's transaction (force_delegation).
	FOREACH fn IN ARRAY api LOOP
		PERFORM create_distributed_function(fn::regprocedure, 'scope',
											colocate_with => colocate_with::text,
											force_delegation => true);
	END LOOP;

	-- Fences: every node's sequence above every fence handed out anywhere
	-- so far (each node had its own sequence, and the coordinator's rows
	-- came with fences from its sequence).
	SELECT greatest(coalesce(max(result::bigint), 0),
					(SELECT coalesce(max(fence), 0) FROM idempotency.keys))
	INTO fence_top
	FROM run_command_on_all_nodes('SELECT last_value FROM idempotency.fence_seq')
	WHERE success;
	PERFORM run_command_on_all_nodes(format(
		'SELECT pg_catalog.setval(''idempotency.fence_seq'', %s) FROM idempotency.fence_seq WHERE last_value < %s',
		fence_top, fence_top));
END
$$;

REVOKE ALL ON FUNCTION idempotency.citus_distribute(regclass) FROM PUBLIC;
