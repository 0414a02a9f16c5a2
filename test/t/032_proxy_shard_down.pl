# A PL/Proxy cluster with a shard down: only the scopes on that shard fail,
# with the error an HTTP layer maps to 503, and they work again once the
# shard is back.  Each shard's background reaper expires its own records.

use strict;
use warnings FATAL => 'all';
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use FindBin;
use lib $FindBin::RealBin;
use IdemProxy;

my $missing = proxy_requirements_missing();
plan skip_all => $missing if $missing;

my $c = proxy_cluster(shards => 2, naptime => '1s');
my $proxy = $c->{proxy};
my @shards = @{ $c->{shards} };

# Runs $sql on the proxy.
sub on_proxy { return $proxy->safe_psql('postgres', $_[0]); }

# Scopes on shard 0 ('' and 'a') and on shard 1 ('acct_42' and 'acct_17').
my @on0 = ('', 'a');
my @on1 = ('acct_42', 'acct_17');
is( on_proxy(
		"SELECT string_agg(idempotency.shard_of(s, 2)::text, ',') FROM (VALUES ('a'), ('acct_42')) v(s)"),
	'0,1', 'the scopes used here are where the test expects them');

# Claims and completes one key in $scope through the proxy.
sub claim_complete
{
	my ($key, $scope) = @_;
	my $fence = on_proxy(
		"SELECT fence FROM idempotency.claim('$key', '\\x01', '$scope')");
	return on_proxy(
		"SELECT idempotency.complete('$key', $fence, 201, 'kept', scope => '$scope')");
}
is(claim_complete('before', $_), 'stored', "a record in scope '$_' before the stop")
  for (@on0, @on1);

# Runs a claim in $scope through the proxy that must fail; returns its error.
sub failed_claim
{
	my ($scope) = @_;
	my ($out, $err);
	my $ret = $proxy->psql('postgres',
		"\\set VERBOSITY verbose\nSELECT outcome FROM idempotency.claim('during', '\\x01', '$scope')",
		stdout => \$out, stderr => \$err);
	return $ret == 0 ? 'no error' : (split /\n/, $err)[0];
}

# Whether the proxy reaches the shard of $scope.
sub reaches
{
	my ($scope) = @_;
	return $proxy->psql('postgres', "SELECT idempotency.lookup('before', '$scope')") == 0;
}

# --- Shard 1 stops: its scopes fail, shard 0's keep working.  Through
# pgbouncer the error is pgbouncer's, relayed by PL/Proxy with SQLSTATE 08P01.
$shards[1]->stop('fast');
like(failed_claim($_), qr/ERROR:  08P01: .*\[shard1\] REMOTE FATAL: /,
	"a claim in scope '$_' fails while its shard is down, with 08P01 from pgbouncer")
  for @on1;
is(claim_complete('during', $_), 'stored',
	"a claim and complete in scope '$_' on the other shard work") for @on0;

# --- Shard 1 is back: its scopes work again, and nothing was lost.
$shards[1]->start;
ok(wait_until(sub { reaches('acct_42') }, 'the proxy reaches shard 1 again'),
	'after the restart the proxy reaches the shard again');
is( on_proxy(
		"SELECT outcome, convert_from(body, 'UTF8') FROM idempotency.claim('before', '\\x01', '$_')"),
	'replay|kept', "scope '$_' replays its record from before the stop")
  for @on1;
is(claim_complete('after', $_), 'stored', "scope '$_' takes new claims") for @on1;

# --- Without pgbouncer, PL/Proxy's own connection error is XX000.
set_partitions($c, partition_connstr($c, 0),
	'host=127.0.0.1 port=' . $shards[1]->port . ' dbname=postgres');
ok(reaches('acct_42'), 'the proxy reaches shard 1 directly');
$shards[1]->stop('fast');
like(failed_claim('acct_42'), qr/ERROR:  XX000: PL\/Proxy function idempotency._proxy_claim\(7\): .*connection to server at "127.0.0.1", port \d+ failed/,
	'connecting directly, a stopped shard is XX000 from PL/Proxy');
ok(reaches(''), 'the other shard still answers');
$shards[1]->start;
ok(reaches('acct_42'), 'the restarted shard answers at the next call');

# --- Each shard's reaper expires the records of its own scopes.
my @reaped_before = map {
	$_->safe_psql('postgres', 'SELECT reaped FROM idempotency.stats')
} @shards;
on_proxy(join ";\n",
	map { "SELECT idempotency.claim('short', '\\x01', '$_', lease => '100 ms', retention => '200 ms')" }
	  (@on0, @on1));
is( join(',', map { $_->safe_psql('postgres',
	"SELECT count(*) FROM idempotency.keys WHERE key = 'short'") } @shards),
	'2,2', 'two short-lived records on each shard');
foreach my $i (0, 1)
{
	ok( wait_until(
			sub {
				$shards[$i]->safe_psql('postgres',
					"SELECT count(*) FROM idempotency.keys WHERE key = 'short'") eq '0';
			},
			"shard $i reaps"),
		"shard $i\'s reaper deleted its expired records");
	ok( $shards[$i]->safe_psql('postgres', 'SELECT reaped FROM idempotency.stats') >=
		  $reaped_before[$i] + 2,
		"shard $i\'s statistics count them");
}
is( join(',', map { $_->safe_psql('postgres',
	"SELECT count(*) FROM idempotency.keys WHERE key IN ('before', 'after')") } @shards),
	'2,4', 'the records still in retention are kept');

proxy_stop($c);
done_testing();
