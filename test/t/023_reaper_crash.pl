# An immediate shutdown in the middle of reaping 200000 expired records:
# after the restart not one live record is lost or changed, and the reaper
# deletes the rest.  (The reaper commits asynchronously: deletions lost in
# the crash only leave expired records, which the next run deletes again.)

use strict;
use warnings FATAL => 'all';

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $expired = 200000;

my $node = PostgreSQL::Test::Cluster->new('reaper_crash');
$node->init;
# Batches of 100: the run takes long enough to be cut in the middle.  The
# naptime is set only once everything is loaded.
$node->append_conf('postgresql.conf', q{
shared_preload_libraries = 'idempotency'
idempotency.reaper_naptime = '1h'
idempotency.reaper_batch = 100
});
$node->start;
$node->safe_psql('postgres', 'CREATE EXTENSION idempotency');

# Live records of every kind: completed with a response, in progress with a
# live lease, in progress with an ended lease (a takeover candidate), and in
# progress with a live lease but an ended retention.
$node->safe_psql('postgres', q{
	SELECT count(idempotency.complete('live' || g, fence, 200,
									  convert_to('response ' || g, 'UTF8'),
									  '{"content-type": "text/plain"}'))
	FROM generate_series(1, 1000) g,
		 LATERAL idempotency.claim('live' || g, '\x01') c;
	SELECT count(idempotency.claim('owned' || g, '\x02', lease => '1 h'))
	FROM generate_series(1, 200) g;
	SELECT count(idempotency.claim('abandoned' || g, '\x03', lease => '1 ms'))
	FROM generate_series(1, 200) g;
	SELECT count(idempotency.claim('leased' || g, '\x04', lease => '1 h', retention => '1 h'))
	FROM generate_series(1, 200) g;
	-- The ended retention is set, not waited for (a claim and an extend
	-- need not fit in 1 ms on a loaded machine).
	UPDATE idempotency.keys SET expires_at = now() - interval '1 s' WHERE key LIKE 'leased%';
});

# The expired records, interleaved by expires_at with nothing live.
$node->safe_psql('postgres', qq{
	INSERT INTO idempotency.keys (fence, created_at, expires_at, completed_at,
		lease, attempt, status_code, state, owner, scope, key, fingerprint, body)
	SELECT nextval('idempotency.fence_seq'), now() - interval '2 days',
		now() - interval '1 day' + g * interval '1 ms', now() - interval '2 days',
		interval '1 min', 1, 200, 'completed', current_user::text::regrole,
		'tenant' || g % 7, 'expired' || g,
		'\\x01', '\\x00ff'
	FROM generate_series(1, $expired) g});

my $live_query = q{
	SELECT count(*), md5(string_agg(concat_ws('|', scope, key, fingerprint, state,
		fence, attempt, lease_expires_at, status_code, headers, encode(body, 'hex'),
		created_at, expires_at), ',' ORDER BY scope, key))
	FROM idempotency.keys WHERE key NOT LIKE 'expired%'};
my $live = $node->safe_psql('postgres', $live_query);
like($live, qr/^1600\|/, '1600 live records before the crash');

# Start the reaper; as soon as it has deleted some, stop the server hard.
$node->safe_psql('postgres', q{
	ALTER SYSTEM SET idempotency.reaper_naptime = '1s';
	SELECT pg_reload_conf()});
my $total = $expired + 1600;
ok( $node->poll_query_until('postgres',
		"SELECT count(*) < $total FROM idempotency.keys"),
	'the reaper has started deleting');
$node->stop('immediate');

$node->start;
my $left = $node->safe_psql('postgres',
	q{SELECT count(*) FROM idempotency.keys WHERE key LIKE 'expired%'});
note "expired records left after the restart: $left";
is($node->safe_psql('postgres', $live_query), $live,
	'right after the restart every live record is intact');

ok( $node->poll_query_until('postgres',
		q{SELECT count(*) = 0 FROM idempotency.keys WHERE key LIKE 'expired%'}),
	'the reaper deletes the rest after the restart');
is($node->safe_psql('postgres', $live_query), $live,
	'every live record is still intact');
is( $node->safe_psql('postgres',
		q{SELECT reaped > 0 AND last_reap_error IS NULL FROM idempotency.stats}),
	't', 'the reaper ran after the restart without an error');

$node->stop;
done_testing();
