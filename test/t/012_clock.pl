# Clock jumps, with the server's wall clock moved by libfaketime through its
# timestamp file (the monotonic clock is left alone, as an NTP step would).
# A backward jump neither takes over a live lease nor reaps anything early;
# a forward jump acts as the time passing: leases end, records expire.

use strict;
use warnings FATAL => 'all';
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use FindBin;
use lib $FindBin::RealBin;
use IdemCrash;

my ($libfaketime) =
  grep { m{/libfaketime\.so\.1$} } split /\n/,
  `dpkg -L libfaketime 2>/dev/null`;
plan skip_all => 'libfaketime is not installed (Debian package libfaketime)'
  unless $libfaketime && -f $libfaketime;

my $clock_file = PostgreSQL::Test::Utils::tempdir . '/faketime';

# Moves the server's wall clock to $offset from the real time ("-1h", "+2h").
sub set_clock
{
	my ($offset) = @_;
	open my $fh, '>', "$clock_file.new" or die "could not write clock file: $!";
	print $fh "$offset\n";
	close $fh;
	rename "$clock_file.new", $clock_file
	  or die "could not rename clock file: $!";
	return;
}

# Returns how many seconds the server's clock is ahead of the real time.
sub clock_offset
{
	my ($node) = @_;
	my $server =
	  $node->safe_psql('postgres', 'SELECT extract(epoch FROM clock_timestamp())');
	return $server - time();
}


my $node = PostgreSQL::Test::Cluster->new('clock');
$node->init;
$node->append_conf('postgresql.conf',
	"shared_preload_libraries = 'idempotency'");
# Only the reap() calls below delete anything.  The background reaper could
# not be tested here anyway: on PostgreSQL 15 the processes the postmaster
# starts from its signal handlers, background workers among them, do not
# follow the clock file (client backends do).
$node->append_conf('postgresql.conf', "idempotency.reaper_naptime = '1h'");
set_clock('+0');
{
	# The postmaster, and every backend it forks, reads the clock file.
	local $ENV{LD_PRELOAD} = $libfaketime;
	local $ENV{FAKETIME_TIMESTAMP_FILE} = $clock_file;
	local $ENV{FAKETIME_NO_CACHE} = '1';
	local $ENV{FAKETIME_DONT_FAKE_MONOTONIC} = '1';
	$node->start;
}
$node->safe_psql('postgres', 'CREATE EXTENSION idempotency');

cmp_ok(abs(clock_offset($node)), '<', 600, 'the server clock starts at the real time');

# Records, each created at the real time:
#   live    in progress, lease 30 min, with a recovery point
#   long    in progress, lease 5 h
#   kept    completed, retention 30 min
#   orphan  in progress, lease 30 min, retention 30 min
#   young   completed, retention 24 h
my %fence;
for my $claim (
	[ 'live',   "lease => '30min'" ],
	[ 'long',   "lease => '5h'" ],
	[ 'kept',   "retention => '30min'" ],
	[ 'orphan', "lease => '30min', retention => '30min'" ],
	[ 'young',  "retention => '24h'" ])
{
	my ($key, $args) = @$claim;
	my ($outcome, $fence) = split /\|/,
	  $node->safe_psql('postgres',
		"SELECT outcome, fence FROM idempotency.claim('$key', '\\xaa', $args)");
	is($outcome, 'new', "claim of $key");
	$fence{$key} = $fence;
}
$node->safe_psql('postgres',
	"SELECT idempotency.checkpoint('live', $fence{live}, 'step-1')");
for my $key (qw(kept young))
{
	is( $node->safe_psql(
			'postgres', "SELECT idempotency.complete('$key', $fence{$key}, 200, 'ok')"
		),
		'stored',
		"complete of $key");
}

# The clock jumps an hour back.
set_clock('-1h');
cmp_ok(clock_offset($node), '<', -3000, 'the server clock went back an hour');

is( $node->safe_psql(
		'postgres',
		"SELECT outcome, retry_after >= 1 FROM idempotency.claim('live', '\\xaa')"),
	'in_progress|t',
	'after a backward jump the live lease is not taken over');
is( $node->safe_psql(
		'postgres', "SELECT outcome FROM idempotency.claim('orphan', '\\xaa')"),
	'in_progress',
	'after a backward jump the orphan is still in progress');
is( $node->safe_psql(
		'postgres', "SELECT outcome FROM idempotency.claim('kept', '\\xaa')"),
	'replay',
	'after a backward jump the completed record replays');
is($node->safe_psql('postgres', 'SELECT idempotency.reap()'),
	'0', 'after a backward jump reap deletes nothing');
is( $node->safe_psql(
		'postgres',
		"SELECT string_agg(key, ',' ORDER BY key) FROM idempotency.keys"),
	'kept,live,long,orphan,young',
	'every record is still there');

# The clock jumps two hours ahead of the real time.
set_clock('+2h');
cmp_ok(clock_offset($node), '>', 6600, 'the server clock went two hours ahead');

my ($outcome, $fence, $attempt, $point) = split /\|/,
  $node->safe_psql('postgres',
	"SELECT outcome, fence, attempt, recovery_point FROM idempotency.claim('live', '\\xaa')"
  );
is("$outcome|$attempt|$point", 'new|2|step-1',
	'after a forward jump the ended lease is taken over');
cmp_ok($fence, '>', $fence{live}, 'the takeover has a larger fence');
is( idem_sqlstate(
		$node, "SELECT idempotency.complete('live', $fence{live}, 200)"),
	'IK001',
	'the old owner of live is fenced off');

my $retry_after;
($outcome, $retry_after) = split /\|/,
  $node->safe_psql('postgres',
	"SELECT outcome, retry_after FROM idempotency.claim('long', '\\xaa')");
is($outcome, 'in_progress', 'the 5 h lease still holds two hours later');
cmp_ok($retry_after, '<=', 3 * 3600 + 60, 'and ends in about three hours');
cmp_ok($retry_after, '>', 3 * 3600 - 1200, 'not sooner');

is( $node->safe_psql(
		'postgres',
		"SELECT count(*) FROM idempotency.lookup('kept') "
		  . "UNION ALL SELECT count(*) FROM idempotency.lookup('orphan')"),
	"0\n0",
	'the records past their retention are absent for lookup');
is($node->safe_psql('postgres', 'SELECT idempotency.reap()'),
	'2', 'after a forward jump reap deletes the two expired records');
is( $node->safe_psql(
		'postgres',
		"SELECT string_agg(key, ',' ORDER BY key) FROM idempotency.keys"),
	'live,long,young',
	'the records within their retention remain');
is( $node->safe_psql(
		'postgres',
		"SELECT outcome, attempt FROM idempotency.claim('kept', '\\xbb')"),
	'new|1',
	'the reaped key is new again, for any fingerprint');

# Back to the real time: the new owner of live keeps its lease.
set_clock('+0');
cmp_ok(abs(clock_offset($node)), '<', 600, 'the server clock is back');
is( $node->safe_psql(
		'postgres', "SELECT outcome FROM idempotency.claim('live', '\\xaa')"),
	'in_progress',
	'after jumping back the lease of the new owner is not taken over');
is( $node->safe_psql('postgres', 'SELECT idempotency.reap()'),
	'0', 'after jumping back reap deletes nothing');
is($node->safe_psql('postgres', "SELECT idempotency.complete('live', $fence, 201)"),
	'stored', 'the new owner of live completes');

done_testing();
