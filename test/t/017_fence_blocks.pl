# Fences handed out from a block in shared memory (1.6): one durable advance
# of the fence sequence covers a block of claims, and every fence handed out
# stays at or below the sequence's value, whatever happens to the server or
# the sequence.
#
# - Many claims advance the sequence once, and no fence is above it.
# - kill -9 after many claims with synchronous_commit off (nothing but the
#   block's own flush made anything durable): no fence comes back.
# - DROP and CREATE EXTENSION while another backend keeps its session: the
#   new sequence's fences, never the rest of the old block.
# - A DBA's setval takes effect at the next claim, up or down.
# - Two databases: each its own block, from its own sequence.
# - A DBA's MAXVALUE: a block stops at it, and past it a claim fails as
#   nextval does.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib $FindBin::RealBin;

use IdemCrash;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = idem_node('fence_blocks');
$node->append_conf('postgresql.conf', q{
synchronous_commit = off
wal_writer_delay = 10s
idempotency.reaper_naptime = '1h'
});
idem_start($node);
$node->safe_psql('postgres', 'CREATE EXTENSION idempotency');

# Claims n new keys named prefix-1..n in one statement; returns their fences.
sub claim_many
{
	my ($db, $prefix, $n) = @_;
	return split /\n/, $node->safe_psql($db, qq{
		SELECT c.fence FROM pg_catalog.generate_series(1, $n) AS g,
			LATERAL idempotency.claim('$prefix-' OPERATOR(pg_catalog.||) g, '\\x01') AS c
		ORDER BY g});
}

# The fence sequence's value in database db.
sub seq_value
{
	my ($db) = @_;
	return $node->safe_psql($db, 'SELECT last_value FROM idempotency.fence_seq');
}

# Whether the list is strictly increasing.
sub increasing
{
	my @l = @_;
	for my $i (1 .. $#l) { return 0 unless $l[$i] > $l[ $i - 1 ]; }
	return 1;
}

# One advance of the sequence covers many claims.
my ($first) = claim_many('postgres', 'one', 1);
my $after_one = seq_value('postgres');
my @fences = claim_many('postgres', 'many', 300);
is(seq_value('postgres'), $after_one,
	'300 more claims leave the fence sequence where the first one put it');
ok(increasing($first, @fences), 'the fences increase claim after claim');
cmp_ok($fences[-1], '<=', $after_one, 'and none is above the sequence');

# kill -9 after many claims: the block's advance was flushed, the commits
# were not.  No fence handed out comes again.
my @before = ($first, @fences, claim_many('postgres', 'more', 300));
idem_crash_restart($node);
my @after = (claim_many('postgres', 'many', 300), claim_many('postgres', 'fresh', 300));
my $max_before = (sort { $a <=> $b } @before)[-1];
my %seen = map { $_ => 1 } @before;
is(scalar(grep { $seen{$_} } @after), 0, 'after kill -9, no fence handed out before comes again');
cmp_ok($after[0], '>', $max_before, 'every fence after the crash is above every fence before it');

# DROP and CREATE EXTENSION while another session that drew fences stays
# connected: its next claim comes from the new sequence.
my $other = $node->background_psql('postgres');
my $old = $other->query_safe(q{SELECT fence FROM idempotency.claim('kept', '\x01')});
$node->safe_psql('postgres', 'DROP EXTENSION idempotency; CREATE EXTENSION idempotency');
my $new = $other->query_safe(q{SELECT fence FROM idempotency.claim('kept', '\x01')});
my $new_seq = seq_value('postgres');
cmp_ok($new, '<=', $new_seq,
	"after DROP and CREATE EXTENSION, the fence ($new; $old before) is the new sequence's ($new_seq)");
my ($fresh) = claim_many('postgres', 'recreated', 1);
cmp_ok($fresh, '>', $new, 'and the next claim of another session goes on above it');
$other->quit;

# A DBA's setval holds from the next claim on, raised or moved back.
$node->safe_psql('postgres', q{SELECT pg_catalog.setval('idempotency.fence_seq', 5000000)});
my ($raised) = claim_many('postgres', 'raised', 1);
cmp_ok($raised, '>', 5000000, 'a raised sequence: the next fence is above the new value');
$node->safe_psql('postgres', q{SELECT pg_catalog.setval('idempotency.fence_seq', 7)});
my ($lowered) = claim_many('postgres', 'lowered', 1);
cmp_ok($lowered, '<=', seq_value('postgres'),
	'a sequence moved back: the next fence is the sequence\'s (the DBA\'s choice)');

# A takeover's fence stays above the record's, also from a sequence moved
# back: it is drawn at least the old fence + 1.
my ($short) = split /\n/, $node->safe_psql('postgres',
	q{SELECT fence FROM idempotency.claim('short', '\x01', lease => '1 microsecond')});
$node->safe_psql('postgres', q{SELECT pg_catalog.setval('idempotency.fence_seq', 7)});
my ($outcome, $attempt, $taken) = split /\|/, $node->safe_psql('postgres',
	q{SELECT outcome, attempt, fence FROM idempotency.claim('short', '\x01')});
is("$outcome $attempt", 'new 2', 'the ended lease is taken over');
cmp_ok($taken, '>', $short, 'with a fence above the first owner\'s');
cmp_ok($taken, '<=', seq_value('postgres'), 'and not above the sequence');

# Concurrent claims, with a DBA's nextval now and then (each ends the block
# in use): every fence and every value the DBA drew is distinct, and none
# is above the sequence.
my $dir = PostgreSQL::Test::Utils::tempdir;
PostgreSQL::Test::Utils::append_to_file("$dir/claim.sql", q{
INSERT INTO drawn SELECT fence FROM idempotency.claim(pg_catalog.gen_random_uuid()::text, '\x01')
	WHERE outcome OPERATOR(pg_catalog.=) 'new';
});
PostgreSQL::Test::Utils::append_to_file("$dir/nextval.sql",
	q{INSERT INTO drawn VALUES (pg_catalog.nextval('idempotency.fence_seq'));});
$node->safe_psql('postgres', 'CREATE TABLE drawn (f bigint NOT NULL)');
$node->command_ok(
	[ 'pgbench', '-n', '-c', '4', '-j', '2', '-t', '300', '-f', "$dir/claim.sql\@20",
		'-f', "$dir/nextval.sql\@1", 'postgres' ],
	'4 clients claim 1200 times, with a nextval of the fence sequence now and then');
is($node->safe_psql('postgres', q{
	SELECT count(*) = 1200, count(*) = count(DISTINCT f),
		max(f) <= (SELECT last_value FROM idempotency.fence_seq)
	FROM drawn}),
	't|t|t', 'every fence and nextval is distinct, and none is above the sequence');

# Two databases, each its own sequence and block.
$node->safe_psql('postgres', 'CREATE DATABASE second');
$node->safe_psql('second', 'CREATE EXTENSION idempotency');
$node->safe_psql('postgres', q{SELECT pg_catalog.setval('idempotency.fence_seq', 9000000)});
my @p = claim_many('postgres', 'db-a', 5);
my @s = claim_many('second', 'db-b', 5);
my @p2 = claim_many('postgres', 'db-a2', 5);
ok(increasing(@p, @p2), 'the first database\'s fences go on increasing');
cmp_ok($p2[-1], '<=', seq_value('postgres'), 'within its own sequence');
ok(increasing(@s), 'the second database\'s fences increase');
cmp_ok($s[-1], '<=', seq_value('second'), 'within its own sequence, not the first database\'s block');

# A DBA's MAXVALUE 10 above the sequence (a nextval first ends the block in
# use): the block drawn next stops at it, so ten claims get the ten fences
# below it, and the next claim fails with nextval's own error.
my $drawn = $node->safe_psql('postgres', q{SELECT pg_catalog.nextval('idempotency.fence_seq')});
my $top = $drawn + 10;
$node->safe_psql('postgres', "ALTER SEQUENCE idempotency.fence_seq MAXVALUE $top");
my @capped = claim_many('postgres', 'capped', 10);
is(join(' ', @capped), join(' ', map { $drawn + $_ } 1 .. 10),
	'under a MAXVALUE 10 above the sequence, ten claims get the ten fences up to it');
my ($rc, $out, $err) = $node->psql('postgres',
	q{SELECT fence FROM idempotency.claim('past-max', '\x01')});
like($err, qr/reached maximum value of sequence "fence_seq" \($top\)/,
	'the next claim fails as nextval does');
is($node->safe_psql('postgres',
	q{SELECT count(*) FROM idempotency.keys WHERE key OPERATOR(pg_catalog.=) 'past-max'}),
	'0', 'and writes nothing');

$node->stop;
done_testing();
