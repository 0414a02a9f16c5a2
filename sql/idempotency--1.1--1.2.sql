/* idempotency--1.1--1.2.sql */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.2'" to load this file. \quit

-- 1.2: claim's token, the caller's id of an attempt, with which a claim
-- whose answer was lost is asked again (README, "claim's token"); the
-- counter claims_resumed.  Nothing else changes.
--
-- The records get the column token, kept while a record is in progress.
-- It belongs among the columns complete() changes (idempotency--1.2.sql
-- says why), and ADD COLUMN can only put it last: so the table is made
-- again, in the order of a fresh install, and the records copied into it,
-- under an ACCESS EXCLUSIVE lock taken first (calls wait for the update).
-- What a DBA added to the table would not come along: the update refuses
-- it, and says what to drop first.

-- No claim may write a record into the old table once the copy has begun.
LOCK TABLE idempotency.keys IN ACCESS EXCLUSIVE MODE;

DO $$
DECLARE
	keys constant regclass := 'idempotency.keys';
	distributed boolean := false;
	extra text;
BEGIN
	IF pg_catalog.to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL THEN
		EXECUTE 'SELECT EXISTS (SELECT FROM pg_catalog.pg_dist_partition
								WHERE logicalrelid OPERATOR(pg_catalog.=) $1)'
			INTO distributed USING keys;
	END IF;
	IF distributed THEN
		RAISE EXCEPTION 'idempotency.keys is distributed by Citus'
			USING ERRCODE = 'object_not_in_prerequisite_state',
				  DETAIL = 'The update to 1.2 makes the table again, which Citus cannot follow.',
				  HINT = 'Run SELECT undistribute_table(''idempotency.keys''), update, and call idempotency.citus_distribute() again.';
	END IF;

	SELECT pg_catalog.string_agg(what, ', ') INTO extra FROM (
		SELECT pg_catalog.format('index %I', i.relname) AS what
		FROM pg_catalog.pg_index x JOIN pg_catalog.pg_class i ON i.oid OPERATOR(pg_catalog.=) x.indexrelid
		WHERE x.indrelid OPERATOR(pg_catalog.=) keys
		  AND i.relname OPERATOR(pg_catalog.<>) ALL (ARRAY['keys_pkey', 'keys_expiry_second_idx'])
	  UNION ALL
		SELECT pg_catalog.format('constraint %I', conname) FROM pg_catalog.pg_constraint
		WHERE conrelid OPERATOR(pg_catalog.=) keys AND conname OPERATOR(pg_catalog.<>) 'keys_pkey'
		  -- PG 18 keeps the columns' NOT NULL as constraints too: the new table has them
		  AND contype OPERATOR(pg_catalog.<>) 'n'
	  UNION ALL
		SELECT pg_catalog.format('trigger %I', tgname) FROM pg_catalog.pg_trigger
		WHERE tgrelid OPERATOR(pg_catalog.=) keys AND NOT tgisinternal
	  UNION ALL
		SELECT pg_catalog.format('rule %I', rulename) FROM pg_catalog.pg_rewrite
		WHERE ev_class OPERATOR(pg_catalog.=) keys
	  UNION ALL
		SELECT pg_catalog.format('policy %I', polname) FROM pg_catalog.pg_policy
		WHERE polrelid OPERATOR(pg_catalog.=) keys
	  UNION ALL
		SELECT pg_catalog.format('column %I', attname) FROM pg_catalog.pg_attribute
		WHERE attrelid OPERATOR(pg_catalog.=) keys AND attnum OPERATOR(pg_catalog.>) 0 AND NOT attisdropped
		  AND attname OPERATOR(pg_catalog.<>) ALL (ARRAY['fence', 'created_at', 'expires_at',
			'attempt', 'owner', 'lease', 'lease_expires_at', 'completed_at', 'status_code', 'state',
			'headers', 'body', 'recovery_point', 'recovery_state', 'scope', 'key', 'fingerprint'])
	  UNION ALL
		SELECT pg_catalog.format('publication %I', p.pubname)
		FROM pg_catalog.pg_publication_rel r JOIN pg_catalog.pg_publication p ON p.oid OPERATOR(pg_catalog.=) r.prpubid
		WHERE r.prrelid OPERATOR(pg_catalog.=) keys
	  UNION ALL
		SELECT 'privileges granted on it' FROM pg_catalog.pg_class c
		WHERE c.oid OPERATOR(pg_catalog.=) keys
		  AND EXISTS (SELECT FROM pg_catalog.aclexplode(c.relacl) a
					  WHERE a.grantee OPERATOR(pg_catalog.<>) c.relowner)
	  UNION ALL
		SELECT 'row-level security, a replica identity or a tablespace' FROM pg_catalog.pg_class c
		WHERE c.oid OPERATOR(pg_catalog.=) keys
		  AND (c.relrowsecurity OR c.relreplident OPERATOR(pg_catalog.<>) 'd'
			   OR c.reltablespace OPERATOR(pg_catalog.<>) 0)
	) found;
	IF extra IS NOT NULL THEN
		RAISE EXCEPTION 'idempotency.keys carries objects that the update to 1.2 would lose'
			USING ERRCODE = 'object_not_in_prerequisite_state',
				  DETAIL = pg_catalog.format('The update makes the table again; it has %s.', extra),
				  HINT = 'Drop them, update, and add them again.';
	END IF;
END
$$;

-- The view stops depending on the table and on the counters for the time
-- of the change: made again, it would lose the grants a DBA made on it.
CREATE OR REPLACE VIEW idempotency.stats AS
SELECT NULL::bigint AS claims_new, NULL::bigint AS claims_replay,
	NULL::bigint AS claims_in_progress, NULL::bigint AS claims_mismatch,
	NULL::bigint AS takeovers, NULL::bigint AS waits, NULL::bigint AS completes_stored,
	NULL::bigint AS completes_released, NULL::bigint AS releases,
	NULL::bigint AS fence_rejections, NULL::bigint AS reaped, NULL::bigint AS reaper_runs,
	NULL::timestamptz AS last_reap_at, NULL::timestamptz AS stats_reset_at,
	NULL::text AS last_reap_error, NULL::bigint AS rows_total,
	NULL::bigint AS rows_in_progress, NULL::timestamptz AS oldest_lease_expires_at;

-- The NOT NULL constraints are named as in a fresh install: PG 18 keeps
-- them in pg_constraint, named after the table they were made on.
CREATE TABLE idempotency.keys_1_2 (
	fence            bigint CONSTRAINT keys_fence_not_null NOT NULL,
	created_at       timestamptz CONSTRAINT keys_created_at_not_null NOT NULL,
	expires_at       timestamptz CONSTRAINT keys_expires_at_not_null NOT NULL,
	attempt          integer CONSTRAINT keys_attempt_not_null NOT NULL,
	owner            regrole CONSTRAINT keys_owner_not_null NOT NULL,
	lease            interval,
	lease_expires_at timestamptz,
	token            uuid,
	completed_at     timestamptz,
	status_code      integer,
	state            idempotency.state CONSTRAINT keys_state_not_null NOT NULL,
	headers          jsonb,
	body             bytea,
	recovery_point   text,
	recovery_state   jsonb,
	scope            text CONSTRAINT keys_scope_not_null NOT NULL COLLATE pg_catalog."C",
	key              text CONSTRAINT keys_key_not_null NOT NULL COLLATE pg_catalog."C",
	fingerprint      bytea CONSTRAINT keys_fingerprint_not_null NOT NULL
);
INSERT INTO idempotency.keys_1_2 (fence, created_at, expires_at, attempt, owner, lease,
	lease_expires_at, completed_at, status_code, state, headers, body, recovery_point,
	recovery_state, scope, key, fingerprint)
SELECT fence, created_at, expires_at, attempt, owner, lease, lease_expires_at, completed_at,
	status_code, state, headers, body, recovery_point, recovery_state, scope, key, fingerprint
FROM idempotency.keys;

-- Out of the extension first, so that pg_dump forgets the old table too.
ALTER EXTENSION idempotency DROP TABLE idempotency.keys;
DROP TABLE idempotency.keys;
ALTER TABLE idempotency.keys_1_2 RENAME TO keys;
ALTER TABLE idempotency.keys ADD PRIMARY KEY (key, scope, owner);
CREATE INDEX keys_expiry_second_idx ON idempotency.keys (idempotency._expiry_second(expires_at));
COMMENT ON TABLE idempotency.keys IS
	'Idempotency records, one per (scope, key, owner role); read and written only through the API';
REVOKE ALL ON idempotency.keys FROM PUBLIC;
SELECT pg_catalog.pg_extension_config_dump('idempotency.keys', '');

DROP FUNCTION idempotency._stats_counters();
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
REVOKE ALL ON FUNCTION idempotency._stats_counters() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION idempotency._stats_counters() TO pg_monitor;

CREATE OR REPLACE VIEW idempotency.stats AS
SELECT c.claims_new, c.claims_replay, c.claims_in_progress, c.claims_mismatch,
	c.takeovers, c.waits, c.completes_stored, c.completes_released, c.releases,
	c.fence_rejections, c.reaped, c.reaper_runs, c.last_reap_at, c.stats_reset_at,
	c.last_reap_error, l.rows_total, l.rows_in_progress, l.oldest_lease_expires_at,
	c.claims_resumed
FROM idempotency._stats_counters() c,
	LATERAL (SELECT pg_catalog.count(*) AS rows_total,
					pg_catalog.count(*) FILTER (WHERE k.state
						OPERATOR(pg_catalog.=) 'in_progress'::idempotency.state)
						AS rows_in_progress,
					pg_catalog.min(k.lease_expires_at) FILTER (WHERE k.state
						OPERATOR(pg_catalog.=) 'in_progress'::idempotency.state)
						AS oldest_lease_expires_at
			 FROM idempotency.keys k) l;

-- claim takes the token: a new signature, so the old function goes (with
-- any grant made on it: EXECUTE stays PUBLIC's, as on a fresh install).
DROP FUNCTION idempotency.claim(text, bytea, text, interval, interval, interval);
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

-- citus_distribute delegates the new claim (its body names each API function's
-- signature).
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
