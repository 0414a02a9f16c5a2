# Retry storm: several clients retry the same keys until each gets an
# answer; the one that owns a key writes its business effect (a row in
# charges) and completes in one transaction.  Meanwhile a nemesis terminates
# client backends at random and once kills the postmaster with -9.  At the
# end every key has exactly one business effect, and its stored response,
# and every response a client was given, names that effect.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib $FindBin::RealBin;

use IdemCrash;
use IPC::Run;
use List::Util qw(shuffle);
use POSIX ();
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(usleep);

my $nclients = 4;
# The clients go through the keys in windows of this many, all clients on
# the same window at about the same time, so that they contend.
my $window = 3;
# Bounds: a client gives up on a key after this many attempts, and the
# whole storm after this many seconds.
my $max_attempts = 400;
my $storm_seconds = 40;
# Backends the nemesis terminates (at least), before and after its kill -9,
# and keys completed (at least) before it lets the clients finish.
my $terminations_wanted = 8;
my $keys_wanted = 20;

my $node = idem_node('retry_storm');
# The default of 100 would do; fewer makes a leak of connections visible.
$node->append_conf('postgresql.conf', 'max_connections = 30');
idem_start($node);
$node->safe_psql(
	'postgres', q{
CREATE EXTENSION idempotency;
CREATE TABLE charges (id serial PRIMARY KEY, key text NOT NULL, scope text NOT NULL);
});

# One attempt of one client at one key, as an HTTP handler would make it:
# claim (with a one-second lease, sometimes waiting for the owner); if it
# owns the key, work for a while (sometimes longer than the lease, so that
# another client takes over) and then write the charge and complete in one
# transaction.  A fenced-out owner's complete fails with IK001 and takes
# its charge with it.
my $attempt_sql = "$PostgreSQL::Test::Utils::tmp_check/storm_attempt.sql";
PostgreSQL::Test::Utils::append_to_file(
	$attempt_sql, q{
\set ON_ERROR_STOP on
\set VERBOSITY verbose
SELECT outcome, fence, retry_after, outcome = 'new' AS is_new,
	convert_from(body, 'UTF8') AS body
FROM idempotency.claim(:'key', sha256(convert_to(:'key', 'UTF8')),
	scope => 'storm', lease => '1s', wait => :'wait') \gset
\if :is_new
SELECT pg_sleep(:delay);
BEGIN;
INSERT INTO charges (key, scope) VALUES (:'key', 'storm') RETURNING id \gset
SELECT idempotency.complete(:'key', :fence, 201,
	convert_to('charge ' || :id, 'UTF8'), scope => 'storm');
COMMIT;
\echo RESULT stored :id
\else
\echo RESULT :outcome :retry_after :body
\endif
});

my $connstr = $node->connstr('postgres') . ' application_name=storm';
my $resultdir = "$PostgreSQL::Test::Utils::tmp_check/storm";
mkdir $resultdir or die "could not create \"$resultdir\": $!";

# One client: window after window of keys, each key in its own order and
# retried until it is answered with stored or replay, until the nemesis is
# done.  Writes what it was told to its result file and leaves by _exit, so
# that no END block of the test runs in it.
sub run_client
{
	my ($client) = @_;
	my $deadline = time + $storm_seconds;
	srand($$ ^ time);
	open(my $log, '>', "$resultdir/client$client")
	  or POSIX::_exit(3);
	$log->autoflush(1);

	for (my $first = 1; !-e "$resultdir/stop"; $first += $window)
	{
		foreach my $key (shuffle(map { "k$_" } $first .. $first + $window - 1))
		{
			my $attempts = 0;
			until (attempt($log, $key))
			{
				POSIX::_exit(4)
				  if ++$attempts >= $max_attempts || time > $deadline;
				usleep(50_000 + int(rand(200_000)));
			}
		}
	}
	close $log;
	POSIX::_exit(0);
}

# One attempt at a key; logs what the client was told, and returns whether
# that was an answer (stored or replay) or the key must be retried.
sub attempt
{
	my ($log, $key) = @_;
	# An owner works a little, or longer than its lease.
	my $delay = rand() < 0.3 ? 1.0 + rand(0.6) : rand(0.3);
	my $wait = rand() < 0.5 ? '0' : '300ms';
	my ($out, $err) = ('', '');

	eval {
		IPC::Run::run(
			[
				'psql', '-X', '-q', '-A', '-t',
				'-v', "key=$key", '-v', "delay=$delay",
				'-v', "wait=$wait", '-f', $attempt_sql, '-d', $connstr
			],
			'<', \undef, '>', \$out, '2>', \$err,
			IPC::Run::timeout(20));
	};
	$err .= $@ if $@;

	if ($out =~ /^RESULT stored (\d+)$/m)
	{
		print $log "stored $key $1\n";
		return 1;
	}
	if ($out =~ /^RESULT replay \S+ charge (\d+)$/m)
	{
		print $log "replay $key $1\n";
		return 1;
	}
	if ($out =~ /^RESULT in_progress/m)
	{
		print $log "in_progress $key\n";
		return 0;
	}
	if ($out =~ /^RESULT .*$/m)
	{
		# Never right here: one fingerprint per key, and new is done above.
		print $log "wrong $key $&\n";
		return 1;
	}
	# The backend was terminated, the server is down, or the owner was
	# fenced out (IK001): the attempt left nothing behind.
	my $what = $err =~ /ERROR:  ([0-9A-Z]{5}):/ ? $1 : 'lost';
	print $log "error $key $what\n";
	return 0;
}

my %children;
foreach my $client (1 .. $nclients)
{
	my $pid = fork();
	die "fork failed: $!" unless defined $pid;
	run_client($client) if $pid == 0;
	$children{$pid} = $client;
}

# The nemesis: terminates random client backends every few hundred
# milliseconds; after the first few it kills the postmaster once, then goes
# on terminating.  When done and enough keys are completed, it tells the
# clients to finish their window.
my %exit_status;
my ($terminated, $crashed) = (0, 0);
my $storm_deadline = time + $storm_seconds + 10;
while (%children && time < $storm_deadline)
{
	usleep(200_000 + int(rand(400_000)));

	if (!$crashed && $terminated >= $terminations_wanted / 2)
	{
		idem_crash_restart($node);
		$crashed = 1;
	}
	elsif ($terminated < $terminations_wanted)
	{
		$terminated += $node->safe_psql(
			'postgres', q{
SELECT count(pg_terminate_backend(pid))
FROM (SELECT pid FROM pg_stat_activity
	  WHERE application_name = 'storm' AND pid <> pg_backend_pid()
	  ORDER BY random() LIMIT 1 + (random() * 2)::int) s});
	}
	elsif ($node->safe_psql('postgres',
			"SELECT count(*) >= $keys_wanted FROM idempotency.keys WHERE state = 'completed'") eq 't')
	{
		PostgreSQL::Test::Utils::append_to_file("$resultdir/stop", '');
	}

	while ((my $pid = waitpid(-1, POSIX::WNOHANG())) > 0)
	{
		$exit_status{ delete $children{$pid} } = $?;
	}
}
kill('KILL', keys %children);
foreach my $pid (keys %children)
{
	waitpid($pid, 0);
	$exit_status{ $children{$pid} } = 'killed at the deadline';
}

is(join(',', map { $exit_status{$_} } sort keys %exit_status),
	join(',', (0) x $nclients),
	'every client got an answer for every key it tried');
ok($crashed, 'the nemesis killed the postmaster');
cmp_ok($terminated, '>=', $terminations_wanted,
	'the nemesis terminated client backends');

# What the clients were told.
my (%told, %tally, @wrong);
foreach my $client (1 .. $nclients)
{
	open(my $fh, '<', "$resultdir/client$client") or die $!;
	while (<$fh>)
	{
		chomp;
		my ($what, $key, $detail) = split / /, $_, 3;
		$tally{$what}++;
		$tally{ "error $detail" }++ if $what eq 'error';
		push @wrong, $_ if $what eq 'wrong';
		push @{ $told{$key} }, $detail if $what eq 'stored' || $what eq 'replay';
	}
	close $fh;
}
note join(', ', map { "$_: $tally{$_}" } sort keys %tally);
is_deeply(\@wrong, [], 'no client got a mismatch or an unexpected outcome');

# The keys are those the clients were told about: every record of the
# scope, each completed.
my $nkeys = keys %told;
cmp_ok($nkeys, '>=', $keys_wanted, 'the clients went through keys');
is( $node->safe_psql(
		'postgres', q{
SELECT count(*) || ' records, ' || count(*) FILTER (WHERE state = 'completed') || ' completed'
FROM idempotency.keys WHERE scope = 'storm'}),
	"$nkeys records, $nkeys completed",
	'every key the clients used is completed');

# Exactly one business effect per key, and none without a key.
is( $node->safe_psql(
		'postgres', q{
SELECT count(*) || ' keys, ' || count(*) FILTER (WHERE n = 1) || ' with one charge'
FROM (SELECT k.key, (SELECT count(*) FROM charges c WHERE c.key = k.key) AS n
	  FROM idempotency.keys k WHERE k.scope = 'storm') s}),
	"$nkeys keys, $nkeys with one charge",
	'every key has exactly one charge');
is( $node->safe_psql(
		'postgres', q{
SELECT count(*) FROM charges c
WHERE NOT EXISTS (SELECT FROM idempotency.keys k
				  WHERE k.scope = 'storm' AND k.key = c.key)}),
	'0', 'no charge without its key');

# Its stored response names it.
is( $node->safe_psql(
		'postgres', q{
SELECT count(*)
FROM charges c
LEFT JOIN LATERAL idempotency.lookup(c.key, 'storm') r ON true
WHERE r.state IS DISTINCT FROM 'completed'
	OR r.status_code IS DISTINCT FROM 201
	OR r.body IS DISTINCT FROM convert_to('charge ' || c.id, 'UTF8')}),
	'0', 'every stored response names the key\'s one charge');

# And so did every answer a client got, stored or replayed.
my %charge_of = map { split /\|/ } split /\n/,
  $node->safe_psql('postgres', 'SELECT key, id FROM charges');
my @misnamed;
foreach my $key (sort keys %told)
{
	push @misnamed, map { "$key: told charge $_, has charge " . ($charge_of{$key} // 'none') }
	  grep { !defined $charge_of{$key} || $_ ne $charge_of{$key} } @{ $told{$key} };
}
is_deeply(\@misnamed, [], 'every answer a client got names the key\'s one charge');

note 'since the restart: '
  . $node->safe_psql('postgres',
	'SELECT takeovers, fence_rejections, waits FROM idempotency.stats');

$node->stop;
done_testing();
