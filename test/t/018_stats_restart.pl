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
# Commits wait for synchronous standbys only where WAL senders may run.
$node->append_conf('postgresql.conf', "wal_level = replica\nmax_wal_senders = 2");
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
# leases_ended (the Prometheus queries' stuck requests): p1's lease, moved
# an hour back with plain SQL and counted by a recount, is the one that
# ended in the window, whichever way the figure is read.
$node->safe_psql('postgres',
	q{UPDATE idempotency.keys SET lease_expires_at = now() - interval '1 hour' WHERE key = 'p1'});
$node->safe_psql('postgres', 'SELECT idempotency.stats_recount()');
my $leases_sql = q{
SELECT idempotency.leases_ended('30 minutes', '1 day'),
       idempotency.leases_ended('30 minutes', '1 day') IS NOT DISTINCT FROM
           (SELECT count(*) FROM idempotency.keys WHERE state = 'in_progress'
            AND lease_expires_at BETWEEN now() - interval '1 day' AND now() - interval '30 minutes')};
is($node->safe_psql('postgres', $figures_sql), 't|3|t', 'exact before the restart');
is($node->safe_psql('postgres', $leases_sql), '1|t', 'the lease that ended, from shared memory');

$node->restart;
is($node->safe_psql('postgres', $gauges_sql), 'f', 'after a restart shared memory has no exact figures');
is($node->safe_psql('postgres', $figures_sql), 't|3|t',
	'the view counts a small table meanwhile');
is($node->safe_psql('postgres', $leases_sql), '1|t', 'and so does leases_ended');
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

# A commit that waits for a synchronous standby that is not there has
# applied its notes (at pre-commit) but not ended: a recount waits for it,
# and gives up (5 s) while it does not end; a recount terminated while it
# waits leaves the next one free to run once the commit has ended.  The
# claim is made before a synchronous standby is asked for (a claim that
# draws new fences would wait for it in the claim itself), and committed
# once a probe's commit shows that commits wait.
my $stuck = $node->background_psql('postgres', on_error_stop => 0);
$stuck->query_safe(q{BEGIN; SELECT outcome FROM idempotency.claim('sync', '\x01');});
$node->safe_psql('postgres', "ALTER SYSTEM SET synchronous_standby_names = 'nobody'");
$node->reload;
my $probe = $node->background_psql('postgres', on_error_stop => 0);
$probe->query_until(qr/started/, "\\echo started\nCREATE TABLE probe ();\n");
$node->poll_query_until('postgres',
	q{SELECT count(*) = 1 FROM pg_stat_activity WHERE wait_event = 'SyncRep'})
  or die 'commits never waited for the synchronous standby';
$stuck->query_until(qr/started/, "\\echo started\nCOMMIT;\n");
ok( $node->poll_query_until('postgres',
		q{SELECT count(*) = 2 FROM pg_stat_activity WHERE wait_event = 'SyncRep'}),
	'the claim waits in its commit for a synchronous standby');
is($node->safe_psql('postgres', 'SELECT idempotency.stats_recount()'),
	'f', 'a recount gives up while a commit that applied its notes has not ended');
# Terminate a recount while it waits (one that gave up first, on a slow
# machine, is tried again).
my $terminated = 0;
for (1 .. 5)
{
	my $recount = $node->background_psql('postgres', on_error_stop => 0);
	my $pid = $recount->query_safe('SELECT pg_backend_pid()');
	$recount->query_until(qr/started/, "\\echo started\nSELECT idempotency.stats_recount();\n");
	$node->poll_query_until('postgres',
		qq{SELECT wait_event_type = 'Extension' OR (state = 'idle' AND query LIKE '%stats_recount%')
		   FROM pg_stat_activity WHERE pid = $pid});
	$terminated = $node->safe_psql('postgres',
		qq{SELECT pg_terminate_backend(pid) FROM pg_stat_activity
		   WHERE pid = $pid AND wait_event_type = 'Extension'}) eq 't';
	# A terminated session's psql has exited: nothing to quit.
	eval { $recount->quit; };
	last if $terminated;
}
ok($terminated, 'a recount waiting for that commit is terminated');
$node->safe_psql('postgres', 'ALTER SYSTEM RESET synchronous_standby_names');
$node->reload;
ok( $node->poll_query_until('postgres',
		q{SELECT count(*) = 0 FROM pg_stat_activity WHERE wait_event = 'SyncRep'}),
	'the commit ends once no synchronous standby is asked for');
$stuck->quit;
$probe->quit;
$node->safe_psql('postgres', 'DROP TABLE probe');
is($node->safe_psql('postgres', 'SELECT idempotency.stats_recount()'),
	't', 'the next recount runs and makes the figures exact');
is($node->safe_psql('postgres', $figures_sql), 't|6|t', 'they count the claim of that commit');
$node->safe_psql('postgres', q{SELECT idempotency.release('sync', fence) FROM idempotency.keys WHERE key = 'sync'});

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
is($node->safe_psql('postgres', $leases_sql), '|f', 'leases_ended has no figure there (NULL)');
is($node->safe_psql('postgres', 'SELECT idempotency.stats_recount()'),
	'f', 'a recount cannot make them exact while they do not fit');
$node->safe_psql('postgres',
	q{SELECT count(*) FROM idempotency.keys k, idempotency.release(k.key, k.fence)
	  WHERE k.key LIKE 'ov%' AND k.key <> 'ov1'});
is($node->safe_psql('postgres', 'SELECT idempotency.stats_recount()'),
	't', 'once they fit, a recount makes them exact');
is($node->safe_psql('postgres', $figures_sql), 't|5|t', 'and they equal a scan');
is($node->safe_psql('postgres', $leases_sql), '1|t', 'so does the lease that ended');

$node->stop;
done_testing();
