# The background reaper: a launcher visible in pg_stat_activity that idles
# with a long naptime; a reload of the naptime takes effect at once; its
# workers then delete exactly the expired records in two databases, count
# what they did in idempotency.stats and log one line per database; with
# idempotency.reaper_databases set they visit only the listed databases.

use strict;
use warnings FATAL => 'all';

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = PostgreSQL::Test::Cluster->new('reaper');
$node->init;
# A naptime of an hour: nothing is reaped until the reload below.
$node->append_conf('postgresql.conf', q{
shared_preload_libraries = 'idempotency'
idempotency.reaper_naptime = '1h'
});
$node->start;

# The launcher runs connected to no database, under its own backend_type.
ok( $node->poll_query_until('postgres',
		q{SELECT count(*) = 1 FROM pg_stat_activity
		  WHERE backend_type = 'idempotency reaper launcher' AND datname IS NULL}),
	'the launcher is in pg_stat_activity');

# In each database: records that expired (completed; in_progress whose lease
# ended too; many abandoned claims) and records that must stay (live;
# expired retention but a live lease; an ended lease within retention).
my @dbs = ('db1', 'db2');
for my $db (@dbs)
{
	$node->safe_psql('postgres', "CREATE DATABASE $db");
	$node->safe_psql($db, q{
		CREATE EXTENSION idempotency;
		SELECT idempotency.complete('done', fence, 200, 'x')
		FROM idempotency.claim('done', '\x01');
		SELECT idempotency.claim('dead', '\x01');
		SELECT count(idempotency.claim('bulk' || g, '\x01'))
		FROM generate_series(1, 2000) g;
		SELECT idempotency.complete('live', fence, 200, 'x')
		FROM idempotency.claim('live', '\x01');
		SELECT idempotency.extend('leased', fence, '1 h')
		FROM idempotency.claim('leased', '\x01');
		SELECT idempotency.claim('abandoned', '\x01');
		-- Ended by hand: a 1 ms lease could end before its complete or
		-- extend on a loaded machine.
		UPDATE idempotency.keys SET expires_at = now() - interval '1 second'
		WHERE key IN ('done', 'dead', 'leased') OR key LIKE 'bulk%';
		UPDATE idempotency.keys SET lease_expires_at = now() - interval '1 second'
		WHERE key IN ('dead', 'abandoned') OR key LIKE 'bulk%';
	});
}

# Still all there: the launcher sleeps for an hour.
for my $db (@dbs)
{
	is($node->safe_psql($db, 'SELECT count(*) FROM idempotency.keys'),
		'2005', "$db: nothing reaped before the reload");
}

# A reload shortens the naptime: the launcher, asleep for an hour, wakes.
$node->safe_psql('postgres', q{
	ALTER SYSTEM SET idempotency.reaper_naptime = '1s';
	SELECT pg_reload_conf();
});
for my $db (@dbs)
{
	ok( $node->poll_query_until($db,
			'SELECT count(*) = 3 FROM idempotency.keys'),
		"$db: the expired records are reaped after the reload");
	is( $node->safe_psql($db,
			'SELECT string_agg(key, \',\' ORDER BY key) FROM idempotency.keys'),
		'abandoned,leased,live',
		"$db: the live records stay");
}

# Counters: 2002 records per database, at least one run each, no error.
my $stats = $node->safe_psql('db1', q{
	SELECT reaped >= 4004, reaper_runs >= 2, last_reap_at IS NOT NULL,
		   last_reap_error IS NULL
	FROM idempotency.stats});
is($stats, 't|t|t|t', 'idempotency.stats counts the reaped records and the runs');

# One line per run that deleted something, with the count; nothing for the
# database without the extension and no error.
for my $db (@dbs)
{
	ok( $node->log_contains(
			qr/LOG:  idempotency reaper deleted 2002 expired records in database "$db"/),
		"$db: the run is logged with its count");
}
ok(!$node->log_contains(qr/reaper.*database "postgres"|database "postgres".*reaper/),
	'nothing is logged for a database without the extension');
ok(!$node->log_contains(qr/ERROR|FATAL/), 'no error in the log');

# reaper_databases: only db2 is visited.  Set at restart, so that every run
# afterwards sees it (counters restart at zero).
$node->append_conf('postgresql.conf', "idempotency.reaper_databases = 'db2'\n");
$node->restart;
for my $db (@dbs)
{
	$node->safe_psql($db, q{
		SELECT count(idempotency.claim('again' || g, '\x01', lease => '1 ms',
									   retention => '1 ms'))
		FROM generate_series(1, 100) g;
		SELECT pg_sleep(0.05);
	});
}
ok( $node->poll_query_until('db2',
		'SELECT count(*) = 3 FROM idempotency.keys'),
	'db2, listed, is reaped');
# Three runs, all in db2: db1 has had every chance to be visited.
ok( $node->poll_query_until('db2',
		'SELECT reaper_runs >= 3 FROM idempotency.stats'),
	'the reaper keeps running');
is($node->safe_psql('db1', 'SELECT count(*) FROM idempotency.keys'),
	'103', 'db1, not listed, is left alone');

$node->stop;
done_testing();
