-- Creates what the benchmark compares, in one database of a throwaway cluster.
-- psql variables: fp, hash (the request's fingerprint as bytea and as hex
-- text), body (the 64-byte JSON response).

CREATE EXTENSION idempotency;

\ir hand-written-table.sql

-- The same table for the PL/pgSQL functions, so that each baseline has its own.
CREATE TABLE plpgsql_keys (LIKE idempotency_keys INCLUDING ALL);

-- The business row written in the same transaction as the claim.
CREATE TABLE payments (
	id           bigserial PRIMARY KEY,
	idem_key     text NOT NULL,
	amount_cents int NOT NULL,
	currency     text NOT NULL,
	created_at   timestamptz NOT NULL DEFAULT now()
);

-- The article's claim logic as a function: insert, else read and compare.
CREATE FUNCTION plpgsql_claim(p_key text, p_hash text,
							  OUT outcome text, OUT response_code int,
							  OUT response_body jsonb)
LANGUAGE plpgsql AS $$
DECLARE
	r record;
BEGIN
	INSERT INTO plpgsql_keys (key, request_hash, status)
	VALUES (p_key, p_hash, 'started')
	ON CONFLICT (key) DO NOTHING;
	IF FOUND THEN
		outcome := 'new';
		RETURN;
	END IF;

	SELECT k.request_hash, k.status, k.response_code, k.response_body
	INTO r FROM plpgsql_keys k WHERE k.key = p_key;
	IF r.request_hash <> p_hash THEN
		outcome := 'mismatch';
	ELSIF r.status = 'completed' THEN
		outcome := 'replay';
		response_code := r.response_code;
		response_body := r.response_body;
	ELSE
		outcome := 'in_progress';
	END IF;
END
$$;

-- The article's completion as a function: one UPDATE.
CREATE FUNCTION plpgsql_complete(p_key text, p_code int, p_body jsonb)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
	UPDATE plpgsql_keys
	SET status = 'completed', response_code = p_code, response_body = p_body
	WHERE key = p_key;
END
$$;

-- 100k completed keys for replay and mismatch (1000000000000000001 ...) and
-- 100k in progress for in_progress (2000000000000000001 ...): the same keys
-- in every implementation.  The extension's go through its API.
CREATE TEMP TABLE won AS
SELECT k, (idempotency.claim(k, :'fp'::bytea)).fence AS fence
FROM (SELECT (1000000000000000000 + i)::text AS k FROM generate_series(1, 100000) i) s;
SELECT count(idempotency.complete(k, fence, 201, convert_to(:'body', 'UTF8')))
	AS completed
FROM won;
SELECT count((idempotency.claim((2000000000000000000 + i)::text, :'fp'::bytea,
								lease => '1 day')).fence) AS in_progress
FROM generate_series(1, 100000) i;

INSERT INTO idempotency_keys (key, request_hash, status, response_code, response_body)
SELECT (1000000000000000000 + i)::text, :'hash', 'completed', 201, :'body'::jsonb
FROM generate_series(1, 100000) i;
INSERT INTO idempotency_keys (key, request_hash, status)
SELECT (2000000000000000000 + i)::text, :'hash', 'started'
FROM generate_series(1, 100000) i;
INSERT INTO plpgsql_keys SELECT * FROM idempotency_keys;

-- The hand-written recipe the client packages' bench/overhead compare with
-- (bench/RESULTS.md), and the route's table, for bench/instructions'
-- middleware-ext and middleware-recipe.
CREATE TABLE recipe_keys (
	scope         text NOT NULL,
	key           text NOT NULL,
	request_hash  bytea NOT NULL,
	status        text NOT NULL DEFAULT 'started',
	response_code int,
	response_body bytea,
	created_at    timestamptz NOT NULL DEFAULT now(),
	PRIMARY KEY (scope, key)
);
CREATE TABLE charges (
	id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
	amount     numeric NOT NULL,
	created_at timestamptz NOT NULL DEFAULT now()
);

VACUUM ANALYZE;
