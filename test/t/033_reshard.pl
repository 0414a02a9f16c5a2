# scripts/reshard doubles a PL/Proxy cluster from 2 to 4 partitions: while
# the new partitions are parked only the moving scopes fail; afterwards every
# record and business row sits on the shard shard_of(scope, 4) names,
# completed records replay through the proxy (and a second proxy), a claim's
# owner still completes it, and new fences, of a takeover or of a new key,
# are larger than any before the split.

use strict;
use warnings FATAL => 'all';
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(usleep);
use FindBin;
use lib $FindBin::RealBin;
use IdemProxy;

my $missing = proxy_requirements_missing();
plan skip_all => $missing if $missing;
plan skip_all => 'scripts/reshard needs psycopg 3 (Debian package python3-psycopg)'
  if system('/usr/bin/python3', '-c', 'import psycopg') != 0;

my $reshard = "$FindBin::RealBin/../../scripts/reshard";
my $c = proxy_cluster(shards => 4, partitions => 2);
my $proxy = $c->{proxy};
my @shards = @{ $c->{shards} };

# Runs $sql on the proxy.
sub on_proxy { return $proxy->safe_psql('postgres', $_[0]); }

# A second proxy database of the same cluster, which reshard must keep in step.
$proxy->safe_psql('postgres', 'CREATE DATABASE proxy2');
$proxy->safe_psql('proxy2',
	"CREATE EXTENSION idempotency_proxy CASCADE; "
	  . "CREATE SERVER idempotency FOREIGN DATA WRAPPER plproxy OPTIONS ("
	  . join(', ', map { "p$_ '" . partition_connstr($c, $_) . "'" } 0, 1) . "); "
	  . "CREATE USER MAPPING FOR PUBLIC SERVER idempotency OPTIONS (user 'idem_proxy')");
sub on_proxy2 { return $proxy->safe_psql('proxy2', $_[0]); }

# Runs scripts/reshard with these arguments; returns its exit status and output.
sub reshard
{
	my (@args) = @_;
	my ($out, $err);
	IPC::Run::run(
		[
			$reshard, '--table', 'public.charges:scope',
			'--proxy', $proxy->connstr('proxy2'), @args,
			$proxy->connstr('postgres'),
			partition_connstr($c, 2), partition_connstr($c, 3)
		],
		'>', \$out, '2>', \$err);
	note("reshard @args: $out$err");
	return ($? >> 8, $out . $err);
}

$_->safe_psql('postgres',
	'CREATE TABLE charges (scope text NOT NULL, key text NOT NULL, amount integer NOT NULL)')
  for @shards;

# 40 scopes, each with a completed record and its charge on its shard.
my @scopes = map { "tenant_$_" } 1 .. 40;
foreach my $scope (@scopes)
{
	my $fence = on_proxy("SELECT fence FROM idempotency.claim('paid', '\\x01', '$scope')");
	on_proxy("SELECT idempotency.complete('paid', $fence, 201, 'receipt $scope', scope => '$scope')");
	$shards[ on_proxy("SELECT idempotency.shard_of('$scope', 2)") ]->safe_psql('postgres',
		"INSERT INTO charges VALUES ('$scope', 'paid', 10)");
}

# Scopes that move (to partitions 2 and 3) and scopes that stay.
my %part4 = map { $_ => on_proxy("SELECT idempotency.shard_of('$_', 4)") } @scopes;
my @moving = grep { $part4{$_} >= 2 } @scopes;
my @staying = grep { $part4{$_} < 2 } @scopes;
ok(@moving >= 5 && @staying >= 5,
	scalar(@moving) . ' scopes move, ' . scalar(@staying) . ' stay');

# Claims in progress in moving scopes: one held for an hour, one whose lease ends soon.
my ($held, $lapsing) = @moving[ 0, 1 ];
my $held_fence = on_proxy(
	"SELECT fence FROM idempotency.claim('open', '\\x02', '$held', lease => '1 hour')");
my $lapsing_fence = on_proxy(
	"SELECT fence FROM idempotency.claim('open', '\\x02', '$lapsing', lease => '1 second')");
my @last_fence = map { $_->safe_psql('postgres', 'SELECT last_value FROM idempotency.fence_seq') }
  @shards[ 0, 1 ];
my $largest_fence = $last_fence[0] > $last_fence[1] ? $last_fence[0] : $last_fence[1];

# --- begin: the new partitions are parked.
my ($status, $output) = reshard('--step', 'begin');
is($status, 0, 'reshard begin succeeds');
my ($out, $err);
$proxy->psql('postgres',
	"\\set VERBOSITY verbose\nSELECT outcome FROM idempotency.claim('paid', '\\x01', '$moving[2]')",
	stdout => \$out, stderr => \$err);
like($err, qr/ERROR:  XX000: .*idempotency-resharding/,
	'while parked, a moving scope fails with a connection error');
$proxy->psql('proxy2',
	"\\set VERBOSITY verbose\nSELECT outcome FROM idempotency.claim('paid', '\\x01', '$moving[2]')",
	stdout => \$out, stderr => \$err);
like($err, qr/ERROR:  XX000: .*idempotency-resharding/, 'on the second proxy too');
is( on_proxy("SELECT outcome FROM idempotency.claim('paid', '\\x01', '$staying[0]')"),
	'replay', 'while parked, a staying scope answers from its shard');
($status, $output) = reshard('--step', 'begin');
isnt($status, 0, 'begin refuses to run twice');

# --- move waits for proxy transactions that may have routed by the old
# partitions, then moves; finish points the partitions at the new shards.
my $open_txn = $proxy->background_psql('postgres');
$open_txn->query_safe("BEGIN; SELECT idempotency.lookup('paid', '$staying[1]')");
($status, $output) = reshard('--step', 'move', '--drain-timeout', '1');
isnt($status, 0, 'move does not start while a proxy transaction older than it is open');
like($output, qr/proxy sessions still run transactions/, 'and says why');
$open_txn->query_safe('COMMIT');
$open_txn->quit;
($status, $output) = reshard('--step', 'move');
is($status, 0, 'reshard move succeeds');
($status, $output) = reshard('--step', 'move');
is($status, 0, 'a second move finds the rows copied and succeeds');
($status, $output) = reshard('--step', 'finish');
is($status, 0, 'reshard finish succeeds');
is( on_proxy(
		"SELECT count(*) FROM pg_options_to_table((SELECT srvoptions FROM pg_foreign_server "
		  . "WHERE srvname = 'idempotency')) WHERE option_name LIKE 'p%'"),
	'4', 'the server has 4 partitions');

# Every row is on the shard the rule names, and none was lost.
my ($records, $charges) = (0, 0);
foreach my $i (0 .. 3)
{
	my ($n, $misplaced) = split /\|/, $shards[$i]->safe_psql('postgres',
		"SELECT count(*), count(*) FILTER (WHERE idempotency.shard_of(scope, 4) <> $i) FROM idempotency.keys");
	my ($m, $misplaced_charges) = split /\|/, $shards[$i]->safe_psql('postgres',
		"SELECT count(*), count(*) FILTER (WHERE idempotency.shard_of(scope, 4) <> $i) FROM charges");
	is("$misplaced/$misplaced_charges", '0/0',
		"shard $i holds only its own scopes ($n records, $m charges)");
	$records += $n;
	$charges += $m;
}
is($records, 42, 'every record is kept');
is($charges, 40, 'every charge is kept');

# Records claimed before the split replay through the proxy after it.
my @replays = grep {
	on_proxy("SELECT outcome, convert_from(body, 'UTF8') FROM idempotency.claim('paid', '\\x01', '$_')")
	  eq "replay|receipt $_"
} @scopes;
is(scalar(@replays), 40, 'every completed record replays through the proxy');
is( on_proxy2(
		"SELECT count(*) FROM pg_options_to_table((SELECT srvoptions FROM pg_foreign_server "
		  . "WHERE srvname = 'idempotency')) WHERE option_name LIKE 'p%'"),
	'4', 'the second proxy has 4 partitions too');
is(on_proxy2("SELECT outcome FROM idempotency.claim('paid', '\\x01', '$moving[2]')"),
	'replay', 'and replays a moved scope from its new shard');

# The owner of a claim made before the split completes it after.
is( on_proxy(
		"SELECT idempotency.complete('open', $held_fence, 200, 'late', scope => '$held')"),
	'stored', "a claim's owner completes it after the split");

# A takeover after the split gets a larger fence than any before it.
usleep(1_100_000);
my ($outcome, $fence, $attempt) = split /\|/, on_proxy(
	"SELECT outcome, fence, attempt FROM idempotency.claim('open', '\\x02', '$lapsing')");
is("$outcome/$attempt", 'new/2', 'a retry takes over the lapsed claim on its new shard');
ok($fence > $largest_fence,
	"the takeover's fence $fence is larger than every fence before the split ($largest_fence)");
is(sqlstate_of($proxy,
	"SELECT idempotency.complete('open', $lapsing_fence, 200, 'stale', scope => '$lapsing')"),
	'IK001', 'the old owner is fenced out');
# A new key in a moved scope draws from the new shard's sequence, which the
# move set above the source's (a takeover alone draws above the old fence).
my $source_fence = $last_fence[ $part4{ $moving[3] } - 2 ];
my $new_fence = on_proxy("SELECT fence FROM idempotency.claim('fresh', '\\x03', '$moving[3]')");
ok($new_fence > $source_fence,
	"a new key's fence $new_fence on a new shard is larger than every fence of its source ($source_fence)");

proxy_stop($c);
done_testing();
