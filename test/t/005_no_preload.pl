# Without shared_preload_libraries the SQL API works: every outcome, fencing,
# a waiting claim (which polls instead of sleeping on a condition variable),
# and idempotency.stats answers its live figures with NULL counters.

use strict;
use warnings FATAL => 'all';
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = PostgreSQL::Test::Cluster->new('no_preload');
$node->init;
$node->start;
$node->safe_psql('postgres', 'CREATE EXTENSION idempotency');

is($node->safe_psql('postgres', 'SHOW shared_preload_libraries'),
	'', 'the library is not preloaded');

my $fence = $node->safe_psql('postgres',
	q{SELECT fence FROM idempotency.claim('k1', '\x01')});
like($fence, qr/^\d+$/, 'claim answers new with a fence');
is( $node->safe_psql('postgres',
		q{SELECT outcome FROM idempotency.claim('k1', '\x01')}),
	'in_progress', 'a second claim is in_progress');
is( $node->safe_psql('postgres',
		q{SELECT outcome FROM idempotency.claim('k1', '\x02')}),
	'mismatch', 'another fingerprint is a mismatch');

# A claim that waits sees the owner complete, by polling.
my $waiter = $node->background_psql('postgres');
$waiter->query_until(qr/waiting/, q{
\echo waiting
SELECT outcome, convert_from(body, 'UTF8') FROM idempotency.claim('k1', '\x01', wait => '60s');
});
$node->poll_query_until('postgres',
	q{SELECT count(*) > 0 FROM pg_stat_activity WHERE query LIKE '%wait => ''60s''%' AND wait_event_type = 'Extension'})
  or die 'the waiting claim never slept';
is( $node->safe_psql('postgres',
		qq{SELECT idempotency.complete('k1', $fence, 201, 'done')}),
	'stored', 'the owner completes');
my $answer = $waiter->query_safe('');
$waiter->quit;
like($answer // '', qr/replay\|done/, 'the waiting claim answers replay');
is( $node->safe_psql('postgres',
		qq{SELECT outcome FROM idempotency.claim('k1', '\x01')}),
	'replay', 'a later claim replays');

# The old fence is refused.
my ($rc, $out, $err) = $node->psql('postgres',
	qq{SELECT idempotency.complete('k1', $fence, 200)});
like($err, qr/no longer owns/, 'a completed claim cannot be completed again');

# The statistics: counters NULL, live figures from the table.
is( $node->safe_psql('postgres',
		q{SELECT claims_new IS NULL AND reaped IS NULL AND stats_reset_at IS NULL,
		         rows_total, rows_in_progress FROM idempotency.stats}),
	't|1|0', 'without preloading the counters are NULL and the live figures answer');
($rc, $out, $err) = $node->psql('postgres', 'SELECT idempotency.stats_reset()');
like($err, qr/statistics are not available/, 'stats_reset() says why it cannot');

# leases_ended (the Prometheus queries' stuck requests): a small table counted.
$node->safe_psql('postgres', q{SELECT idempotency.claim('k2', '\x01')});
$node->safe_psql('postgres',
	q{UPDATE idempotency.keys SET lease_expires_at = now() - interval '5 minutes' WHERE key = 'k2'});
is( $node->safe_psql('postgres',
		q{SELECT idempotency.leases_ended('1 minute', '15 minutes'),
		         idempotency.leases_ended('10 minutes', '15 minutes')}),
	'1|0', 'without preloading leases_ended counts the leases that ended in the window');

$node->stop;
done_testing();
