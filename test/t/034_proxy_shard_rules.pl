# A DBA's additions to idempotency.keys on one PL/Proxy shard apply to the
# calls routed there, as they do on a single server: a column with NOT NULL
# and a DEFAULT, a CHECK constraint, a trigger, a second unique index; and
# the shard's own code sees the fixed search_path, not the proxy caller's.
# The other shard, untouched, keeps the direct writes.

use strict;
use warnings FATAL => 'all';
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use FindBin;
use lib $FindBin::RealBin;
use IdemProxy;

my $missing = proxy_requirements_missing();
plan skip_all => $missing if $missing;

my $c = proxy_cluster(shards => 2);
my $proxy = $c->{proxy};
my @shards = @{ $c->{shards} };

# Runs $sql on the proxy as the application role.
sub as_app { return $proxy->safe_psql('postgres', "SET ROLE app; $_[0]"); }

# A scope on each shard, by the rule.
my ($scope_dba, $scope_plain);
foreach my $s (map { "tenant_$_" } 1 .. 20)
{
	my $shard = $proxy->safe_psql('postgres', "SELECT idempotency.shard_of('$s', 2)");
	$scope_dba //= $s if $shard == 0;
	$scope_plain //= $s if $shard == 1;
}
my $dba = $shards[0];

# The DBA's additions, on shard 0 only.
$dba->safe_psql(
	'postgres', q{
ALTER TABLE idempotency.keys ADD COLUMN region text NOT NULL DEFAULT 'eu';
ALTER TABLE idempotency.keys ADD CONSTRAINT keys_short_key CHECK (length(key) <= 12);
CREATE UNIQUE INDEX keys_one_owner ON idempotency.keys (scope, key);
CREATE TABLE public.keys_seen (op text, key text, path text);
CREATE FUNCTION public.keys_seen_trigger() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO public.keys_seen VALUES (TG_OP, NEW.key, current_setting('search_path'));
  RETURN NULL;
END $$;
CREATE TRIGGER keys_seen AFTER INSERT OR UPDATE ON idempotency.keys
  FOR EACH ROW EXECUTE FUNCTION public.keys_seen_trigger();
GRANT INSERT ON public.keys_seen TO PUBLIC;
CREATE ROLE idem_other LOGIN;
GRANT USAGE ON SCHEMA idempotency TO idem_other;
});

# A new claim gets the default, fires the trigger, and completes.
my ($outcome, $fence) = split /\|/,
  as_app("SELECT outcome, fence FROM idempotency.claim('short', '\\x01', '$scope_dba')");
is($outcome, 'new', 'a claim on the DBA\'s shard is new');
is(as_app("SELECT idempotency.complete('short', $fence, 201, 'ok', scope => '$scope_dba')"),
	'stored', 'and completes');
is($dba->safe_psql('postgres', "SELECT region FROM idempotency.keys WHERE key = 'short'"),
	'eu', 'the row got the DBA\'s default');
is($dba->safe_psql('postgres', "SELECT string_agg(op || ' ' || path, ', ' ORDER BY op) FROM public.keys_seen"),
	'INSERT pg_catalog, pg_temp, UPDATE pg_catalog, pg_temp',
	'the DBA\'s trigger fired for the insert and the update, with the fixed search_path');
is($dba->safe_psql('postgres', "UPDATE idempotency.keys SET region = region; SELECT 'valid'"),
	'valid', 'the rows stay valid for an ordinary UPDATE');

# The CHECK constraint refuses a long key, with its SQLSTATE through the proxy; nothing is written.
is(sqlstate_of($proxy, "SELECT idempotency.claim('a-very-long-key', '\\x01', '$scope_dba')",
		role => 'app'),
	'23514', 'the shard\'s CHECK constraint refuses a claim through the proxy');
is($dba->safe_psql('postgres', "SELECT count(*) FROM idempotency.keys WHERE key = 'a-very-long-key'"),
	'0', 'and nothing was written');

# Another role's claim of the same key on that shard breaks the DBA's unique index: 23505.
is(sqlstate_of($dba, "SELECT idempotency.claim('short', '\\x01', '$scope_dba')",
		role => 'idem_other'),
	'23505', 'a second unique index is a unique violation (23505), not a retry loop');

# The untouched shard works as ever, without the DBA's column.
($outcome, $fence) = split /\|/,
  as_app("SELECT outcome, fence FROM idempotency.claim('a-very-long-key', '\\x01', '$scope_plain')");
is($outcome, 'new', 'the other shard takes the long key');
is(as_app("SELECT idempotency.complete('a-very-long-key', $fence, 201, 'ok', scope => '$scope_plain')"),
	'stored', 'and completes it');

proxy_stop($c);
done_testing();
