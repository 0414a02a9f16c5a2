# Helpers shared by the TAP tests:
# a node that preloads the library, a server clock the test can move, and a
# restart after kill -9 of the postmaster.

package IdemCrash;

use strict;
use warnings FATAL => 'all';

use Exporter 'import';
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(usleep);

our @EXPORT =
  qw(idem_node idem_start idem_crash_restart idem_clock_advance idem_sqlstate);

# Where Debian's libfaketime lives; the test infrastructure installs it.
my @faketime_libs = (
	'/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1',
	glob('/usr/lib/*/faketime/libfaketime.so.1'));

# Creates (does not start) a node that preloads the library.  With
# faketime => 1, its server processes read their clock through libfaketime,
# so that idem_clock_advance() can end a lease without the test sleeping.
sub idem_node
{
	my ($name, %opts) = @_;
	my $node = PostgreSQL::Test::Cluster->new($name);

	$node->init;
	$node->append_conf('postgresql.conf',
		"shared_preload_libraries = 'idempotency'");

	if ($opts{faketime})
	{
		my ($lib) = grep { -e $_ } @faketime_libs;
		BAIL_OUT('libfaketime is not installed (Debian package libfaketime)')
		  unless defined $lib;
		my $file = "$PostgreSQL::Test::Utils::tmp_check/faketime_$name";
		_write_file($file, "+0s\n");
		$node->{idem_faketime} = { lib => $lib, file => $file, offset => 0 };
	}
	return $node;
}

# Starts the node; under faketime, only the server gets the preload.
sub idem_start
{
	my ($node, %params) = @_;
	my $ft = $node->{idem_faketime};

	return $node->start(%params) unless $ft;

	local $ENV{LD_PRELOAD}              = $ft->{lib};
	local $ENV{FAKETIME_TIMESTAMP_FILE} = $ft->{file};
	local $ENV{FAKETIME_NO_CACHE}       = '1';
	return $node->start(%params);
}

# Moves the server's clock forward by this many seconds (all its processes
# read the file on every clock call).
sub idem_clock_advance
{
	my ($node, $seconds) = @_;
	my $ft = $node->{idem_faketime}
	  or die "node was not created with faketime => 1";

	$ft->{offset} += $seconds;
	_write_file($ft->{file}, "+$ft->{offset}s\n");
	return;
}

# kill -9 of the postmaster, then a start.  The new postmaster refuses to
# start while the old one is not yet reaped or while orphaned backends
# still hold the old shared memory, so wait for both, within a bound.
sub idem_crash_restart
{
	my ($node) = @_;
	my $pid = $node->{_pid};
	my $name = $node->name;
	my $deadline = time + 60;

	$node->kill9;
	usleep(50_000) while kill(0, $pid) && time < $deadline;
	usleep(50_000) while _has_processes($name) && time < $deadline;
	BAIL_OUT("processes of node \"$name\" survived kill -9 for 60 s")
	  if time >= $deadline;
	idem_start($node);
	return;
}

# Runs SQL that must fail; returns the SQLSTATE it failed with.
sub idem_sqlstate
{
	my ($node, $query) = @_;
	my ($stdout, $stderr);
	my $ret = $node->psql('postgres', "\\set VERBOSITY verbose\n$query",
		stdout => \$stdout, stderr => \$stderr);

	return 'no error' if $ret == 0;
	return $stderr =~ /ERROR:  ([0-9A-Z]{5}):/ ? $1 : "unexpected: $stderr";
}

# Whether any process titled "postgres: <cluster name>: ..." is alive: the
# nodes are started with --cluster-name, which every child shows.
sub _has_processes
{
	my ($name) = @_;

	foreach my $cmdline (glob('/proc/[0-9]*/cmdline'))
	{
		open(my $fh, '<', $cmdline) or next;
		my $title = <$fh>;
		close $fh;
		return 1 if defined $title && index($title, "postgres: $name: ") == 0;
	}
	return 0;
}

# Replaces a file's contents in one write.
sub _write_file
{
	my ($path, $text) = @_;
	my $tmp = "$path.tmp";

	open(my $fh, '>', $tmp) or die "could not write \"$tmp\": $!";
	print $fh $text;
	close $fh or die "could not close \"$tmp\": $!";
	rename($tmp, $path) or die "could not rename \"$tmp\": $!";
	return;
}

1;
