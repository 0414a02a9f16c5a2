# A fence is never handed out twice across promotion of a synchronous
# standby.  A claim that draws new fences from the sequence (a block, from 1.6) waits, like
# a commit, until the synchronous standby has that batch: while the standby
# is unreachable, the claim itself waits.  Its transaction is left open, the
# primary dies, the standby is promoted: the same key claimed there gets a
# larger fence, and the first attempt's complete is refused (IK001).
# Before the fix the claim returned at once, and the promoted standby
# handed out the same fence again.

use strict;
use warnings FATAL => 'all';
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use FindBin;
use lib $FindBin::RealBin;
use IdemCrash;

my $primary = PostgreSQL::Test::Cluster->new('primary');
$primary->init(allows_streaming => 1);
$primary->append_conf('postgresql.conf', qq{
shared_preload_libraries = 'idempotency'
idempotency.reaper_naptime = '1h'
});
$primary->start;
$primary->safe_psql('postgres', 'CREATE EXTENSION idempotency');

# Makes a streaming standby named $name of $primary, and makes it the
# synchronous one (only once it streams: until then commits would wait).
sub synchronous_standby
{
	my ($primary, $name) = @_;
	my $standby = PostgreSQL::Test::Cluster->new($name);

	$primary->backup("base_$name");
	$standby->init_from_backup($primary, "base_$name", has_streaming => 1);
	$standby->start;
	$primary->append_conf('postgresql.conf', "synchronous_standby_names = '*'");
	$primary->reload;
	$primary->poll_query_until('postgres',
		q{SELECT count(*) = 1 FROM pg_stat_replication WHERE sync_state = 'sync'})
	  or die "standby $name never became synchronous";
	return $standby;
}

my $standby = synchronous_standby($primary, 'standby');

# Earlier claims, replicated synchronously.
my $fence_before = $primary->safe_psql('postgres',
	q{SELECT fence FROM idempotency.claim('before', '\x01')});

# Make the next claim draw new fences: a nextval, which ends the block of
# fences in use (1.6: the sequence is no longer as the block's draw left
# it), then the rest of the sequence's logged batch, so that the next claim
# advances the sequence past what the standby knows, and would hand out
# itself after promotion.  (A checkpoint meanwhile makes the sequence log a
# new batch: the loop goes on to its end.)
my $use_up_batch = q{
	DO $$BEGIN
		PERFORM pg_catalog.nextval('idempotency.fence_seq');
		WHILE (SELECT log_cnt FROM idempotency.fence_seq) OPERATOR(pg_catalog.>) 0 LOOP
			PERFORM pg_catalog.nextval('idempotency.fence_seq');
		END LOOP;
	END$$};
$primary->safe_psql('postgres', $use_up_batch);
is($primary->safe_psql('postgres', 'SELECT log_cnt FROM idempotency.fence_seq'),
	'0', 'the fence sequence is at the end of its logged batch');
$primary->wait_for_catchup($standby, 'replay');

# The synchronous standby becomes unreachable.
$standby->stop;

# Attempt A claims the key in a transaction it leaves open.
my $a = $primary->background_psql('postgres');
$a->query_until(qr/started/, q{
BEGIN;
\echo started
SELECT fence FROM idempotency.claim('victim', '\xaa');
});
# Either the claim waits for the standby (the fix) or it has returned.
$primary->poll_query_until('postgres', q{
	SELECT wait_event = 'SyncRep' OR state = 'idle in transaction'
	FROM pg_stat_activity WHERE query LIKE '%claim(''victim''%'
	  AND pid OPERATOR(pg_catalog.<>) pg_backend_pid()})
  or die 'the claim neither waited nor returned';
my $waited = $primary->safe_psql('postgres', q{
	SELECT wait_event = 'SyncRep' FROM pg_stat_activity
	WHERE query LIKE '%claim(''victim''%' AND pid OPERATOR(pg_catalog.<>) pg_backend_pid()});
is($waited, 't', 'the claim waits while the synchronous standby is unreachable');

# The standby comes back and receives the new batch: the claim returns.
# (A claim that returned without waiting dies with the primary first: its
# batch never reaches the standby.)
$standby->start if $waited eq 't';
my $fence_a = $a->query_safe('');
like($fence_a, qr/^\d+$/, 'attempt A got its fence');
cmp_ok($fence_a, '>', $fence_before, 'a fence larger than the earlier ones');

# The primary dies with A's transaction open; the standby is promoted.
$primary->stop('immediate');
$a->quit;
$standby->start if $waited ne 't';
$standby->promote;
is($standby->safe_psql('postgres', 'SELECT pg_is_in_recovery()'),
	'f', 'the standby is promoted');

# Attempt B claims the same key on the new primary.
my ($outcome_b, $fence_b) = split /\|/, $standby->safe_psql('postgres',
	q{SELECT outcome, fence FROM idempotency.claim('victim', '\xaa')});
is($outcome_b, 'new', 'attempt B claims the key anew after promotion');
cmp_ok($fence_b, '>', $fence_a, 'attempt B has a larger fence than attempt A');
is( idem_sqlstate($standby,
		qq{SELECT idempotency.complete('victim', $fence_a, 201, 'from A')}),
	'IK001', 'attempt A cannot complete with its fence');
is( $standby->safe_psql('postgres',
		qq{SELECT idempotency.complete('victim', $fence_b, 201, 'from B')}),
	'stored', 'attempt B completes');

# A claim's wait for the standby ends on cancel (here statement_timeout),
# and the claim fails rather than hand out a fence the standby may not have.
my $new_standby = synchronous_standby($standby, 'standby2');
$standby->safe_psql('postgres', $use_up_batch);
is($standby->safe_psql('postgres', 'SELECT log_cnt FROM idempotency.fence_seq'),
	'0', 'the new primary\'s fence sequence is at the end of its logged batch');
$new_standby->stop;
my ($ret, $out, $err) = $standby->psql('postgres', q{
	SET statement_timeout = '1s';
	SELECT fence FROM idempotency.claim('cancelled', '\xaa')});
isnt($ret, 0, 'a claim whose wait for the standby is cancelled fails');
like($err, qr/canceling claim before its fence reached the synchronous standby/,
	'it says why');
is($out, '', 'and hands out no fence');

$new_standby->start;
is( $standby->safe_psql('postgres',
		q{SELECT outcome FROM idempotency.claim('cancelled', '\xaa')}),
	'new', 'once the standby is back, the key is claimed');

done_testing();
