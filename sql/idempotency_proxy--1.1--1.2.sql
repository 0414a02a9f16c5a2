/* idempotency_proxy--1.1--1.2.sql */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION idempotency_proxy UPDATE TO '1.2'" to load this file. \quit

-- 1.2: claim takes the token, as on the shards (which must have idempotency
-- 1.2 first: the proxy passes the token on).  A new signature: the old
-- functions go (with any grant made on them).

DROP FUNCTION idempotency.claim(text, bytea, text, interval, interval, interval);
DROP FUNCTION idempotency._proxy_claim(text, bytea, text, interval, interval, interval);

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

COMMENT ON FUNCTION idempotency._proxy_claim(text, bytea, text, interval, interval, interval, uuid) IS
'internal: routes claim to the shard of a resolved scope';
COMMENT ON FUNCTION idempotency.claim(text, bytea, text, interval, interval, interval, uuid) IS
'claims a key on the scope''s shard: new, replay, in_progress or mismatch; the same token resumes its own claim';
