-- A DBA's changes to idempotency.keys: claim's insert and complete's update
-- do without the executor only where they do exactly what INSERT and UPDATE
-- would; otherwise they go through the executor and every rule applies.  A
-- changed column type is refused clearly; no number of indexes stops the API.
CREATE EXTENSION IF NOT EXISTS idempotency;

-- A changed column type: a clear error for claim (its read and its writes)
-- and for every other call, never a crash; restored, all works again.
SELECT fence AS typed_fence FROM idempotency.claim('Typed-1', '\x01', scope => 'changes') \gset
ALTER TABLE idempotency.keys ALTER COLUMN attempt TYPE numeric;
\set VERBOSITY sqlstate
SELECT outcome FROM idempotency.claim('Typed-1', '\x01', scope => 'changes');
SELECT outcome FROM idempotency.claim('Typed-2', '\x01', scope => 'changes');
SELECT idempotency.complete('Typed-1', :typed_fence, 200, scope => 'changes');
SELECT count(*) FROM idempotency.lookup('Typed-1', 'changes');
\set VERBOSITY default
SELECT outcome FROM idempotency.claim('Typed-2', '\x01', scope => 'changes');
ALTER TABLE idempotency.keys ALTER COLUMN attempt TYPE integer;
ALTER TABLE idempotency.keys ALTER COLUMN key TYPE varchar(300);
SELECT outcome FROM idempotency.claim('Typed-2', '\x01', scope => 'changes');
ALTER TABLE idempotency.keys ALTER COLUMN key TYPE text COLLATE "C";
-- The scope in the type of a Citus tenant column is citus_distribute's
-- doing: without Citus it is a changed column type like any other.
ALTER TABLE idempotency.keys ALTER COLUMN scope TYPE varchar;
\set VERBOSITY sqlstate
SELECT outcome FROM idempotency.claim('Typed-2', '\x01', scope => 'changes');
\set VERBOSITY default
ALTER TABLE idempotency.keys ALTER COLUMN scope TYPE text COLLATE "C";
SELECT outcome FROM idempotency.claim('Typed-1', '\x01', scope => 'changes');
SELECT idempotency.complete('Typed-1', :typed_fence, 200, scope => 'changes');

-- A DBA's column with NOT NULL and a DEFAULT, and a CHECK constraint: a new
-- claim gets the default, and one the check refuses writes nothing (NOT
-- VALID: the records of earlier tests are not the point).
ALTER TABLE idempotency.keys ADD COLUMN region text NOT NULL DEFAULT 'eu';
ALTER TABLE idempotency.keys ADD CONSTRAINT keys_short_key CHECK (length(key) <= 12) NOT VALID;
SELECT outcome FROM idempotency.claim('Region-1', '\x01', scope => 'changes');
\set VERBOSITY sqlstate
SELECT outcome FROM idempotency.claim('Region-very-long-key', '\x01', scope => 'changes');
\set VERBOSITY default
SELECT key, region FROM idempotency.keys WHERE scope = 'changes' AND key LIKE 'Region%';
-- complete keeps the row valid: an ordinary UPDATE of it still passes
SELECT fence AS region_fence FROM idempotency.keys WHERE key = 'Region-1' \gset
SELECT idempotency.complete('Region-1', :region_fence, 201, 'ok', scope => 'changes');
UPDATE idempotency.keys SET region = region WHERE scope = 'changes';
ALTER TABLE idempotency.keys DROP CONSTRAINT keys_short_key, DROP COLUMN region;

-- A foreign key and a trigger apply to claim's insert and complete's update.
CREATE TABLE public.idem_tenants (scope text COLLATE "C" PRIMARY KEY);
INSERT INTO public.idem_tenants VALUES ('changes');
ALTER TABLE idempotency.keys ADD CONSTRAINT keys_tenant
  FOREIGN KEY (scope) REFERENCES public.idem_tenants NOT VALID;
\set VERBOSITY sqlstate
SELECT outcome FROM idempotency.claim('FK-1', '\x01', scope => 'no-such-tenant');
\set VERBOSITY default
SELECT fence AS fk_fence FROM idempotency.claim('FK-1', '\x01', scope => 'changes') \gset
ALTER TABLE idempotency.keys DROP CONSTRAINT keys_tenant;
DROP TABLE public.idem_tenants;
CREATE TABLE public.idem_seen (op text, key text, state text);
CREATE FUNCTION public.idem_seen_trigger() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO public.idem_seen VALUES (TG_OP, NEW.key, NEW.state);
  RETURN NULL;
END $$;
CREATE TRIGGER keys_seen AFTER INSERT OR UPDATE ON idempotency.keys
  FOR EACH ROW EXECUTE FUNCTION public.idem_seen_trigger();
SELECT outcome FROM idempotency.claim('Trig-1', '\x01', scope => 'changes');
SELECT idempotency.complete('FK-1', :fk_fence, 200, scope => 'changes');
SELECT * FROM public.idem_seen ORDER BY op;
-- The executor's insert stores claim's token (its own claim is answered
-- again), and its update clears it.
SELECT fence AS trig_fence FROM idempotency.claim('Trig-2', '\x01', scope => 'changes',
  token => '00000000-0000-4000-8000-000000000002') \gset
SELECT outcome, fence = :trig_fence AS same_fence FROM idempotency.claim('Trig-2', '\x01',
  scope => 'changes', token => '00000000-0000-4000-8000-000000000002');
SELECT idempotency.complete('Trig-2', :trig_fence, 200, scope => 'changes');
SELECT token IS NULL AS token_cleared FROM idempotency.keys WHERE key = 'Trig-2';
DROP TRIGGER keys_seen ON idempotency.keys;
DROP FUNCTION public.idem_seen_trigger();
DROP TABLE public.idem_seen;

-- A second unique index: only the primary key is claim's arbiter, another
-- violation is 23505 at once (not a 40001 after retries), writing nothing.
CREATE ROLE idem_tenant_a LOGIN;
CREATE ROLE idem_tenant_b LOGIN;
GRANT USAGE ON SCHEMA idempotency TO idem_tenant_a, idem_tenant_b;
CREATE UNIQUE INDEX keys_one_owner ON idempotency.keys (scope, key);
SET ROLE idem_tenant_a;
SELECT outcome FROM idempotency.claim('Uniq-1', '\x01', scope => 'changes');
SELECT outcome FROM idempotency.claim('Uniq-1', '\x01', scope => 'changes');
SET ROLE idem_tenant_b;
\set VERBOSITY sqlstate
SELECT outcome FROM idempotency.claim('Uniq-1', '\x01', scope => 'changes');
\set VERBOSITY default
RESET ROLE;
SELECT owner, count(*) AS uniq_rows FROM idempotency.keys WHERE key = 'Uniq-1' GROUP BY owner;
DROP INDEX idempotency.keys_one_owner;

-- A publication whose row filter names a column outside the replica
-- identity: complete is refused as an UPDATE is (42P10), as extend is.
SELECT fence AS pub_fence FROM idempotency.claim('Pub-1', '\x01', scope => 'changes') \gset
SET client_min_messages = error;
CREATE PUBLICATION idem_completed FOR TABLE idempotency.keys WHERE (completed_at IS NOT NULL);
RESET client_min_messages;
\set VERBOSITY sqlstate
SELECT idempotency.extend('Pub-1', :pub_fence, scope => 'changes');
SELECT idempotency.complete('Pub-1', :pub_fence, 200, scope => 'changes');
\set VERBOSITY default
DROP PUBLICATION idem_completed;
SELECT idempotency.complete('Pub-1', :pub_fence, 200, scope => 'changes');

-- More indexes than any fixed limit, one of them invalid (a failed CREATE
-- INDEX CONCURRENTLY, as a cancelled REINDEX CONCURRENTLY leaves): claims
-- and completes go on (indexes_amcheck checks what the indexes hold).
DO $$
BEGIN
  FOR i IN 1..70 LOOP
    EXECUTE format('CREATE INDEX keys_many_%s ON idempotency.keys ((fence %% %s))', i, i + 1);
  END LOOP;
END $$;
CREATE INDEX CONCURRENTLY keys_failed ON idempotency.keys ((1 / (attempt - 1)));
SELECT indisvalid FROM pg_index WHERE indexrelid = 'idempotency.keys_failed'::regclass;
SELECT count(*) AS claimed
FROM generate_series(1, 20) i,
     LATERAL idempotency.claim('Many-' || i, '\x01', scope => 'changes') c
WHERE c.outcome = 'new';
SELECT count(idempotency.complete(key, fence, 201, 'ok', scope => 'changes')) AS completed
FROM idempotency.keys WHERE scope = 'changes' AND key LIKE 'Many-%';
DO $$
DECLARE r record;
BEGIN
  FOR r IN SELECT indexrelid::regclass AS idx FROM pg_index
           WHERE indrelid = 'idempotency.keys'::regclass
             AND indexrelid::regclass::text LIKE 'idempotency.keys\_many\_%' LOOP
    EXECUTE format('DROP INDEX %s', r.idx);
  END LOOP;
END $$;
DROP INDEX idempotency.keys_failed;

-- Row-level security with FORCE, the table owned by a role that it binds:
-- claim, which reads without the executor, is refused clearly rather than
-- read past the policies; NO FORCE (or no policy) lets the API work again.
CREATE ROLE idem_keys_owner;
CREATE ROLE idem_rls_app LOGIN;
GRANT USAGE ON SCHEMA idempotency TO idem_rls_app, idem_keys_owner;
ALTER TABLE idempotency.keys OWNER TO idem_keys_owner;
ALTER SEQUENCE idempotency.fence_seq OWNER TO idem_keys_owner;
ALTER TABLE idempotency.keys ENABLE ROW LEVEL SECURITY;
ALTER TABLE idempotency.keys FORCE ROW LEVEL SECURITY;
CREATE POLICY keys_not_hidden ON idempotency.keys
  USING (scope <> 'hidden') WITH CHECK (scope <> 'hidden');
SET ROLE idem_rls_app;
\set VERBOSITY sqlstate
SELECT outcome FROM idempotency.claim('RLS-1', '\x01', scope => 'hidden');
\set VERBOSITY default
SELECT outcome FROM idempotency.claim('RLS-1', '\x01', scope => 'hidden');
RESET ROLE;
ALTER TABLE idempotency.keys NO FORCE ROW LEVEL SECURITY;
SET ROLE idem_rls_app;
SELECT outcome FROM idempotency.claim('RLS-2', '\x01', scope => 'changes');
RESET ROLE;
SELECT count(*) AS hidden_written FROM idempotency.keys WHERE scope = 'hidden';
DROP POLICY keys_not_hidden ON idempotency.keys;
ALTER TABLE idempotency.keys DISABLE ROW LEVEL SECURITY;
ALTER TABLE idempotency.keys OWNER TO CURRENT_USER;
ALTER SEQUENCE idempotency.fence_seq OWNER TO CURRENT_USER;

-- Back to the table as the extension made it: the direct writes again.
SELECT outcome FROM idempotency.claim('Plain-1', '\x01', scope => 'changes');
DELETE FROM idempotency.keys WHERE scope IN ('changes', 'hidden');
REVOKE ALL ON SCHEMA idempotency FROM idem_tenant_a, idem_tenant_b, idem_rls_app, idem_keys_owner;
DROP ROLE idem_tenant_a, idem_tenant_b, idem_rls_app, idem_keys_owner;
