# The reaper never makes DROP DATABASE or DROP EXTENSION fail: caught in the
# middle of a long run (batches of one record), the worker is visible in
# pg_stat_activity, gives way to the command and leaves without an error.
# CREATE EXTENSION again and the reaper serves the new table.

use strict;
use warnings FATAL => 'all';

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = PostgreSQL::Test::Cluster->new('reaper_drop');
$node->init;
# One record per batch: 100000 expired records keep a worker busy far
# longer than the 5 seconds DROP DATABASE waits for other sessions to leave.
$node->append_conf('postgresql.conf', q{
shared_preload_libraries = 'idempotency'
idempotency.reaper_naptime = '1s'
idempotency.reaper_batch = 1
});
$node->start;

# Adds n expired (completed) records, directly: claims would take longer.
sub add_expired
{
	my ($db, $n) = @_;
	$node->safe_psql($db, qq{
		INSERT INTO idempotency.keys (fence, created_at, expires_at, completed_at,
			lease, attempt, status_code, state, owner, scope, key, fingerprint)
		SELECT nextval('idempotency.fence_seq'), now() - interval '2 days',
			now() - interval '1 day' + g * interval '1 ms', now() - interval '2 days',
			interval '1 min', 1, 200, 'completed', current_user::text::regrole, '',
			'expired' || g, '\\x01'
		FROM generate_series(1, $n) g});
}

# Waits until a reaper worker is in pg_stat_activity for this database.
sub wait_for_worker_in
{
	my ($db) = @_;
	return $node->poll_query_until('postgres', qq{
		SELECT count(*) = 1 FROM pg_stat_activity
		WHERE backend_type = 'idempotency reaper' AND datname = '$db'
		  AND state = 'active'
		  AND query = 'reaping expired records of idempotency.keys'});
}

# Errors of the reaper in the log from this offset on.
sub reaper_errors_since
{
	my ($offset) = @_;
	my $log = slurp_file($node->logfile, $offset);
	my @errors = grep { /ERROR|FATAL/ } split /\n/, $log;
	return join("\n", @errors);
}

for my $db ('gone', 'kept')
{
	$node->safe_psql('postgres', "CREATE DATABASE $db");
	$node->safe_psql($db, 'CREATE EXTENSION idempotency');
}

# DROP DATABASE while the worker is connected and reaping.
my $offset = -s $node->logfile;
add_expired('gone', 100000);
ok(wait_for_worker_in('gone'), 'a worker reaps in the database, visibly');
my ($ret, $stdout, $stderr) = $node->psql('postgres', 'DROP DATABASE gone');
is($ret, 0, 'DROP DATABASE succeeds while the worker was reaping');
is($stderr, '', 'DROP DATABASE reports nothing');
is( $node->safe_psql('postgres',
		q{SELECT count(*) FROM pg_database WHERE datname = 'gone'}),
	'0', 'the database is gone');

# DROP EXTENSION while the worker is reaping.
add_expired('kept', 100000);
ok(wait_for_worker_in('kept'), 'a worker reaps in the other database');
($ret, $stdout, $stderr) = $node->psql('kept', 'DROP EXTENSION idempotency');
is($ret, 0, 'DROP EXTENSION succeeds while the worker was reaping');
is($stderr, '', 'DROP EXTENSION reports nothing');

# Without the extension the workers come and go without a word.
ok( $node->poll_query_until('postgres', q{
		SELECT count(*) = 0 FROM pg_stat_activity
		WHERE backend_type = 'idempotency reaper' AND datname = 'kept'}),
	'the worker has left');

# CREATE EXTENSION again: the reaper serves the new table.
$node->safe_psql('kept', 'CREATE EXTENSION idempotency');
add_expired('kept', 100);
$node->safe_psql('kept', q{
	SELECT idempotency.complete('live', fence, 200, 'x')
	FROM idempotency.claim('live', '\x01')});
ok( $node->poll_query_until('kept',
		q{SELECT string_agg(key, ',') = 'live' FROM idempotency.keys}),
	'after CREATE EXTENSION again, expired records are reaped, the live one stays');

is(reaper_errors_since($offset), '', 'no error or FATAL in the log');

$node->stop;
done_testing();
