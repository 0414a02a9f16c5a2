# The metrics of idempotency.stats through Debian's prometheus-postgres-exporter
# and the queries file the repository ships (contrib/prometheus/queries.yaml):
# the exporter, listening on 127.0.0.1 and connected as a role that has only
# pg_monitor, serves every metric with its type, and the values are those of
# the view.  Skipped, saying why, where the exporter is not installed.

use strict;
use warnings FATAL => 'all';
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use FindBin;
use lib $FindBin::RealBin;
use IdemCrash;
use HTTP::Tiny;
use IPC::Run;
use Time::HiRes qw(usleep);

my $exporter = '/usr/bin/prometheus-postgres-exporter';
plan skip_all => "$exporter is not installed (Debian package prometheus-postgres-exporter)"
  unless -x $exporter;
my $queries = "$FindBin::RealBin/../../contrib/prometheus/queries.yaml";

my $node = idem_node('prometheus');
$node->append_conf('postgresql.conf', "idempotency.reaper_naptime = '1h'");
idem_start($node);
$node->safe_psql('postgres', q{
	CREATE EXTENSION idempotency;
	CREATE ROLE idem_exporter LOGIN IN ROLE pg_monitor;
	SELECT idempotency.stats_reset();
});

# Something to count: two new claims, a replay, a mismatch, an in_progress,
# a fence rejection; one record left in progress.
my $f1 = $node->safe_psql('postgres', q{SELECT fence FROM idempotency.claim('m1', '\x01')});
$node->safe_psql('postgres', "SELECT idempotency.complete('m1', $f1, 201)");
$node->safe_psql('postgres', q{SELECT idempotency.claim('m1', '\x01')});
$node->safe_psql('postgres', q{SELECT idempotency.claim('m1', '\x02')});
my $f2 = $node->safe_psql('postgres',
	q{SELECT fence FROM idempotency.claim('m2', '\x01', lease => '1h')});
$node->safe_psql('postgres', q{SELECT idempotency.claim('m2', '\x01')});
is(idem_sqlstate($node, "SELECT idempotency.complete('m2', $f2 - 1, 200)"),
	'IK001', 'a stale fence is refused');

# For the stuck-request alert: a handler that crashed 5 minutes ago (its
# lease ended, nobody took it over) counts; a key abandoned 2 hours ago,
# still kept for its retention, does not; nor does m2, whose lease runs.
# Their leases are moved back with plain SQL, which the library's figures
# see only through a recount: then the figure is the library's (exact),
# not the count of a small table that an inexact one falls back to.
for my $k ([ 'crashed', '5 minutes' ], [ 'abandoned', '2 hours' ])
{
	$node->safe_psql('postgres',
		"SELECT idempotency.claim('$k->[0]', '\\x01', lease => '1s', retention => '1 day')");
	$node->safe_psql('postgres', qq{
		UPDATE idempotency.keys SET lease_expires_at = now() - interval '$k->[1]'
		WHERE key = '$k->[0]'});
}
is($node->safe_psql('postgres', 'SELECT idempotency.stats_recount()'),
	't', 'the figures are counted (exact) before the exporter reads them');

my $port = PostgreSQL::Test::Cluster::get_free_port();
my ($out, $err) = ('', '');
my $dsn = sprintf('host=%s port=%d user=idem_exporter dbname=postgres sslmode=disable',
	$node->host, $node->port);
local $ENV{DATA_SOURCE_NAME} = $dsn;
my $h = IPC::Run::start(
	[
		$exporter, "--extend.query-path=$queries",
		'--disable-default-metrics', '--disable-settings-metrics',
		"--web.listen-address=127.0.0.1:$port", '--log.level=warn'
	],
	'>', \$out, '2>', \$err);

# Scrapes until the exporter answers with our metrics (it takes a moment to
# listen), within the suite's timeout.
my $http = HTTP::Tiny->new(timeout => 10);
my $body = '';
my $deadline = time() + $PostgreSQL::Test::Utils::timeout_default;
while (time() < $deadline)
{
	my $r = $http->get("http://127.0.0.1:$port/metrics");
	if ($r->{success} && $r->{content} =~ /^idempotency_rows_in_progress[{ ]/m)
	{
		$body = $r->{content};
		last;
	}
	usleep(200_000);
}
$h->kill_kill;
isnt($body, '', 'the exporter serves the metrics of idempotency.stats')
  or diag("exporter stderr: $err");

my (%type, %value);
for (split /\n/, $body)
{
	$type{$1} = $2 if /^# TYPE (idempotency_\w+) (\w+)$/;
	$value{$1} = $2 if /^(idempotency_\w+)(?:\{[^}]*\})? (\S+)$/;
}

my $stats = $node->safe_psql('postgres', q{
	SELECT claims_new, claims_replay, claims_mismatch, claims_in_progress, completes_stored,
		fence_rejections, rows_in_progress, extract(epoch FROM oldest_lease_expires_at)
	FROM idempotency.stats});
is($value{idempotency_leases_ended_unclaimed}, '1',
	'only the lease that ended recently counts as stuck, not the key abandoned hours ago');
is( $node->safe_psql(
		'postgres', q{
SELECT live_figures_exact,
       idempotency._stats_gauges_leases_ended('idempotency.keys',
           now() - interval '15 minutes', now() - interval '1 minute')
FROM idempotency.stats}),
	't|1',
	"the exporter's figure is the library's, counted from shared memory");
is($type{idempotency_leases_ended_unclaimed}, 'gauge', 'idempotency_leases_ended_unclaimed is a gauge');

# A scrape scans nothing of the table, whatever its size (before 1.6's
# leases_ended the query counted in_flight, a scan of the table): the
# queries file's query, run as the exporter's role, starts no scan of the
# table or of its indexes in its transaction.
my ($query) = slurp_file($queries) =~ /^  query: \|\n((?:    .*\n)+)/m;
ok(defined $query, "the queries file's query is read");
my @scan_lines = split /\n/, $node->safe_psql(
	'postgres', qq{
BEGIN;
SET LOCAL ROLE idem_exporter;
$query;
RESET ROLE;
SELECT sum(pg_stat_get_xact_numscans(r.oid))
FROM (SELECT 'idempotency.keys'::regclass::oid AS oid
	  UNION ALL SELECT indexrelid FROM pg_index WHERE indrelid = 'idempotency.keys'::regclass) r;
COMMIT;});
is($scan_lines[-1], '0', 'the scrape scans neither the table nor its indexes');
my %expected;
@expected{
	qw(claims_new_total claims_replay_total claims_mismatch_total claims_in_progress_total
	  completes_stored_total fence_rejections_total rows_in_progress
	  oldest_lease_expires_timestamp_seconds)
} = split /\|/, $stats;
is_deeply(
	[ @expected{qw(claims_new_total claims_replay_total claims_mismatch_total
		  claims_in_progress_total completes_stored_total fence_rejections_total rows_in_progress)} ],
	[ 4, 1, 1, 1, 1, 1, 3 ],
	'the view counted the calls');

for my $name (sort keys %expected)
{
	my $want = $name =~ /_total$/ ? 'counter' : 'gauge';
	is($type{"idempotency_$name"}, $want, "idempotency_$name is a $want");
	ok(defined $value{"idempotency_$name"}
		  && abs($value{"idempotency_$name"} - $expected{$name}) < 0.001,
		"idempotency_$name is the view's value ($expected{$name})");
}
for my $name (qw(claims_resumed_total takeovers_total waits_total completes_released_total
	releases_total reaped_total reaper_runs_total))
{
	is($type{"idempotency_$name"}, 'counter', "idempotency_$name is a counter");
}
for my $name (qw(rows_estimate reaper_error last_reap_timestamp_seconds
	stats_reset_timestamp_seconds))
{
	is($type{"idempotency_$name"}, 'gauge', "idempotency_$name is a gauge");
}
is($value{idempotency_reaper_error}, '0', 'no reaper error');

# Every metric the alerting rules name is one the exporter serves.
my $alerts = slurp_file("$FindBin::RealBin/../../contrib/prometheus/alerts.yaml");
my %named = map { $_ => 1 } $alerts =~ /\b(idempotency_\w+)/g;
ok(scalar(keys %named) >= 6, 'alerts.yaml names the metrics');
for my $name (sort keys %named)
{
	ok(defined $type{$name}, "alerts.yaml's $name is served by the exporter");
}
cmp_ok($value{idempotency_rows_estimate}, '>=', 1,
	'the estimate of the records counts at least those in progress');

$node->stop;
done_testing();
