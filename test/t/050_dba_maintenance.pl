# A DBA's routine work on idempotency.keys while claims keep coming: claims
# of the same keys by several clients at once (the races of inserts that a
# unique index decides) while REINDEX CONCURRENTLY rebuilds the primary
# key, over and over:
# - on the table as the extension made it (the executor-free writes);
# - with the primary key rebuilt as (scope, key, owner), from here on;
# - with a trigger on it (the executor's writes) and an inheritance child
#   holding a live record, while reap runs too;
# - attached as a partition of a table partitioned by scope.
# No claim ever fails (pgbench stops a client at its first error, and then
# exits with a failure): the answers are new, in_progress and replay
# throughout.  The child's record survives, a claim that the partition
# constraint refuses writes nothing (23514), and amcheck finds every index
# of the table sound after each round.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib $FindBin::RealBin;

use IdemCrash;
use IPC::Run;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

# Each round: this long of claims, and at most this many rebuilds in it.
my $round_seconds = 6;
my $max_reindexes = 50;

my $node = idem_node('dba_maintenance');
idem_start($node);
$node->safe_psql('postgres', 'CREATE EXTENSION idempotency; CREATE EXTENSION amcheck;');
# Claims of a new key every 5 ms, the same for every client, the classic
# race of inserts that a unique index decides (the one that gets new
# completes); and claims of two keys whose new one is released at once, so
# that they are inserted again and again.
my $race_sql = "$PostgreSQL::Test::Utils::tmp_check/claim_race.sql";
PostgreSQL::Test::Utils::append_to_file(
	$race_sql, q{
SELECT CASE WHEN c.outcome = 'new' THEN idempotency.complete(s.k, c.fence, 201) ELSE c.outcome END
FROM (SELECT 'race-' || (extract(epoch FROM clock_timestamp()) * 200)::bigint AS k) s,
	idempotency.claim(s.k, '\x01') c;
});
my $release_sql = "$PostgreSQL::Test::Utils::tmp_check/claim_release.sql";
PostgreSQL::Test::Utils::append_to_file(
	$release_sql, q{
\set k random(1, 2)
SELECT CASE WHEN c.outcome = 'new'
	THEN idempotency.release('maint-' || :k, c.fence)::text ELSE c.outcome END
FROM idempotency.claim('maint-' || :k, '\x01') c;
});

# Runs claims from 8 clients for $round_seconds while $maintenance is run
# again and again (at most $max_reindexes times); checks that no claim
# failed, that the maintenance ran, and that amcheck finds the indexes sound.
sub claims_during
{
	my ($name, $maintenance) = @_;
	my ($out, $err) = ('', '');
	my $pgbench = IPC::Run::start(
		[
			'pgbench', '-n', '-c', '8', '-j', '2', '-T', $round_seconds,
			'-f', "$race_sql\@3", '-f', "$release_sql\@1",
			$node->connstr('postgres')
		],
		'>', \$out, '2>', \$err);
	my $runs = 0;
	while ($runs < $max_reindexes && $pgbench->pumpable)
	{
		$node->safe_psql('postgres', $maintenance);
		$runs++;
		$pgbench->pump_nb;
	}
	my $succeeded = $pgbench->finish;
	note("pgbench: $out$err");
	ok($succeeded, "$name: no claim failed during $runs runs of the maintenance")
	  or diag($err);
	like($out, qr/number of transactions actually processed: [1-9]/,
		"$name: claims were made");
	cmp_ok($runs, '>=', 2, "$name: the maintenance ran while claims were made");
	is( $node->safe_psql(
			'postgres', q{
SELECT count(*) FROM (SELECT bt_index_check(i.indexrelid, heapallindexed => true)
	FROM pg_index i WHERE i.indrelid = 'idempotency.keys'::regclass AND i.indisvalid) c}),
		'2',
		"$name: amcheck finds the table's two indexes (primary key, expiry) sound");
}

# 1. The table as the extension made it.
claims_during('plain table',
	'REINDEX INDEX CONCURRENTLY idempotency.keys_pkey');

# From here on, the primary key rebuilt with the scope first (a DBA's way
# of grouping a tenant's keys): claims find their records through it, and
# through the copy REINDEX CONCURRENTLY builds of it.
$node->safe_psql(
	'postgres', q{
ALTER TABLE idempotency.keys DROP CONSTRAINT keys_pkey,
	ADD CONSTRAINT keys_pkey PRIMARY KEY (scope, key, owner);
});
claims_during('primary key (scope, key, owner)',
	'REINDEX INDEX CONCURRENTLY idempotency.keys_pkey');

# 2. A trigger (every write through the executor) and an inheritance child
# with a live record of one of the keys, while reap runs.
$node->safe_psql(
	'postgres', q{
CREATE FUNCTION keys_noop() RETURNS trigger LANGUAGE plpgsql AS 'BEGIN RETURN NEW; END';
CREATE TRIGGER keys_noop BEFORE INSERT OR UPDATE ON idempotency.keys
	FOR EACH ROW EXECUTE FUNCTION keys_noop();
CREATE TABLE keys_child () INHERITS (idempotency.keys);
INSERT INTO keys_child (fence, created_at, expires_at, lease_expires_at, lease, attempt,
		state, owner, scope, key, fingerprint)
	SELECT 1000000 + n, now(), now() + '10 days', now() + '10 days', '10 days', 1,
		'in_progress', current_user::regrole, '', 'maint-' || n, '\x02'
	FROM generate_series(1, 3) n;
});
claims_during('trigger and inheritance child',
	'REINDEX TABLE CONCURRENTLY idempotency.keys; SELECT idempotency.reap();');
is( $node->safe_psql(
		'postgres',
		q{SELECT string_agg(key || ' ' || fence || ' ' || state, ', ' ORDER BY key) FROM keys_child}
	),
	'maint-1 1000001 in_progress, maint-2 1000002 in_progress, maint-3 1000003 in_progress',
	'the inheritance child keeps its records');
$node->safe_psql(
	'postgres', q{
DROP TABLE keys_child;
DROP TRIGGER keys_noop ON idempotency.keys;
});

# 3. A partition of a table partitioned by scope, for the unscoped claims.
$node->safe_psql(
	'postgres', q{
DELETE FROM idempotency.keys WHERE scope <> '';
CREATE TABLE all_keys (LIKE idempotency.keys) PARTITION BY LIST (scope);
ALTER TABLE all_keys ATTACH PARTITION idempotency.keys FOR VALUES IN ('');
});
claims_during('partition',
	'REINDEX INDEX CONCURRENTLY idempotency.keys_pkey');
is(idem_sqlstate($node, q{SELECT idempotency.claim('maint-1', '\x01', scope => 'elsewhere')}),
	'23514', 'a claim outside the partition fails with 23514');
is($node->safe_psql('postgres', q{SELECT count(*) FROM idempotency.keys WHERE scope <> ''}),
	'0', '... and writes nothing');

done_testing();
