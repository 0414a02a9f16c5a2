/* idempotency_proxy--1.2.sql */

-- complain if script is sourced in psql, rather than via CREATE EXTENSION
\echo Use "CREATE EXTENSION idempotency_proxy" to load this file. \quit

-- The proxy database's side of a sharded cluster (docs/sharding.md): the
-- API of the idempotency extension, same names, signatures, defaults and
-- results, routed to the shards of the PL/Proxy SQL/MED server named
-- "idempotency" by the scope's shard hash.  The records live on the shards;
-- this database holds none.  Every name in a function body is
-- schema-qualified: a caller's search_path cannot substitute its own.

DO $$
BEGIN
	IF EXISTS (SELECT FROM pg_catalog.pg_extension
			   WHERE extname OPERATOR(pg_catalog.=) 'idempotency') THEN
		RAISE EXCEPTION 'extension "idempotency" is installed in this database'
			USING ERRCODE = 'object_not_in_prerequisite_state',
				  HINT = 'A proxy database holds no records: create idempotency_proxy in a database of its own.';
	END IF;
END
$$;

-- The extension makes its own schema, and fails if one by that name exists:
-- a function someone else put there (an overload of claim, say) could
-- otherwise catch the application's calls.
CREATE SCHEMA idempotency;
COMMENT ON SCHEMA idempotency IS
	'Idempotency keys for HTTP APIs, routed to shards; grant USAGE to the roles that use the API';

-- Computed on the proxy itself, by the same C code as on the shards.

CREATE FUNCTION idempotency.fingerprint(
	method text,
	path text,
	body bytea DEFAULT NULL,
	query text DEFAULT NULL)
RETURNS bytea
AS 'MODULE_PATHNAME', 'idempotency_fingerprint'
LANGUAGE C IMMUTABLE PARALLEL SAFE;

CREATE FUNCTION idempotency.fingerprint_json(
	method text,
	path text,
	body jsonb,
	query text DEFAULT NULL)
RETURNS bytea
AS 'MODULE_PATHNAME', 'idempotency_fingerprint_json'
LANGUAGE C IMMUTABLE PARALLEL SAFE;

CREATE FUNCTION idempotency.shard_hash(scope text)
RETURNS integer
AS 'MODULE_PATHNAME', 'idempotency_shard_hash'
LANGUAGE C IMMUTABLE PARALLEL SAFE;

CREATE FUNCTION idempotency.shard_of(scope text, shards integer)
RETURNS integer
AS 'MODULE_PATHNAME', 'idempotency_shard_of'
LANGUAGE C IMMUTABLE PARALLEL SAFE;

COMMENT ON FUNCTION idempotency.fingerprint(text, text, bytea, text) IS
'SHA-256 of a request (method, path, body, query), computed on the proxy';
COMMENT ON FUNCTION idempotency.fingerprint_json(text, text, jsonb, text) IS
'the fingerprint of a request with the canonical text of its JSON body, computed on the proxy';
COMMENT ON FUNCTION idempotency.shard_hash(text) IS
'the first 4 bytes of SHA-256 of the scope''s UTF-8 bytes, as a signed big-endian integer: the routing hash';
COMMENT ON FUNCTION idempotency.shard_of(text, integer) IS
'the shard, 0 to shards - 1, that holds the scope in a cluster of shards (a power of two): shard_hash(scope) & (shards - 1)';

-- The scope of a call: the argument, else this session's idempotency.scope,
-- else ''.  Resolved here, before routing, because the shard's session
-- does not see the proxy's settings.
CREATE FUNCTION idempotency._proxy_scope(scope text)
RETURNS text
LANGUAGE sql STABLE PARALLEL SAFE
AS $$ SELECT coalesce(scope, pg_catalog.current_setting('idempotency.scope', true), '') $$;

COMMENT ON FUNCTION idempotency._proxy_scope(text) IS
'internal: the scope a call names, else the session''s idempotency.scope, else the empty scope';

-- The routing functions: PL/Proxy runs each as one autocommit statement on
-- the shard that shard_hash(scope) names, calling the function of the same
-- name there.  Internal: the functions below call them with a resolved
-- scope.  They keep EXECUTE for PUBLIC because the functions below are
-- SECURITY INVOKER, so that PL/Proxy uses the caller's user mapping and
-- checks the caller's USAGE on the server (docs/sharding.md, Privileges).

CREATE FUNCTION idempotency._proxy_claim(
	key text,
	fingerprint bytea,
	scope text,
	lease interval,
	retention interval,
	wait interval,
	token uuid,
	OUT outcome text,
	OUT fence bigint,
	OUT attempt integer,
	OUT status_code integer,
	OUT headers jsonb,
	OUT body bytea,
	OUT recovery_point text,
	OUT recovery_state jsonb,
	OUT retry_after integer,
	OUT created_at timestamptz)
RETURNS record
LANGUAGE plproxy
AS $$
	CLUSTER 'idempotency';
	RUN ON idempotency.shard_hash(scope);
	TARGET idempotency.claim;
$$;

CREATE FUNCTION idempotency._proxy_complete(
	key text,
	fence bigint,
	status_code integer,
	body bytea,
	headers jsonb,
	scope text)
RETURNS text
LANGUAGE plproxy
AS $$
	CLUSTER 'idempotency';
	RUN ON idempotency.shard_hash(scope);
	TARGET idempotency.complete;
$$;

CREATE FUNCTION idempotency._proxy_release(key text, fence bigint, scope text)
RETURNS boolean
LANGUAGE plproxy
AS $$
	CLUSTER 'idempotency';
	RUN ON idempotency.shard_hash(scope);
	TARGET idempotency.release;
$$;

CREATE FUNCTION idempotency._proxy_extend(
	key text,
	fence bigint,
	lease interval,
	scope text)
RETURNS timestamptz
LANGUAGE plproxy
AS $$
	CLUSTER 'idempotency';
	RUN ON idempotency.shard_hash(scope);
	TARGET idempotency.extend;
$$;

CREATE FUNCTION idempotency._proxy_checkpoint(
	key text,
	fence bigint,
	recovery_point text,
	recovery_state jsonb,
	scope text)
RETURNS void
LANGUAGE plproxy
AS $$
	CLUSTER 'idempotency';
	RUN ON idempotency.shard_hash(scope);
	TARGET idempotency.checkpoint;
$$;

CREATE FUNCTION idempotency._proxy_lookup(
	key text,
	scope text,
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
LANGUAGE plproxy
AS $$
	CLUSTER 'idempotency';
	RUN ON idempotency.shard_hash(scope);
	TARGET idempotency.lookup;
$$;

-- The API, as on the shards.  Each resolves the scope and routes the call;
-- the shard checks the arguments and applies its own settings for those
-- left NULL (lease, retention, max_response_bytes, ...).  The functions
-- returning a scalar are SQL, which the planner inlines into the caller's
-- query; claim is PL/pgSQL, which keeps its plan for the session (a SQL
-- function returning a record is planned again at every call: a replayed
-- claim took a median 0.35 ms that way and 0.23 ms in PL/pgSQL, pgbench,
-- 1 client, docs/sharding.md); lookup stays SQL, as PL/pgSQL refuses an
-- argument and a result column of one name.

-- claim's row, as on the shards.
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
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
AS $$
DECLARE
	result idempotency.claim_result;
BEGIN
	SELECT * INTO result
	FROM idempotency._proxy_claim(key, fingerprint,
		idempotency._proxy_scope(scope), lease, retention, wait, token);
	RETURN result;
END
$$;

CREATE FUNCTION idempotency.complete(
	key text,
	fence bigint,
	status_code integer,
	body bytea DEFAULT NULL,
	headers jsonb DEFAULT NULL,
	scope text DEFAULT NULL)
RETURNS text
LANGUAGE sql VOLATILE PARALLEL UNSAFE
AS $$
	SELECT idempotency._proxy_complete(key, fence, status_code, body, headers,
		idempotency._proxy_scope(scope))
$$;

CREATE FUNCTION idempotency.release(
	key text,
	fence bigint,
	scope text DEFAULT NULL)
RETURNS boolean
LANGUAGE sql VOLATILE PARALLEL UNSAFE
AS $$
	SELECT idempotency._proxy_release(key, fence, idempotency._proxy_scope(scope))
$$;

CREATE FUNCTION idempotency.extend(
	key text,
	fence bigint,
	lease interval DEFAULT NULL,
	scope text DEFAULT NULL)
RETURNS timestamptz
LANGUAGE sql VOLATILE PARALLEL UNSAFE
AS $$
	SELECT idempotency._proxy_extend(key, fence, lease, idempotency._proxy_scope(scope))
$$;

CREATE FUNCTION idempotency.checkpoint(
	key text,
	fence bigint,
	recovery_point text,
	recovery_state jsonb DEFAULT NULL,
	scope text DEFAULT NULL)
RETURNS void
LANGUAGE sql VOLATILE PARALLEL UNSAFE
AS $$
	SELECT idempotency._proxy_checkpoint(key, fence, recovery_point, recovery_state,
		idempotency._proxy_scope(scope))
$$;

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
LANGUAGE sql VOLATILE PARALLEL UNSAFE ROWS 1
AS $$
	SELECT * FROM idempotency._proxy_lookup(key, idempotency._proxy_scope(scope))
$$;

COMMENT ON FUNCTION idempotency.claim(text, bytea, text, interval, interval, interval, uuid) IS
'claims a key on the scope''s shard: new, replay, in_progress or mismatch; the same token resumes its own claim';
COMMENT ON FUNCTION idempotency.complete(text, bigint, integer, bytea, jsonb, text) IS
'stores the response of a claim on the scope''s shard (commits there at once)';
COMMENT ON FUNCTION idempotency.release(text, bigint, text) IS
'deletes a claim on the scope''s shard, so that the next retry runs again';
COMMENT ON FUNCTION idempotency.extend(text, bigint, interval, text) IS
'renews the lease of a claim on the scope''s shard';
COMMENT ON FUNCTION idempotency.checkpoint(text, bigint, text, jsonb, text) IS
'saves the progress of a claim on the scope''s shard and renews its lease';
COMMENT ON FUNCTION idempotency.lookup(text, text) IS
'the record of a key as claim would see it, read on the scope''s shard';
COMMENT ON FUNCTION idempotency._proxy_claim(text, bytea, text, interval, interval, interval, uuid) IS
'internal: routes claim to the shard of a resolved scope';
COMMENT ON FUNCTION idempotency._proxy_complete(text, bigint, integer, bytea, jsonb, text) IS
'internal: routes complete to the shard of a resolved scope';
COMMENT ON FUNCTION idempotency._proxy_release(text, bigint, text) IS
'internal: routes release to the shard of a resolved scope';
COMMENT ON FUNCTION idempotency._proxy_extend(text, bigint, interval, text) IS
'internal: routes extend to the shard of a resolved scope';
COMMENT ON FUNCTION idempotency._proxy_checkpoint(text, bigint, text, jsonb, text) IS
'internal: routes checkpoint to the shard of a resolved scope';
COMMENT ON FUNCTION idempotency._proxy_lookup(text, text) IS
'internal: routes lookup to the shard of a resolved scope';
