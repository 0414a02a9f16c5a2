-- The role a record belongs to is kept by OID: renaming the role keeps its
-- records; REASSIGN OWNED hands over objects, not records; after DROP ROLE
-- its records belong to no role (another role, one of the same name too,
-- never meets them) until they expire and reap deletes them.
CREATE EXTENSION IF NOT EXISTS idempotency;
CREATE ROLE idem_first LOGIN;
CREATE ROLE idem_heir LOGIN;
GRANT USAGE ON SCHEMA idempotency TO idem_first, idem_heir;
SET ROLE idem_first;
SELECT fence AS first_fence FROM idempotency.claim('Role-1', '\x01', scope => 'roles') \gset
SELECT idempotency.complete('Role-1', :first_fence, 201, 'first', scope => 'roles');
SELECT outcome FROM idempotency.claim('Role-2', '\x01', scope => 'roles');
RESET ROLE;

-- renamed: still its records
ALTER ROLE idem_first RENAME TO idem_renamed;
SET ROLE idem_renamed;
SELECT outcome, body FROM idempotency.claim('Role-1', '\x01', scope => 'roles');
RESET ROLE;
SELECT owner, key FROM idempotency.keys WHERE scope = 'roles' ORDER BY key;

-- REASSIGN OWNED does not hand the records over
REASSIGN OWNED BY idem_renamed TO idem_heir;
SET ROLE idem_heir;
SELECT count(*) AS heir_sees FROM idempotency.lookup('Role-1', 'roles');
SELECT outcome FROM idempotency.claim('Role-1', '\x02', scope => 'roles');
RESET ROLE;

-- dropped: its records are nobody's; a new role of the same name does not get them
REVOKE ALL ON SCHEMA idempotency FROM idem_renamed;
DROP ROLE idem_renamed;
CREATE ROLE idem_renamed LOGIN;
GRANT USAGE ON SCHEMA idempotency TO idem_renamed;
SET ROLE idem_renamed;
SELECT count(*) AS namesake_sees FROM idempotency.lookup('Role-1', 'roles');
SELECT outcome, attempt FROM idempotency.claim('Role-1', '\x03', scope => 'roles');
RESET ROLE;
SELECT count(*) FILTER (WHERE r.oid IS NULL) AS orphaned,
       count(*) FILTER (WHERE r.rolname = 'idem_heir') AS heirs,
       count(*) FILTER (WHERE r.rolname = 'idem_renamed') AS namesakes
FROM idempotency.keys k LEFT JOIN pg_roles r ON r.oid = k.owner
WHERE k.scope = 'roles';
-- an orphaned record expires and is reaped like any other
UPDATE idempotency.keys SET expires_at = now() - interval '1 hour',
  lease_expires_at = now() - interval '1 hour' WHERE scope = 'roles' AND key = 'Role-2';
SELECT idempotency.reap() >= 1 AS reaped;
SELECT count(*) AS orphan_left FROM idempotency.keys k
WHERE k.scope = 'roles' AND k.key = 'Role-2';

DELETE FROM idempotency.keys WHERE scope = 'roles';
REVOKE ALL ON SCHEMA idempotency FROM idem_renamed, idem_heir;
DROP ROLE idem_renamed, idem_heir;
