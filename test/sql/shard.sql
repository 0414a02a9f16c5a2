-- shard_hash() and shard_of(): the routing rule, fixed forever.  The same
-- vectors are in docs/sharding.md and in the proxy's TAP test.
CREATE EXTENSION IF NOT EXISTS idempotency;

-- The first 4 bytes of SHA-256 of the scope's UTF-8 bytes, signed big-endian.
SELECT scope, encode(convert_to(scope, 'UTF8'), 'hex') AS utf8,
       idempotency.shard_hash(scope) AS hash,
       idempotency.shard_hash(scope) = expected AS ok,
       idempotency.shard_of(scope, 2) AS of_2,
       idempotency.shard_of(scope, 4) AS of_4,
       idempotency.shard_of(scope, 65536) AS of_65536
FROM (VALUES ('', -474954686),
             ('acct_42', 1496260889),
             ('acct_17', 353627363),
             ('a', -896040686),
             ('tenant:0001', -2013900505),
             ('Zürich', 1112631390),
             ('東京', 318772914),
             ('🙂', -798026459)) AS v(scope, expected);

-- It is the rule as stated, for any scope: sha256() is PostgreSQL's own.
SELECT count(*) AS scopes,
       count(*) FILTER (WHERE idempotency.shard_hash(s) =
           ('x' || encode(substr(sha256(convert_to(s, 'UTF8')), 1, 4), 'hex'))::bit(32)::integer)
         AS agree
FROM (SELECT 'scope-' || i AS s FROM generate_series(1, 1000) AS i) AS t;

-- shard_of is hash & (shards - 1), for every power of two up to 2^16
SELECT count(*) AS checks,
       count(*) FILTER (WHERE idempotency.shard_of(s, n) = idempotency.shard_hash(s) & (n - 1)) AS agree
FROM (SELECT 'scope-' || i AS s FROM generate_series(1, 100) AS i) AS t,
     (SELECT (2 ^ e)::integer AS n FROM generate_series(0, 16) AS e) AS p;
SELECT idempotency.shard_of('acct_42', 1) AS of_1;

-- Immutable and parallel safe: usable in an index or a partition key.
SELECT proname, provolatile, proparallel, proisstrict
FROM pg_proc WHERE proname IN ('shard_hash', 'shard_of')
  AND pronamespace = 'idempotency'::regnamespace ORDER BY proname;

-- Errors: the number of shards is a power of two from 1 to 65536 (22023);
-- NULL arguments raise 22004.
SELECT idempotency.shard_of('a', 0);
\set VERBOSITY sqlstate
SELECT idempotency.shard_of('a', 0);
SELECT idempotency.shard_of('a', 3);
SELECT idempotency.shard_of('a', -2);
SELECT idempotency.shard_of('a', 131072);
SELECT idempotency.shard_of('a', -2147483648);
SELECT idempotency.shard_hash(NULL);
SELECT idempotency.shard_of(NULL, 2);
SELECT idempotency.shard_of('a', NULL);
\set VERBOSITY default

-- The hash is of the UTF-8 bytes whatever the database encoding: in a
-- LATIN1 database 'Zürich' is stored as 5a fc 72 69 63 68 and hashes as above.
CREATE DATABASE regress_shard_latin1 ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0;
\c regress_shard_latin1
SET client_encoding = 'UTF8';
CREATE EXTENSION idempotency;
SELECT encode(convert_to('Zürich', 'LATIN1'), 'hex') AS latin1,
       idempotency.shard_hash('Zürich') AS hash;
\c contrib_regression
DROP DATABASE regress_shard_latin1;
