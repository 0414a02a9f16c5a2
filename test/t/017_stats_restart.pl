# idempotency.stats' live figures (1.6: shared memory, kept from the API's
# writes) after a restart and a crash, when shared memory starts empty: they
# are not exact until a recount, by stats_recount() or by the reaper at its
# next run, makes them exact again, also with claims made in between.  The
# view meanwhile counts a table of up to 10,000 records (a bounded scan),
# and on a larger one says its figures are an estimate.  And what else makes them
# inexact until a recount: a prepared transaction that wrote records, more
# records in progress than shared memory tracks; and what they do not see:
# a DBA's plain SQL on the table, until stats_recount().

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib $FindBin::RealBin;

use IdemCrash;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = idem_node('stats_restart');
$node->append_conf('postgresql.conf', "idempotency.reaper_naptime = '1h'");
$node->append_conf('postgresql.conf', 'max_prepared_transactions = 2');
idem_start($node);
$node->safe_psql('postgres', 'CREATE EXTENSION idempotency');

# live_figures_exact, rows_in_progress, and whether both figures equal a scan.
# Whether shared memory's figures are exact (NULL: it has none for the database).
my $gauges_sql =
  q{SELECT coalesce((idempotency._stats_gauges('idempotency.keys')).exact, false)};
my $figures_sql = q{
SELECT s.live_figures_exact, s.rows_in_progress,
       s.rows_in_progress IS NOT DISTINCT FROM
           (SELECT count(*) FROM idempotency.keys WHERE state = 'in_progress')
       AND s.oldest_lease_expires_at IS NOT DISTINCT FROM
           (SELECT min(lease_expires_at) FROM idempotency.keys WHERE state = 'in_progress')
FROM idempotency.stats s};

is($node->safe_psql('postgres', 'SELECT idempotency.stats_recount()'),
	't', 'a recount makes the figures exact');
$node->safe_psql(
	'postgres', q{
SELECT idempotency.claim('p' || i, '\x01', lease => (i || ' minutes')::interval) FROM generate_series(1, 3) i;
SELECT idempotency.complete('c' || i, (idempotency.claim('c' || i, '\x01')).fence, 200)
FROM generate_series(1, 2) i;
});
is($node->safe_psql('postgres', $figures_sql), 't|3|t', 'exact before the restart');

$node->restart;
is($node->safe_psql('postgres', $gauges_sql), 'f', 'after a restart shared memory has no exact figures');
is($node->safe_psql('postgres', $figures_sql), 't|3|t',
	'the view counts a small table meanwhile');
$node->safe_psql('postgres', q{SELECT idempotency.claim('p4', '\x01')});
is($node->safe_psql('postgres', 'SELECT idempotency.stats_recount()'),
	't', 'stats_recount() makes them exact');
is($node->safe_psql('postgres', $figures_sql), 't|4|t',
	'the recount counted the records from before the restart and the claim after it');

idem_crash_restart($node);
is($node->safe_psql('postgres', $gauges_sql), 'f', 'after a crash shared memory has no exact figures');
$node->safe_psql('postgres', q{SELECT idempotency.claim('p5', '\x01')});
$node->append_conf('postgresql.conf', "idempotency.reaper_naptime = '1s'");
$node->reload;
ok( $node->poll_query_until('postgres', $gauges_sql),
	'the reaper recounts them at its next run');
is($node->safe_psql('postgres', $figures_sql), 't|5|t',
	'the reaper counted the records from before the crash and the claim after it');
$node->append_conf('postgresql.conf', "idempotency.reaper_naptime = '1h'");
$node->reload;

# A prepared transaction that wrote records: applied at PREPARE, doubtful
# until a recount, which cannot be exact while it is still prepared.
$node->safe_psql(
	'postgres', q{
BEGIN;
SELECT idempotency.claim('prep', '\x01');
PREPARE TRANSACTION 'claims';
});
is($node->safe_psql('postgres', $gauges_sql),
	'f', 'a prepared transaction that claimed makes the figures inexact');
is($node->safe_psql('postgres', 'SELECT idempotency.stats_recount()'),
	'f', 'a recount while it is prepared leaves them an estimate');
$node->safe_psql('postgres', "ROLLBACK PREPARED 'claims'");
is($node->safe_psql('postgres', 'SELECT idempotency.stats_recount()'),
	't', 'once it has ended, a recount makes them exact');
is($node->safe_psql('postgres', $figures_sql), 't|5|t', 'the rolled-back claim is not counted');

# A DBA's plain SQL is not seen until a recount.
$node->safe_psql('postgres', q{DELETE FROM idempotency.keys WHERE key = 'p5'});
is($node->safe_psql('postgres', $figures_sql), 't|5|f',
	"a DBA's DELETE on the table is not seen by the figures");
$node->safe_psql('postgres', 'SELECT idempotency.stats_recount()');
is($node->safe_psql('postgres', $figures_sql), 't|4|t', 'stats_recount() sees it');

# More records in progress than shared memory tracks (65536): an estimate,
# until they are fewer again and counted.
$node->safe_psql('postgres',
	q{SELECT count(*) FROM generate_series(1, 65540) i, idempotency.claim('ov' || i, '\x01')});
is($node->safe_psql('postgres', $gauges_sql),
	'f', 'more records in progress than tracked: inexact');
is($node->safe_psql('postgres',
		'SELECT live_figures_exact, oldest_lease_expires_at IS NULL FROM idempotency.stats'),
	'f|t', 'the view, on a table too large to count, says its figures are an estimate');
is($node->safe_psql('postgres', 'SELECT idempotency.stats_recount()'),
	'f', 'a recount cannot make them exact while they do not fit');
$node->safe_psql('postgres',
	q{SELECT count(*) FROM idempotency.keys k, idempotency.release(k.key, k.fence)
	  WHERE k.key LIKE 'ov%' AND k.key <> 'ov1'});
is($node->safe_psql('postgres', 'SELECT idempotency.stats_recount()'),
	't', 'once they fit, a recount makes them exact');
is($node->safe_psql('postgres', $figures_sql), 't|5|t', 'and they equal a scan');

$node->stop;
done_testing();
