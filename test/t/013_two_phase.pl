# Two-phase commit: a prepared transaction that claimed or completed a key
# keeps its write of the record uncommitted until COMMIT or ROLLBACK
# PREPARED, and a claim of the key waits for that transaction.  A claim's
# `wait` bounds that wait (lock_timeout bounds the rest), and a claim
# waiting for a prepared complete wakes when COMMIT PREPARED ends the
# transaction, rather than at its next safety re-check.

use strict;
use warnings FATAL => 'all';
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use lib 'test/t';
use IdemCrash;

my $node = idem_node('two_phase');
$node->append_conf('postgresql.conf', "max_prepared_transactions = 10\n");
idem_start($node);
$node->safe_psql('postgres', 'CREATE EXTENSION idempotency');

# An orphaned prepared claim: wait bounds the wait, then in_progress.
$node->safe_psql('postgres', q{
	BEGIN;
	SELECT outcome FROM idempotency.claim('p1', '\x01');
	PREPARE TRANSACTION 'claim_p1';
});
is( $node->safe_psql('postgres',
		q{SELECT outcome, retry_after FROM idempotency.claim('p1', '\x01', wait => '300ms')}),
	'in_progress|1',
	'a claim with wait meets a prepared claim of its key: in_progress when wait ends');
is( idem_sqlstate($node,
		q{SET lock_timeout = '200ms'; SELECT idempotency.claim('p1', '\x01')}),
	'55P03', 'without wait, lock_timeout bounds the wait');
is($node->safe_psql('postgres', q{SELECT count(*) FROM pg_prepared_xacts}),
	'1', 'the prepared transaction is still there');
$node->safe_psql('postgres', q{ROLLBACK PREPARED 'claim_p1'});
is( $node->safe_psql('postgres',
		q{SELECT outcome, attempt FROM idempotency.claim('p1', '\x01', wait => '300ms')}),
	'new|1', 'after ROLLBACK PREPARED the key is free');

# A claim waits for a key in progress; its owner completes in a prepared
# transaction.  The waiter is woken at PREPARE, finds the record written by
# the prepared transaction, waits for that transaction (a lock wait on its
# id), and answers replay as soon as COMMIT PREPARED ends it.
my $fence = $node->safe_psql('postgres',
	q{SELECT fence FROM idempotency.claim('p2', '\x02')});
my $waiter = $node->background_psql('postgres');
$waiter->query_until(qr/waiting/, q{
\echo waiting
SELECT outcome, status_code FROM idempotency.claim('p2', '\x02', wait => '60s');
});
$node->poll_query_until('postgres',
	q{SELECT count(*) > 0 FROM pg_stat_activity
	  WHERE query LIKE '%wait => ''60s''%' AND wait_event_type = 'Extension'})
  or die 'the waiting claim never slept';
$node->safe_psql('postgres', qq{
	BEGIN;
	SELECT idempotency.complete('p2', $fence, 200, 'done');
	PREPARE TRANSACTION 'complete_p2';
});
ok( $node->poll_query_until('postgres',
		q{SELECT count(*) > 0 FROM pg_stat_activity
		  WHERE query LIKE '%wait => ''60s''%' AND wait_event_type = 'Lock'}),
	'the waiter now waits for the prepared transaction, a lock wait');
$node->safe_psql('postgres', q{COMMIT PREPARED 'complete_p2'});
is($waiter->query_safe(''), 'replay|200', 'COMMIT PREPARED wakes it: replay');
$waiter->quit;

$node->stop;
done_testing();
