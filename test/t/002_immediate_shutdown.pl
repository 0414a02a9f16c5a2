# Immediate shutdown under load: pgbench clients claim and complete fresh
# keys with synchronous_commit on, the server is stopped with -m immediate
# while they run, and after the restart every complete a client saw
# acknowledged is there, byte for byte.  What the clients saw comes from
# pgbench's per-transaction log: it writes a line only once the whole script
# (claim, then complete) has returned.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib $FindBin::RealBin;

use IdemCrash;
use IPC::Run;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(usleep);

my $clients = 6;
# Acknowledged completes to see before the shutdown.
my $min_acked = 6000;
# Bound on the load phase.
my $max_seconds = 40;

my $node = idem_node('shutdown_load');
$node->append_conf('postgresql.conf', 'synchronous_commit = on');
# pgbench would flood the log.
$node->append_conf('postgresql.conf', 'log_statement = none');
idem_start($node);

# body_for() gives each key its own response: 35 to 6435 bytes that do not
# compress, so that large ones are stored out of line in TOAST.
$node->safe_psql(
	'postgres', q{
CREATE EXTENSION idempotency;
CREATE FUNCTION body_for(k text) RETURNS bytea
LANGUAGE sql IMMUTABLE STRICT AS $$
	SELECT convert_to(k || E'\n', 'UTF8')
		|| string_agg(sha256(convert_to(k || ':' || i, 'UTF8')), ''::bytea ORDER BY i)
	FROM generate_series(1, 1 + abs(hashtext(k)) % 200) AS i
$$;
CREATE TABLE acked (key text PRIMARY KEY);
});

# Each client numbers its transactions (n persists across them), so the
# key of each is known: c<client>-<n>.  Claim and complete are separate
# autocommit statements, as in an HTTP handler.
my $script = "$PostgreSQL::Test::Utils::tmp_check/claim_complete.sql";
PostgreSQL::Test::Utils::append_to_file(
	$script, q{
\set n :n + 1
SELECT fence
FROM idempotency.claim('c' || :client_id || '-' || :n,
	sha256(convert_to('c' || :client_id || '-' || :n, 'UTF8'))) \gset
SELECT idempotency.complete('c' || :client_id || '-' || :n, :fence, 201,
	body_for('c' || :client_id || '-' || :n),
	jsonb_build_object('x-key', 'c' || :client_id || '-' || :n));
});

my $logdir = "$PostgreSQL::Test::Utils::tmp_check/pgbench_shutdown";
mkdir $logdir or die "could not create \"$logdir\": $!";

my ($out, $err) = ('', '');
my $pgbench = IPC::Run::start(
	[
		'pgbench', '-n', '-c', $clients, '-j', 2,
		'-T', $max_seconds, '-D', 'n=0', '-f', $script, '-l',
		'--log-prefix', "$logdir/txn",
		'-h', $node->host, '-p', $node->port, 'postgres'
	],
	'>', \$out, '2>', \$err,
	IPC::Run::timeout($max_seconds + 30));

# Under load (enough completes), then the immediate shutdown: SIGQUIT, no
# checkpoint, crash recovery at the next start.
my $deadline = time + $max_seconds;
until ($node->safe_psql('postgres',
		"SELECT count(*) >= $min_acked FROM idempotency.keys WHERE state = 'completed'") eq 't')
{
	die "pgbench ended early: $err" unless $pgbench->pumpable;
	die "pgbench did not complete $min_acked keys in $max_seconds s" if time > $deadline;
	usleep(100_000);
}
$node->stop('immediate');

# The clients abort on the lost connections; pgbench writes its logs out
# and exits.
$pgbench->finish;
note "pgbench stderr (tail): " . substr($err, -600);

# Every line in the log is a transaction whose complete was acknowledged.
my %acked_per_client;
foreach my $file (glob("$logdir/txn*"))
{
	open(my $fh, '<', $file) or die "could not open \"$file\": $!";
	while (my $line = <$fh>)
	{
		# client_id transaction_no time script_no time_epoch time_us
		my ($client, $txn, $latency) = split ' ', $line;
		die "unexpected pgbench log line: $line" unless $latency =~ /^\d+$/;
		push @{ $acked_per_client{$client} }, $txn;
	}
	close $fh;
}

# A client's transactions run one after another, so its acknowledged ones
# are its first ones: keys c<client>-1 .. c<client>-<count>.
my @acked;
foreach my $client (sort keys %acked_per_client)
{
	my @txns = sort { $a <=> $b } @{ $acked_per_client{$client} };
	die "client $client logged transactions out of sequence"
	  unless $txns[-1] - $txns[0] == $#txns;
	push @acked, map { "c$client-$_" } 1 .. scalar(@txns);
}
cmp_ok(scalar(@acked), '>=', $min_acked,
	'pgbench logged the acknowledged completes');
note scalar(@acked) . ' completes acknowledged before the shutdown';

idem_start($node);

$node->safe_psql('postgres',
	'INSERT INTO acked VALUES ' . join(',', map { "('$_')" } @acked));

# Every acknowledged complete is there: completed, with its body and headers.
is( $node->safe_psql(
		'postgres', q{
SELECT count(*)
FROM acked a
LEFT JOIN LATERAL idempotency.lookup(a.key) r ON true
WHERE r.state IS DISTINCT FROM 'completed'
	OR r.status_code IS DISTINCT FROM 201
	OR r.body IS DISTINCT FROM body_for(a.key)
	OR r.headers IS DISTINCT FROM jsonb_build_object('x-key', a.key)}),
	'0', 'every acknowledged complete survived the immediate shutdown');

# And each replays byte for byte.
is( $node->safe_psql(
		'postgres', q{
SELECT count(*)
FROM acked a,
	idempotency.claim(a.key, sha256(convert_to(a.key, 'UTF8'))) c
WHERE c.outcome <> 'replay' OR c.body IS DISTINCT FROM body_for(a.key)}),
	'0', 'every acknowledged complete replays byte for byte');

# Completes in flight at the shutdown may or may not have committed, but
# nothing is half there: every completed record holds its whole response.
is( $node->safe_psql(
		'postgres', q{
SELECT count(*)
FROM idempotency.keys k
WHERE k.state = 'completed' AND k.body IS DISTINCT FROM body_for(k.key)}),
	'0', 'every completed record holds its whole body');
note 'completed but not seen acknowledged: '
  . $node->safe_psql(
	'postgres', q{
SELECT count(*) FROM idempotency.keys k
WHERE k.state = 'completed' AND NOT EXISTS (SELECT FROM acked a WHERE a.key = k.key)});

$node->stop;
done_testing();
