# A fence is never handed out twice after a crash, also with
# synchronous_commit = off.  Nothing but the claim then flushes the fence
# sequence's WAL before the fence leaves: the commit does not wait for its
# WAL, and the WAL writer (wal_writer_delay at 10 s) does not run in
# between.  In each round a checkpoint makes the next claim's fence the
# first that the sequence logs after it; the claim returns that fence and
# the server is killed at once.  After the restart the same key is free
# (its asynchronous commit may be lost with the crash): claimed again, it
# gets a larger fence, and the first fence's complete gets IK001.  Before
# the fix the sequence started again below the fence handed out, and the
# same fence came back.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib $FindBin::RealBin;

use IdemCrash;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = idem_node('fence_async');
$node->append_conf('postgresql.conf', q{
synchronous_commit = off
wal_writer_delay = 10s
idempotency.reaper_naptime = '1h'
});
idem_start($node);
$node->safe_psql('postgres', 'CREATE EXTENSION idempotency');

# Three rounds: in one of them the WAL writer could flush by chance (a
# claim's WAL that fills a page wakes it), not in all.
foreach my $round (1 .. 3)
{
	my $key = "async-$round";

	$node->safe_psql('postgres', 'CHECKPOINT');
	my $fence = $node->safe_psql('postgres',
		qq{SELECT fence FROM idempotency.claim('$key', '\\x01')});
	idem_crash_restart($node);

	my ($outcome, $fence_after) = split /\|/, $node->safe_psql('postgres',
		qq{SELECT outcome, fence FROM idempotency.claim('$key', '\\x01')});
	cmp_ok($fence_after, '>', $fence,
		"round $round: after the crash, the claim ($outcome) has a larger fence than the one handed out before it");
	is(idem_sqlstate($node,
			qq{SELECT idempotency.complete('$key', $fence, 200)}),
		'IK001', "round $round: the fence handed out before the crash cannot complete");
}

$node->stop;
done_testing();
