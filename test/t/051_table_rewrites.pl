# The commands that rewrite idempotency.keys into new files, run by a DBA
# while claims, completes, releases and the reaper go on: VACUUM FULL,
# CLUSTER, and from PostgreSQL 19 REPACK and REPACK (CONCURRENTLY), which
# copies the table while it is written and then replays the writes made
# meanwhile.  Through each: no claim, complete or release fails (pgbench
# stops a client at its first error and then exits with a failure); every
# record a claim made and its complete stored is there once, with its fence;
# no fence is handed out twice (each new claim's fence goes into a table
# with a unique constraint, in the same statement); the reaper deletes what
# expires; amcheck finds the table and its indexes sound after each round.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib $FindBin::RealBin;

use IdemCrash;
use IPC::Run;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

# Each round: this long of claims, and at most this many rewrites in it.
my $round_seconds = 6;
my $max_rewrites = 30;

my $node = idem_node('table_rewrites');
# REPACK (CONCURRENTLY) decodes the WAL: replica, the default of a server.
$node->append_conf('postgresql.conf', "wal_level = replica\nidempotency.reaper_naptime = 1\n");
idem_start($node);
my $major = $node->pg_version->major;
$node->safe_psql(
	'postgres', q{
CREATE EXTENSION idempotency;
CREATE EXTENSION amcheck;
-- Every fence a claim answered new with, once (a second one fails the claim's statement).
CREATE TABLE fences (fence bigint PRIMARY KEY, key text COLLATE "C" NOT NULL);
CREATE SEQUENCE fresh_keys;
});

my $dir = $PostgreSQL::Test::Utils::tmp_check;
# A new key, claimed and completed; its fence recorded.
PostgreSQL::Test::Utils::append_to_file(
	"$dir/fresh.sql", q{
WITH c AS MATERIALIZED (
	SELECT s.k, c.* FROM (SELECT 'fresh-' || nextval('fresh_keys') AS k) s,
		idempotency.claim(s.k, '\x01') c),
f AS (INSERT INTO fences SELECT fence, k FROM c WHERE outcome = 'new')
SELECT idempotency.complete(k, fence, 201, '\x6f6b') FROM c;
});
# The same key for every client for 5 ms: one new (completed), the others
# in_progress or replay.
PostgreSQL::Test::Utils::append_to_file(
	"$dir/race.sql", q{
WITH c AS MATERIALIZED (
	SELECT s.k, c.* FROM (SELECT 'race-' || (extract(epoch FROM clock_timestamp()) * 200)::bigint AS k) s,
		idempotency.claim(s.k, '\x01') c),
f AS (INSERT INTO fences SELECT fence, k FROM c WHERE outcome = 'new')
SELECT CASE WHEN outcome = 'new' THEN idempotency.complete(k, fence, 201) ELSE outcome END FROM c;
});
# Two keys claimed and released again and again (a new fence each time).
PostgreSQL::Test::Utils::append_to_file(
	"$dir/release.sql", q{
\set n random(1, 2)
WITH c AS MATERIALIZED (SELECT c.* FROM idempotency.claim('release-' || :n, '\x01') c),
f AS (INSERT INTO fences SELECT fence, 'release-' || :n FROM c WHERE outcome = 'new')
SELECT CASE WHEN outcome = 'new' THEN idempotency.release('release-' || :n, fence)::text
	ELSE outcome END FROM c;
});
# Records kept for a second, for the reaper (and reap()) to delete.
PostgreSQL::Test::Utils::append_to_file(
	"$dir/expiring.sql", q{
SELECT idempotency.complete(s.k, c.fence, 200, scope => 'expiring')
FROM (SELECT 'expiring-' || nextval('fresh_keys') AS k) s,
	idempotency.claim(s.k, '\x01', scope => 'expiring', lease => '1 s', retention => '1 s') c;
});

# Runs the four kinds of calls from 8 clients for $round_seconds while
# $rewrite is run again and again; then checks every guarantee.
sub calls_during
{
	my ($rewrite) = @_;
	my ($out, $err) = ('', '');
	my $pgbench = IPC::Run::start(
		[
			'pgbench', '-n', '-c', '8', '-j', '2', '-T', $round_seconds,
			'-f', "$dir/fresh.sql\@3", '-f', "$dir/race.sql\@3",
			'-f', "$dir/release.sql\@1", '-f', "$dir/expiring.sql\@1",
			$node->connstr('postgres')
		],
		'>', \$out, '2>', \$err);
	my $runs = 0;
	my $started = time;
	while ($runs < $max_rewrites && $pgbench->pumpable)
	{
		$node->safe_psql('postgres', "$rewrite; SELECT idempotency.reap();");
		$runs++;
		$pgbench->pump_nb;
	}
	note("$rewrite: $runs runs in " . (time - $started) . ' s');
	my $succeeded = $pgbench->finish;
	note("pgbench: $out$err");
	ok($succeeded, "$rewrite: no call failed during $runs runs") or diag($err);
	like($out, qr/number of transactions actually processed: [1-9]/,
		"$rewrite: calls were made");
	cmp_ok($runs, '>=', 2, "$rewrite: it ran while the calls were made");

	# Read from the heap, not through an index that could share a fault.
	is( $node->safe_psql(
			'postgres', q{
SET enable_indexscan = off; SET enable_bitmapscan = off; SET enable_indexonlyscan = off;
SELECT count(*) FROM fences f
	LEFT JOIN (SELECT key, fence, count(*) AS n FROM idempotency.keys
		WHERE state = 'completed' AND body = '\x6f6b' GROUP BY key, fence) k USING (key, fence)
WHERE f.key LIKE 'fresh-%' AND k.n IS DISTINCT FROM 1}),
		'0',
		"$rewrite: every fresh key's record is there once, completed, with its fence");
	is( $node->safe_psql(
			'postgres', q{
SET enable_indexscan = off; SET enable_bitmapscan = off; SET enable_indexonlyscan = off;
SELECT count(*) FROM (SELECT FROM idempotency.keys GROUP BY key, scope, owner
	HAVING count(*) > 1) d}),
		'0',
		"$rewrite: no record is there twice");
	is( $node->safe_psql(
			'postgres', q{
SELECT count(*) FROM idempotency.keys k LEFT JOIN fences f USING (fence)
WHERE k.scope = '' AND f.fence IS NULL}),
		'0',
		"$rewrite: every record's fence is one a claim answered new with");
	is( $node->safe_psql(
			'postgres', q{
SELECT count(*) FROM pg_index i
WHERE i.indrelid = 'idempotency.keys'::regclass AND i.indisvalid
	AND bt_index_check(i.indexrelid, heapallindexed => true) IS NOT NULL}),
		'2',
		"$rewrite: amcheck finds the two indexes sound");
	is($node->safe_psql('postgres', q{SELECT count(*) FROM verify_heapam('idempotency.keys')}),
		'0', "$rewrite: amcheck finds the table sound");
}

my @rewrites = (
	'VACUUM FULL idempotency.keys',
	'CLUSTER idempotency.keys USING keys_pkey');
if ($major >= 19)
{
	push @rewrites,
	  'REPACK idempotency.keys',
	  'REPACK (CONCURRENTLY) idempotency.keys',
	  'REPACK (CONCURRENTLY) idempotency.keys USING INDEX keys_pkey';
}
else
{
	note("PostgreSQL $major has no REPACK (new in 19): VACUUM FULL and CLUSTER only");
}
calls_during($_) foreach @rewrites;

# The reaper deletes the expired records that the rewrites carried over.
ok( $node->poll_query_until(
		'postgres', q{SELECT count(*) = 0 FROM idempotency.keys WHERE scope = 'expiring'}),
	'the reaper deletes every expired record after the rewrites');

done_testing();
