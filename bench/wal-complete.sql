-- WAL per claim + complete, each complete right after its claim (as in an
-- API), 2000 keys of 37 bytes, scope acct_42, SHA-256 fingerprints, the
-- 64-byte body of bench/run.  Where claim's token (1.2) sits in the row
-- decides what complete's WAL record holds (idempotency--1.2.sql).
--
--   psql -d DB -v version=1.2 -v token=on -v token_last=off -f bench/wal-complete.sql
--
-- version: the extension's version to install (1.1 has no token); token:
-- claim with a token (on) or none (off); token_last: move the token column
-- to the end of the row first (on), the layout ADD COLUMN would give.  Run
-- it in a database of its own (it drops and creates the extension), with
-- full_page_writes = off, so that full-page images do not hide the records.
\set ON_ERROR_STOP 1
DROP EXTENSION IF EXISTS idempotency;
CREATE EXTENSION idempotency VERSION :'version';
SELECT :'token_last' = 'on' AS move_token \gset
\if :move_token
ALTER TABLE idempotency.keys DROP COLUMN token;
ALTER TABLE idempotency.keys ADD COLUMN token uuid;
\endif
SELECT set_config('bench.token', :'token', false) IS NULL AS unset \gset
CHECKPOINT;
SELECT pg_current_wal_insert_lsn() AS l0 \gset
DO $$
DECLARE
	f bigint;
BEGIN
	FOR i IN 1..2000 LOOP
		IF current_setting('bench.token') = 'on' THEN
			SELECT fence INTO f FROM idempotency.claim(md5(i::text) || '-abcd',
				sha256(i::text::bytea), 'acct_42', token => gen_random_uuid());
		ELSE
			SELECT fence INTO f FROM idempotency.claim(md5(i::text) || '-abcd',
				sha256(i::text::bytea), 'acct_42');
		END IF;
		PERFORM idempotency.complete(md5(i::text) || '-abcd', f, 201,
			'{"payment_id":"pay_00000042","status":"succeeded","amount":1999}'::bytea,
			'{"Content-Type": "application/json"}', 'acct_42');
	END LOOP;
END
$$;
SELECT pg_current_wal_insert_lsn() AS l1 \gset
SELECT :'version' AS version, :'token' AS token, :'token_last' AS token_last,
	round(pg_wal_lsn_diff(:'l1', :'l0') / 2000, 1) AS wal_bytes_per_claim_and_complete,
	(SELECT n_tup_hot_upd || '/' || n_tup_upd FROM pg_stat_xact_user_tables
	 WHERE relid = 'idempotency.keys'::regclass) AS hot_updates;
