# A crash between claim and complete: kill -9 of the postmaster with a
# completed record, a committed claim and a claim whose transaction is still
# open.  After the restart the completed response replays byte for byte, the
# committed claim is in_progress until its lease ends and is then taken over
# with a larger fence, and the uncommitted claim is gone.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib $FindBin::RealBin;

use IdemCrash;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

# The server's clock is moved forward to end the lease: the test never waits
# for wall-clock time to pass.
my $node = idem_node('crash_claim', faketime => 1);
idem_start($node);
$node->safe_psql('postgres', 'CREATE EXTENSION idempotency');

# Every byte value, both ways, then a multibyte character and CR LF: the
# replay must give back exactly these bytes.
my $body_hex = join('', map { sprintf('%02x', $_) } (0 .. 255, reverse(0 .. 255)))
  . unpack('H*', "caf\xc3\xa9\r\n");
my $headers = '{"content-type": "application/octet-stream", "x-request-id": "r-1"}';

# Runs SQL that must succeed; returns its output (unaligned, tuples only).
sub sql
{
	my ($query) = @_;
	return $node->safe_psql('postgres', $query);
}

# 1. A completed record.
my ($fence_done) = split /\|/, sql(
	q{SELECT fence FROM idempotency.claim('key-done', '\x01'::bytea)});
is( sql(qq{SELECT idempotency.complete('key-done', $fence_done, 201,
			'\\x$body_hex'::bytea, '$headers'::jsonb)}),
	'stored', 'first key completed');

# 2. A committed claim whose owner then dies: a lease of ten minutes, so
# that it is still live when the server is back (the clock is not moved
# before that check).
my ($fence_claimed, $attempt_claimed) = split /\|/, sql(
	q{SELECT fence, attempt FROM idempotency.claim('key-claimed', '\x02'::bytea,
		lease => '10 min')});
is($attempt_claimed, '1', 'second key claimed, attempt 1');
cmp_ok($fence_claimed, '>', $fence_done, 'second claim has a larger fence');

# 3. A claim in a transaction that is still open when the server dies: its
# client cannot tell whether it committed, and may come back with its fence
# after the restart.  The checkpoint makes this claim's fence the first
# that the fence sequence logs after it, in WAL that nothing has flushed.
sql('CHECKPOINT');
my $open = $node->background_psql('postgres');
$open->query_safe('BEGIN');
my $fence_open = $open->query_safe(
	q{SELECT fence FROM idempotency.claim('key-open', '\x03'::bytea)});
like($fence_open, qr/^\d+$/, 'third key claimed in an open transaction');
is( sql(q{SELECT count(*) FROM idempotency.lookup('key-open')}),
	'0', 'the uncommitted claim is invisible to other sessions');

idem_crash_restart($node);
# The open session's connection died with the server.
$open->quit;

# The completed record: intact, and replayed byte for byte.
is( sql(q{SELECT state, status_code, encode(body, 'hex'), headers
		FROM idempotency.lookup('key-done')}),
	"completed|201|$body_hex|$headers",
	'completed record survived the crash');
is( sql(q{SELECT outcome, status_code, encode(body, 'hex'), headers
		FROM idempotency.claim('key-done', '\x01'::bytea)}),
	"replay|201|$body_hex|$headers",
	'completed record replays byte for byte after the crash');

# The committed claim: still owned by the dead owner, whose lease runs on.
my ($outcome, $retry_after) = split /\|/, sql(
	q{SELECT outcome, retry_after FROM idempotency.claim('key-claimed', '\x02'::bytea)});
is($outcome, 'in_progress', 'committed claim is in_progress after the crash');
ok($retry_after >= 1 && $retry_after <= 600,
	"retry_after ($retry_after) is within the lease");
is( sql(q{SELECT state, attempt FROM idempotency.lookup('key-claimed')}),
	'in_progress|1', 'committed claim kept its attempt');

# The uncommitted claim: gone; the key is free.
is( sql(q{SELECT count(*) FROM idempotency.lookup('key-open')}),
	'0', 'uncommitted claim is gone after the crash');
my ($outcome_open, $fence_reclaimed, $attempt_open) = split /\|/, sql(
	q{SELECT outcome, fence, attempt FROM idempotency.claim('key-open', '\x03'::bytea)});
is("$outcome_open|$attempt_open", 'new|1',
	'the key of the uncommitted claim is claimed anew, attempt 1');
cmp_ok($fence_reclaimed, '>', $fence_claimed,
	'a claim after the crash has a larger fence than every committed one');

# The uncommitted claim's client comes back with its fence: the key now
# belongs to someone else, so its fence must be new and the old one fenced
# out.  This holds because claim flushes the fence sequence's WAL before it
# hands a fence out.
cmp_ok($fence_reclaimed, '>', $fence_open,
	'the claim after the crash has a larger fence than the uncommitted one');
is( idem_sqlstate($node,
		qq{SELECT idempotency.complete('key-open', $fence_open, 200)}),
	'IK001', 'the uncommitted claim\'s fence cannot complete the new claim');

# End the lease: move the server's clock past it.
idem_clock_advance($node, 3600);

my ($outcome_takeover, $fence_takeover, $attempt_takeover) = split /\|/, sql(
	q{SELECT outcome, fence, attempt FROM idempotency.claim('key-claimed', '\x02'::bytea)});
is("$outcome_takeover|$attempt_takeover", 'new|2',
	'once the lease ended, the committed claim is taken over (attempt 2)');
cmp_ok($fence_takeover, '>', $fence_claimed,
	'the takeover has a larger fence than the dead owner');
cmp_ok($fence_takeover, '>', $fence_reclaimed,
	'the takeover has a larger fence than any fence handed out before it');

# The dead owner's fence no longer completes; the new owner's does.
is( idem_sqlstate($node,
		qq{SELECT idempotency.complete('key-claimed', $fence_claimed, 200)}),
	'IK001', 'the dead owner cannot complete after the takeover');
is( sql(qq{SELECT idempotency.complete('key-claimed', $fence_takeover, 200,
			'\\x6f6b'::bytea)}),
	'stored', 'the new owner completes');
is( sql(q{SELECT outcome, status_code, encode(body, 'hex')
		FROM idempotency.claim('key-claimed', '\x02'::bytea)}),
	'replay|200|6f6b', 'the new owner\'s response replays');

# An hour later the first record still replays (retention is a day).
is( sql(q{SELECT outcome, encode(body, 'hex')
		FROM idempotency.claim('key-done', '\x01'::bytea)}),
	"replay|$body_hex", 'completed record still replays after the clock moved');

$node->stop;
done_testing();
