-- The portable edition's database for bench/run: the script, and the same
-- 100k completed keys as setup.sql gives the extension (1000000000000000001 ...),
-- through its API.  psql variables: fp, body.
\ir portable-idempotency.sql
CREATE TEMP TABLE won AS
SELECT k, (idempotency.claim(k, :'fp'::bytea)).fence AS fence
FROM (SELECT (1000000000000000000 + i)::text AS k FROM generate_series(1, 100000) i) s;
SELECT count(idempotency.complete(k, fence, 201, convert_to(:'body', 'UTF8'))) AS completed
FROM won;
VACUUM ANALYZE;
