-- Writes :rows completed records each way in a fresh database, the way the
-- workflow does (claim, then complete, in batches of 100k), and reports the
-- bytes each needs: after a plain VACUUM and compacted by VACUUM FULL.
-- psql variables: rows, fp, hash, body.

CREATE EXTENSION idempotency;
\ir hand-written-table.sql
CREATE UNLOGGED TABLE won (i int PRIMARY KEY, k text, fence bigint);

-- Keys md5('size-1') .. : 32 characters, in random order like UUIDs.
SELECT format($q$INSERT INTO won SELECT i, k, (idempotency.claim(k, %L::bytea)).fence
				 FROM (SELECT i, md5('size-' || i) AS k FROM generate_series(%s, %s) i) s$q$,
			  :'fp', lo, least(lo + 99999, :rows))
FROM generate_series(1, :rows, 100000) lo \gexec
SELECT format($q$SELECT count(idempotency.complete(k, fence, 201, convert_to(%L, 'UTF8')))
				 FROM won WHERE i BETWEEN %s AND %s$q$,
			  :'body', lo, least(lo + 99999, :rows))
FROM generate_series(1, :rows, 100000) lo \gexec

SELECT format($q$INSERT INTO idempotency_keys (key, request_hash, status)
				 SELECT md5('size-' || i), %L, 'started' FROM generate_series(%s, %s) i
				 ON CONFLICT (key) DO NOTHING$q$,
			  :'hash', lo, least(lo + 99999, :rows))
FROM generate_series(1, :rows, 100000) lo \gexec
SELECT format($q$UPDATE idempotency_keys
				 SET status = 'completed', response_code = 201, response_body = %L
				 WHERE key IN (SELECT md5('size-' || i) FROM generate_series(%s, %s) i)$q$,
			  :'body', lo, least(lo + 99999, :rows))
FROM generate_series(1, :rows, 100000) lo \gexec

CREATE TEMP TABLE sizes (impl text, stage text, records bigint, heap bigint,
						 indexes bigint, total bigint);

-- Records one line of sizes for a table.
CREATE FUNCTION pg_temp.measure(impl text, stage text, rel regclass, completed text)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
	n bigint;
BEGIN
	EXECUTE format('SELECT count(*) FROM %s WHERE %s', rel, completed) INTO n;
	INSERT INTO sizes VALUES (impl, stage, n, pg_table_size(rel),
							  pg_indexes_size(rel), pg_total_relation_size(rel));
END
$$;

VACUUM idempotency.keys;
VACUUM idempotency_keys;
SELECT pg_temp.measure('extension', 'vacuumed', 'idempotency.keys', $$state = 'completed'$$);
SELECT pg_temp.measure('hand-written', 'vacuumed', 'idempotency_keys', $$status = 'completed'$$);
VACUUM FULL idempotency.keys;
VACUUM FULL idempotency_keys;
SELECT pg_temp.measure('extension', 'compacted', 'idempotency.keys', $$state = 'completed'$$);
SELECT pg_temp.measure('hand-written', 'compacted', 'idempotency_keys', $$status = 'completed'$$);

-- Average stored bytes per column, for whoever wants to shrink the row.
SELECT 'extension' AS impl, avg(pg_column_size(k.*))::int AS row_bytes,
	   avg(pg_column_size(k.key))::int AS key, avg(pg_column_size(k.fingerprint))::int AS fingerprint,
	   avg(pg_column_size(k.body))::int AS body
FROM idempotency.keys k
UNION ALL
SELECT 'hand-written', avg(pg_column_size(h.*))::int, avg(pg_column_size(h.key))::int,
	   avg(pg_column_size(h.request_hash))::int, avg(pg_column_size(h.response_body))::int
FROM idempotency_keys h;

\pset format unaligned
\pset fieldsep '\t'
\pset tuples_only on
\echo SIZES
SELECT impl, stage, records, heap, indexes, total FROM sizes;
