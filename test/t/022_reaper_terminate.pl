# The reaper comes back from whatever stops it: pg_terminate_backend of a
# worker in the middle of a run, of the launcher (which stops its worker and
# is started again by the postmaster, without a FATAL line), and kill -9 of a
# worker (a crash restart of the whole server).  Each time the expired
# records are all reaped in the end and the live ones stay.

use strict;
use warnings FATAL => 'all';

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = PostgreSQL::Test::Cluster->new('reaper_terminate');
$node->init;
# One record per batch, so that a run lasts long enough to be interrupted.
$node->append_conf('postgresql.conf', q{
shared_preload_libraries = 'idempotency'
idempotency.reaper_naptime = '1s'
idempotency.reaper_batch = 1
restart_after_crash = on
});
$node->start;
$node->safe_psql('postgres', 'CREATE EXTENSION idempotency');

# Live records: completed with a response, and in progress.
$node->safe_psql('postgres', q{
	SELECT count(idempotency.complete('live' || g, fence, 200, convert_to('body' || g, 'UTF8')))
	FROM generate_series(1, 100) g,
		 LATERAL idempotency.claim('live' || g, '\x01') c;
	SELECT count(idempotency.claim('owned' || g, '\x01', lease => '1 h'))
	FROM generate_series(1, 100) g;
});
my $live_query = q{
	SELECT count(*), md5(string_agg(key || state || coalesce(encode(body, 'hex'), ''),
									',' ORDER BY key))
	FROM idempotency.keys WHERE key NOT LIKE 'expired%'};
my $live = $node->safe_psql('postgres', $live_query);

# Adds n expired records, directly: claims would take longer.
sub add_expired
{
	my ($n) = @_;
	$node->safe_psql('postgres', qq{
		INSERT INTO idempotency.keys (fence, created_at, expires_at, completed_at,
			lease, attempt, status_code, state, owner, scope, key, fingerprint)
		SELECT nextval('idempotency.fence_seq'), now() - interval '2 days',
			now() - interval '1 day' + g * interval '1 ms', now() - interval '2 days',
			interval '1 min', 1, 200, 'completed', current_user::text::regrole, '',
			'expired' || g, '\\x01'
		FROM generate_series(1, $n) g
		ON CONFLICT DO NOTHING});
}

# The pid of the worker once it is reaping.
sub busy_worker_pid
{
	$node->poll_query_until('postgres', q{
		SELECT count(*) = 1 FROM pg_stat_activity
		WHERE backend_type = 'idempotency reaper' AND state = 'active'})
	  or return undef;
	return $node->safe_psql('postgres', q{
		SELECT pid FROM pg_stat_activity WHERE backend_type = 'idempotency reaper'});
}

# The pid of the launcher once it runs.
sub launcher_pid
{
	$node->poll_query_until('postgres', q{
		SELECT count(*) = 1 FROM pg_stat_activity
		WHERE backend_type = 'idempotency reaper launcher'})
	  or return undef;
	return $node->safe_psql('postgres', q{
		SELECT pid FROM pg_stat_activity
		WHERE backend_type = 'idempotency reaper launcher'});
}

# Waits until every expired record is gone; then checks the live ones.
sub all_reaped
{
	my ($what) = @_;
	ok( $node->poll_query_until('postgres',
			q{SELECT count(*) = 0 FROM idempotency.keys WHERE key LIKE 'expired%'}),
		"$what: the expired records are all reaped");
	is($node->safe_psql('postgres', $live_query), $live,
		"$what: the live records are intact");
}

# 1. pg_terminate_backend of a worker in the middle of a run.
add_expired(30000);
my $worker = busy_worker_pid();
ok($worker, 'a worker is reaping');
is($node->safe_psql('postgres', "SELECT pg_terminate_backend($worker)"),
	't', 'the worker is terminated');
ok($node->poll_query_until('postgres',
		"SELECT count(*) = 0 FROM pg_stat_activity WHERE pid = $worker"),
	'the worker exits');
all_reaped('after the worker was terminated');

# 2. pg_terminate_backend of the launcher while its worker reaps: the worker
# stops with it, and the postmaster starts the launcher again.
add_expired(30000);
$worker = busy_worker_pid();
my $launcher = launcher_pid();
my $offset = -s $node->logfile;
is($node->safe_psql('postgres', "SELECT pg_terminate_backend($launcher)"),
	't', 'the launcher is terminated');
ok( $node->poll_query_until('postgres',
		"SELECT count(*) = 0 FROM pg_stat_activity WHERE pid IN ($launcher, $worker)"),
	'the launcher and its worker exit');
my $new_launcher = launcher_pid();
ok($new_launcher && $new_launcher != $launcher, 'the launcher is started again');
all_reaped('after the launcher was terminated');
my $log = slurp_file($node->logfile, $offset);
unlike($log, qr/FATAL:  terminating background worker "idempotency reaper launcher"/,
	'the launcher stops without a FATAL line');

# 3. kill -9 of a worker: the postmaster restarts every process.
add_expired(30000);
$worker = busy_worker_pid();
$offset = -s $node->logfile;
kill 'KILL', $worker;
ok( $node->wait_for_log(qr/database system is ready to accept connections/, $offset),
	'the server has restarted after the crash');
all_reaped('after a worker was killed');
ok(launcher_pid(), 'the launcher runs after the crash restart');

$node->stop;
done_testing();
