# A large response: with idempotency.max_response_bytes raised to 64 MB, a
# body of exactly 64 MB is stored, survives an immediate shutdown (crash
# recovery) and replays byte for byte to the client; one byte more is
# refused with 54000 and leaves the claim as it was.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib $FindBin::RealBin;

use IdemCrash;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $size = 64 * 1024 * 1024;

# The body: random bytes (they do not compress), kept here to compare the
# replay with and handed to the server through a file.
my $body_file = "$PostgreSQL::Test::Utils::tmp_check/body.bin";
my $expected;
open(my $random, '<:raw', '/dev/urandom') or die "could not open /dev/urandom: $!";
read($random, $expected, $size) == $size or die "short read from /dev/urandom";
close $random;
open(my $fh, '>:raw', $body_file) or die "could not write \"$body_file\": $!";
print $fh $expected;
close $fh or die "could not write \"$body_file\": $!";

my $node = idem_node('large_response');
idem_start($node);
$node->safe_psql(
	'postgres', qq{
CREATE EXTENSION idempotency;
CREATE TABLE big AS SELECT pg_read_binary_file('$body_file') AS b;
});
is($node->safe_psql('postgres', 'SELECT length(b) FROM big'),
	$size, 'the 64 MB body is ready');

my $fence = $node->safe_psql('postgres',
	q{SELECT fence FROM idempotency.claim('big', '\x0b'::bytea)});

# The claim as it is before a complete: state, fence, stored response.
my $claim_state = q{
SELECT state, fence, status_code IS NULL, body IS NULL, completed_at IS NULL
FROM idempotency.keys WHERE key = 'big'};
my $untouched = "in_progress|$fence|t|t|t";
is($node->safe_psql('postgres', $claim_state), $untouched, 'claimed');

is( idem_sqlstate($node,
		"SELECT idempotency.complete('big', $fence, 200, (SELECT b FROM big))"),
	'54000', '64 MB is refused under the default limit');

my $raise = "SET idempotency.max_response_bytes = '64MB';";
is( idem_sqlstate($node,
		"$raise SELECT idempotency.complete('big', $fence, 200,
			(SELECT b || '\\x00'::bytea FROM big))"),
	'54000', '64 MB + 1 byte is refused with the limit at 64 MB');
is($node->safe_psql('postgres', $claim_state),
	$untouched, 'a refused body leaves the claim as it was');

is( idem_sqlstate($node,
		"$raise SELECT idempotency.complete('big', $fence, 200,
			(SELECT b FROM big), '{\"content-type\": \"application/octet-stream\"}')"),
	'54000', '64 MB and headers are refused with the limit at 64 MB: headers count');
is( $node->safe_psql(
		'postgres', "$raise SELECT idempotency.complete('big', $fence, 200,
			(SELECT b FROM big))"
	),
	'stored',
	'exactly 64 MB is stored with the limit at 64 MB');

# Crash recovery has to replay the 64 MB from the WAL.
$node->stop('immediate');
idem_start($node);

is( $node->safe_psql(
		'postgres', q{
SELECT c.outcome, c.status_code, length(c.body), c.body = big.b, c.headers
FROM idempotency.claim('big', '\x0b'::bytea) c, big}),
	"replay|200|$size|t|",
	'the 64 MB response survived the restart');

# Byte for byte at the client, against a body rebuilt here.
my $replayed = $node->safe_psql('postgres',
	q{SELECT body FROM idempotency.claim('big', '\x0b'::bytea)});
ok($replayed =~ s/^\\x//, 'the client received a bytea');
is(length($replayed), 2 * $size, 'the client received 64 MB');
ok(pack('H*', $replayed) eq $expected,
	'the client received the body byte for byte');

$node->stop;
unlink $body_file;
done_testing();
