/* idempotency--1.0--1.1.sql */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.1'" to load this file. \quit

-- 1.1: which shard holds a scope, for clusters of several servers
-- (docs/sharding.md).  Nothing else changes.

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
