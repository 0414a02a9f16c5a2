-- A DBA's rebuild of the unique key of idempotency.keys: in any column
-- order, as a primary key or a unique constraint, claims, replays and
-- completes find the caller's own record and never another's (whose key and
-- scope are the caller's scope and key); without a unique index on exactly
-- (key, scope, owner), claim and complete refuse (55000) and write nothing.
CREATE EXTENSION IF NOT EXISTS idempotency;

-- Two tenants' records whose key and scope are each other's.
SELECT fence AS acme_fence FROM idempotency.claim('order-1', '\x01', scope => 'acme') \gset
SELECT idempotency.complete('order-1', :acme_fence, 201, 'acme''s order-1', scope => 'acme');

-- The primary key rebuilt with the scope first: each tenant gets its own.
ALTER TABLE idempotency.keys DROP CONSTRAINT keys_pkey,
  ADD CONSTRAINT keys_pkey PRIMARY KEY (scope, key, owner);
SELECT outcome, body FROM idempotency.claim('acme', '\x01', scope => 'order-1');
SELECT fence AS o1_fence FROM idempotency.keys WHERE scope = 'order-1' AND key = 'acme' \gset
SELECT idempotency.complete('acme', :o1_fence, 202, 'order-1''s acme', scope => 'order-1');
SELECT outcome, status_code, convert_from(body, 'UTF8') AS body
FROM idempotency.claim('acme', '\x01', scope => 'order-1');
SELECT outcome, status_code, convert_from(body, 'UTF8') AS body
FROM idempotency.claim('order-1', '\x01', scope => 'acme');
SELECT outcome FROM idempotency.claim('order-1', '\x02', scope => 'acme');
-- A claim in progress: in_progress for another claim, released by its fence.
SELECT fence AS r_fence FROM idempotency.claim('Reordered-1', '\x01', scope => 'acme') \gset
SELECT outcome FROM idempotency.claim('Reordered-1', '\x01', scope => 'acme');
SELECT idempotency.release('Reordered-1', :r_fence, scope => 'acme');

-- The same through the executor (a trigger): ON CONFLICT finds the reordered key.
CREATE FUNCTION public.idem_pk_noop() RETURNS trigger LANGUAGE plpgsql AS 'BEGIN RETURN NEW; END';
CREATE TRIGGER keys_noop BEFORE INSERT OR UPDATE ON idempotency.keys
  FOR EACH ROW EXECUTE FUNCTION public.idem_pk_noop();
SELECT fence AS t_fence FROM idempotency.claim('acme', '\x01', scope => 'order-2') \gset
SELECT outcome FROM idempotency.claim('acme', '\x01', scope => 'order-2');
SELECT idempotency.complete('acme', :t_fence, 203, 'order-2''s acme', scope => 'order-2');
SELECT outcome, convert_from(body, 'UTF8') AS body
FROM idempotency.claim('acme', '\x01', scope => 'order-2');
DROP TRIGGER keys_noop ON idempotency.keys;

-- No primary key: a unique constraint in yet another order is the key.
ALTER TABLE idempotency.keys DROP CONSTRAINT keys_pkey,
  ADD CONSTRAINT keys_unique UNIQUE (owner, scope, key);
SELECT outcome, convert_from(body, 'UTF8') AS body
FROM idempotency.claim('order-1', '\x01', scope => 'acme');
SELECT outcome, convert_from(body, 'UTF8') AS body
FROM idempotency.claim('acme', '\x01', scope => 'order-1');
SELECT fence AS u_fence FROM idempotency.claim('acme', '\x01', scope => 'order-3') \gset
SELECT outcome FROM idempotency.claim('acme', '\x01', scope => 'order-3');
SELECT idempotency.complete('acme', :u_fence, 204, scope => 'order-3');

-- Unique indexes that are not a key of (key, scope, owner): one with an
-- extra column, an expression, a predicate, another collation or another
-- operator class.  Claim and complete refuse, clearly, and write nothing;
-- the calls that need no unique index to be right go on.
SELECT fence AS n_fence FROM idempotency.claim('acme', '\x01', scope => 'order-4') \gset
ALTER TABLE idempotency.keys DROP CONSTRAINT keys_unique;
CREATE UNIQUE INDEX keys_extra ON idempotency.keys (key, scope, owner, fence);
CREATE UNIQUE INDEX keys_expr ON idempotency.keys (key, scope, (owner::oid));
CREATE UNIQUE INDEX keys_partial ON idempotency.keys (key, scope, owner) WHERE fence > 0;
CREATE UNIQUE INDEX keys_collated ON idempotency.keys (key COLLATE "POSIX", scope, owner);
CREATE UNIQUE INDEX keys_pattern ON idempotency.keys (key text_pattern_ops, scope, owner);
\set VERBOSITY sqlstate
SELECT outcome FROM idempotency.claim('acme', '\x01', scope => 'order-5');
SELECT outcome FROM idempotency.claim('acme', '\x01', scope => 'order-1');
SELECT idempotency.complete('acme', :n_fence, 200, scope => 'order-4');
\set VERBOSITY default
SELECT outcome FROM idempotency.claim('acme', '\x01', scope => 'order-5');
DROP INDEX idempotency.keys_extra, idempotency.keys_expr, idempotency.keys_partial,
  idempotency.keys_collated, idempotency.keys_pattern;
-- No unique index at all, also through the executor.
SELECT outcome FROM idempotency.claim('acme', '\x01', scope => 'order-5');
CREATE TRIGGER keys_noop BEFORE INSERT OR UPDATE ON idempotency.keys
  FOR EACH ROW EXECUTE FUNCTION public.idem_pk_noop();
\set VERBOSITY sqlstate
SELECT outcome FROM idempotency.claim('acme', '\x01', scope => 'order-5');
SELECT outcome FROM idempotency.claim('acme', '\x01', scope => 'order-5');
SELECT idempotency.complete('acme', :n_fence, 200, scope => 'order-4');
\set VERBOSITY default
DROP TRIGGER keys_noop ON idempotency.keys;
DROP FUNCTION public.idem_pk_noop();
SELECT count(*) AS refused_written FROM idempotency.keys WHERE scope = 'order-5';
SELECT state FROM idempotency.lookup('acme', 'order-4');
SELECT idempotency.release('acme', :n_fence, scope => 'order-4');

-- The key as the extension makes it: all works again.
ALTER TABLE idempotency.keys ADD CONSTRAINT keys_pkey PRIMARY KEY (key, scope, owner);
SELECT outcome, convert_from(body, 'UTF8') AS body
FROM idempotency.claim('acme', '\x01', scope => 'order-1');
DELETE FROM idempotency.keys WHERE scope IN ('acme', 'order-1', 'order-2', 'order-3', 'order-4');
