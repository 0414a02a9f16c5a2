-- version: 1.6
/* portable/idempotency.sql: the portable edition of idempotency, 1.6 (the C edition's 1.6 without Citus).
 *
 * The API of the C extension in SQL and PL/pgSQL, for servers that load no
 * library of ours (managed PostgreSQL): the same names, signatures,
 * defaults, result columns, outcomes, SQLSTATEs, fingerprints and record
 * format.  Install it as a database owner:
 *
 *     psql -v ON_ERROR_STOP=1 -f portable/idempotency.sql
 *
 * This file is the one source: portable/build makes portable/pg_tle.sql from
 * it (CREATE EXTENSION idempotency through pg_tle).  Lines marked
 * "-- plain only" are left out of that form, lines starting "-- pg_tle: "
 * are put in (uncommented).  docs/portable.md says what
 * differs from the C edition.
 *
 * How the calls run: a record belongs to the role whose privileges the
 * calling code has (current_user at the call): in another role's SECURITY
 * DEFINER function, or in an index expression that ANALYZE runs as the
 * table's owner, that is the other role, never the session's.  Each API
 * function runs with its caller's rights only to make a token of that role
 * (idempotency._caller_token: only code running as a role can make one
 * naming it, and it names nobody after the statement that made it), and
 * hands it with its arguments to its work (_claim_hot, _complete_hot,
 * _release, _extend, _checkpoint, _lookup, _reap), which runs as the
 * table's owner (SECURITY DEFINER, search_path = pg_catalog, pg_temp) and
 * reads and writes only the records of roles whose privileges the token's
 * role has.  No application role holds a privilege on the table or on any
 * relation over it: none can lock the records, nor plan a query (EXPLAIN
 * ANALYZE) that visits another role's.  Every operator below is
 * schema-qualified.  Calling a function needs USAGE on the schema, as for
 * any schema; pg_monitor's USAGE (for the stats view) is refused the API.
 *
 * The atomic claim: a claim reads the record with a fresh snapshot and
 * decides in the design's order; only `new` writes, with one conditional
 * write whose own WHERE clause (or the primary key, for INSERT ... ON
 * CONFLICT (key, scope, owner) DO NOTHING) settles any race, waiting as
 * PostgreSQL does for a transaction writing the same record; any other
 * unique or exclusion constraint raises its own error (23505, 23P01).  A write that a concurrent
 * transaction made moot sends the claim round again.
 */

BEGIN; -- plain only

-- The schema is our own: CREATE SCHEMA fails when one by that name exists,
-- so that nobody else's objects (an operator, a function) can be bound in.
CREATE SCHEMA idempotency;
COMMENT ON SCHEMA idempotency IS
	'Idempotency keys for HTTP APIs; grant USAGE to the roles that use the API';

CREATE TYPE idempotency.state AS ENUM ('in_progress', 'completed');
COMMENT ON TYPE idempotency.state IS 'State of an idempotency record';

CREATE SEQUENCE idempotency.fence_seq AS bigint;
COMMENT ON SEQUENCE idempotency.fence_seq IS
	'Fencing tokens: each claim and takeover takes a new, larger one';

-- The reaper's index key, as the C edition's: the whole second, rounded
-- down, in which a record expires, counted from 2000-01-01 UTC.  Built of
-- immutable functions only, so that the planner inlines it (a SQL function
-- called per index entry costs more than the rest of an insert).
CREATE FUNCTION idempotency._expiry_second(expires_at timestamptz)
RETURNS bigint
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN pg_catalog.floor(EXTRACT(epoch FROM
	expires_at OPERATOR(pg_catalog.-) '2000-01-01 00:00:00+00'::timestamptz))::bigint;
COMMENT ON FUNCTION idempotency._expiry_second(timestamptz) IS
	'internal: the second in which a record expires, the key of the reaper''s index';

-- The table of the C edition, column for column (see sql/idempotency--1.0.sql
-- for why this order); token (1.2) is kept only while a record is in progress.
CREATE TABLE idempotency.keys (
	fence            bigint NOT NULL,
	created_at       timestamptz NOT NULL,
	expires_at       timestamptz NOT NULL,
	attempt          integer NOT NULL,
	owner            regrole NOT NULL DEFAULT pg_catalog.quote_ident(CURRENT_USER)::pg_catalog.regrole,
	lease            interval,
	lease_expires_at timestamptz,
	token            uuid,
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

-- Pins the columns' types: PostgreSQL refuses to change the type of a
-- column that a view uses (0A000), where the C edition refuses to work with
-- a changed one (42804).  Open to no role.
CREATE VIEW idempotency._column_types AS
SELECT k.fence, k.created_at, k.expires_at, k.attempt, k.owner, k.lease, k.lease_expires_at,
	k.token, k.completed_at, k.status_code, k.state, k.headers, k.body, k.recovery_point,
	k.recovery_state, k.scope, k.key, k.fingerprint
FROM ONLY idempotency.keys k WHERE false;
COMMENT ON VIEW idempotency._column_types IS
	'internal: keeps the types of the columns of idempotency.keys from being changed';

-- Who calls: the role whose privileges the calling code has, as a token
-- that only code running as that role can make.  The API's functions run
-- with their caller's rights only to make it (idempotency._me()), and hand
-- it to their work, which runs as the table's owner (SECURITY DEFINER): no
-- application role holds any privilege on the table, or on any relation
-- over it, so none can lock the records or plan a query over them.  The
-- domain's check runs as the code that makes a token, with its
-- current_user: a token names that role or none.  The token holds the
-- backend and the statement's start too, which the work checks: made by a
-- role's code in one statement, it names nobody in any other (a function
-- of another role that kept one, from a call of its code that ran as you,
-- cannot use it later).
-- (An array, not a row: PL/pgSQL checks a domain over a row type again
-- when its function receives one, there as the table's owner.)
CREATE DOMAIN idempotency._caller_token AS bigint[]
	CHECK (VALUE[1] OPERATOR(pg_catalog.=)
		pg_catalog.quote_ident(CURRENT_USER)::pg_catalog.regrole::pg_catalog.oid::bigint);
COMMENT ON DOMAIN idempotency._caller_token IS
	'internal: {role, backend, statement start}: the role of the code that made it, in the statement that made it';

-- The start of this statement, in microseconds since 1970, as a token
-- holds it (date_part's float8, cheaper than EXTRACT's numeric, rounds each
-- microsecond to itself).
CREATE FUNCTION idempotency._statement_start()
RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
RETURN (pg_catalog.date_part('epoch', pg_catalog.statement_timestamp()) OPERATOR(pg_catalog.*) 1000000)::bigint;
COMMENT ON FUNCTION idempotency._statement_start() IS
	'internal: the start of this statement, as a token holds it';

-- The token of the calling code: its current_user, this backend, the
-- start of this statement.
CREATE FUNCTION idempotency._me()
RETURNS idempotency._caller_token
LANGUAGE sql STABLE PARALLEL SAFE
RETURN ARRAY[pg_catalog.quote_ident(CURRENT_USER)::pg_catalog.regrole::pg_catalog.oid::bigint,
	pg_catalog.pg_backend_pid(), idempotency._statement_start()]::idempotency._caller_token;
COMMENT ON FUNCTION idempotency._me() IS
	'internal: a token of the calling role, for the API''s work';

-- Whether a token was made in this statement of this backend, and so names
-- the role of the code that made it.  (Not through _me(): the work runs as
-- the table's owner, whose token it would make and check for nothing.)
CREATE FUNCTION idempotency._token_holds(me idempotency._caller_token)
RETURNS boolean
LANGUAGE sql STABLE PARALLEL SAFE
RETURN COALESCE(me[1] IS NOT NULL
	AND me[2] OPERATOR(pg_catalog.=) pg_catalog.pg_backend_pid()
	AND me[3] OPERATOR(pg_catalog.=) idempotency._statement_start(), false);
COMMENT ON FUNCTION idempotency._token_holds(idempotency._caller_token) IS
	'internal: whether a token names its role now';

-- pg_tle: SELECT pg_catalog.pg_extension_config_dump('idempotency.keys', '');
-- pg_tle: SELECT pg_catalog.pg_extension_config_dump('idempotency.fence_seq', '');

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

------------------------------------------------------------------------------
-- Internal helpers: arguments, settings, the caller.  The API's work calls
-- them and fixes search_path for them (a SET clause of their own would
-- cost each call a search_path change); they run with their caller's
-- rights, so a role that calls one itself gets nothing the API does not
-- give it.
------------------------------------------------------------------------------

-- Raises 22004 when a required argument is NULL.
CREATE FUNCTION idempotency._require(val anyelement, name text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
	IF val IS NULL THEN
		RAISE EXCEPTION 'argument "%" must not be null', name
			USING ERRCODE = 'null_value_not_allowed';
	END IF;
END
$$;
COMMENT ON FUNCTION idempotency._require(anyelement, text) IS
	'internal: raises 22004 when a required argument is NULL';

-- Tells whether s holds a control character: C0, DEL, or C1 in UTF-8.
CREATE FUNCTION idempotency._has_control_chars(s text)
RETURNS boolean
LANGUAGE sql STABLE PARALLEL SAFE
RETURN s OPERATOR(pg_catalog.~) '[\x01-\x1f\x7f]'
	OR (s OPERATOR(pg_catalog.~) '[\u0080-\u009f]'
		AND pg_catalog.getdatabaseencoding() OPERATOR(pg_catalog.=) 'UTF8');
COMMENT ON FUNCTION idempotency._has_control_chars(text) IS
	'internal: whether a text holds control characters';

-- Raises 22023 unless key is 1 to 255 bytes without control characters.
CREATE FUNCTION idempotency._check_key(key text)
RETURNS text
LANGUAGE plpgsql STABLE
AS $$
DECLARE
	len int := octet_length(key);
BEGIN
	IF key IS NULL THEN
		RAISE EXCEPTION 'argument "key" must not be null'
			USING ERRCODE = 'null_value_not_allowed';
	END IF;
	IF len OPERATOR(pg_catalog.<) 1 OR len OPERATOR(pg_catalog.>) 255 THEN
		RAISE EXCEPTION 'invalid idempotency key'
			USING ERRCODE = 'invalid_parameter_value',
				  DETAIL = format('An idempotency key must be 1 to 255 bytes long; this one has %s.', len);
	END IF;
	IF idempotency._has_control_chars(key) THEN
		RAISE EXCEPTION 'invalid idempotency key'
			USING ERRCODE = 'invalid_parameter_value',
				  DETAIL = 'An idempotency key must not contain control characters.';
	END IF;
	RETURN key;
END
$$;
COMMENT ON FUNCTION idempotency._check_key(text) IS
	'internal: checks a key argument (22004, 22023)';

-- Returns the scope argument, or idempotency.scope when NULL; at most 255
-- bytes, no control characters (22023).
CREATE FUNCTION idempotency._scope(scope text)
RETURNS text
LANGUAGE plpgsql STABLE
AS $$
DECLARE
	s text := COALESCE(scope, current_setting('idempotency.scope', true), '');
BEGIN
	IF octet_length(s) OPERATOR(pg_catalog.>) 255 THEN
		RAISE EXCEPTION 'invalid scope'
			USING ERRCODE = 'invalid_parameter_value',
				  DETAIL = format('A scope must be at most 255 bytes long; this one has %s.', octet_length(s));
	END IF;
	IF idempotency._has_control_chars(s) THEN
		RAISE EXCEPTION 'invalid scope'
			USING ERRCODE = 'invalid_parameter_value',
				  DETAIL = 'A scope must not contain control characters.';
	END IF;
	RETURN s;
END
$$;
COMMENT ON FUNCTION idempotency._scope(text) IS
	'internal: the scope argument, or the setting idempotency.scope';

-- Returns a duration setting as an interval: a bare number is in unit (the
-- C edition's unit for it), anything else is read as an interval ('2s').
CREATE FUNCTION idempotency._setting_interval(name text, unit text, dflt interval)
RETURNS interval
LANGUAGE plpgsql STABLE
AS $$
DECLARE
	v text := btrim(current_setting(name, true));
BEGIN
	IF v IS NULL OR v OPERATOR(pg_catalog.=) '' THEN
		RETURN dflt;
	ELSIF v OPERATOR(pg_catalog.~) '^[0-9]+$' THEN
		RETURN (v OPERATOR(pg_catalog.||) ' ' OPERATOR(pg_catalog.||) unit)::interval;
	END IF;
	RETURN v::interval;
END
$$;
COMMENT ON FUNCTION idempotency._setting_interval(text, text, interval) IS
	'internal: a duration setting, read as the C edition reads it';

-- Returns an interval argument, or dflt when NULL; 22023 when a field is
-- beyond 10000 years (so that now + it cannot overflow).
CREATE FUNCTION idempotency._bounded(span interval, name text, dflt interval)
RETURNS interval
LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
	months numeric;
	days numeric;
	usecs numeric;
BEGIN
	IF span IS NULL THEN
		RETURN dflt;
	END IF;
	months := EXTRACT(year FROM span) OPERATOR(pg_catalog.*) 12 OPERATOR(pg_catalog.+) EXTRACT(month FROM span);
	days := EXTRACT(day FROM span);
	IF abs(months) OPERATOR(pg_catalog.<=) 120000 AND abs(days) OPERATOR(pg_catalog.<=) 3660000 THEN
		usecs := EXTRACT(epoch FROM span OPERATOR(pg_catalog.-)
						 make_interval(months => months::int, days => days::int))
				 OPERATOR(pg_catalog.*) 1000000;
	END IF;
	-- 10000 years of 366 days, in microseconds (the C edition's bound)
	IF usecs IS NULL OR abs(usecs) OPERATOR(pg_catalog.>) 316224000000000000::numeric THEN
		RAISE EXCEPTION 'argument "%" is out of range', name
			USING ERRCODE = 'invalid_parameter_value',
				  DETAIL = 'Each field of the interval must be at most 10000 years.';
	END IF;
	RETURN span;
END
$$;
COMMENT ON FUNCTION idempotency._bounded(interval, text, interval) IS
	'internal: an interval argument within 10000 years per field (22023)';

-- Returns 1, 0 or -1 as now + span is later than, the same as or earlier
-- than now; -1 when it is before the first representable timestamp (a
-- span within 10000 years per field cannot pass the last one).
CREATE FUNCTION idempotency._sign_from(span interval, now timestamptz)
RETURNS integer
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
	RETURN sign(EXTRACT(epoch FROM (now OPERATOR(pg_catalog.+) span) OPERATOR(pg_catalog.-) now));
EXCEPTION WHEN datetime_field_overflow THEN
	RETURN '-1'::integer;
END
$$;
COMMENT ON FUNCTION idempotency._sign_from(interval, timestamptz) IS
	'internal: the sign of now + span - now, -1 before the first timestamp';

-- Raises 22023 unless now + span is later than now.  A span that ends
-- before the first representable timestamp is not positive either (not
-- 22008): such an end is long past.
CREATE FUNCTION idempotency._require_positive(span interval, now timestamptz, name text)
RETURNS interval
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
	IF idempotency._sign_from(span, now) OPERATOR(pg_catalog.>) 0 THEN
		RETURN span;
	END IF;
	RAISE EXCEPTION 'argument "%" must be positive', name
		USING ERRCODE = 'invalid_parameter_value',
			  DETAIL = 'The interval must end later than it starts, whatever its months and days add up to.';
END
$$;
COMMENT ON FUNCTION idempotency._require_positive(interval, timestamptz, text) IS
	'internal: raises 22023 unless an interval is positive as elapsed time';

-- Raises 25006 in a read-only transaction or on a standby, as the C
-- edition's PreventCommandIfReadOnly does, whatever the call would write.
CREATE FUNCTION idempotency._require_writable(what text)
RETURNS void
LANGUAGE plpgsql STABLE
AS $$
BEGIN
	IF current_setting('transaction_read_only') OPERATOR(pg_catalog.=) 'on' THEN
		RAISE EXCEPTION 'cannot execute % in a read-only transaction', what
			USING ERRCODE = 'read_only_sql_transaction';
	END IF;
END
$$;
COMMENT ON FUNCTION idempotency._require_writable(text) IS
	'internal: raises 25006 in a read-only transaction';

-- Returns the calling role, whose records are its own: the role of the
-- token, made in this statement of this backend (see _caller_token), else
-- 42501.  Raises 42501 too for a role whose only USAGE on the schema is
-- pg_monitor's (that grant is for the stats view), unless it may read the
-- table anyway (its owner, a member of it, a superuser).
CREATE FUNCTION idempotency._caller(me idempotency._caller_token)
RETURNS regrole
LANGUAGE plpgsql STABLE
AS $$
DECLARE
	caller regrole := me[1]::oid::regrole;
BEGIN
	IF NOT idempotency._token_holds(me) THEN
		RAISE EXCEPTION 'permission denied for schema idempotency'
			USING ERRCODE = 'insufficient_privilege',
				  DETAIL = 'The API acts only for the role whose code calls it, in the statement that calls it.';
	END IF;
	IF pg_has_role(caller, 'pg_monitor', 'USAGE')
	   AND NOT has_table_privilege(caller, 'idempotency.keys'::pg_catalog.regclass, 'SELECT')
	   AND NOT EXISTS (
		   SELECT FROM pg_namespace n,
				LATERAL aclexplode(COALESCE(n.nspacl, acldefault('n', n.nspowner))) a
		   WHERE n.nspname OPERATOR(pg_catalog.=) 'idempotency'
			 AND a.privilege_type OPERATOR(pg_catalog.=) 'USAGE'
			 AND a.grantee OPERATOR(pg_catalog.<>) 'pg_monitor'::regrole
			 AND (a.grantee OPERATOR(pg_catalog.=) 0::oid
				  OR pg_has_role(caller, a.grantee, 'USAGE'))) THEN
		RAISE EXCEPTION 'permission denied for schema idempotency'
			USING ERRCODE = 'insufficient_privilege',
				  DETAIL = 'Membership in pg_monitor gives access to idempotency.stats only.',
				  HINT = 'Grant USAGE on schema idempotency to the roles that use the API.';
	END IF;
	RETURN caller;
END
$$;
COMMENT ON FUNCTION idempotency._caller(idempotency._caller_token) IS
	'internal: the calling role, allowed to use the API';

-- Sets lock_timeout, to the end of the transaction (the caller restores
-- its own), to what is left until deadline, unless the caller's own is
-- shorter: a wait for another transaction's write ends at the deadline.
-- At most lock_timeout's largest value (about 24.8 days): a longer wait
-- ends then and answers in_progress, as the C edition's does.  Returns
-- whether it set it: a timeout that is the caller's own is the caller's
-- error (55P03), as in the C edition.
CREATE FUNCTION idempotency._lock_timeout_until(deadline timestamptz)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
	caller_ms float8 := EXTRACT(epoch FROM current_setting('lock_timeout')::interval)
		OPERATOR(pg_catalog.*) 1000;
	left_ms float8 := GREATEST(1, LEAST(2147483647, ceil(EXTRACT(epoch FROM
		deadline OPERATOR(pg_catalog.-) clock_timestamp()) OPERATOR(pg_catalog.*) 1000)));
BEGIN
	IF caller_ms OPERATOR(pg_catalog.=) 0 OR caller_ms OPERATOR(pg_catalog.>) left_ms THEN
		PERFORM set_config('lock_timeout', left_ms::bigint::text, true);
		RETURN true;
	END IF;
	RETURN false;
END
$$;
COMMENT ON FUNCTION idempotency._lock_timeout_until(timestamptz) IS
	'internal: bounds lock_timeout by what is left of a claim''s wait';

-- Raises IK001: the fence no longer owns the claim.
CREATE FUNCTION idempotency._fence_lost(key text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
	RAISE EXCEPTION 'this fence no longer owns idempotency key "%"', key
		USING ERRCODE = 'IK001',
			  DETAIL = 'The claim was taken over, released, completed or expired.',
			  HINT = 'Do not send this response: another attempt owns the request.';
END
$$;
COMMENT ON FUNCTION idempotency._fence_lost(text) IS
	'internal: raises IK001';

-- Returns idempotency.max_response_bytes in bytes (default 1MB).
CREATE FUNCTION idempotency._max_response_bytes()
RETURNS bigint
LANGUAGE sql STABLE
RETURN COALESCE(pg_catalog.pg_size_bytes(CASE
	WHEN pg_catalog.current_setting('idempotency.max_response_bytes', true) OPERATOR(pg_catalog.<>) ''
	THEN pg_catalog.current_setting('idempotency.max_response_bytes', true) END), 1048576);
COMMENT ON FUNCTION idempotency._max_response_bytes() IS
	'internal: the setting idempotency.max_response_bytes, in bytes';

-- Checks headers (a JSON object whose names are HTTP tokens and whose values
-- are strings or arrays of strings without CR or LF) and returns them
-- without those named in idempotency.header_denylist (any case).
CREATE FUNCTION idempotency._filter_headers(headers jsonb)
RETURNS jsonb
LANGUAGE plpgsql STABLE
AS $$
DECLARE
	list text := COALESCE(current_setting('idempotency.header_denylist', true),
		'set-cookie, authorization, proxy-authorization, cookie, www-authenticate');
	denied text[];
	h record;
	v jsonb;
	dropped text[] := '{}';
BEGIN
	IF jsonb_typeof(headers) OPERATOR(pg_catalog.<>) 'object' THEN
		RAISE EXCEPTION 'invalid response headers'
			USING ERRCODE = 'invalid_parameter_value',
				  DETAIL = 'Headers must be a JSON object.';
	END IF;
	SELECT COALESCE(array_agg(lower(btrim(btrim(n), '"'))), '{}') INTO denied
	FROM unnest(string_to_array(list, ',')) n
	WHERE btrim(n) OPERATOR(pg_catalog.<>) '';
	FOR h IN SELECT * FROM jsonb_each(headers) LOOP
		IF h.key OPERATOR(pg_catalog.=) '' THEN
			RAISE EXCEPTION 'invalid response header name ""'
				USING ERRCODE = 'invalid_parameter_value',
					  DETAIL = 'A header name must not be empty.';
		END IF;
		IF h.key OPERATOR(pg_catalog.!~) '^[-!#$%&''*+.^_`|~0-9A-Za-z]+$' THEN
			RAISE EXCEPTION 'invalid response header name "%"', h.key
				USING ERRCODE = 'invalid_parameter_value',
					  DETAIL = 'A header name must be an HTTP token: letters, digits and !#$%&''*+-.^_`|~ only.';
		END IF;
		FOR v IN SELECT CASE WHEN jsonb_typeof(h.value) OPERATOR(pg_catalog.=) 'array' THEN e ELSE h.value END
				 FROM jsonb_array_elements(CASE WHEN jsonb_typeof(h.value) OPERATOR(pg_catalog.=) 'array'
										   THEN h.value ELSE '[null]' END) e LOOP
			IF jsonb_typeof(v) OPERATOR(pg_catalog.<>) 'string' THEN
				RAISE EXCEPTION 'invalid value of response header "%"', h.key
					USING ERRCODE = 'invalid_parameter_value',
						  DETAIL = 'A header value must be a string or an array of strings.';
			END IF;
			IF (v OPERATOR(pg_catalog.#>>) '{}') OPERATOR(pg_catalog.~) '[\r\n]' THEN
				RAISE EXCEPTION 'invalid value of response header "%"', h.key
					USING ERRCODE = 'invalid_parameter_value',
						  DETAIL = 'A header value must not contain CR, LF or NUL characters.';
			END IF;
		END LOOP;
		IF lower(h.key) OPERATOR(pg_catalog.=) ANY (denied) THEN
			dropped := dropped OPERATOR(pg_catalog.||) h.key;
		END IF;
	END LOOP;
	IF cardinality(dropped) OPERATOR(pg_catalog.=) 0 THEN
		RETURN headers;
	END IF;
	RETURN headers OPERATOR(pg_catalog.-) dropped;
END
$$;
COMMENT ON FUNCTION idempotency._filter_headers(jsonb) IS
	'internal: checks response headers and drops the denied ones';

------------------------------------------------------------------------------
-- The API
------------------------------------------------------------------------------

-- claim() in full: every check, the decision in the design's order, the
-- waits.  claim() answers a new key and a replay itself, and calls this for
-- everything else.
CREATE FUNCTION idempotency._claim(
	me idempotency._caller_token,
	key text,
	fingerprint bytea,
	scope text,
	lease interval,
	retention interval,
	wait interval,
	token uuid)
RETURNS idempotency.claim_result
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
AS $$
#variable_conflict use_column
DECLARE
	now timestamptz := clock_timestamp();
	p_key text COLLATE "C" := key;
	p_fp bytea := fingerprint;
	p_scope text := COALESCE(scope, current_setting('idempotency.scope', true), '');
	p_lease interval := lease;
	p_retention interval := retention;
	p_wait interval := wait;
	p_token uuid := token;
	setting text;
	caller regrole;
	deadline timestamptz;
	res idempotency.claim_result;
	rec record;
	step text;
	new_fence bigint;
	won timestamptz;
	saved_lock_timeout text;
	our_timeout boolean;
	wrote boolean;
	nap float8 := 0.005;
	inserts_failed int := 0;
	tries int := 0;
BEGIN
	-- FORCE ROW LEVEL SECURITY binds the table's owner, as whom the API
	-- reads; the policies would hide records from it, or not bind it (a
	-- superuser): refused, as the C edition refuses it.
	IF EXISTS (SELECT FROM pg_catalog.pg_class r WHERE r.oid OPERATOR(pg_catalog.=) 'idempotency.keys'::pg_catalog.regclass
			   AND r.relrowsecurity AND r.relforcerowsecurity) THEN
		RAISE EXCEPTION 'row-level security of idempotency.keys applies to its owner, as whom the API runs'
			USING ERRCODE = 'feature_not_supported',
				  DETAIL = 'The API reads its records without the policies that would hide them.',
				  HINT = 'Use ALTER TABLE idempotency.keys NO FORCE ROW LEVEL SECURITY.';
	END IF;
	-- The arguments' checks, in the C edition's order: one expression finds
	-- them all in order, the helpers say which failed.
	IF p_key IS NULL OR octet_length(p_key) OPERATOR(pg_catalog.>) 255 OR p_key OPERATOR(pg_catalog.=) ''
	   OR p_key OPERATOR(pg_catalog.~) '[\x01-\x1f\x7f\u0080-\u009f]'
	   OR p_fp IS NULL OR octet_length(p_fp) OPERATOR(pg_catalog.>) 64 OR octet_length(p_fp) OPERATOR(pg_catalog.=) 0
	   OR octet_length(p_scope) OPERATOR(pg_catalog.>) 255
	   OR p_scope OPERATOR(pg_catalog.~) '[\x01-\x1f\x7f\u0080-\u009f]' THEN
		PERFORM idempotency._check_key(p_key);
		IF p_fp IS NULL THEN
			RAISE EXCEPTION 'argument "fingerprint" must not be null'
				USING ERRCODE = 'null_value_not_allowed';
		END IF;
		IF octet_length(p_fp) OPERATOR(pg_catalog.<) 1 OR octet_length(p_fp) OPERATOR(pg_catalog.>) 64 THEN
			RAISE EXCEPTION 'invalid fingerprint'
				USING ERRCODE = 'invalid_parameter_value',
					  DETAIL = format('A fingerprint must be 1 to 64 bytes long; this one has %s.', octet_length(p_fp));
		END IF;
		p_scope := idempotency._scope(p_scope);
	END IF;
	IF p_lease IS NULL AND p_retention IS NULL AND p_wait IS NULL
	   AND current_setting('idempotency.lease', true) IS NULL
	   AND current_setting('idempotency.retention', true) IS NULL THEN
		p_lease := '60s';
		p_retention := '24h';
		p_wait := '0';
	ELSE
		IF p_lease IS NULL THEN
			p_lease := idempotency._setting_interval('idempotency.lease', 'ms', '60s');
		ELSE
			p_lease := idempotency._bounded(p_lease, 'lease', NULL);
		END IF;
		PERFORM idempotency._require_positive(p_lease, now, 'lease');
		IF p_retention IS NULL THEN
			p_retention := idempotency._setting_interval('idempotency.retention', 's', '24h');
		ELSE
			p_retention := idempotency._bounded(p_retention, 'retention', NULL);
		END IF;
		PERFORM idempotency._require_positive(p_retention, now, 'retention');
		IF (now OPERATOR(pg_catalog.+) p_retention) OPERATOR(pg_catalog.<) (now OPERATOR(pg_catalog.+) p_lease) THEN
			RAISE EXCEPTION 'retention must not be shorter than the lease'
				USING ERRCODE = 'invalid_parameter_value',
					  DETAIL = 'A response stored at the end of the lease must still be there to be replayed.';
		END IF;
		IF p_wait IS NULL THEN
			p_wait := '0';
		ELSE
			p_wait := idempotency._bounded(p_wait, 'wait', NULL);
			IF idempotency._sign_from(p_wait, now) OPERATOR(pg_catalog.<) 0 THEN
				RAISE EXCEPTION 'argument "wait" must not be negative'
					USING ERRCODE = 'invalid_parameter_value';
			END IF;
		END IF;
	END IF;
	IF current_setting('transaction_read_only') OPERATOR(pg_catalog.=) 'on' THEN
		PERFORM idempotency._require_writable('idempotency.claim()');
	END IF;
	caller := idempotency._caller(me);
	-- Under REPEATABLE READ or SERIALIZABLE the snapshot would hide the
	-- owner's complete or release: such a claim does not wait for them.
	IF current_setting('transaction_isolation') OPERATOR(pg_catalog.<>) 'read committed' THEN
		p_wait := '0';
	END IF;

	deadline := now OPERATOR(pg_catalog.+) p_wait;

	LOOP
		-- The record the caller sees: its own live one, else a live one of a
		-- role whose privileges it has, else its own expired one, else
		-- another's.  Each statement reads with a new snapshot (READ COMMITTED).
		SELECT k.owner, k.fence, k.state, k.fingerprint OPERATOR(pg_catalog.=) p_fp AS same_fp,
			   k.lease_expires_at, k.expires_at, k.created_at, k.status_code,
			   k.headers, k.body, k.token, k.attempt, k.recovery_point, k.recovery_state,
			   k.expires_at OPERATOR(pg_catalog.<=) now
				 AND (k.state OPERATOR(pg_catalog.=) 'completed'
					  OR k.lease_expires_at OPERATOR(pg_catalog.<=) now) AS expired
		INTO rec
		FROM ONLY idempotency.keys k
		WHERE k.key OPERATOR(pg_catalog.=) p_key
		  AND k.scope OPERATOR(pg_catalog.=) (p_scope COLLATE "C")
		  AND (k.owner OPERATOR(pg_catalog.=) caller OR pg_has_role(caller::oid, k.owner::oid, 'USAGE'))
		ORDER BY (k.expires_at OPERATOR(pg_catalog.<=) now
				  AND (k.state OPERATOR(pg_catalog.=) 'completed'
					   OR k.lease_expires_at OPERATOR(pg_catalog.<=) now)),
				 k.owner OPERATOR(pg_catalog.<>) caller
		LIMIT 1;

		res := NULL;
		IF NOT FOUND THEN
			step := 'insert';
		ELSIF rec.expired THEN
			step := CASE WHEN rec.owner OPERATOR(pg_catalog.=) caller THEN 'reset' ELSE 'insert' END;
		ELSE
			res.created_at := rec.created_at;
			IF NOT rec.same_fp THEN
				res.outcome := 'mismatch';
			ELSIF rec.state OPERATOR(pg_catalog.=) 'completed' THEN
				res.outcome := 'replay';
				res.status_code := rec.status_code;
				res.headers := rec.headers;
				res.body := rec.body;
			ELSIF rec.lease_expires_at OPERATOR(pg_catalog.>) now THEN
				IF p_token IS NOT NULL AND rec.token OPERATOR(pg_catalog.=) p_token
				   AND rec.owner OPERATOR(pg_catalog.=) caller THEN
					-- the same attempt asks again: the same answer (claims_resumed),
					-- once a transaction writing the record (complete's, whose
					-- answer was lost) has ended; with wait, at most until the
					-- deadline.  A record it changed is read again.
					saved_lock_timeout := current_setting('lock_timeout');
					BEGIN
						our_timeout := p_wait OPERATOR(pg_catalog.>) '0'
							AND idempotency._lock_timeout_until(deadline);
						PERFORM FROM ONLY idempotency.keys k
						WHERE k.key OPERATOR(pg_catalog.=) p_key
						  AND k.scope OPERATOR(pg_catalog.=) (p_scope COLLATE "C")
						  AND k.owner OPERATOR(pg_catalog.=) caller
						  AND k.fence OPERATOR(pg_catalog.=) rec.fence
						  AND k.state OPERATOR(pg_catalog.=) 'in_progress'
						FOR SHARE;
						wrote := FOUND; -- before PERFORM sets FOUND again
						PERFORM set_config('lock_timeout', saved_lock_timeout, true);
					EXCEPTION WHEN lock_not_available THEN
						PERFORM set_config('lock_timeout', saved_lock_timeout, true);
						IF NOT our_timeout THEN
							RAISE;
						END IF;
						res.outcome := 'in_progress';
						res.retry_after := 1;
						RETURN res;
					END;
					IF NOT wrote THEN
						now := clock_timestamp();
						CONTINUE;
					END IF;
					res.outcome := 'new';
					res.fence := rec.fence;
					res.attempt := rec.attempt;
					res.recovery_point := rec.recovery_point;
					res.recovery_state := rec.recovery_state;
					RETURN res;
				END IF;
				res.outcome := 'in_progress';
				-- with wait: poll in short, growing sleeps, never past the
				-- lease's end or the deadline (pg_sleep checks for cancel)
				IF clock_timestamp() OPERATOR(pg_catalog.<) deadline THEN
					PERFORM pg_sleep(LEAST(nap,
						EXTRACT(epoch FROM LEAST(deadline, rec.lease_expires_at)
										   OPERATOR(pg_catalog.-) clock_timestamp()) OPERATOR(pg_catalog.+) 0.001));
					nap := LEAST(nap OPERATOR(pg_catalog.*) 2, 0.1);
					now := clock_timestamp();
					CONTINUE;
				END IF;
				res.retry_after := GREATEST(1, LEAST(2147483647, ceil(EXTRACT(epoch FROM
					rec.lease_expires_at OPERATOR(pg_catalog.-) now))))::int;
			ELSE
				step := 'takeover';
			END IF;
			IF res.outcome IS NOT NULL THEN
				RETURN res;
			END IF;
		END IF;

		-- With wait, a transaction writing the record (a late complete in
		-- one transaction, another takeover) is waited for at most until the
		-- deadline, as by the C edition: the row is locked first.
		IF step OPERATOR(pg_catalog.<>) 'insert' AND p_wait OPERATOR(pg_catalog.>) '0' THEN
			saved_lock_timeout := current_setting('lock_timeout');
			BEGIN
				our_timeout := idempotency._lock_timeout_until(deadline);
				PERFORM FROM ONLY idempotency.keys k
				WHERE k.key OPERATOR(pg_catalog.=) p_key
				  AND k.scope OPERATOR(pg_catalog.=) (p_scope COLLATE "C")
				  AND k.owner OPERATOR(pg_catalog.=) rec.owner
				  AND k.fence OPERATOR(pg_catalog.=) rec.fence
				FOR UPDATE;
				PERFORM set_config('lock_timeout', saved_lock_timeout, true);
			EXCEPTION WHEN lock_not_available THEN
				PERFORM set_config('lock_timeout', saved_lock_timeout, true);
				IF NOT our_timeout THEN
					RAISE;
				END IF;
				res.outcome := 'in_progress';
				res.retry_after := 1;
				RETURN res;
			END;
		END IF;

		-- The clock after the read: a lease starts when it is won.
		now := clock_timestamp();
		new_fence := pg_catalog.nextval('idempotency.fence_seq'::pg_catalog.regclass);
		IF step OPERATOR(pg_catalog.=) 'insert' THEN
			-- Waits, as the primary key makes it, for a transaction that is
			-- inserting the same record; with wait, at most until the deadline.
			IF p_wait OPERATOR(pg_catalog.>) '0' THEN
				saved_lock_timeout := current_setting('lock_timeout');
				BEGIN
					our_timeout := idempotency._lock_timeout_until(deadline);
					INSERT INTO idempotency.keys (fence, created_at, expires_at, attempt, owner,
						lease, lease_expires_at, state, scope, key, fingerprint, token)
					VALUES (new_fence, now, now OPERATOR(pg_catalog.+) p_retention, 1, caller,
						p_lease, now OPERATOR(pg_catalog.+) p_lease, 'in_progress', p_scope,
						p_key, p_fp, p_token)
					ON CONFLICT (key, scope, owner) DO NOTHING;
					wrote := FOUND; -- before PERFORM sets FOUND again
					PERFORM set_config('lock_timeout', saved_lock_timeout, true);
				EXCEPTION WHEN lock_not_available THEN
					PERFORM set_config('lock_timeout', saved_lock_timeout, true);
					IF NOT our_timeout THEN
						RAISE;
					END IF;
					res.outcome := 'in_progress';
					res.retry_after := 1;
					RETURN res;
				END;
			ELSE
				INSERT INTO idempotency.keys (fence, created_at, expires_at, attempt, owner,
					lease, lease_expires_at, state, scope, key, fingerprint, token)
				VALUES (new_fence, now, now OPERATOR(pg_catalog.+) p_retention, 1, caller,
					p_lease, now OPERATOR(pg_catalog.+) p_lease, 'in_progress', p_scope,
					p_key, p_fp, p_token)
				ON CONFLICT (key, scope, owner) DO NOTHING;
				wrote := FOUND;
			END IF;
			IF wrote THEN
				res.outcome := 'new';
				res.fence := new_fence;
				res.attempt := 1;
				res.created_at := now;
				RETURN res;
			END IF;
			-- Under REPEATABLE READ or SERIALIZABLE a second failed insert
			-- means a record committed that the snapshot cannot see.
			inserts_failed := inserts_failed OPERATOR(pg_catalog.+) 1;
			IF inserts_failed OPERATOR(pg_catalog.>) 1
			   AND current_setting('transaction_isolation') OPERATOR(pg_catalog.<>) 'read committed' THEN
				RAISE EXCEPTION 'could not serialize access due to concurrent update'
					USING ERRCODE = 'serialization_failure';
			END IF;
		ELSIF step OPERATOR(pg_catalog.=) 'reset' THEN
			-- The caller's own expired record becomes a new claim.
			UPDATE ONLY idempotency.keys k SET fingerprint = p_fp, state = 'in_progress',
				fence = new_fence, attempt = 1, lease = p_lease,
				lease_expires_at = now OPERATOR(pg_catalog.+) p_lease,
				recovery_point = NULL, recovery_state = NULL, status_code = NULL,
				headers = NULL, body = NULL, created_at = now, completed_at = NULL,
				expires_at = now OPERATOR(pg_catalog.+) p_retention, token = p_token
			WHERE k.key OPERATOR(pg_catalog.=) p_key
			  AND k.scope OPERATOR(pg_catalog.=) (p_scope COLLATE "C")
			  AND k.owner OPERATOR(pg_catalog.=) caller
			  AND k.fence OPERATOR(pg_catalog.=) rec.fence
			  AND k.expires_at OPERATOR(pg_catalog.<=) now
			  AND (k.state OPERATOR(pg_catalog.=) 'completed'
				   OR k.lease_expires_at OPERATOR(pg_catalog.<=) now);
			IF FOUND THEN
				res.outcome := 'new';
				res.fence := new_fence;
				res.attempt := 1;
				res.created_at := now;
			END IF;
		ELSE
			-- A takeover of an ended lease: a new fence, one more attempt,
			-- the recovery point kept; the expiry moves with the lease's end.
			UPDATE ONLY idempotency.keys k SET fence = new_fence,
				attempt = k.attempt OPERATOR(pg_catalog.+) 1, lease = p_lease,
				lease_expires_at = GREATEST(k.lease_expires_at, now OPERATOR(pg_catalog.+) p_lease),
				expires_at = k.expires_at OPERATOR(pg_catalog.+) GREATEST(
					(now OPERATOR(pg_catalog.+) p_lease) OPERATOR(pg_catalog.-) k.lease_expires_at,
					'0'::interval),
				token = p_token
			WHERE k.key OPERATOR(pg_catalog.=) p_key
			  AND k.scope OPERATOR(pg_catalog.=) (p_scope COLLATE "C")
			  AND k.owner OPERATOR(pg_catalog.=) rec.owner
			  AND k.fence OPERATOR(pg_catalog.=) rec.fence
			  AND k.state OPERATOR(pg_catalog.=) 'in_progress'
			  AND k.lease_expires_at OPERATOR(pg_catalog.<=) now
			  AND NOT (k.expires_at OPERATOR(pg_catalog.<=) now)
			RETURNING k.attempt, k.recovery_point, k.recovery_state, k.created_at
			INTO res.attempt, res.recovery_point, res.recovery_state, res.created_at;
			IF FOUND THEN
				res.outcome := 'new';
				res.fence := new_fence;
			END IF;
		END IF;

		IF res.outcome OPERATOR(pg_catalog.=) 'new' THEN
			-- An update kept waiting by another transaction's write of the
			-- row restarts the lease (and a reset record's life) when it won.
			won := clock_timestamp();
			IF won OPERATOR(pg_catalog.-) now OPERATOR(pg_catalog.>) '1 ms'::interval THEN
				UPDATE ONLY idempotency.keys k
				SET lease_expires_at = won OPERATOR(pg_catalog.+) k.lease,
					created_at = CASE WHEN step OPERATOR(pg_catalog.=) 'reset' THEN won ELSE k.created_at END,
					expires_at = CASE WHEN step OPERATOR(pg_catalog.=) 'reset'
						THEN won OPERATOR(pg_catalog.+) p_retention
						ELSE k.expires_at OPERATOR(pg_catalog.+) GREATEST(
							(won OPERATOR(pg_catalog.+) k.lease) OPERATOR(pg_catalog.-) k.lease_expires_at,
							'0'::interval) END
				WHERE k.key OPERATOR(pg_catalog.=) p_key
				  AND k.scope OPERATOR(pg_catalog.=) (p_scope COLLATE "C")
				  AND k.fence OPERATOR(pg_catalog.=) new_fence
				  AND (k.owner OPERATOR(pg_catalog.=) caller OR pg_has_role(caller::oid, k.owner::oid, 'USAGE'));
				IF step OPERATOR(pg_catalog.=) 'reset' THEN
					res.created_at := won;
				END IF;
			END IF;
			RETURN res;
		END IF;
		-- A concurrent transaction changed the record first: read it again;
		-- a claim that keeps losing such races gives up.
		tries := tries OPERATOR(pg_catalog.+) 1;
		IF tries OPERATOR(pg_catalog.>=) 16 THEN
			RAISE EXCEPTION 'could not claim idempotency key "%" because of concurrent updates', p_key
				USING ERRCODE = 'serialization_failure', HINT = 'Retry the claim.';
		END IF;
		now := clock_timestamp();
	END LOOP;
END
$$;
CREATE FUNCTION idempotency._claim_hot(
	me idempotency._caller_token,
	key text,
	fingerprint bytea,
	scope text,
	lease interval,
	retention interval,
	wait interval,
	token uuid)
RETURNS idempotency.claim_result
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
-- claim()'s work, as the table's owner for the role of the token.  The
-- hot path: a new key, or a replay of the caller's own record, with the
-- default lease and retention (unset, or set as the C edition shows its
-- defaults: its library may be loaded too), no wait, in READ COMMITTED.
-- PL/pgSQL prepares each expression again in every transaction, and the
-- executor sets up each node and function of a statement at every call
-- (bench/instructions counts them): this has few, and leaves every other
-- case to _claim.  (ON CONFLICT names the primary key's columns, which the
-- arguments would shadow.)
#variable_conflict use_column
DECLARE
	caller regrole := me[1]::oid::regrole;
	p_scope text COLLATE "C" := COALESCE(_claim_hot.scope, current_setting('idempotency.scope', true), '');
	rec record;
	new_fence bigint;
	now timestamptz;
BEGIN
	IF _claim_hot.key IS NULL OR octet_length(_claim_hot.key) OPERATOR(pg_catalog.>) 255
	   OR _claim_hot.key OPERATOR(pg_catalog.=) '' OR _claim_hot.key OPERATOR(pg_catalog.~) '[\x01-\x1f\x7f\u0080-\u009f]'
	   OR _claim_hot.fingerprint IS NULL OR octet_length(_claim_hot.fingerprint) OPERATOR(pg_catalog.>) 64
	   OR octet_length(_claim_hot.fingerprint) OPERATOR(pg_catalog.=) 0
	   OR octet_length(p_scope) OPERATOR(pg_catalog.>) 255 OR p_scope OPERATOR(pg_catalog.~) '[\x01-\x1f\x7f\u0080-\u009f]'
	   OR _claim_hot.lease IS NOT NULL OR _claim_hot.retention IS NOT NULL OR _claim_hot.wait IS NOT NULL
	   OR COALESCE(current_setting('idempotency.lease', true), '1min') OPERATOR(pg_catalog.<>) '1min'
	   OR COALESCE(current_setting('idempotency.retention', true), '1d') OPERATOR(pg_catalog.<>) '1d'
	   OR current_setting('transaction_read_only') OPERATOR(pg_catalog.=) 'on'
	   OR current_setting('transaction_isolation') OPERATOR(pg_catalog.<>) 'read committed'
	   OR NOT idempotency._token_holds(me)
	   OR (pg_has_role(caller, 'pg_monitor', 'USAGE')
		   AND NOT has_table_privilege(caller, 'idempotency.keys'::pg_catalog.regclass, 'SELECT')) THEN
		RETURN idempotency._claim(me, _claim_hot.key, _claim_hot.fingerprint, _claim_hot.scope, _claim_hot.lease,
								  _claim_hot.retention, _claim_hot.wait, _claim_hot.token);
	END IF;
	-- The caller's record of (scope, key), unless FORCE ROW LEVEL SECURITY
	-- binds the table: one row whatever there is, none when forced (then
	-- _claim refuses it), so one statement tells both.  A record of another
	-- role, or a second one, is _claim's to order (the first row is taken,
	-- in index order).
	SELECT k.owner IS NULL AS absent,
		   k.owner OPERATOR(pg_catalog.=) caller
			 AND k.fingerprint OPERATOR(pg_catalog.=) _claim_hot.fingerprint
			 AND k.state OPERATOR(pg_catalog.=) 'completed'
			 AND k.expires_at OPERATOR(pg_catalog.>) clock_timestamp() AS replay,
		   k.status_code, k.headers, k.body, k.created_at
	INTO rec
	FROM pg_catalog.pg_class r
	LEFT JOIN ONLY idempotency.keys k
		ON k.key OPERATOR(pg_catalog.=) (_claim_hot.key COLLATE "C")
	   AND k.scope OPERATOR(pg_catalog.=) p_scope
	   AND (k.owner OPERATOR(pg_catalog.=) caller OR pg_has_role(caller::oid, k.owner::oid, 'USAGE'))
	WHERE r.oid OPERATOR(pg_catalog.=) 'idempotency.keys'::pg_catalog.regclass
	  AND NOT (r.relrowsecurity AND r.relforcerowsecurity);
	IF rec.absent THEN
		-- No record: one INSERT, which the primary key settles (waiting, as
		-- it does, for a transaction inserting the same record).  The clock
		-- is read after the read: a lease starts when it is won.
		now := clock_timestamp();
		INSERT INTO idempotency.keys AS k (fence, created_at, expires_at, attempt, owner,
			lease, lease_expires_at, state, scope, key, fingerprint, token)
		VALUES (pg_catalog.nextval('idempotency.fence_seq'::pg_catalog.regclass), now,
			now OPERATOR(pg_catalog.+) '24h'::interval, 1, caller, '60s'::interval,
			now OPERATOR(pg_catalog.+) '60s'::interval, 'in_progress', p_scope,
			_claim_hot.key, _claim_hot.fingerprint, _claim_hot.token)
		ON CONFLICT (key, scope, owner) DO NOTHING
		RETURNING k.fence INTO new_fence;
		IF new_fence IS NOT NULL THEN
			RETURN ROW('new', new_fence, 1, NULL, NULL, NULL, NULL, NULL, NULL, now)::idempotency.claim_result;
		END IF;
	ELSIF rec.replay THEN
		RETURN ROW('replay', NULL, NULL, rec.status_code, rec.headers, rec.body, NULL, NULL, NULL,
				   rec.created_at)::idempotency.claim_result;
	END IF;
	RETURN idempotency._claim(me, _claim_hot.key, _claim_hot.fingerprint, _claim_hot.scope, _claim_hot.lease,
							  _claim_hot.retention, _claim_hot.wait, _claim_hot.token);
END
$$;
-- The API's functions make the caller's token with its rights and hand
-- their arguments to their work: one SQL expression, which the planner
-- puts in the calling query (inlines), so that a call costs no function
-- of its own; its names were bound when it was created.
CREATE FUNCTION idempotency.claim(
	key text,
	fingerprint bytea,
	scope text DEFAULT NULL,
	lease interval DEFAULT NULL,
	retention interval DEFAULT NULL,
	wait interval DEFAULT NULL,
	token uuid DEFAULT NULL)
RETURNS idempotency.claim_result
LANGUAGE sql VOLATILE PARALLEL UNSAFE
RETURN idempotency._claim_hot(idempotency._me(), key, fingerprint, scope, lease, retention, wait, token);
COMMENT ON FUNCTION idempotency._claim(idempotency._caller_token, text, bytea, text, interval, interval, interval, uuid) IS
	'internal: claim() in full, for all but its hot path';
COMMENT ON FUNCTION idempotency._claim_hot(idempotency._caller_token, text, bytea, text, interval, interval, interval, uuid) IS
	'internal: claim()''s work, as the table''s owner for the caller';
COMMENT ON FUNCTION idempotency.claim(text, bytea, text, interval, interval, interval, uuid) IS
	'Claims an idempotency key: new (run the request), replay, in_progress or mismatch';

-- complete() in full; complete() stores a 1xx-4xx response without
-- headers itself, and calls this for everything else.
CREATE FUNCTION idempotency._complete(
	me idempotency._caller_token,
	key text,
	fence bigint,
	status_code integer,
	body bytea,
	headers jsonb,
	scope text)
RETURNS text
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
AS $$
DECLARE
	p_key text COLLATE "C" := key;
	p_fence bigint := fence;
	p_scope text := COALESCE(scope, current_setting('idempotency.scope', true), '');
	p_status int := status_code;
	p_body bytea := body;
	p_headers jsonb;
	release boolean;
	size bigint;
	now timestamptz;
	caller regrole;
BEGIN
	-- The helpers' checks inline, as in claim.
	IF p_key IS NULL OR octet_length(p_key) OPERATOR(pg_catalog.>) 255 OR p_key OPERATOR(pg_catalog.=) ''
	   OR p_key OPERATOR(pg_catalog.~) '[\x01-\x1f\x7f\u0080-\u009f]' THEN
		PERFORM idempotency._check_key(p_key);
	END IF;
	IF p_fence IS NULL THEN
		PERFORM idempotency._require(p_fence, 'fence');
	END IF;
	IF octet_length(p_scope) OPERATOR(pg_catalog.>) 255
	   OR p_scope OPERATOR(pg_catalog.~) '[\x01-\x1f\x7f\u0080-\u009f]' THEN
		p_scope := idempotency._scope(p_scope);
	END IF;
	IF p_status IS NULL THEN
		PERFORM idempotency._require(p_status, 'status_code');
	END IF;
	IF p_status OPERATOR(pg_catalog.<) 100 OR p_status OPERATOR(pg_catalog.>) 599 THEN
		RAISE EXCEPTION 'status code % is out of range', p_status
			USING ERRCODE = 'invalid_parameter_value',
				  DETAIL = 'An HTTP status code is between 100 and 599.';
	END IF;
	-- A 5xx that is released is not stored: its body and headers are not checked.
	release := p_status OPERATOR(pg_catalog.>=) 500
		AND NOT COALESCE(current_setting('idempotency.store_server_errors', true), 'off')::boolean;
	IF NOT release THEN
		IF headers IS NOT NULL THEN
			p_headers := idempotency._filter_headers(headers);
		END IF;
		-- The size the C edition counts: the headers' jsonb as it is in
		-- memory (#> '{}' hands it back decompressed), not as it was stored.
		size := COALESCE(octet_length(p_body), 0) OPERATOR(pg_catalog.+)
			COALESCE(pg_column_size(p_headers OPERATOR(pg_catalog.#>) '{}'::text[]) OPERATOR(pg_catalog.-) 4, 0);
		IF size OPERATOR(pg_catalog.>) idempotency._max_response_bytes() THEN
			RAISE EXCEPTION 'response is too large'
				USING ERRCODE = 'program_limit_exceeded',
					  DETAIL = format('The body and headers have %s bytes; idempotency.max_response_bytes allows %s.',
									  size, idempotency._max_response_bytes());
		END IF;
	ELSE
		p_body := NULL;
	END IF;
	IF current_setting('transaction_read_only') OPERATOR(pg_catalog.=) 'on' THEN
		PERFORM idempotency._require_writable('idempotency.complete()');
	END IF;
	caller := idempotency._caller(me);
	IF release THEN
		DELETE FROM ONLY idempotency.keys k
		WHERE k.key OPERATOR(pg_catalog.=) p_key
		  AND k.scope OPERATOR(pg_catalog.=) (p_scope COLLATE "C")
		  AND k.fence OPERATOR(pg_catalog.=) p_fence
		  AND k.state OPERATOR(pg_catalog.=) 'in_progress'
		  AND (k.owner OPERATOR(pg_catalog.=) caller OR pg_has_role(caller::oid, k.owner::oid, 'USAGE'));
	ELSE
		now := clock_timestamp();
		UPDATE ONLY idempotency.keys k
		SET state = 'completed', status_code = p_status, headers = p_headers, body = p_body,
			completed_at = now, lease_expires_at = NULL, lease = NULL, token = NULL
		WHERE k.key OPERATOR(pg_catalog.=) p_key
		  AND k.scope OPERATOR(pg_catalog.=) (p_scope COLLATE "C")
		  AND k.fence OPERATOR(pg_catalog.=) p_fence
		  AND k.state OPERATOR(pg_catalog.=) 'in_progress'
		  AND NOT (k.expires_at OPERATOR(pg_catalog.<=) now
				   AND k.lease_expires_at OPERATOR(pg_catalog.<=) now)
		  AND (k.owner OPERATOR(pg_catalog.=) caller OR pg_has_role(caller::oid, k.owner::oid, 'USAGE'));
	END IF;
	IF NOT FOUND THEN
		PERFORM idempotency._fence_lost(p_key);
	END IF;
	RETURN CASE WHEN release THEN 'released' ELSE 'stored' END;
END
$$;
CREATE FUNCTION idempotency._complete_hot(
	me idempotency._caller_token,
	key text,
	fence bigint,
	status_code integer,
	body bytea,
	headers jsonb,
	scope text)
RETURNS text
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
-- complete()'s work, as the table's owner for the role of the token.  The
-- hot path, as claim's: few expressions, the rest in _complete.
DECLARE
	caller regrole := me[1]::oid::regrole;
	p_scope text COLLATE "C" := COALESCE(_complete_hot.scope, current_setting('idempotency.scope', true), '');
	now timestamptz;
BEGIN
	IF _complete_hot.key IS NULL OR octet_length(_complete_hot.key) OPERATOR(pg_catalog.>) 255
	   OR _complete_hot.key OPERATOR(pg_catalog.=) '' OR _complete_hot.key OPERATOR(pg_catalog.~) '[\x01-\x1f\x7f\u0080-\u009f]'
	   OR _complete_hot.fence IS NULL OR _complete_hot.status_code IS NULL
	   OR _complete_hot.status_code OPERATOR(pg_catalog.<) 100 OR _complete_hot.status_code OPERATOR(pg_catalog.>) 499
	   OR _complete_hot.headers IS NOT NULL
	   OR octet_length(p_scope) OPERATOR(pg_catalog.>) 255 OR p_scope OPERATOR(pg_catalog.~) '[\x01-\x1f\x7f\u0080-\u009f]'
	   OR octet_length(_complete_hot.body) OPERATOR(pg_catalog.>) 1048576
	   OR COALESCE(current_setting('idempotency.max_response_bytes', true), '1MB') OPERATOR(pg_catalog.<>) '1MB'
	   OR current_setting('transaction_read_only') OPERATOR(pg_catalog.=) 'on'
	   OR NOT idempotency._token_holds(me)
	   OR (pg_has_role(caller, 'pg_monitor', 'USAGE')
		   AND NOT has_table_privilege(caller, 'idempotency.keys'::pg_catalog.regclass, 'SELECT')) THEN
		RETURN idempotency._complete(me, _complete_hot.key, _complete_hot.fence, _complete_hot.status_code,
									 _complete_hot.body, _complete_hot.headers, _complete_hot.scope);
	END IF;
	now := clock_timestamp();
	UPDATE ONLY idempotency.keys k
	SET state = 'completed', status_code = _complete_hot.status_code, headers = NULL, body = _complete_hot.body,
		completed_at = now, lease_expires_at = NULL, lease = NULL, token = NULL
	WHERE k.key OPERATOR(pg_catalog.=) (_complete_hot.key COLLATE "C")
	  AND k.scope OPERATOR(pg_catalog.=) p_scope
	  AND k.fence OPERATOR(pg_catalog.=) _complete_hot.fence
	  AND k.state OPERATOR(pg_catalog.=) 'in_progress'
	  AND NOT (k.expires_at OPERATOR(pg_catalog.<=) now AND k.lease_expires_at OPERATOR(pg_catalog.<=) now)
	  AND (k.owner OPERATOR(pg_catalog.=) caller OR pg_has_role(caller::oid, k.owner::oid, 'USAGE'));
	IF NOT FOUND THEN
		PERFORM idempotency._fence_lost(_complete_hot.key);
	END IF;
	RETURN 'stored';
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
RETURN idempotency._complete_hot(idempotency._me(), key, fence, status_code, body, headers, scope);
COMMENT ON FUNCTION idempotency._complete(idempotency._caller_token, text, bigint, integer, bytea, jsonb, text) IS
	'internal: complete() in full, for all but its hot path';
COMMENT ON FUNCTION idempotency._complete_hot(idempotency._caller_token, text, bigint, integer, bytea, jsonb, text) IS
	'internal: complete()''s work, as the table''s owner for the caller';
COMMENT ON FUNCTION idempotency.complete(text, bigint, integer, bytea, jsonb, text) IS
	'Stores the response of a claim (stored), or releases it for a 5xx (released)';

CREATE FUNCTION idempotency._release(
	me idempotency._caller_token,
	key text,
	fence bigint,
	scope text)
RETURNS boolean
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	caller regrole;
	p_key text COLLATE "C" := idempotency._check_key(key);
	p_fence bigint := fence;
	p_scope text;
BEGIN
	PERFORM idempotency._require(p_fence, 'fence');
	p_scope := idempotency._scope(scope);
	PERFORM idempotency._require_writable('idempotency.release()');
	caller := idempotency._caller(me);
	DELETE FROM ONLY idempotency.keys k
	WHERE k.key OPERATOR(pg_catalog.=) p_key
	  AND k.scope OPERATOR(pg_catalog.=) (p_scope COLLATE "C")
	  AND k.fence OPERATOR(pg_catalog.=) p_fence
	  AND k.state OPERATOR(pg_catalog.=) 'in_progress'
	  AND (k.owner OPERATOR(pg_catalog.=) caller OR pg_has_role(caller::oid, k.owner::oid, 'USAGE'));
	RETURN FOUND;
END
$$;
CREATE FUNCTION idempotency.release(
	key text,
	fence bigint,
	scope text DEFAULT NULL)
RETURNS boolean
LANGUAGE sql VOLATILE PARALLEL UNSAFE
RETURN idempotency._release(idempotency._me(), key, fence, scope);
COMMENT ON FUNCTION idempotency._release(idempotency._caller_token, text, bigint, text) IS
	'internal: release()''s work, as the table''s owner for the caller';
COMMENT ON FUNCTION idempotency.release(text, bigint, text) IS
	'Deletes a claim so that the next retry runs again; false when the fence no longer owns it';

CREATE FUNCTION idempotency._extend(
	me idempotency._caller_token,
	key text,
	fence bigint,
	lease interval,
	scope text)
RETURNS timestamptz
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	caller regrole;
	now timestamptz := clock_timestamp();
	p_key text COLLATE "C" := idempotency._check_key(key);
	p_fence bigint := fence;
	p_lease interval := lease;
	p_scope text;
	ends timestamptz;
BEGIN
	PERFORM idempotency._require(p_fence, 'fence');
	IF p_lease IS NOT NULL THEN
		p_lease := idempotency._require_positive(idempotency._bounded(p_lease, 'lease', NULL),
												 now, 'lease');
	END IF;
	p_scope := idempotency._scope(scope);
	PERFORM idempotency._require_writable('idempotency.extend()');
	caller := idempotency._caller(me);
	-- The lease's end never moves earlier; the expiry moves as much as it.
	UPDATE ONLY idempotency.keys k
	SET lease_expires_at = GREATEST(k.lease_expires_at, now OPERATOR(pg_catalog.+) COALESCE(p_lease, k.lease)),
		expires_at = k.expires_at OPERATOR(pg_catalog.+) GREATEST(
			(now OPERATOR(pg_catalog.+) COALESCE(p_lease, k.lease)) OPERATOR(pg_catalog.-) k.lease_expires_at,
			'0'::interval)
	WHERE k.key OPERATOR(pg_catalog.=) p_key
	  AND k.scope OPERATOR(pg_catalog.=) (p_scope COLLATE "C")
	  AND k.fence OPERATOR(pg_catalog.=) p_fence
	  AND k.state OPERATOR(pg_catalog.=) 'in_progress'
	  AND NOT (k.expires_at OPERATOR(pg_catalog.<=) now AND k.lease_expires_at OPERATOR(pg_catalog.<=) now)
	  AND (k.owner OPERATOR(pg_catalog.=) caller OR pg_has_role(caller::oid, k.owner::oid, 'USAGE'))
	RETURNING k.lease_expires_at INTO ends;
	IF NOT FOUND THEN
		PERFORM idempotency._fence_lost(p_key);
	END IF;
	RETURN ends;
END
$$;
CREATE FUNCTION idempotency.extend(
	key text,
	fence bigint,
	lease interval DEFAULT NULL,
	scope text DEFAULT NULL)
RETURNS timestamptz
LANGUAGE sql VOLATILE PARALLEL UNSAFE
RETURN idempotency._extend(idempotency._me(), key, fence, lease, scope);
COMMENT ON FUNCTION idempotency._extend(idempotency._caller_token, text, bigint, interval, text) IS
	'internal: extend()''s work, as the table''s owner for the caller';
COMMENT ON FUNCTION idempotency.extend(text, bigint, interval, text) IS
	'Renews the lease of a claim; returns when it now ends';

CREATE FUNCTION idempotency._checkpoint(
	me idempotency._caller_token,
	key text,
	fence bigint,
	recovery_point text,
	recovery_state jsonb,
	scope text)
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	caller regrole;
	p_key text COLLATE "C" := idempotency._check_key(key);
	p_fence bigint := fence;
	p_point text := recovery_point;
	p_state jsonb := recovery_state;
	p_scope text;
	size bigint;
	now timestamptz;
BEGIN
	PERFORM idempotency._require(p_fence, 'fence');
	p_scope := idempotency._scope(scope);
	PERFORM idempotency._require(p_point, 'recovery_point');
	-- As the C edition counts: the state as it is in memory (#> '{}' hands
	-- it back decompressed), not as it was stored.
	size := octet_length(p_point) OPERATOR(pg_catalog.+)
		COALESCE(pg_column_size(p_state OPERATOR(pg_catalog.#>) '{}'::text[]) OPERATOR(pg_catalog.-) 4, 0);
	IF size OPERATOR(pg_catalog.>) idempotency._max_response_bytes() THEN
		RAISE EXCEPTION 'recovery point is too large'
			USING ERRCODE = 'program_limit_exceeded',
				  DETAIL = format('The recovery point and state have %s bytes; idempotency.max_response_bytes allows %s.',
								  size, idempotency._max_response_bytes());
	END IF;
	PERFORM idempotency._require_writable('idempotency.checkpoint()');
	caller := idempotency._caller(me);
	now := clock_timestamp();
	UPDATE ONLY idempotency.keys k
	SET recovery_point = p_point, recovery_state = p_state,
		lease_expires_at = GREATEST(k.lease_expires_at, now OPERATOR(pg_catalog.+) k.lease),
		expires_at = k.expires_at OPERATOR(pg_catalog.+) GREATEST(
			(now OPERATOR(pg_catalog.+) k.lease) OPERATOR(pg_catalog.-) k.lease_expires_at, '0'::interval)
	WHERE k.key OPERATOR(pg_catalog.=) p_key
	  AND k.scope OPERATOR(pg_catalog.=) (p_scope COLLATE "C")
	  AND k.fence OPERATOR(pg_catalog.=) p_fence
	  AND k.state OPERATOR(pg_catalog.=) 'in_progress'
	  AND NOT (k.expires_at OPERATOR(pg_catalog.<=) now AND k.lease_expires_at OPERATOR(pg_catalog.<=) now)
	  AND (k.owner OPERATOR(pg_catalog.=) caller OR pg_has_role(caller::oid, k.owner::oid, 'USAGE'));
	IF NOT FOUND THEN
		PERFORM idempotency._fence_lost(p_key);
	END IF;
END
$$;
CREATE FUNCTION idempotency.checkpoint(
	key text,
	fence bigint,
	recovery_point text,
	recovery_state jsonb DEFAULT NULL,
	scope text DEFAULT NULL)
RETURNS void
LANGUAGE sql VOLATILE PARALLEL UNSAFE
RETURN idempotency._checkpoint(idempotency._me(), key, fence, recovery_point, recovery_state, scope);
COMMENT ON FUNCTION idempotency._checkpoint(idempotency._caller_token, text, bigint, text, jsonb, text) IS
	'internal: checkpoint()''s work, as the table''s owner for the caller';
COMMENT ON FUNCTION idempotency.checkpoint(text, bigint, text, jsonb, text) IS
	'Saves the progress of multi-step work, handed to the next attempt after a takeover, and renews the lease';

-- The record lookup shows: its columns named apart from the arguments
-- (PL/pgSQL would not tell them apart).
CREATE FUNCTION idempotency._lookup(me idempotency._caller_token, p_key text, p_scope text)
RETURNS TABLE (r_scope text, r_key text, r_fingerprint bytea, r_state text,
	r_attempt integer, r_lease interval, r_lease_expires_at timestamptz,
	r_recovery_point text, r_recovery_state jsonb, r_status_code integer,
	r_headers jsonb, r_body bytea, r_created_at timestamptz,
	r_completed_at timestamptz, r_expires_at timestamptz)
LANGUAGE plpgsql VOLATILE PARALLEL SAFE ROWS 1 SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	now timestamptz := clock_timestamp();
	k_key text COLLATE "C" := idempotency._check_key(p_key);
	k_scope text := idempotency._scope(p_scope);
	caller regrole := idempotency._caller(me);
BEGIN
	RETURN QUERY
	SELECT k.scope::text, k.key::text, k.fingerprint, k.state::text, k.attempt, k.lease,
		   k.lease_expires_at, k.recovery_point, k.recovery_state, k.status_code, k.headers,
		   k.body, k.created_at, k.completed_at, k.expires_at
	FROM ONLY idempotency.keys k
	WHERE k.key OPERATOR(pg_catalog.=) k_key
	  AND k.scope OPERATOR(pg_catalog.=) (k_scope COLLATE "C")
	  AND (k.owner OPERATOR(pg_catalog.=) caller OR pg_has_role(caller::oid, k.owner::oid, 'USAGE'))
	  AND NOT (k.expires_at OPERATOR(pg_catalog.<=) now
			   AND (k.state OPERATOR(pg_catalog.=) 'completed'
					OR k.lease_expires_at OPERATOR(pg_catalog.<=) now))
	ORDER BY k.owner OPERATOR(pg_catalog.<>) caller, k.owner::oid
	LIMIT 1;
END
$$;
COMMENT ON FUNCTION idempotency._lookup(idempotency._caller_token, text, text) IS
	'internal: the record of lookup(), read as the table''s owner for the caller';

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
LANGUAGE sql VOLATILE PARALLEL SAFE ROWS 1
SET search_path = pg_catalog, pg_temp
AS $$ SELECT * FROM idempotency._lookup(idempotency._me(), $1, $2) $$;
COMMENT ON FUNCTION idempotency.lookup(text, text) IS
	'Shows the record of a key as claim sees it, without its fence; read-only, works on a standby';

-- Feeds one part of a request to the fingerprint: a presence byte, an
-- 8-byte big-endian length, the bytes (so that parts cannot run together).
CREATE FUNCTION idempotency._part(data bytea)
RETURNS bytea
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN CASE WHEN data IS NULL THEN '\x000000000000000000'::bytea
	ELSE '\x01'::bytea OPERATOR(pg_catalog.||)
		 pg_catalog.int8send(pg_catalog.octet_length(data)::bigint) OPERATOR(pg_catalog.||) data END;
COMMENT ON FUNCTION idempotency._part(bytea) IS
	'internal: one length-prefixed part of a fingerprint';

-- Raises 22004 for a NULL method or path, else returns the fingerprint of
-- the parts (body already as bytes).
CREATE FUNCTION idempotency._fingerprint(method text, path text, body bytea, query text)
RETURNS bytea
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	IF method IS NULL OR path IS NULL THEN
		RAISE EXCEPTION 'argument "%" must not be null', CASE WHEN method IS NULL THEN 'method' ELSE 'path' END
			USING ERRCODE = 'null_value_not_allowed';
	END IF;
	-- ASCII upper-casing only, as the C edition's asc_toupper
	RETURN sha256(idempotency._part(convert_to(translate(method,
			'abcdefghijklmnopqrstuvwxyz', 'ABCDEFGHIJKLMNOPQRSTUVWXYZ'), getdatabaseencoding()))
		OPERATOR(pg_catalog.||) idempotency._part(convert_to(path, getdatabaseencoding()))
		OPERATOR(pg_catalog.||) idempotency._part(body)
		OPERATOR(pg_catalog.||) idempotency._part(convert_to(query, getdatabaseencoding())));
END
$$;
COMMENT ON FUNCTION idempotency._fingerprint(text, text, bytea, text) IS
	'internal: SHA-256 of the length-prefixed parts of a request';

CREATE FUNCTION idempotency.fingerprint(
	method text,
	path text,
	body bytea DEFAULT NULL,
	query text DEFAULT NULL)
RETURNS bytea
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN idempotency._fingerprint(method, path, body, query);
COMMENT ON FUNCTION idempotency.fingerprint(text, text, bytea, text) IS
	'SHA-256 of a request: method, path, body and query';

-- The body's canonical text is jsonb's output (keys sorted, duplicates
-- merged, whitespace fixed), in the database's encoding as the C edition's.
CREATE FUNCTION idempotency.fingerprint_json(
	method text,
	path text,
	body jsonb,
	query text DEFAULT NULL)
RETURNS bytea
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN idempotency._fingerprint(method, path,
	pg_catalog.convert_to(body::text, pg_catalog.getdatabaseencoding()), query);
COMMENT ON FUNCTION idempotency.fingerprint_json(text, text, jsonb, text) IS
	'SHA-256 of a request with a JSON body, whatever its key order and whitespace';

-- reap()'s work: deletes up to batch expired records, oldest first
-- through the reaper's index, skipping locked ones, of the roles whose
-- privileges the caller has, so that one role's transaction never holds
-- another's records; of every role for the table's owner, its members and
-- superusers (the scheduled reap).  The table itself only (ONLY): a ctid
-- names a row of one table.
CREATE FUNCTION idempotency._reap(me idempotency._caller_token, batch integer)
RETURNS bigint
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	n int := COALESCE(batch, (CASE WHEN current_setting('idempotency.reaper_batch', true) OPERATOR(pg_catalog.<>) ''
		THEN current_setting('idempotency.reaper_batch', true) END)::int, 10000);
	now timestamptz := clock_timestamp();
	caller regrole;
	every_owner boolean;
	reaped bigint;
BEGIN
	IF n OPERATOR(pg_catalog.<=) 0 THEN
		RAISE EXCEPTION 'argument "%" must be positive', 'batch'
			USING ERRCODE = 'invalid_parameter_value';
	END IF;
	PERFORM idempotency._require_writable('idempotency.reap()');
	caller := idempotency._caller(me);
	SELECT pg_has_role(caller::oid, c.relowner, 'USAGE') INTO every_owner
	FROM pg_catalog.pg_class c WHERE c.oid OPERATOR(pg_catalog.=) 'idempotency.keys'::pg_catalog.regclass;
	DELETE FROM ONLY idempotency.keys WHERE ctid OPERATOR(pg_catalog.=) ANY (ARRAY(
		SELECT k.ctid FROM ONLY idempotency.keys k
		WHERE idempotency._expiry_second(k.expires_at) OPERATOR(pg_catalog.<=) idempotency._expiry_second(now)
		  AND k.expires_at OPERATOR(pg_catalog.<=) now
		  AND (k.state OPERATOR(pg_catalog.=) 'completed' OR k.lease_expires_at OPERATOR(pg_catalog.<=) now)
		  AND (every_owner OR (k.owner OPERATOR(pg_catalog.=) caller OR pg_has_role(caller::oid, k.owner::oid, 'USAGE')))
		ORDER BY idempotency._expiry_second(k.expires_at), k.expires_at
		LIMIT n FOR UPDATE SKIP LOCKED));
	GET DIAGNOSTICS reaped = ROW_COUNT;
	RETURN reaped;
END
$$;
COMMENT ON FUNCTION idempotency._reap(idempotency._caller_token, integer) IS
	'internal: reap()''s work, as the table''s owner for the caller';

CREATE FUNCTION idempotency.reap(batch integer DEFAULT NULL)
RETURNS bigint
LANGUAGE sql VOLATILE PARALLEL UNSAFE
RETURN idempotency._reap(idempotency._me(), batch);
COMMENT ON FUNCTION idempotency.reap(integer) IS
	'Deletes up to batch expired records, oldest first; returns how many';

CREATE FUNCTION idempotency.shard_hash(scope text)
RETURNS integer
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	IF scope IS NULL THEN
		RAISE EXCEPTION 'argument "scope" must not be null' USING ERRCODE = 'null_value_not_allowed';
	END IF;
	RETURN ('x' OPERATOR(pg_catalog.||) encode(substr(sha256(convert_to(scope, 'UTF8')), 1, 4), 'hex'))::bit(32)::int;
END
$$;
COMMENT ON FUNCTION idempotency.shard_hash(text) IS
'the first 4 bytes of SHA-256 of the scope''s UTF-8 bytes, as a signed big-endian integer: PL/Proxy''s RUN ON hash';

CREATE FUNCTION idempotency.shard_of(scope text, shards integer)
RETURNS integer
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	hash int := idempotency.shard_hash(scope);
BEGIN
	IF shards IS NULL THEN
		RAISE EXCEPTION 'argument "shards" must not be null' USING ERRCODE = 'null_value_not_allowed';
	END IF;
	IF shards OPERATOR(pg_catalog.<) 1 OR shards OPERATOR(pg_catalog.>) 65536
	   OR (shards OPERATOR(pg_catalog.&) (shards OPERATOR(pg_catalog.-) 1)) OPERATOR(pg_catalog.<>) 0 THEN
		RAISE EXCEPTION 'invalid number of shards: %', shards
			USING ERRCODE = 'invalid_parameter_value',
				  DETAIL = 'The number of shards must be a power of two from 1 to 65536.';
	END IF;
	RETURN hash OPERATOR(pg_catalog.&) (shards OPERATOR(pg_catalog.-) 1);
END
$$;
COMMENT ON FUNCTION idempotency.shard_of(text, integer) IS
'the shard, 0 to shards - 1, that holds the scope in a cluster of shards (a power of two): shard_hash(scope) & (shards - 1)';

-- No shared memory here: the counters are NULL, as the C edition's are
-- without preloading.
CREATE FUNCTION idempotency._stats_counters(
	OUT claims_new bigint,
	OUT claims_resumed bigint,
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
LANGUAGE sql VOLATILE PARALLEL SAFE
RETURN ROW(NULL::bigint, NULL::bigint, NULL::bigint, NULL::bigint, NULL::bigint, NULL::bigint,
	NULL::bigint, NULL::bigint, NULL::bigint, NULL::bigint, NULL::bigint, NULL::bigint,
	NULL::bigint, NULL::timestamptz, NULL::timestamptz, NULL::text);
COMMENT ON FUNCTION idempotency._stats_counters() IS
	'The counters behind idempotency.stats: none in the portable edition (NULL)';

CREATE FUNCTION idempotency.stats_reset()
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	RAISE EXCEPTION 'idempotency statistics are not available'
		USING ERRCODE = 'object_not_in_prerequisite_state',
			  HINT = 'The portable edition keeps no counters; the live figures of idempotency.stats still answer.';
END
$$;
COMMENT ON FUNCTION idempotency.stats_reset() IS
	'Zeroes the counters of idempotency.stats (none in the portable edition)';

-- claim's and complete's full paths are called by their work only.
REVOKE ALL ON FUNCTION idempotency._claim(idempotency._caller_token, text, bytea, text, interval,
	interval, interval, uuid) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency._complete(idempotency._caller_token, text, bigint, integer, bytea,
	jsonb, text) FROM PUBLIC;

GRANT USAGE ON SCHEMA idempotency TO pg_monitor;
REVOKE ALL ON FUNCTION idempotency._stats_counters() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION idempotency._stats_counters() TO pg_monitor;
REVOKE ALL ON FUNCTION idempotency.stats_reset() FROM PUBLIC;

-- The live figures of idempotency.stats, as the C edition's without its
-- shared memory (there is none here): a table of up to 10,000 records is
-- counted (a scan that stops there) and its figures are exact; a larger
-- one's rows_in_progress is an estimate from the planner's statistics (the
-- share of rows with a lease), with oldest_lease_expires_at NULL and
-- live_figures_exact false.  No index of the records in progress (1.3 to
-- 1.5 had one, keys_in_progress_idx), so that complete's update is HOT.
-- rows_total is an estimate: the cumulative statistics' live rows, or
-- pg_class.reltuples when those are empty (after a crash or a reset), never
-- below the records in progress.
CREATE FUNCTION idempotency._stats_figures(
	OUT rows_total bigint,
	OUT rows_in_progress bigint,
	OUT oldest_lease_expires_at timestamptz,
	OUT live_figures_exact boolean)
RETURNS record
LANGUAGE plpgsql STABLE SECURITY DEFINER PARALLEL SAFE
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
	small_table constant bigint := 10000;
	estimate bigint;
	scanned bigint;
BEGIN
	SELECT CASE WHEN pg_catalog.pg_stat_get_live_tuples(c.oid) OPERATOR(pg_catalog.>) 0
				THEN pg_catalog.pg_stat_get_live_tuples(c.oid)
				ELSE GREATEST(c.reltuples, 0)::bigint END
	INTO estimate
	FROM pg_catalog.pg_class c
	WHERE c.oid OPERATOR(pg_catalog.=) 'idempotency.keys'::pg_catalog.regclass;
	SELECT pg_catalog.count(*) FILTER (WHERE t.state OPERATOR(pg_catalog.=) 'in_progress'::idempotency.state),
		pg_catalog.min(t.lease_expires_at) FILTER (WHERE t.state OPERATOR(pg_catalog.=) 'in_progress'::idempotency.state),
		pg_catalog.count(*)
	INTO rows_in_progress, oldest_lease_expires_at, scanned
	FROM (SELECT k.state, k.lease_expires_at FROM ONLY idempotency.keys k
		  LIMIT small_table OPERATOR(pg_catalog.+) 1) t;
	live_figures_exact := scanned OPERATOR(pg_catalog.<=) small_table;
	IF NOT live_figures_exact THEN
		SELECT (estimate OPERATOR(pg_catalog.*) (1 OPERATOR(pg_catalog.-) s.null_frac))::bigint
		INTO rows_in_progress
		FROM pg_catalog.pg_stats s
		WHERE s.schemaname OPERATOR(pg_catalog.=) 'idempotency'
		  AND s.tablename OPERATOR(pg_catalog.=) 'keys'
		  AND s.attname OPERATOR(pg_catalog.=) 'lease_expires_at';
		oldest_lease_expires_at := NULL;
	END IF;
	rows_total := GREATEST(rows_in_progress, estimate);
END
$$;
COMMENT ON FUNCTION idempotency._stats_figures() IS
	'The live figures behind idempotency.stats, without a scan of more than 10,000 records';

-- The C edition's leases_ended (1.6), for alerting on stuck requests
-- (contrib/prometheus/queries.yaml): the records in progress whose lease
-- ended between newer_than and older_than ago (both included), counted as
-- _stats_figures counts: a table of up to 10,000 records, NULL for a
-- larger one.
CREATE FUNCTION idempotency.leases_ended(older_than interval, newer_than interval)
RETURNS bigint
LANGUAGE plpgsql STABLE SECURITY DEFINER PARALLEL SAFE
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
	small_table constant bigint := 10000;
	ended_from timestamptz := pg_catalog.now() OPERATOR(pg_catalog.-) newer_than;
	ended_to timestamptz := pg_catalog.now() OPERATOR(pg_catalog.-) older_than;
	ended bigint;
	scanned bigint;
BEGIN
	IF older_than IS NULL OR newer_than IS NULL THEN
		RAISE EXCEPTION 'argument "%" must not be null', CASE WHEN older_than IS NULL
			THEN 'older_than' ELSE 'newer_than' END
			USING ERRCODE = 'null_value_not_allowed';
	END IF;
	IF older_than OPERATOR(pg_catalog.<) '0'::interval THEN
		RAISE EXCEPTION 'argument "older_than" must not be negative'
			USING ERRCODE = 'invalid_parameter_value';
	END IF;
	IF newer_than OPERATOR(pg_catalog.<) older_than THEN
		RAISE EXCEPTION 'argument "newer_than" must not be shorter than argument "older_than"'
			USING ERRCODE = 'invalid_parameter_value',
				  HINT = 'The window runs from newer_than ago to older_than ago, e.g. older_than => ''1 minute'', newer_than => ''15 minutes''.';
	END IF;
	SELECT pg_catalog.count(*) FILTER (WHERE t.state OPERATOR(pg_catalog.=) 'in_progress'::idempotency.state
			AND t.lease_expires_at OPERATOR(pg_catalog.>=) ended_from
			AND t.lease_expires_at OPERATOR(pg_catalog.<=) ended_to),
		pg_catalog.count(*)
	INTO ended, scanned
	FROM (SELECT k.state, k.lease_expires_at FROM ONLY idempotency.keys k
		  LIMIT small_table OPERATOR(pg_catalog.+) 1) t;
	IF scanned OPERATOR(pg_catalog.>) small_table THEN
		ended := NULL;
	END IF;
	RETURN ended;
END
$$;
COMMENT ON FUNCTION idempotency.leases_ended(interval, interval) IS
	'The records in progress whose lease ended between newer_than and older_than ago, without a scan of more than 10,000 records (NULL when that cannot be exact)';

-- The C edition's stats_recount(): no shared memory here keeps figures to
-- count again; returns whether they are exact (a table of up to 10,000
-- records, which idempotency.stats counts).
CREATE FUNCTION idempotency.stats_recount()
RETURNS boolean
LANGUAGE sql VOLATILE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
	SELECT f.live_figures_exact FROM idempotency._stats_figures() f;
END;
COMMENT ON FUNCTION idempotency.stats_recount() IS
	'Says whether the figures of idempotency.stats are exact: the portable edition keeps none to count again, and counts a table of up to 10,000 records';

-- The C edition's columns in its order (claims_resumed, of 1.2, then
-- live_figures_exact, of 1.6, last).
CREATE VIEW idempotency.stats AS
SELECT c.claims_new, c.claims_replay, c.claims_in_progress, c.claims_mismatch,
	c.takeovers, c.waits, c.completes_stored, c.completes_released, c.releases,
	c.fence_rejections, c.reaped, c.reaper_runs, c.last_reap_at, c.stats_reset_at,
	c.last_reap_error, l.rows_total, l.rows_in_progress, l.oldest_lease_expires_at,
	c.claims_resumed, l.live_figures_exact
FROM idempotency._stats_counters() c, idempotency._stats_figures() l;
COMMENT ON VIEW idempotency.stats IS
	'Counters of the API since start or stats_reset() (NULL here), and live figures of the records';
COMMENT ON COLUMN idempotency.stats.live_figures_exact IS
	'Whether rows_in_progress and oldest_lease_expires_at are exact: on a table of over 10,000 records, false (the portable edition has no shared memory to keep them)';
COMMENT ON COLUMN idempotency.stats.rows_total IS
	'Estimate of the records: live rows from the cumulative statistics (pg_class.reltuples when they have none)';
COMMENT ON COLUMN idempotency.stats.rows_in_progress IS
	'Records in progress (exact when live_figures_exact, else an estimate)';
COMMENT ON COLUMN idempotency.stats.oldest_lease_expires_at IS
	'The earliest end of a lease of a record in progress (exact when live_figures_exact, else NULL)';
REVOKE ALL ON idempotency.stats FROM PUBLIC;
GRANT SELECT ON idempotency.stats TO pg_monitor;
REVOKE ALL ON FUNCTION idempotency.stats_recount() FROM PUBLIC;

-- The records in progress, oldest first, for whoever monitors the server:
-- which requests are stuck, since when, on which attempt.  writing: a
-- transaction that is still running holds the record (an uncommitted
-- complete, checkpoint, extend or takeover, or a row lock), told by the
-- row's xmax being the id of a transaction in pg_locks.  A scan of the
-- table (no index of the records in progress: see _stats_figures).  A
-- function under the view, so that the view does not pin the table's
-- column types.
CREATE FUNCTION idempotency._in_flight()
RETURNS TABLE (scope text, key text, owner name, attempt integer, claimed_at timestamptz,
			   lease_expires_at timestamptz, recovery_point text, writing boolean)
LANGUAGE sql VOLATILE SECURITY DEFINER PARALLEL SAFE
SET search_path TO pg_catalog, pg_temp
AS $$
SELECT k.scope, k.key, pg_catalog.pg_get_userbyid(k.owner::pg_catalog.oid),
	k.attempt, k.created_at, k.lease_expires_at, k.recovery_point,
	k.xmax OPERATOR(pg_catalog.=) ANY (ARRAY(
		SELECT l.transactionid FROM pg_catalog.pg_locks l
		WHERE l.locktype OPERATOR(pg_catalog.=) 'transactionid'
		  AND l.mode OPERATOR(pg_catalog.=) 'ExclusiveLock' AND l.granted))
FROM ONLY idempotency.keys k
WHERE k.state OPERATOR(pg_catalog.=) 'in_progress'::idempotency.state
$$;
COMMENT ON FUNCTION idempotency._in_flight() IS
	'The records behind idempotency.in_flight';

CREATE VIEW idempotency.in_flight AS
SELECT f.scope, f.key, f.owner, f.attempt, f.claimed_at, f.lease_expires_at,
	f.recovery_point, f.writing
FROM idempotency._in_flight() f
ORDER BY f.claimed_at, f.scope, f.key;
COMMENT ON VIEW idempotency.in_flight IS
	'The records in progress, oldest first, and whether a transaction is writing each now';
REVOKE ALL ON FUNCTION idempotency._stats_figures() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION idempotency._stats_figures() TO pg_monitor;
REVOKE ALL ON FUNCTION idempotency.leases_ended(interval, interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION idempotency.leases_ended(interval, interval) TO pg_monitor;
REVOKE ALL ON FUNCTION idempotency._in_flight() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION idempotency._in_flight() TO pg_monitor;
REVOKE ALL ON idempotency.in_flight FROM PUBLIC;
GRANT SELECT ON idempotency.in_flight TO pg_monitor;

COMMIT; -- plain only
