# Helpers for the Citus TAP tests: a coordinator and two workers on
# 127.0.0.1 that preload citus and the library, with the extension created
# on the coordinator (Citus propagates it), and the facts the tests ask of
# them (which worker holds a scope, whether a node crashed).

package IdemCitus;

use strict;
use warnings FATAL => 'all';

use Exporter 'import';
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

our @EXPORT = qw(citus_skip_unless_installed citus_cluster citus_add_worker citus_stop
  citus_shard_of citus_worker_of citus_crashed);

# Skips the whole test file unless Citus is installed in the PostgreSQL the
# tests run against; the message says how to install it.
sub citus_skip_unless_installed
{
	my $probe = PostgreSQL::Test::Cluster->new('citus_probe');
	my $pkglibdir = $probe->config_data('--pkglibdir');

	return if -e "$pkglibdir/citus.so";
	plan skip_all =>
	  "Citus is not installed in $pkglibdir (no registry we reach packages "
	  . "it): install a Citus that supports PostgreSQL "
	  . $probe->pg_version->major
	  . " from Citus's own packages to run this test (Citus 13: PostgreSQL 15 to 17; "
	  . "14: 16 to 18; none for 19 yet)";
	return;
}

# Creates and starts a coordinator and two workers; returns
# ($coordinator, [$worker1, $worker2]).  Each listens on 127.0.0.1 (Citus
# connects its nodes over TCP) besides the harness's Unix socket, and
# preloads citus first, then the library.  %opts: worker_conf => text
# appended to the workers' postgresql.conf; prefix => a prefix of the nodes'
# names (for a test that makes more than one cluster).
sub citus_cluster
{
	my (%opts) = @_;
	my $prefix = $opts{prefix} // '';
	my $coord = _citus_node("${prefix}coordinator", '');
	my @workers = map { _citus_node("${prefix}worker$_", $opts{worker_conf} // '') } (1, 2);

	foreach my $node ($coord, @workers)
	{
		$node->safe_psql('postgres', 'CREATE EXTENSION citus');
	}
	$coord->safe_psql('postgres',
		"SELECT citus_set_coordinator_host('127.0.0.1', " . $coord->port . ')');
	foreach my $w (@workers)
	{
		$coord->safe_psql('postgres',
			"SELECT citus_add_node('127.0.0.1', " . $w->port . ')');
	}
	$coord->safe_psql('postgres', 'CREATE EXTENSION idempotency');
	return ($coord, \@workers);
}

# Creates and starts another worker, as configured as the others, and adds
# it to the cluster (Citus creates the extension there unless $prepare, SQL
# run on it before, did); returns it.
sub citus_add_worker
{
	my ($coord, $name, $extra_conf, $prepare) = @_;
	my $worker = _citus_node($name, $extra_conf // '');

	$worker->safe_psql('postgres', 'CREATE EXTENSION citus');
	$worker->safe_psql('postgres', $prepare) if defined $prepare;
	$coord->safe_psql('postgres',
		"SELECT citus_add_node('127.0.0.1', " . $worker->port . ')');
	return $worker;
}

# Creates and starts one node of the cluster.
sub _citus_node
{
	my ($name, $extra_conf) = @_;
	my $node = PostgreSQL::Test::Cluster->new($name);

	$node->init;
	# wal_level logical: citus_move_shard_placement copies by logical
	# replication.  More connections than the harness's default 10: every
	# delegated call holds a connection from the coordinator to a worker.
	# The old placements of moved shards stay until
	# citus_cleanup_orphaned_resources(), not for 15 s: tests do not depend
	# on timing.  Citus copies records between nodes as text, as
	# citus_distribute requires (a role's OID differs from node to node).
	$node->append_conf('postgresql.conf', qq{
shared_preload_libraries = 'citus,idempotency'
listen_addresses = '127.0.0.1'
wal_level = logical
max_connections = 80
citus.defer_shard_delete_interval = -1
citus.enable_binary_protocol = off
max_wal_senders = 10
max_replication_slots = 10
shared_buffers = 16MB
$extra_conf
});
	$node->start;
	# Debian's PostgreSQL (15.20 onwards) lets only listed libraries decode
	# WAL: shard splits decode with citus.
	if ($node->safe_psql('postgres',
			q{SELECT count(*) FROM pg_settings WHERE name = 'output_plugin_libraries'}))
	{
		$node->append_conf('postgresql.conf',
			"output_plugin_libraries = 'pgoutput, test_decoding, citus'");
		$node->reload;
	}
	return $node;
}

# Stops every node.
sub citus_stop
{
	my ($coord, $workers) = @_;

	$_->stop for ($coord, @$workers);
	return;
}

# Returns the shard of idempotency.keys that holds scope's records.
sub citus_shard_of
{
	my ($coord, $scope) = @_;

	return $coord->safe_psql('postgres',
		"SELECT get_shard_id_for_distribution_column('idempotency.keys', '$scope')");
}

# Returns the worker (of $workers) that holds scope's records.
sub citus_worker_of
{
	my ($coord, $workers, $scope) = @_;
	my $shard = citus_shard_of($coord, $scope);
	my $port = $coord->safe_psql('postgres',
		"SELECT nodeport FROM pg_dist_shard_placement WHERE shardid = $shard");
	my ($worker) = grep { $_->port == $port } @$workers;

	die "no worker holds shard $shard (port $port)" unless $worker;
	return $worker;
}

# Whether a backend of the node died of a signal since the log offset.
sub citus_crashed
{
	my ($node, $offset) = @_;

	return $node->log_contains(qr/terminated by signal/, $offset // 0);
}

1;
