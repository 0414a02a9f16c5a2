-- Code of another role that runs in your session acts as that role, never
-- as you: a record belongs to, and is seen by, current_user at the call.
CREATE EXTENSION IF NOT EXISTS idempotency;
CREATE ROLE idem_orc_alice LOGIN;
CREATE ROLE idem_orc_bob LOGIN;
CREATE ROLE idem_orc_mallory LOGIN;
GRANT USAGE ON SCHEMA idempotency TO idem_orc_alice, idem_orc_bob, idem_orc_mallory;
CREATE SCHEMA idem_orc_app AUTHORIZATION idem_orc_alice;
CREATE SCHEMA idem_orc_mal AUTHORIZATION idem_orc_mallory;

-- bob stores a response; alice has one of her own
SET ROLE idem_orc_bob;
SELECT fence AS bob_fence FROM idempotency.claim('orc-1', '\x01', scope => 'orc') \gset
SELECT idempotency.complete('orc-1', :bob_fence, 200, 'bob''s secret', scope => 'orc');
SET ROLE idem_orc_alice;
SELECT fence AS alice_fence FROM idempotency.claim('orc-2', '\x01', scope => 'orc') \gset
SELECT idempotency.complete('orc-2', :alice_fence, 201, 'alice''s', scope => 'orc');

-- An IMMUTABLE function of alice's in an index expression on her table:
-- a superuser's ANALYZE runs it as the table's owner, alice, and so does
-- the API inside it: it sees her record, never bob's.
CREATE TABLE idem_orc_app.t (x int);
INSERT INTO idem_orc_app.t VALUES (1);
CREATE FUNCTION idem_orc_app.peek(int) RETURNS int LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
  RAISE NOTICE 'as %: bob''s record: % row(s), body %; alice''s: % row(s)', current_user,
    (SELECT count(*) FROM idempotency.lookup('orc-1', 'orc')),
    (SELECT body FROM idempotency.lookup('orc-1', 'orc')),
    (SELECT count(*) FROM idempotency.lookup('orc-2', 'orc'));
  RETURN $1;
END $$;
CREATE INDEX t_peek ON idem_orc_app.t (idem_orc_app.peek(x));
RESET ROLE;
ANALYZE idem_orc_app.t;
-- the superuser itself sees bob's record
SELECT body FROM idempotency.lookup('orc-1', 'orc');

-- A SECURITY DEFINER function of mallory's, called by alice, acts as
-- mallory: it cannot see, complete, release, extend or checkpoint alice's
-- records with her fence, and what it claims is mallory's.
SET ROLE idem_orc_mallory;
CREATE FUNCTION idem_orc_mal.act(k text, f bigint) RETURNS text LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
  seen bigint;
  outcome text;
  released boolean;
  errors text := '';
BEGIN
  SELECT count(*) INTO seen FROM idempotency.lookup(k, 'orc');
  SELECT c.outcome INTO outcome FROM idempotency.claim(k, '\x01', scope => 'orc') c;
  BEGIN
    PERFORM idempotency.complete('orc-3', f, 200, 'forged', scope => 'orc');
  EXCEPTION WHEN SQLSTATE 'IK001' THEN errors := errors || ' complete IK001';
  END;
  BEGIN
    PERFORM idempotency.extend('orc-3', f, scope => 'orc');
  EXCEPTION WHEN SQLSTATE 'IK001' THEN errors := errors || ' extend IK001';
  END;
  BEGIN
    PERFORM idempotency.checkpoint('orc-3', f, 'forged', scope => 'orc');
  EXCEPTION WHEN SQLSTATE 'IK001' THEN errors := errors || ' checkpoint IK001';
  END;
  released := idempotency.release('orc-3', f, scope => 'orc');
  RETURN format('as %s: saw %s, claim %s, released %s;%s', current_user, seen, outcome, released, errors);
END $$;
GRANT USAGE ON SCHEMA idem_orc_mal TO idem_orc_alice;
SET ROLE idem_orc_alice;
SELECT idem_orc_mal.act('orc-2', :alice_fence);
SELECT fence AS alice_fence3 FROM idempotency.claim('orc-3', '\x01', scope => 'orc') \gset
SELECT idem_orc_mal.act('orc-3', :alice_fence3);
-- alice's records are as she left them
SELECT key, state, attempt, recovery_point, body FROM idempotency.lookup('orc-2', 'orc')
UNION ALL
SELECT key, state, attempt, recovery_point, body FROM idempotency.lookup('orc-3', 'orc');
SELECT idempotency.complete('orc-3', :alice_fence3, 201, 'alice''s own', scope => 'orc');
RESET ROLE;
SELECT k.owner, k.key, k.state, k.body FROM idempotency.keys k WHERE k.scope = 'orc' ORDER BY k.key, k.owner::text;

DELETE FROM idempotency.keys WHERE scope = 'orc';
DROP SCHEMA idem_orc_app CASCADE;
DROP SCHEMA idem_orc_mal CASCADE;
REVOKE ALL ON SCHEMA idempotency FROM idem_orc_alice, idem_orc_bob, idem_orc_mallory;
DROP ROLE idem_orc_alice, idem_orc_bob, idem_orc_mallory;
