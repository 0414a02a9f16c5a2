-- A DBA's code on idempotency.keys (index expressions, triggers, checks)
-- runs as the table's owner, in a restricted security context, with
-- search_path = pg_catalog, pg_temp: never with the caller's search_path,
-- where an application role could plant a function to run as the owner.
CREATE EXTENSION IF NOT EXISTS idempotency;
CREATE ROLE idem_app LOGIN;
GRANT USAGE ON SCHEMA idempotency TO idem_app;
CREATE SCHEMA idem_app_schema AUTHORIZATION idem_app;

-- the DBA's expression index, through a function that names lower()
-- without a schema
CREATE FUNCTION public.idem_norm_key(text) RETURNS text LANGUAGE sql IMMUTABLE
  AS 'SELECT lower($1)';
CREATE INDEX keys_norm_key ON idempotency.keys (public.idem_norm_key(key));

-- the application role plants its own lower() and now(), first in its path
SET ROLE idem_app;
CREATE FUNCTION idem_app_schema.lower(text) RETURNS text LANGUAGE plpgsql AS $$
BEGIN
  RAISE NOTICE 'planted lower() ran, as a superuser: %',
    (SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user);
  RETURN pg_catalog.lower($1);
END $$;
CREATE FUNCTION idem_app_schema.now() RETURNS timestamptz LANGUAGE plpgsql AS $$
BEGIN
  RAISE NOTICE 'planted now() ran, as a superuser: %',
    (SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user);
  RETURN pg_catalog.now();
END $$;
SET search_path = idem_app_schema, pg_catalog;
-- claim's direct insert evaluates the index expression: not with the planted lower()
SELECT outcome FROM idempotency.claim('Owner-Code-1', '\x01', scope => 'owner');
RESET search_path;
RESET ROLE;

-- once the index's expressions are cached (the SQL function above is
-- inlined then): an expression index on what complete changes, through a
-- PL/pgSQL function (never inlined), and a hash index with the DBA's
-- operator class; both name lower() without a schema
CREATE FUNCTION public.idem_norm_status(int) RETURNS text LANGUAGE plpgsql IMMUTABLE
  AS 'BEGIN RETURN lower($1::text); END';
CREATE INDEX keys_norm_status ON idempotency.keys (public.idem_norm_status(status_code));
CREATE FUNCTION public.idem_hash_key(text) RETURNS int LANGUAGE sql IMMUTABLE
  AS 'SELECT pg_catalog.hashtext(lower($1))';
CREATE OPERATOR CLASS public.idem_key_hash_ops FOR TYPE text USING hash AS
  OPERATOR 1 pg_catalog.= (text, text), FUNCTION 1 public.idem_hash_key(text);
SET ROLE idem_app;
SET search_path = idem_app_schema, pg_catalog;
SELECT fence AS owner_fence FROM idempotency.claim('Owner-Code-3', '\x01', scope => 'owner') \gset
-- complete's update evaluates the expression index on status_code: not with the planted lower()
SELECT idempotency.complete('Owner-Code-3', :owner_fence, 201, scope => 'owner');
RESET search_path;
RESET ROLE;
CREATE INDEX keys_hash_key ON idempotency.keys USING hash (key public.idem_key_hash_ops);
SET ROLE idem_app;
SET search_path = idem_app_schema, pg_catalog;
SELECT outcome FROM idempotency.claim('Owner-Code-4', '\x01', scope => 'owner');
-- the hash index's support function, on the next insert: not with the planted lower()
SELECT outcome FROM idempotency.claim('Owner-Code-5', '\x01', scope => 'owner');
RESET search_path;
RESET ROLE;
DROP INDEX idempotency.keys_norm_status, idempotency.keys_hash_key;
DROP OPERATOR FAMILY public.idem_key_hash_ops USING hash;
DROP FUNCTION public.idem_hash_key(text), public.idem_norm_status(int);
SELECT count(*) AS indexed_by_pg_catalog_lower FROM idempotency.keys
WHERE public.idem_norm_key(key) = 'owner-code-1';

-- the DBA adds an audit trigger that calls now(), on insert and delete
CREATE TABLE public.idem_audit (op text, key text, who name, path text, at timestamptz);
CREATE FUNCTION public.idem_audit_trigger() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'INSERT' AND NEW.key = 'Owner-Boom' THEN
    RAISE EXCEPTION 'the DBA refuses this key';
  END IF;
  INSERT INTO public.idem_audit
  VALUES (TG_OP, COALESCE(NEW.key, OLD.key), current_user, current_setting('search_path'), now());
  RETURN NULL;
END $$;
CREATE TRIGGER keys_audit AFTER INSERT OR DELETE ON idempotency.keys
  FOR EACH ROW EXECUTE FUNCTION public.idem_audit_trigger();
GRANT INSERT ON public.idem_audit TO PUBLIC;
SET ROLE idem_app;
SET search_path = idem_app_schema, pg_catalog;
-- the trigger, fired by claim and release, does not find the planted now()
SELECT fence AS owner_fence FROM idempotency.claim('Owner-Code-2', '\x01', scope => 'owner') \gset
SELECT idempotency.release('Owner-Code-2', :owner_fence, scope => 'owner');
-- the caller's path and user are back after each call
SHOW search_path;
SELECT current_user;
-- and after a call that failed inside, in the DBA's trigger
DO $$
BEGIN
  PERFORM idempotency.claim('Owner-Boom', '\x01', scope => 'owner');
EXCEPTION WHEN raise_exception THEN
  RAISE NOTICE 'caught "%"; path: %; user: %', SQLERRM, current_setting('search_path'), current_user;
END $$;
SHOW search_path;
-- the planted functions are still there, and do run when the caller calls them itself
SELECT lower('X') AS planted_runs_for_its_owner;
RESET search_path;
RESET ROLE;

-- what the DBA's trigger saw: the table's owner, the fixed search_path
SELECT op, key, who = (SELECT tableowner FROM pg_tables
                       WHERE schemaname = 'idempotency' AND tablename = 'keys') AS as_table_owner,
       path
FROM public.idem_audit ORDER BY at, op;

DROP TRIGGER keys_audit ON idempotency.keys;
DROP INDEX idempotency.keys_norm_key;
DROP FUNCTION public.idem_norm_key(text), public.idem_audit_trigger();
DROP TABLE public.idem_audit;
DELETE FROM idempotency.keys WHERE scope = 'owner';
DROP SCHEMA idem_app_schema CASCADE;
REVOKE ALL ON SCHEMA idempotency FROM idem_app;
DROP ROLE idem_app;
