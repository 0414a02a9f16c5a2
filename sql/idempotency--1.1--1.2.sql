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

-- The new table, empty until the checks below pass.  The NOT NULL
-- constraints are named as in a fresh install: PG 18 keeps them in
-- pg_constraint, named after the table they were made on.
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
COMMENT ON TABLE idempotency.keys_1_2 IS
	'Idempotency records, one per (scope, key, owner role); read and written only through the API';

-- What the new table could not take over from the old one is refused here,
-- all of it named in one error, before a record moves.
DO $$
DECLARE
	keys constant regclass := 'idempotency.keys';
	new_keys constant regclass := 'idempotency.keys_1_2';
	pg_class_id constant regclass := 'pg_catalog.pg_class';
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
		  -- PG 18 keeps the columns' NOT NULL as constraints too: compared below
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
		-- the extension's columns as a DBA changed them
		SELECT pg_catalog.format(c.what, o.attname, pg_catalog.format_type(o.atttypid, o.atttypmod))
		FROM pg_catalog.pg_attribute o
		JOIN pg_catalog.pg_attribute n ON n.attrelid OPERATOR(pg_catalog.=) new_keys
			AND n.attname OPERATOR(pg_catalog.=) o.attname
		CROSS JOIN LATERAL (VALUES
			(o.atttypid OPERATOR(pg_catalog.<>) n.atttypid OR o.atttypmod OPERATOR(pg_catalog.<>) n.atttypmod,
			 'column %I of type %s'),
			(o.attcollation OPERATOR(pg_catalog.<>) n.attcollation
			 AND o.atttypid OPERATOR(pg_catalog.=) n.atttypid, 'collation of column %I'),
			(o.attnotnull AND NOT n.attnotnull, 'NOT NULL on column %I'),
			(n.attnotnull AND NOT o.attnotnull, 'column %I without NOT NULL'),
			(o.atthasdef, 'default of column %I'),
			(o.attidentity OPERATOR(pg_catalog.<>) '', 'identity column %I'),
			(o.attgenerated OPERATOR(pg_catalog.<>) '', 'generated column %I')) c(differs, what)
		WHERE o.attrelid OPERATOR(pg_catalog.=) keys AND o.attnum OPERATOR(pg_catalog.>) 0
		  AND NOT o.attisdropped AND c.differs
	  UNION ALL
		SELECT 'column privileges' WHERE EXISTS (
			SELECT FROM pg_catalog.pg_attribute
			WHERE attrelid OPERATOR(pg_catalog.=) keys AND attacl IS NOT NULL)
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
		SELECT 'row-level security' FROM pg_catalog.pg_class c
		WHERE c.oid OPERATOR(pg_catalog.=) keys AND (c.relrowsecurity OR c.relforcerowsecurity)
	  UNION ALL
		SELECT 'security labels' WHERE EXISTS (
			SELECT FROM pg_catalog.pg_seclabel
			WHERE classoid OPERATOR(pg_catalog.=) pg_class_id AND objoid OPERATOR(pg_catalog.=) keys)
	  UNION ALL
		SELECT pg_catalog.format('%s %s',
			CASE WHEN c.relispartition THEN 'partition of' ELSE 'inheritance parent' END,
			(pg_catalog.pg_identify_object(pg_class_id, i.inhparent, 0)).identity)
		FROM pg_catalog.pg_inherits i JOIN pg_catalog.pg_class c ON c.oid OPERATOR(pg_catalog.=) i.inhrelid
		WHERE i.inhrelid OPERATOR(pg_catalog.=) keys
	  UNION ALL
		SELECT pg_catalog.format('inheritance child %s',
			(pg_catalog.pg_identify_object(pg_class_id, i.inhrelid, 0)).identity)
		FROM pg_catalog.pg_inherits i WHERE i.inhparent OPERATOR(pg_catalog.=) keys
	  UNION ALL
		SELECT pg_catalog.format('sequence %s owned by column %I',
			(pg_catalog.pg_identify_object(pg_class_id, s.oid, 0)).identity, a.attname)
		FROM pg_catalog.pg_depend d
		JOIN pg_catalog.pg_class s ON s.oid OPERATOR(pg_catalog.=) d.objid
		JOIN pg_catalog.pg_attribute a ON a.attrelid OPERATOR(pg_catalog.=) d.refobjid
			AND a.attnum OPERATOR(pg_catalog.=) d.refobjsubid
		WHERE d.classid OPERATOR(pg_catalog.=) pg_class_id AND d.refclassid OPERATOR(pg_catalog.=) pg_class_id
		  AND d.refobjid OPERATOR(pg_catalog.=) keys AND d.deptype OPERATOR(pg_catalog.=) 'a'
		  AND s.relkind OPERATOR(pg_catalog.=) 'S'
	  UNION ALL
		-- what depends on the table or its row type elsewhere (views, foreign
		-- keys, columns, functions): DROP TABLE would refuse it
		SELECT DISTINCT pg_catalog.format('%s %s depending on it', i.type, i.identity)
		FROM pg_catalog.pg_depend d
		LEFT JOIN pg_catalog.pg_rewrite r
			ON d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_rewrite'::pg_catalog.regclass
			AND r.oid OPERATOR(pg_catalog.=) d.objid
		-- a view is named, not its rule
		CROSS JOIN LATERAL (SELECT
			CASE WHEN r.oid IS NULL THEN d.classid ELSE pg_class_id END AS classid,
			coalesce(r.ev_class, d.objid) AS objid) w
		CROSS JOIN LATERAL pg_catalog.pg_identify_object(w.classid, w.objid, 0) i
		WHERE d.deptype OPERATOR(pg_catalog.=) 'n'
		  AND ((d.refclassid OPERATOR(pg_catalog.=) pg_class_id AND d.refobjid OPERATOR(pg_catalog.=) keys)
			   OR (d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_type'::pg_catalog.regclass
				   AND EXISTS (SELECT FROM pg_catalog.pg_type t
							   WHERE t.typrelid OPERATOR(pg_catalog.=) keys
								 AND d.refobjid OPERATOR(pg_catalog.=) ANY (ARRAY[t.oid, t.typarray]))))
		  -- not the table's own objects (listed above), which depend on it
		  -- automatically too, nor the extension's
		  AND NOT EXISTS (SELECT FROM pg_catalog.pg_depend a
						  WHERE a.classid OPERATOR(pg_catalog.=) d.classid
							AND a.objid OPERATOR(pg_catalog.=) d.objid
							AND a.refclassid OPERATOR(pg_catalog.=) pg_class_id
							AND a.refobjid OPERATOR(pg_catalog.=) keys
							AND a.deptype OPERATOR(pg_catalog.=) ANY (ARRAY['a', 'i']::"char"[]))
		  AND NOT EXISTS (SELECT FROM pg_catalog.pg_depend e
						  WHERE e.classid OPERATOR(pg_catalog.=) w.classid
							AND e.objid OPERATOR(pg_catalog.=) w.objid AND e.deptype OPERATOR(pg_catalog.=) 'e')
		  AND NOT EXISTS (SELECT FROM pg_catalog.pg_inherits h
						  WHERE w.classid OPERATOR(pg_catalog.=) pg_class_id
							AND h.inhrelid OPERATOR(pg_catalog.=) w.objid
							AND h.inhparent OPERATOR(pg_catalog.=) keys)
	) found;
	IF extra IS NOT NULL THEN
		RAISE EXCEPTION 'idempotency.keys carries objects that the update to 1.2 would lose'
			USING ERRCODE = 'object_not_in_prerequisite_state',
				  DETAIL = pg_catalog.format('The update makes the table again; it has %s.', extra),
				  HINT = 'Drop or undo them, update, and make them again.';
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

-- The copy, and what a DBA set on the old table, made again on the new one:
-- the owner, storage parameters (of the table, its TOAST table and its two
-- indexes), tablespaces, UNLOGGED, the access method, the columns'
-- storage, compression, statistics target and options, the statistics
-- target of an index's expression, statistics objects, the CLUSTER mark, the replica identity and comments.  A clean table runs
-- none of it, and so ends as a fresh install's.  The statements are made
-- with search_path = pg_catalog, pg_temp, so that the names in them are
-- qualified where they have to be.
DO $$
DECLARE
	old_keys constant regclass := 'idempotency.keys';
	new_keys constant regclass := 'idempotency.keys_1_2';
	pg_class_id constant regclass := 'pg_catalog.pg_class';
	path constant text := pg_catalog.current_setting('search_path');
	before_copy text[];     -- on the empty idempotency.keys_1_2
	after_indexes text[];   -- on idempotency.keys, once it has its indexes
	pkey_clauses text;
	expiry_clauses text;
	command text;
BEGIN
	PERFORM pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', true);

	WITH options AS (
		-- storage parameters, as the WITH list of the object they are set on
		SELECT target, pg_catalog.string_agg(pg_catalog.format('%s%I = %L', prefix,
				   pg_catalog.split_part(o, '=', 1),
				   pg_catalog.substr(o, pg_catalog.strpos(o, '=') OPERATOR(pg_catalog.+) 1)), ', '
				   ORDER BY prefix, n) AS list
		FROM (
			SELECT 'table' AS target, '' AS prefix, o, n
			FROM pg_catalog.pg_class c, pg_catalog.unnest(c.reloptions) WITH ORDINALITY u(o, n)
			WHERE c.oid OPERATOR(pg_catalog.=) old_keys
		  UNION ALL
			SELECT 'table', 'toast.', o, n
			FROM pg_catalog.pg_class c
			JOIN pg_catalog.pg_class t ON t.oid OPERATOR(pg_catalog.=) c.reltoastrelid,
			pg_catalog.unnest(t.reloptions) WITH ORDINALITY u(o, n)
			WHERE c.oid OPERATOR(pg_catalog.=) old_keys
		  UNION ALL
			SELECT i.relname::text, '', o, n
			FROM pg_catalog.pg_index x
			JOIN pg_catalog.pg_class i ON i.oid OPERATOR(pg_catalog.=) x.indexrelid,
			pg_catalog.unnest(i.reloptions) WITH ORDINALITY u(o, n)
			WHERE x.indrelid OPERATOR(pg_catalog.=) old_keys
		  UNION ALL
			-- (Debian's 15.20 keeps a pg_attver of its own among them)
			SELECT a.attname::text, '', o, n
			FROM pg_catalog.pg_attribute a, pg_catalog.unnest(a.attoptions) WITH ORDINALITY u(o, n)
			WHERE a.attrelid OPERATOR(pg_catalog.=) old_keys AND a.attnum OPERATOR(pg_catalog.>) 0
			  AND NOT pg_catalog.starts_with(o, 'pg_attver=')
		) each_option
		GROUP BY target
	), index_clauses AS (
		SELECT i.relname, pg_catalog.concat(
				   CASE WHEN w.list IS NOT NULL THEN pg_catalog.format(' WITH (%s)', w.list) END,
				   CASE WHEN s.spcname IS NULL THEN NULL
						WHEN x.indisprimary THEN pg_catalog.format(' USING INDEX TABLESPACE %I', s.spcname)
						ELSE pg_catalog.format(' TABLESPACE %I', s.spcname) END) AS clauses
		FROM pg_catalog.pg_index x
		JOIN pg_catalog.pg_class i ON i.oid OPERATOR(pg_catalog.=) x.indexrelid
		LEFT JOIN pg_catalog.pg_tablespace s ON s.oid OPERATOR(pg_catalog.=) i.reltablespace
		LEFT JOIN options w ON w.target OPERATOR(pg_catalog.=) i.relname
		WHERE x.indrelid OPERATOR(pg_catalog.=) old_keys
	), statements AS (
		-- in the order they run (step)
		SELECT true AS before, 1 AS step,
			pg_catalog.format('ALTER TABLE idempotency.keys_1_2 SET TABLESPACE %I', s.spcname) AS statement
		FROM pg_catalog.pg_class c JOIN pg_catalog.pg_tablespace s ON s.oid OPERATOR(pg_catalog.=) c.reltablespace
		WHERE c.oid OPERATOR(pg_catalog.=) old_keys
	  UNION ALL
		SELECT true, 2, 'ALTER TABLE idempotency.keys_1_2 SET UNLOGGED' FROM pg_catalog.pg_class
		WHERE oid OPERATOR(pg_catalog.=) old_keys AND relpersistence OPERATOR(pg_catalog.=) 'u'
	  UNION ALL
		SELECT true, 3, pg_catalog.format('ALTER TABLE idempotency.keys_1_2 SET ACCESS METHOD %I', am.amname)
		FROM pg_catalog.pg_class o
		JOIN pg_catalog.pg_class n ON n.oid OPERATOR(pg_catalog.=) new_keys
		JOIN pg_catalog.pg_am am ON am.oid OPERATOR(pg_catalog.=) o.relam
		WHERE o.oid OPERATOR(pg_catalog.=) old_keys AND o.relam OPERATOR(pg_catalog.<>) n.relam
	  UNION ALL
		SELECT true, 4, pg_catalog.format('ALTER TABLE idempotency.keys_1_2 SET (%s)', list)
		FROM options WHERE target OPERATOR(pg_catalog.=) 'table'
	  UNION ALL
		-- the columns' settings, where they differ from a fresh install's
		SELECT true, 5, pg_catalog.format('ALTER TABLE idempotency.keys_1_2 ALTER COLUMN %I %s', o.attname, c.action)
		FROM pg_catalog.pg_attribute o
		JOIN pg_catalog.pg_attribute n ON n.attrelid OPERATOR(pg_catalog.=) new_keys
			AND n.attname OPERATOR(pg_catalog.=) o.attname
		CROSS JOIN LATERAL (VALUES
			(o.attstorage OPERATOR(pg_catalog.<>) n.attstorage,
			 pg_catalog.format('SET STORAGE %s',
				 (ARRAY['PLAIN', 'EXTERNAL', 'EXTENDED', 'MAIN'])[pg_catalog.strpos('pexm', o.attstorage::text)])),
			(o.attcompression OPERATOR(pg_catalog.<>) n.attcompression,
			 pg_catalog.format('SET COMPRESSION %s',
				 CASE WHEN o.attcompression OPERATOR(pg_catalog.=) '' THEN 'DEFAULT'
					  ELSE (ARRAY['pglz', 'lz4'])[pg_catalog.strpos('pl', o.attcompression::text)] END)),
			(coalesce(o.attstattarget::integer, '-1') OPERATOR(pg_catalog.<>) coalesce(n.attstattarget::integer, '-1'),
			 pg_catalog.format('SET STATISTICS %s', coalesce(o.attstattarget::integer, '-1'))),
			((SELECT list FROM options WHERE target OPERATOR(pg_catalog.=) o.attname) IS NOT NULL,
			 pg_catalog.format('SET (%s)', (SELECT list FROM options WHERE target OPERATOR(pg_catalog.=) o.attname)))
			) c(differs, action)
		WHERE o.attrelid OPERATOR(pg_catalog.=) old_keys AND o.attnum OPERATOR(pg_catalog.>) 0
		  AND NOT o.attisdropped AND c.differs
	  UNION ALL
		-- comments: the table's where a DBA changed it, the columns'
		SELECT true, 6, pg_catalog.format('COMMENT ON TABLE idempotency.keys_1_2 IS %L',
									   pg_catalog.obj_description(old_keys, 'pg_class'))
		WHERE coalesce(pg_catalog.obj_description(old_keys, 'pg_class')
					   OPERATOR(pg_catalog.<>) pg_catalog.obj_description(new_keys, 'pg_class'), true)
	  UNION ALL
		SELECT true, 7, pg_catalog.format('COMMENT ON COLUMN idempotency.keys_1_2.%I IS %L', a.attname, d.description)
		FROM pg_catalog.pg_description d
		JOIN pg_catalog.pg_attribute a ON a.attrelid OPERATOR(pg_catalog.=) d.objoid
			AND a.attnum OPERATOR(pg_catalog.=) d.objsubid
		WHERE d.classoid OPERATOR(pg_catalog.=) pg_class_id AND d.objoid OPERATOR(pg_catalog.=) old_keys
		  AND d.objsubid OPERATOR(pg_catalog.>) 0
	  UNION ALL
		-- the indexes' comments, and the primary key constraint's
		SELECT false, 8, pg_catalog.format('COMMENT ON INDEX idempotency.%I IS %L', i.relname, d.description)
		FROM pg_catalog.pg_index x
		JOIN pg_catalog.pg_class i ON i.oid OPERATOR(pg_catalog.=) x.indexrelid
		JOIN pg_catalog.pg_description d ON d.classoid OPERATOR(pg_catalog.=) pg_class_id
			AND d.objoid OPERATOR(pg_catalog.=) i.oid
		WHERE x.indrelid OPERATOR(pg_catalog.=) old_keys
	  UNION ALL
		SELECT false, 9, pg_catalog.format('COMMENT ON CONSTRAINT %I ON idempotency.keys IS %L', k.conname, d.description)
		FROM pg_catalog.pg_constraint k
		JOIN pg_catalog.pg_description d
			ON d.classoid OPERATOR(pg_catalog.=) 'pg_catalog.pg_constraint'::pg_catalog.regclass
			AND d.objoid OPERATOR(pg_catalog.=) k.oid
		WHERE k.conrelid OPERATOR(pg_catalog.=) old_keys AND k.conname OPERATOR(pg_catalog.=) 'keys_pkey'
	  UNION ALL
		-- the statistics target of an index's expression column
		SELECT false, 10, pg_catalog.format('ALTER INDEX idempotency.%I ALTER COLUMN %s SET STATISTICS %s',
											i.relname, a.attnum, a.attstattarget)
		FROM pg_catalog.pg_index x
		JOIN pg_catalog.pg_class i ON i.oid OPERATOR(pg_catalog.=) x.indexrelid
		JOIN pg_catalog.pg_attribute a ON a.attrelid OPERATOR(pg_catalog.=) i.oid
		WHERE x.indrelid OPERATOR(pg_catalog.=) old_keys AND a.attnum OPERATOR(pg_catalog.>) 0
		  AND x.indkey[a.attnum OPERATOR(pg_catalog.-) 1] OPERATOR(pg_catalog.=) 0
		  AND coalesce(a.attstattarget::integer, '-1') OPERATOR(pg_catalog.<>) '-1'	  UNION ALL
		SELECT false, 10, pg_catalog.format('ALTER TABLE idempotency.keys CLUSTER ON %I', i.relname)
		FROM pg_catalog.pg_index x JOIN pg_catalog.pg_class i ON i.oid OPERATOR(pg_catalog.=) x.indexrelid
		WHERE x.indrelid OPERATOR(pg_catalog.=) old_keys AND x.indisclustered
	  UNION ALL
		SELECT false, 11, pg_catalog.format('ALTER TABLE idempotency.keys REPLICA IDENTITY %s',
			CASE WHEN c.relreplident OPERATOR(pg_catalog.=) 'f' THEN 'FULL'
				 WHEN c.relreplident OPERATOR(pg_catalog.=) 'n' THEN 'NOTHING'
				 ELSE pg_catalog.format('USING INDEX %I',
					 (SELECT i.relname FROM pg_catalog.pg_index x
					  JOIN pg_catalog.pg_class i ON i.oid OPERATOR(pg_catalog.=) x.indexrelid
					  WHERE x.indrelid OPERATOR(pg_catalog.=) old_keys AND x.indisreplident)) END)
		FROM pg_catalog.pg_class c
		WHERE c.oid OPERATOR(pg_catalog.=) old_keys AND c.relreplident OPERATOR(pg_catalog.<>) 'd'
	  UNION ALL
		-- statistics objects: made again (the same definition and name), with
		-- their owner, target and comment
		SELECT false, 12 OPERATOR(pg_catalog.+) s.step, s.statement
		FROM pg_catalog.pg_statistic_ext x
		CROSS JOIN LATERAL (SELECT (pg_catalog.pg_identify_object(
			'pg_catalog.pg_statistic_ext'::pg_catalog.regclass, x.oid, 0)).identity AS name) n
		CROSS JOIN LATERAL (VALUES
			(1, pg_catalog.pg_get_statisticsobjdef(x.oid)),
			(2, pg_catalog.format('ALTER STATISTICS %s OWNER TO %I', n.name,
								  pg_catalog.pg_get_userbyid(x.stxowner))),
			(3, pg_catalog.format('ALTER STATISTICS %s SET STATISTICS %s', n.name,
								  coalesce(x.stxstattarget::integer, '-1'))),
			(4, pg_catalog.format('COMMENT ON STATISTICS %s IS %L', n.name,
								  pg_catalog.obj_description(x.oid, 'pg_statistic_ext')))) s(step, statement)
		WHERE x.stxrelid OPERATOR(pg_catalog.=) old_keys
		  AND (s.step OPERATOR(pg_catalog.<) 4
			   OR pg_catalog.obj_description(x.oid, 'pg_statistic_ext') IS NOT NULL)
	  UNION ALL
		-- last, the owner: the role a DBA gave the table to
		SELECT false, 20, pg_catalog.format('ALTER TABLE idempotency.keys OWNER TO %I',
										pg_catalog.pg_get_userbyid(o.relowner))
		FROM pg_catalog.pg_class o JOIN pg_catalog.pg_class n ON n.oid OPERATOR(pg_catalog.=) new_keys
		WHERE o.oid OPERATOR(pg_catalog.=) old_keys AND o.relowner OPERATOR(pg_catalog.<>) n.relowner
	)
	SELECT pg_catalog.array_agg(s.statement ORDER BY s.step) FILTER (WHERE s.before),
		   pg_catalog.array_agg(s.statement ORDER BY s.step) FILTER (WHERE NOT s.before),
		   (SELECT clauses FROM index_clauses WHERE relname OPERATOR(pg_catalog.=) 'keys_pkey'),
		   (SELECT clauses FROM index_clauses WHERE relname OPERATOR(pg_catalog.=) 'keys_expiry_second_idx')
	INTO before_copy, after_indexes, pkey_clauses, expiry_clauses
	FROM statements s;

	FOREACH command IN ARRAY coalesce(before_copy, '{}') LOOP
		EXECUTE command;
	END LOOP;

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
	EXECUTE pg_catalog.concat('ALTER TABLE idempotency.keys ADD PRIMARY KEY (key, scope, owner)', pkey_clauses);
	EXECUTE pg_catalog.concat(
		'CREATE INDEX keys_expiry_second_idx ON idempotency.keys (idempotency._expiry_second(expires_at))',
		expiry_clauses);
	REVOKE ALL ON idempotency.keys FROM PUBLIC;
	PERFORM pg_catalog.pg_extension_config_dump('idempotency.keys', '');

	FOREACH command IN ARRAY coalesce(after_indexes, '{}') LOOP
		EXECUTE command;
	END LOOP;
	-- A statistics object made in this script would be the extension's:
	-- it stays the DBA's.
	FOR command IN
		SELECT (pg_catalog.pg_identify_object(e.classid, e.objid, 0)).identity
		FROM pg_catalog.pg_depend e JOIN pg_catalog.pg_statistic_ext x ON x.oid OPERATOR(pg_catalog.=) e.objid
		WHERE e.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_statistic_ext'::pg_catalog.regclass
		  AND e.deptype OPERATOR(pg_catalog.=) 'e' AND x.stxrelid OPERATOR(pg_catalog.=) new_keys
	LOOP
		EXECUTE pg_catalog.format('ALTER EXTENSION idempotency DROP STATISTICS %s', command);
	END LOOP;

	PERFORM pg_catalog.set_config('search_path', path, true);
END
$$;

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
