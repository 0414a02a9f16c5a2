# Behind pgbouncer in transaction pooling with one server connection, clients
# whose transactions interleave on that connection get the right answers,
# and the API leaves no session state behind: no locks, no settings, no
# temporary tables, no LISTEN.  SET LOCAL idempotency.scope is per request.

use strict;
use warnings FATAL => 'all';
use IPC::Run;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(usleep);

my ($pgbouncer) = grep { -x $_ }
  ((map { "$_/pgbouncer" } split /:/, ($ENV{PATH} // '')), '/usr/sbin/pgbouncer');
plan skip_all => 'pgbouncer is not installed (Debian package pgbouncer)'
  unless $pgbouncer;

my $node = PostgreSQL::Test::Cluster->new('main');
$node->init;
$node->append_conf('postgresql.conf',
	"shared_preload_libraries = 'idempotency'");
$node->append_conf('postgresql.conf', "idempotency.reaper_naptime = '1h'");
$node->start;
$node->safe_psql('postgres', 'CREATE EXTENSION idempotency');

# pgbouncer listens on a Unix socket of its own and reaches the node through
# the node's socket.
my $dir = PostgreSQL::Test::Utils::tempdir_short;
my $port = PostgreSQL::Test::Cluster::get_free_port();
my $user = getpwuid($<);
my $node_host = $node->host;
my $node_port = $node->port;
append_to_file("$dir/userlist.txt", qq{"$user" ""\n});
append_to_file(
	"$dir/pgbouncer.ini", qq{[databases]
postgres = host=$node_host port=$node_port dbname=postgres

[pgbouncer]
unix_socket_dir = $dir
listen_port = $port
auth_type = trust
auth_file = $dir/userlist.txt
pool_mode = transaction
default_pool_size = 1
reserve_pool_size = 0
max_client_conn = 20
logfile = $PostgreSQL::Test::Utils::log_path/011_pgbouncer_pgbouncer.log
pidfile = $dir/pgbouncer.pid
});
my $bouncer = IPC::Run::start([ $pgbouncer, "$dir/pgbouncer.ini" ],
	'>', \my $bouncer_out, '2>', \my $bouncer_err);
END { $bouncer->kill_kill if $bouncer; }
for (1 .. 100)
{
	last if -S "$dir/.s.PGSQL.$port";
	usleep(100_000);
}
ok(-S "$dir/.s.PGSQL.$port", 'pgbouncer listens')
  or BAIL_OUT("pgbouncer did not start: $bouncer_err");

# A psql client that stays connected to pgbouncer.
sub client
{
	my %client = (in => '', out => '', err => '', count => 0);
	$client{run} = IPC::Run::start(
		[
			$node->installed_command('psql'), '-XAtq',
			'-v', 'ON_ERROR_STOP=0', '-v', 'VERBOSITY=verbose',
			'-d', "host=$dir port=$port dbname=postgres"
		],
		'<', \$client{in}, '>', \$client{out}, '2>', \$client{err},
		IPC::Run::timeout(60));
	return \%client;
}

# Sends $sql to $client without waiting for its answer.
sub send_sql
{
	my ($client, $sql) = @_;
	my $mark = 'done ' . ++$client->{count};
	$client->{mark} = $mark;
	$client->{in} .= "$sql\n;\n\\echo '$mark'\n\\warn '$mark'\n";
	$client->{run}->pump_nb;
	return;
}

# Waits for the answer to what was last sent to $client; returns stdout, dies on an error.
sub result
{
	my ($client) = @_;
	my $mark = qr/\Q$client->{mark}\E\n/;
	$client->{run}->pump until $client->{out} =~ $mark && $client->{err} =~ $mark;
	(my $out = $client->{out}) =~ s/$mark//;
	(my $err = $client->{err}) =~ s/$mark//;
	$client->{out} = $client->{err} = '';
	die "query failed: $err" if $err =~ /ERROR/;
	chomp $out;
	return $out;
}

# Runs $sql through $client and returns its output.
sub run_sql
{
	my ($client, $sql) = @_;
	send_sql($client, $sql);
	return result($client);
}

# Runs $sql through $client in one transaction that sets the scope locally.
sub in_scope
{
	my ($client, $scope, $sql) = @_;
	return run_sql($client,
		"BEGIN;\nSET LOCAL idempotency.scope = '$scope';\n$sql;\nCOMMIT;");
}

my ($ca, $cb, $cc) = (client(), client(), client());

# Every client talks to the same, single server connection.
my $server_pid = run_sql($ca, 'SELECT pg_backend_pid()');
is(run_sql($cb, 'SELECT pg_backend_pid()'), $server_pid,
	'the second client shares the server connection');
is(run_sql($cc, 'SELECT pg_backend_pid()'), $server_pid,
	'the third client shares the server connection');

# Returns every setting of the server connection, as client $client sees them.
sub settings
{
	my ($client) = @_;
	my %setting = map { split /\|/, $_, 2 } split /\n/,
	  run_sql($client,
		"SELECT name, setting FROM pg_settings WHERE name <> 'application_name'");
	return \%setting;
}
my $settings_before = settings($ca);

# Three clients claim the same key, each in its own scope, one after the other
# on the one server connection.
my ($outcome, $fence_a) = split /\|/,
  in_scope($ca, 'acct_a',
	"SELECT outcome, fence FROM idempotency.claim('order-1', '\\xaa')");
is($outcome, 'new', 'client a claims order-1 in acct_a');
my $fence_b;
($outcome, $fence_b) = split /\|/,
  in_scope($cb, 'acct_b',
	"SELECT outcome, fence FROM idempotency.claim('order-1', '\\xbb')");
is($outcome, 'new', 'client b claims order-1 in acct_b: scopes never meet');
my $fence_c;
($outcome, $fence_c) = split /\|/,
  run_sql($cc,
	"SELECT outcome, fence FROM idempotency.claim('order-1', '\\xcc')");
is($outcome, 'new',
	'client c, which sets no scope, claims order-1 unscoped: no scope leaked');
is(run_sql($cc, "SELECT current_setting('idempotency.scope')"),
	'', 'the scope set by SET LOCAL is gone after the transaction');

# Three claims are in progress, and the server connection holds nothing.
is( $node->safe_psql(
		'postgres',
		"SELECT state, (SELECT count(*) FROM pg_locks WHERE pid = $server_pid) "
		  . "FROM pg_stat_activity WHERE pid = $server_pid"),
	'idle|0',
	'with claims in progress the server connection is idle and holds no lock');
is( $node->safe_psql(
		'postgres', "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"),
	'0',
	'no advisory locks are held');

# The retry of a's request arrives through client b while a still works on it.
is( in_scope(
		$cb, 'acct_a',
		"SELECT outcome, retry_after >= 1 FROM idempotency.claim('order-1', '\\xaa')"),
	'in_progress|t',
	'client b sees order-1 of acct_a in progress');
is( in_scope(
		$ca, 'acct_a',
		"SELECT idempotency.complete('order-1', $fence_a, 201, 'created')"),
	'stored',
	'client a completes order-1');
is( in_scope(
		$cc, 'acct_a',
		"SELECT outcome, status_code, convert_from(body, 'UTF8') "
		  . "FROM idempotency.claim('order-1', '\\xaa')"),
	'replay|201|created',
	'client c replays order-1 of acct_a');
is( in_scope(
		$cc, 'acct_a', "SELECT outcome FROM idempotency.claim('order-1', '\\xdd')"),
	'mismatch',
	'client c gets a mismatch for another fingerprint');
is( in_scope(
		$ca, 'acct_b',
		"SELECT idempotency.complete('order-1', $fence_b, 200, 'b')"),
	'stored',
	'client a completes the claim client b made in acct_b');
is( $node->safe_psql(
		'postgres', "SELECT idempotency.complete('order-1', $fence_c, 200, 'c')"),
	'stored',
	'a direct connection completes the unscoped claim client c made');
is( $node->safe_psql(
		'postgres',
		"SELECT string_agg(scope || ':' || state || ':' || convert_from(body, 'UTF8'), "
		  . "',' ORDER BY scope) FROM idempotency.keys WHERE key = 'order-1'"),
	':completed:c,acct_a:completed:created,acct_b:completed:b',
	'each scope holds its own response');

# A claim that waits holds the server connection; the owner, elsewhere,
# completes, and the waiter replays.
my $fence_w = in_scope($ca, 'acct_a',
	"SELECT fence FROM idempotency.claim('order-2', '\\xaa')");
send_sql($cb,
	    "BEGIN;\nSET LOCAL idempotency.scope = 'acct_a';\n"
	  . "SELECT outcome, status_code FROM idempotency.claim('order-2', '\\xaa', "
	  . "wait => '20s');\nCOMMIT;");
my $waiting = 0;
for (1 .. 100)
{
	$waiting = $node->safe_psql('postgres',
		"SELECT count(*) FROM pg_stat_activity WHERE pid = $server_pid "
		  . "AND state = 'active' AND query LIKE '%order-2%'");
	last if $waiting;
	usleep(100_000);
}
is($waiting, '1', 'client b waits for order-2 on the server connection');
is( $node->safe_psql(
		'postgres',
		"SET idempotency.scope = 'acct_a'; "
		  . "SELECT idempotency.complete('order-2', $fence_w, 201, 'two')"),
	'stored',
	'the owner of order-2 completes on a direct connection');
is(result($cb), 'replay|201', 'the waiting client b replays order-2');

# Nothing is left on the server connection.
is_deeply(settings($cc), $settings_before,
	'no setting changed on the server connection');
is( $node->safe_psql(
		'postgres',
		"SELECT state, (SELECT count(*) FROM pg_locks WHERE pid = $server_pid) "
		  . "FROM pg_stat_activity WHERE pid = $server_pid"),
	'idle|0',
	'the server connection is idle and holds no lock');
is( $node->safe_psql(
		'postgres', "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"),
	'0',
	'no advisory locks are held');
is( run_sql(
		$ca,
		"SELECT (SELECT count(*) FROM pg_listening_channels()), "
		  . "(SELECT count(*) FROM pg_class WHERE relpersistence = 't'), "
		  . "(SELECT count(*) FROM pg_prepared_statements)"),
	'0|0|0',
	'no LISTEN, temporary tables or prepared statements remain');

# Controls: session state does survive from client to client here, so the
# checks above would see it.
run_sql($cc, "SET idempotency.scope = 'acct_leak'");
is(run_sql($ca, "SELECT current_setting('idempotency.scope')"),
	'acct_leak', 'control: a plain SET leaks to the next client');
run_sql($ca, 'RESET idempotency.scope');
run_sql($cc, 'SELECT pg_advisory_lock(42)');
is( $node->safe_psql(
		'postgres', "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"),
	'1',
	'control: a session advisory lock stays on the server connection');
run_sql($cb, 'SELECT pg_advisory_unlock(42)');

$_->{in} .= "\\q\n", $_->{run}->finish for ($ca, $cb, $cc);
$bouncer->signal('TERM');
$bouncer->finish;
undef $bouncer;

done_testing();
