# A DBA's additions to a Citus worker's shard of idempotency.keys apply to
# the calls the coordinator delegates there, as on a single server: a column
# with NOT NULL and a DEFAULT, a CHECK constraint and a trigger on the shard
# (which then sees the fixed search_path); a changed column type on the
# shard is a clear error, never a crash.  Shards as Citus makes them carry
# none of this, and keep the direct writes.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib $FindBin::RealBin;

use IdemCitus;
use IdemCrash;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

citus_skip_unless_installed();

my ($coord, $workers) = citus_cluster();

# Runs SQL on the coordinator's database.
sub cq { return $coord->safe_psql('postgres', $_[0]); }

cq(q{CREATE TABLE charges (tenant text COLLATE "C" NOT NULL, id bigserial,
	 amount int NOT NULL, PRIMARY KEY (tenant, id));
	 SELECT create_distributed_table('charges', 'tenant');
	 SELECT idempotency.citus_distribute('charges');});

my $w = citus_worker_of($coord, $workers, 'acct_1');
my $shard = "idempotency.keys_" . citus_shard_of($coord, 'acct_1');

is($w->safe_psql('postgres',
		"SELECT count(*) FROM pg_trigger WHERE tgrelid = '$shard'::regclass"),
	'0', 'a shard as Citus makes it has no trigger');

# The DBA's additions, on the worker's shard only (Citus makes functions on
# the coordinator, and propagates them).
cq(q{CREATE FUNCTION public.keys_seen_trigger() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO public.keys_seen VALUES (TG_OP, NEW.key, current_setting('search_path'));
  RETURN NULL;
END $$;});
$w->safe_psql(
	'postgres', qq{
ALTER TABLE $shard ADD COLUMN region text NOT NULL DEFAULT 'eu';
ALTER TABLE $shard ADD CONSTRAINT keys_short_key CHECK (length(key) <= 12);
CREATE TABLE public.keys_seen (op text, key text, path text);
CREATE TRIGGER keys_seen AFTER INSERT OR UPDATE ON $shard
  FOR EACH ROW EXECUTE FUNCTION public.keys_seen_trigger();
});

my ($outcome, $fence) = split /\|/,
  cq(q{SELECT outcome, fence FROM idempotency.claim('short', '\x01', 'acct_1')});
is($outcome, 'new', 'a claim delegated to the DBA\'s shard is new');
is(cq(qq{SELECT idempotency.complete('short', $fence, 201, 'ok', scope => 'acct_1')}),
	'stored', 'and completes');
is($w->safe_psql('postgres', "SELECT region FROM $shard WHERE key = 'short'"),
	'eu', 'the row got the DBA\'s default');
is($w->safe_psql('postgres',
		"SELECT string_agg(op || ' ' || path, ', ' ORDER BY op) FROM public.keys_seen"),
	'INSERT pg_catalog, pg_temp, UPDATE pg_catalog, pg_temp',
	'the shard\'s trigger fired for the insert and the update, with the fixed search_path');
is(idem_sqlstate($coord, q{SELECT idempotency.claim('a-very-long-key', '\x01', 'acct_1')}),
	'23514', 'the shard\'s CHECK constraint refuses a claim through the coordinator');
is($w->safe_psql('postgres', "SELECT count(*) FROM $shard WHERE key = 'a-very-long-key'"),
	'0', 'and nothing was written');

# A changed column type on the shard: a clear error, and the node lives.
my $log_offset = -s $w->logfile;
$w->safe_psql('postgres', "ALTER TABLE $shard ALTER COLUMN attempt TYPE numeric");
is(idem_sqlstate($coord, q{SELECT idempotency.claim('typed', '\x01', 'acct_1')}),
	'42804', 'a changed column type on the shard is refused (42804)');
ok(!citus_crashed($w, $log_offset), 'no backend of the worker crashed');
$w->safe_psql('postgres', "ALTER TABLE $shard ALTER COLUMN attempt TYPE integer");
is(cq(q{SELECT outcome FROM idempotency.claim('typed', '\x01', 'acct_1')}),
	'new', 'with the type restored, claims work again');

citus_stop($coord, $workers);
done_testing();
