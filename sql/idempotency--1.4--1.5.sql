/* idempotency--1.4--1.5.sql */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.5'" to load this file. \quit

-- 1.5: reap() called by a role deletes, and so keeps locked until its
-- transaction ends, only the expired records of the roles whose privileges
-- it has; a superuser, the table's owner and the background reaper delete
-- every role's (the library does this for 1.4's objects too).  A claim
-- flushes the fence sequence's WAL also with synchronous_commit off, and a
-- waiting claim is woken by a Citus tenant's value rather than its text:
-- both in the library alone.  This step changes reap's comment only.

COMMENT ON FUNCTION idempotency.reap(integer) IS
	'Deletes up to batch expired records of the roles whose privileges the caller has (every role''s for a superuser or the table''s owner), oldest first; returns how many';
