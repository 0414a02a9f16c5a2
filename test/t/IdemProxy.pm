# Helpers shared by the PL/Proxy TAP tests: shards that preload the library,
# a pgbouncer in transaction pooling in front of them, and a proxy database
# with idempotency_proxy whose SQL/MED server "idempotency" reaches the shards
# through pgbouncer.  Everything listens on 127.0.0.1.

package IdemProxy;

use strict;
use warnings FATAL => 'all';

use Exporter 'import';
use IO::Socket::INET;
use IPC::Run;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(usleep);

# The pgbouncers started here, stopped however the test ends.
my @bouncers;
END { $_->kill_kill for @bouncers; }

our @EXPORT = qw(proxy_requirements_missing proxy_cluster proxy_stop
  partition_connstr set_partitions sqlstate_of wait_until psql_start psql_finish);

# Says what is missing for these tests (PL/Proxy, pgbouncer), or '' when nothing.
sub proxy_requirements_missing
{
	my $sharedir = `pg_config --sharedir`;
	my ($major) = `pg_config --version` =~ /PostgreSQL (\d+)/;
	chomp $sharedir;
	return "PL/Proxy is not installed (Debian package postgresql-$major-plproxy"
	  . ($major >= 19 ? ', which Debian does not have yet)' : ')')
	  unless -e "$sharedir/extension/plproxy.control";
	return 'pgbouncer is not installed (Debian package pgbouncer)'
	  unless _pgbouncer();
	return '';
}

# The pgbouncer executable, or undef.
sub _pgbouncer
{
	my ($path) = grep { -x $_ } (
		(map { "$_/pgbouncer" } split /:/, ($ENV{PATH} // '')),
		'/usr/sbin/pgbouncer');
	return $path;
}

# Builds and starts a cluster: $opts{shards} shard nodes (default 2), of which
# the first $opts{partitions} (default all) are the server's partitions.
# Shards get idempotency.reaper_naptime $opts{naptime} (default 1h).
# Returns { proxy => node, shards => [nodes], bouncer_port => port, ... }.
sub proxy_cluster
{
	my (%opts) = @_;
	my $nshards = $opts{shards} // 2;
	my $npart = $opts{partitions} // $nshards;
	my $naptime = $opts{naptime} // '1h';
	my %c = (shards => []);

	foreach my $i (0 .. $nshards - 1)
	{
		my $shard = PostgreSQL::Test::Cluster->new("shard$i");
		$shard->init;
		$shard->append_conf(
			'postgresql.conf', qq{
shared_preload_libraries = 'idempotency'
idempotency.reaper_naptime = '$naptime'
listen_addresses = '127.0.0.1'
max_connections = 60
});
		$shard->start;
		# The proxy's user mapping connects as idem_proxy, a plain role, whose
		# OID differs on each shard as on separate servers (made so by $i
		# roles created before it): a record moved between shards must keep
		# its owner by name.
		$shard->safe_psql('postgres', "CREATE ROLE oid_skew_$_") for 1 .. $i;
		$shard->safe_psql(
			'postgres', q{
CREATE EXTENSION idempotency;
CREATE ROLE idem_proxy LOGIN;
GRANT USAGE ON SCHEMA idempotency TO idem_proxy;
});
		push @{ $c{shards} }, $shard;
	}

	_start_bouncer(\%c);

	my $proxy = PostgreSQL::Test::Cluster->new('proxy');
	$proxy->init;
	$proxy->append_conf('postgresql.conf', "listen_addresses = '127.0.0.1'");
	$proxy->start;
	$c{proxy} = $proxy;
	my $partitions = join ', ',
	  map { "p$_ '" . partition_connstr(\%c, $_) . "'" } 0 .. $npart - 1;
	$proxy->safe_psql(
		'postgres', qq{
CREATE EXTENSION idempotency_proxy CASCADE;
CREATE SERVER idempotency FOREIGN DATA WRAPPER plproxy OPTIONS ($partitions);
CREATE USER MAPPING FOR PUBLIC SERVER idempotency OPTIONS (user 'idem_proxy');
CREATE ROLE app LOGIN;
GRANT USAGE ON SCHEMA idempotency TO app;
GRANT USAGE ON FOREIGN SERVER idempotency TO app;
});
	return \%c;
}

# The connection string through pgbouncer to shard $i, as a partition of the server.
sub partition_connstr
{
	my ($c, $i) = @_;
	return "host=127.0.0.1 port=$c->{bouncer_port} dbname=shard$i";
}

# Points the server's partitions at these connection strings (ALTER SERVER).
sub set_partitions
{
	my ($c, @connstrs) = @_;
	my $proxy = $c->{proxy};
	my %have = map { $_ => 1 } split /\n/,
	  $proxy->safe_psql('postgres',
		"SELECT option_name FROM pg_options_to_table("
		  . "(SELECT srvoptions FROM pg_foreign_server WHERE srvname = 'idempotency'))");
	my @options = map {
		($have{"p$_"} ? 'SET' : 'ADD') . " p$_ '$connstrs[$_]'"
	} 0 .. $#connstrs;
	push @options, map { "DROP $_" }
	  grep { /^p(\d+)$/ && $1 > $#connstrs } sort keys %have;
	$proxy->safe_psql('postgres',
		'ALTER SERVER idempotency OPTIONS (' . join(', ', @options) . ')');
	return;
}

# Starts pgbouncer in transaction pooling on 127.0.0.1, one database per shard.
sub _start_bouncer
{
	my ($c) = @_;
	my $dir = PostgreSQL::Test::Utils::tempdir_short;
	my $port = PostgreSQL::Test::Cluster::get_free_port();
	my $user = getpwuid($<);
	my $databases = join '',
	  map {
		my $s = $c->{shards}[$_];
		"shard$_ = host=127.0.0.1 port=" . $s->port . " dbname=postgres\n"
	  } 0 .. $#{ $c->{shards} };

	append_to_file("$dir/userlist.txt", qq{"$user" ""\n"idem_proxy" ""\n});
	append_to_file(
		"$dir/pgbouncer.ini", qq{[databases]
$databases
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $port
unix_socket_dir =
auth_type = trust
auth_file = $dir/userlist.txt
pool_mode = transaction
default_pool_size = 20
max_client_conn = 200
server_login_retry = 1
query_wait_timeout = 5
logfile = $PostgreSQL::Test::Utils::log_path/pgbouncer_$port.log
pidfile = $dir/pgbouncer.pid
});
	$c->{bouncer} = IPC::Run::start([ _pgbouncer(), "$dir/pgbouncer.ini" ],
		'>', \my $out, '2>', \my $err);
	push @bouncers, $c->{bouncer};
	$c->{bouncer_port} = $port;
	wait_until(
		sub {
			IO::Socket::INET->new(PeerAddr => "127.0.0.1:$port", Proto => 'tcp');
		},
		'pgbouncer listens'
	) or BAIL_OUT("pgbouncer did not start: " . ($err // ''));
	return;
}

# Stops pgbouncer and every node.
sub proxy_stop
{
	my ($c) = @_;
	if ($c->{bouncer})
	{
		@bouncers = grep { $_ != $c->{bouncer} } @bouncers;
		$c->{bouncer}->signal('TERM');
		$c->{bouncer}->finish;
		delete $c->{bouncer};
	}
	$_->stop for grep { $_->{_pid} } ($c->{proxy}, @{ $c->{shards} });
	return;
}

# Runs SQL that must fail on $node (as $opts{role} when given); returns its
# SQLSTATE, or 'no error'.
sub sqlstate_of
{
	my ($node, $sql, %opts) = @_;
	my ($stdout, $stderr);
	my $role = $opts{role} ? "SET ROLE $opts{role};\n" : '';
	my $ret = $node->psql('postgres', "\\set VERBOSITY verbose\n$role$sql",
		stdout => \$stdout, stderr => \$stderr);
	return 'no error' if $ret == 0;
	return $stderr =~ /ERROR:  ([0-9A-Z]{5}):/ ? $1 : "unexpected: $stderr";
}

# Starts psql on $node running $sql without waiting for it; psql_finish
# collects what it printed.
sub psql_start
{
	my ($node, $sql) = @_;
	my %h = (out => '', err => '');
	$h{run} = IPC::Run::start(
		[
			$node->installed_command('psql'), '-XAtq',
			'-v', 'VERBOSITY=verbose', '-d', $node->connstr('postgres'),
			'-c', $sql
		],
		'>', \$h{out}, '2>', \$h{err},
		IPC::Run::timeout(180));
	return \%h;
}

# Waits for a psql_start'ed psql to end; returns its stdout and stderr.
sub psql_finish
{
	my ($h) = @_;
	$h->{run}->finish;
	chomp $h->{out};
	return ($h->{out}, $h->{err});
}

# Calls $check until it returns true, for up to $seconds (default 60);
# returns whether it did.
sub wait_until
{
	my ($check, $what, $seconds) = @_;
	my $deadline = time + ($seconds // 60);
	while (time < $deadline)
	{
		return 1 if $check->();
		usleep(50_000);
	}
	diag("timed out waiting until $what");
	return 0;
}

1;
