# On a hot standby the launcher runs, visible in pg_stat_activity, but
# starts no worker (a standby cannot delete); once promoted, it reaps.

use strict;
use warnings FATAL => 'all';

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $primary = PostgreSQL::Test::Cluster->new('reaper_primary');
$primary->init(allows_streaming => 1);
# The primary's reaper sleeps: the expired records reach the standby.
$primary->append_conf('postgresql.conf', q{
shared_preload_libraries = 'idempotency'
idempotency.reaper_naptime = '1h'
});
$primary->start;
$primary->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	SELECT count(idempotency.claim('expired' || g, '\x01', lease => '1 ms',
								   retention => '1 ms'))
	FROM generate_series(1, 500) g;
	SELECT idempotency.complete('live', fence, 200, 'x')
	FROM idempotency.claim('live', '\x01');
});
$primary->backup('backup');

my $standby = PostgreSQL::Test::Cluster->new('reaper_standby');
$standby->init_from_backup($primary, 'backup', has_streaming => 1);
$standby->append_conf('postgresql.conf', q{
idempotency.reaper_naptime = '1s'
log_min_messages = debug1
});
$standby->start;
$primary->wait_for_catchup($standby);

ok( $standby->poll_query_until('postgres', q{
		SELECT count(*) = 1 FROM pg_stat_activity
		WHERE backend_type = 'idempotency reaper launcher'}),
	'the launcher runs on the standby');

# Let several naptimes pass: the launcher wakes up, and does nothing.
ok( $standby->poll_query_until('postgres', q{
		SELECT now() - pg_postmaster_start_time() > interval '4 s'}),
	'the standby has been up for four naptimes');
ok( !$standby->log_contains(qr/starting background worker process "idempotency reaper for/),
	'no worker was started on the standby');
ok(!$standby->log_contains(qr/ERROR|FATAL/), 'no error on the standby');
is($standby->safe_psql('postgres', 'SELECT count(*) FROM idempotency.keys'),
	'501', 'the standby still has every record');

# Promoted, it reaps.
$standby->promote;
ok( $standby->poll_query_until('postgres',
		q{SELECT string_agg(key, ',') = 'live' FROM idempotency.keys}),
	'after promotion the expired records are reaped');
is( $standby->safe_psql('postgres',
		q{SELECT reaped = 500 AND reaper_runs >= 1 FROM idempotency.stats}),
	't', 'the promoted server counts its runs');

$standby->stop;
$primary->stop;
done_testing();
