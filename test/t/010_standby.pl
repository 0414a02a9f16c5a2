# A hot standby with the library preloaded: every writing function raises
# 25006 whatever its answer would be, lookup answers from the replicated
# records, and the reaper idles without errors.  After promotion the same
# records are replayed, taken over and reaped, with fences larger than any
# the old primary handed out.

use strict;
use warnings FATAL => 'all';
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use FindBin;
use lib $FindBin::RealBin;
use IdemCrash;
use Time::HiRes qw(usleep);


# Returns the lines of $node's log after byte $offset that report a failure
# of a server process.  The test's own sessions fail on purpose, and the WAL
# receiver when the primary goes away: those are left out.
sub failures_in_log
{
	my ($node, $offset) = @_;
	my $log = slurp_file($node->logfile, $offset);
	return grep {
		(/\b(?:WARNING|ERROR|FATAL|PANIC):/
			&& !/\] (?:client backend|walreceiver) /)
		  || /exited with exit code [1-9]/
		  || /terminated by signal/
	} split /\n/, $log;
}

# Waits, up to $seconds, until $sql returns $expected on $node; true if it did.
sub wait_for_value
{
	my ($node, $sql, $expected, $seconds) = @_;
	my $deadline = time() + $seconds;
	while (time() < $deadline)
	{
		return 1 if $node->safe_psql('postgres', $sql) eq $expected;
		usleep(100_000);
	}
	return 0;
}

my $primary = PostgreSQL::Test::Cluster->new('primary');
$primary->init(allows_streaming => 1);
$primary->append_conf('postgresql.conf',
	"shared_preload_libraries = 'idempotency'");
# The backend type in each log line tells the reaper's lines from the test's.
$primary->append_conf('postgresql.conf', "log_line_prefix = '%m [%p] %b %q%a '");
# The primary's reaper must leave the expired record for the standby to see.
$primary->append_conf('postgresql.conf', "idempotency.reaper_naptime = '1h'");
$primary->start;
$primary->safe_psql('postgres', 'CREATE EXTENSION idempotency');

$primary->backup('base');
my $standby = PostgreSQL::Test::Cluster->new('standby');
$standby->init_from_backup($primary, 'base', has_streaming => 1);
# A short naptime, so that the standby's reaper gets many chances to misbehave.
$standby->append_conf('postgresql.conf', "idempotency.reaper_naptime = '1s'");
$standby->start;

# The records the standby will see, one of each kind:
#   done   completed, a replay for the same fingerprint
#   busy   in progress with a live lease
#   stale  in progress, lease ended, with a recovery point: a takeover
#   gone   in progress, lease and retention ended: absent, reapable
my %fence;
$fence{done} = $primary->safe_psql('postgres',
	"SELECT fence FROM idempotency.claim('done', '\\xaa')");
$primary->safe_psql('postgres',
	"SELECT idempotency.complete('done', $fence{done}, 201, 'created', "
	  . "'{\"content-type\": \"text/plain\"}')");
$fence{busy} = $primary->safe_psql('postgres',
	"SELECT fence FROM idempotency.claim('busy', '\\xaa', lease => '1h')");
$fence{stale} = $primary->safe_psql('postgres',
	"SELECT fence FROM idempotency.claim('stale', '\\xaa', lease => '1ms')");
$primary->safe_psql('postgres',
	"SELECT idempotency.checkpoint('stale', $fence{stale}, 'charged', "
	  . "'{\"charge\": \"ch_1\"}')");
$fence{gone} = $primary->safe_psql('postgres',
	"SELECT fence FROM idempotency.claim('gone', '\\xaa', "
	  . "lease => '1ms', retention => '1ms')");
my ($max_fence) = sort { $b <=> $a } values %fence;

# Both short intervals have ended before anything below looks at them.
ok( wait_for_value(
		$primary,
		"SELECT count(*) FROM idempotency.lookup('stale') "
		  . "WHERE lease_expires_at < clock_timestamp()",
		'1', 10),
	'the lease of stale has ended');
ok(wait_for_value($primary, "SELECT count(*) FROM idempotency.lookup('gone')", '0', 10),
	'gone has expired');

$primary->wait_for_catchup($standby);

# The reaper runs on the standby for several naptimes.  Whatever it does
# there, it must not fail: a DELETE attempted on a standby would be logged.
my $log_offset = -s $standby->logfile;
sleep(4);
is(join("\n", failures_in_log($standby, $log_offset)),
	'', 'no errors in the standby log while its reaper ran');
is( $standby->safe_psql('postgres',
		"SELECT count(*) FROM idempotency.keys WHERE key = 'gone'"),
	'1',
	'the expired record is still on the standby');

# Writing functions: 25006 whatever the answer would be.
for my $key (qw(done busy stale gone absent))
{
	is(idem_sqlstate($standby, "SELECT * FROM idempotency.claim('$key', '\\xaa')"),
		'25006', "claim of $key on the standby raises 25006");
}
is(idem_sqlstate($standby, "SELECT * FROM idempotency.claim('done', '\\xbb')"),
	'25006', 'claim that would be a mismatch raises 25006 on the standby');
is( idem_sqlstate(
		$standby, "SELECT idempotency.complete('busy', $fence{busy}, 200)"),
	'25006',
	'complete on the standby raises 25006');
is(idem_sqlstate($standby, "SELECT idempotency.release('busy', $fence{busy})"),
	'25006', 'release on the standby raises 25006');
is(idem_sqlstate($standby, "SELECT idempotency.extend('busy', $fence{busy})"),
	'25006', 'extend on the standby raises 25006');
is( idem_sqlstate(
		$standby, "SELECT idempotency.checkpoint('busy', $fence{busy}, 'p')"),
	'25006',
	'checkpoint on the standby raises 25006');
is(idem_sqlstate($standby, 'SELECT idempotency.reap()'),
	'25006', 'reap on the standby raises 25006');

# lookup answers on the standby, as claim would see the record.
is( $standby->safe_psql(
		'postgres',
		"SELECT state, attempt, status_code, convert_from(body, 'UTF8'), "
		  . "headers->>'content-type' FROM idempotency.lookup('done')"),
	'completed|1|201|created|text/plain',
	'lookup on the standby shows the completed response');
is( $standby->safe_psql(
		'postgres',
		"SELECT state, attempt, lease_expires_at > clock_timestamp() "
		  . "FROM idempotency.lookup('busy')"),
	'in_progress|1|t',
	'lookup on the standby shows the live claim');
is( $standby->safe_psql(
		'postgres',
		"SELECT state, recovery_point, recovery_state->>'charge' "
		  . "FROM idempotency.lookup('stale')"),
	'in_progress|charged|ch_1',
	'lookup on the standby shows the recovery point');
is($standby->safe_psql('postgres', "SELECT count(*) FROM idempotency.lookup('gone')"),
	'0', 'lookup on the standby hides the expired record');
is($standby->safe_psql('postgres', "SELECT count(*) FROM idempotency.lookup('absent')"),
	'0', 'lookup on the standby finds no absent record');
is( $standby->safe_psql(
		'postgres',
		"SELECT to_jsonb(l) ? 'fence' FROM idempotency.lookup('busy') l"),
	'f',
	'lookup on the standby does not show the fence');

# Failover: the old primary dies, the standby takes over.
$log_offset = -s $standby->logfile;
$primary->stop('immediate');
$standby->promote;
my $node = $standby;
is($node->safe_psql('postgres', 'SELECT pg_is_in_recovery()'),
	'f', 'the standby is promoted');

# The reaper starts working once the node is a primary.
ok( wait_for_value(
		$node, "SELECT count(*) FROM idempotency.keys WHERE key = 'gone'",
		'0', 30),
	'the reaper deletes the expired record after promotion');
is(join("\n", failures_in_log($node, $log_offset)),
	'', 'no errors in the log after promotion');

# claim works and answers from the replicated records.
my ($outcome, $fence, $attempt) = split /\|/,
  $node->safe_psql('postgres',
	"SELECT outcome, fence, attempt FROM idempotency.claim('absent', '\\xaa')");
is("$outcome|$attempt", 'new|1', 'claim of a new key after promotion');
cmp_ok($fence, '>', $max_fence,
	'its fence is larger than any the old primary handed out');
is($node->safe_psql('postgres', "SELECT idempotency.complete('absent', $fence, 201)"),
	'stored', 'complete after promotion');

is( $node->safe_psql(
		'postgres',
		"SELECT outcome, status_code, convert_from(body, 'UTF8') "
		  . "FROM idempotency.claim('done', '\\xaa')"),
	'replay|201|created',
	'claim of the completed key after promotion is a replay');
is( $node->safe_psql(
		'postgres', "SELECT outcome FROM idempotency.claim('done', '\\xbb')"),
	'mismatch',
	'another fingerprint is a mismatch');
is( $node->safe_psql(
		'postgres',
		"SELECT outcome, retry_after >= 1 FROM idempotency.claim('busy', '\\xaa')"),
	'in_progress|t',
	'the live lease of the old primary still holds');

my ($point, $state);
($outcome, $fence, $attempt, $point, $state) = split /\|/,
  $node->safe_psql('postgres',
	    "SELECT outcome, fence, attempt, recovery_point, recovery_state->>'charge' "
	  . "FROM idempotency.claim('stale', '\\xaa')");
is("$outcome|$attempt|$point|$state", 'new|2|charged|ch_1',
	'the ended lease is taken over with its recovery point');
cmp_ok($fence, '>', $max_fence, 'the takeover has a larger fence');
is( idem_sqlstate(
		$node, "SELECT idempotency.complete('stale', $fence{stale}, 200)"),
	'IK001',
	'the old owner of stale is fenced off');
is($node->safe_psql('postgres', "SELECT idempotency.complete('stale', $fence, 200)"),
	'stored', 'the new owner of stale completes');

done_testing();
