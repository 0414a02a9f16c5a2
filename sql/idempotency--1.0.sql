/* idempotency--1.0.sql */

-- complain if script is sourced in psql, rather than via CREATE EXTENSION
\echo Use "CREATE EXTENSION idempotency" to load this file. \quit

-- The extension makes its own schema, and fails if one by that name exists:
-- objects someone else put there (an operator, a function) could otherwise
-- be bound into ours.  For the same reason every name below is qualified,
-- operators included.
CREATE SCHEMA idempotency;
COMMENT ON SCHEMA idempotency IS
	'Idempotency keys for HTTP APIs; grant USAGE to the roles that use the API';

CREATE TYPE idempotency.state AS ENUM ('in_progress', 'completed');
COMMENT ON TYPE idempotency.state IS 'State of an idempotency record';

-- Fences come from here: never reused, also not after release or reaping.
CREATE SEQUENCE idempotency.fence_seq AS bigint;
COMMENT ON SEQUENCE idempotency.fence_seq IS
	'Fencing tokens: each claim and takeover takes a new, larger one';

-- The reaper's index key: expires_at in whole seconds.  Records that expire
-- in the same second share one index entry (btree deduplication), which
-- makes the index a third of one on expires_at itself.
CREATE FUNCTION idempotency._expiry_second(expires_at timestamptz)
RETURNS bigint
AS 'MODULE_PATHNAME', 'idempotency_expiry_second'
LANGUAGE C IMMUTABLE STRICT PARALLEL SAFE;
COMMENT ON FUNCTION idempotency._expiry_second(timestamptz) IS
	'internal: the second in which a record expires, the key of the reaper''s index';

-- The order of the columns: fixed-width ones first, so that the row has no
-- alignment padding; the ones complete() changes in the middle, so that its
-- WAL record holds only them (an update logs what differs between the old
-- and new row after their common beginning and end).  complete() changes no
-- indexed column, so it is a HOT update whenever the page has room: it
-- usually has, as complete follows its claim closely (95% HOT measured at
-- the default fillfactor; 100% at 75 cost 25% more heap).  lease and
-- lease_expires_at are NULL once the record is completed.
-- A record belongs to the role that claimed it (owner): other roles see it
-- only when they have that role's privileges, so owner is part of the key.
-- The key comes first in it: comparisons in its descents then mostly stop
-- at the first column, as keys differ and scopes often do not.
CREATE TABLE idempotency.keys (
	fence            bigint NOT NULL,
	created_at       timestamptz NOT NULL,
	expires_at       timestamptz NOT NULL,
	attempt          integer NOT NULL,
	owner            regrole NOT NULL,
	lease            interval,
	lease_expires_at timestamptz,
	completed_at     timestamptz,
	status_code      integer,
	state            idempotency.state NOT NULL,
	headers          jsonb,
	body             bytea,
	recovery_point   text,
	recovery_state   jsonb,
	scope            text NOT NULL COLLATE pg_catalog."C",
	key              text NOT NULL COLLATE pg_catalog."C",
	fingerprint      bytea NOT NULL,
	PRIMARY KEY (key, scope, owner)
);
COMMENT ON TABLE idempotency.keys IS
	'Idempotency records, one per (scope, key, owner role); read and written only through the API';

CREATE INDEX keys_expiry_second_idx ON idempotency.keys (idempotency._expiry_second(expires_at));

REVOKE ALL ON idempotency.keys FROM PUBLIC;
REVOKE ALL ON idempotency.fence_seq FROM PUBLIC;

SELECT pg_catalog.pg_extension_config_dump('idempotency.keys', '');
SELECT pg_catalog.pg_extension_config_dump('idempotency.fence_seq', '');

-- claim's row.  A named type rather than OUT parameters: the executor then
-- takes the row's descriptor from the type cache at each call, instead of
-- building it from the function's catalog entry (a tenth of a replay's cost).
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
	wait interval DEFAULT NULL)
RETURNS idempotency.claim_result
AS 'MODULE_PATHNAME', 'idempotency_claim'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
COMMENT ON FUNCTION idempotency.claim(text, bytea, text, interval, interval, interval) IS
	'Claims an idempotency key: new (run the request), replay, in_progress or mismatch';

CREATE FUNCTION idempotency.complete(
	key text,
	fence bigint,
	status_code integer,
	body bytea DEFAULT NULL,
	headers jsonb DEFAULT NULL,
	scope text DEFAULT NULL)
RETURNS text
AS 'MODULE_PATHNAME', 'idempotency_complete'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
COMMENT ON FUNCTION idempotency.complete(text, bigint, integer, bytea, jsonb, text) IS
	'Stores the response of a claim (stored), or releases it for a 5xx (released)';

CREATE FUNCTION idempotency.release(
	key text,
	fence bigint,
	scope text DEFAULT NULL)
RETURNS boolean
AS 'MODULE_PATHNAME', 'idempotency_release'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
COMMENT ON FUNCTION idempotency.release(text, bigint, text) IS
	'Deletes a claim so that the next retry runs again; false when the fence no longer owns it';

CREATE FUNCTION idempotency.extend(
	key text,
	fence bigint,
	lease interval DEFAULT NULL,
	scope text DEFAULT NULL)
RETURNS timestamptz
AS 'MODULE_PATHNAME', 'idempotency_extend'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
COMMENT ON FUNCTION idempotency.extend(text, bigint, interval, text) IS
	'Renews the lease of a claim; returns when it now ends';

CREATE FUNCTION idempotency.checkpoint(
	key text,
	fence bigint,
	recovery_point text,
	recovery_state jsonb DEFAULT NULL,
	scope text DEFAULT NULL)
RETURNS void
AS 'MODULE_PATHNAME', 'idempotency_checkpoint'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
COMMENT ON FUNCTION idempotency.checkpoint(text, bigint, text, jsonb, text) IS
	'Saves the progress of multi-step work, handed to the next attempt after a takeover, and renews the lease';

-- VOLATILE: it reads the clock, so two calls in one statement may differ.
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
AS 'MODULE_PATHNAME', 'idempotency_lookup'
LANGUAGE C VOLATILE PARALLEL SAFE ROWS 1;
COMMENT ON FUNCTION idempotency.lookup(text, text) IS
	'Shows the record of a key as claim sees it, without its fence; read-only, works on a standby';

CREATE FUNCTION idempotency.fingerprint(
	method text,
	path text,
	body bytea DEFAULT NULL,
	query text DEFAULT NULL)
RETURNS bytea
AS 'MODULE_PATHNAME', 'idempotency_fingerprint'
LANGUAGE C IMMUTABLE PARALLEL SAFE;
COMMENT ON FUNCTION idempotency.fingerprint(text, text, bytea, text) IS
	'SHA-256 of a request: method, path, body and query';

CREATE FUNCTION idempotency.fingerprint_json(
	method text,
	path text,
	body jsonb,
	query text DEFAULT NULL)
RETURNS bytea
AS 'MODULE_PATHNAME', 'idempotency_fingerprint_json'
LANGUAGE C IMMUTABLE PARALLEL SAFE;
COMMENT ON FUNCTION idempotency.fingerprint_json(text, text, jsonb, text) IS
	'SHA-256 of a request with a JSON body, whatever its key order and whitespace';

CREATE FUNCTION idempotency.reap(batch integer DEFAULT NULL)
RETURNS bigint
AS 'MODULE_PATHNAME', 'idempotency_reap'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
COMMENT ON FUNCTION idempotency.reap(integer) IS
	'Deletes up to batch expired records, oldest first; returns how many';

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
	OUT last_reap_error text)
RETURNS record
AS 'MODULE_PATHNAME', 'idempotency_stats_counters'
LANGUAGE C VOLATILE PARALLEL SAFE;
COMMENT ON FUNCTION idempotency._stats_counters() IS
	'The counters behind idempotency.stats';

CREATE FUNCTION idempotency.stats_reset()
RETURNS void
AS 'MODULE_PATHNAME', 'idempotency_stats_reset'
LANGUAGE C VOLATILE PARALLEL SAFE;
COMMENT ON FUNCTION idempotency.stats_reset() IS
	'Zeroes the counters of idempotency.stats';

-- Counters from shared memory, live figures from the table (one scan).
CREATE VIEW idempotency.stats AS
SELECT c.*, l.rows_total, l.rows_in_progress, l.oldest_lease_expires_at
FROM idempotency._stats_counters() c,
	LATERAL (SELECT pg_catalog.count(*) AS rows_total,
					pg_catalog.count(*) FILTER (WHERE k.state
						OPERATOR(pg_catalog.=) 'in_progress'::idempotency.state)
						AS rows_in_progress,
					pg_catalog.min(k.lease_expires_at) FILTER (WHERE k.state
						OPERATOR(pg_catalog.=) 'in_progress'::idempotency.state)
						AS oldest_lease_expires_at
			 FROM idempotency.keys k) l;
COMMENT ON VIEW idempotency.stats IS
	'Counters of the API since start or stats_reset(), and live figures of the records';

-- Statistics are for whoever monitors the server, without the API (the
-- functions refuse a role whose USAGE on the schema is pg_monitor's only);
-- resetting them for superusers.
GRANT USAGE ON SCHEMA idempotency TO pg_monitor;
REVOKE ALL ON idempotency.stats FROM PUBLIC;
GRANT SELECT ON idempotency.stats TO pg_monitor;
REVOKE ALL ON FUNCTION idempotency._stats_counters() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION idempotency._stats_counters() TO pg_monitor;
REVOKE ALL ON FUNCTION idempotency.stats_reset() FROM PUBLIC;
