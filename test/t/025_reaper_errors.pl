# The reaper where a database owner made the database read-only by default
# (it still reaps), and where reaping fails: the failure is reported in
# idempotency.stats with its database's name, and a success in another
# database does not hide it; a later success in the same database does.

use strict;
use warnings FATAL => 'all';

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = PostgreSQL::Test::Cluster->new('reaper_errors');
$node->init;
$node->append_conf('postgresql.conf', q{
shared_preload_libraries = 'idempotency'
idempotency.reaper_naptime = '1h'
});
$node->start;

for my $db ('readonly', 'failing')
{
	$node->safe_psql('postgres', "CREATE DATABASE $db");
	$node->safe_psql($db, q{
		CREATE EXTENSION idempotency;
		SELECT count(idempotency.claim('dead' || g, '\x01', lease => '1 ms',
									   retention => '1 ms'))
		FROM generate_series(1, 10) g;
	});
}
$node->safe_psql('postgres',
	'ALTER DATABASE readonly SET default_transaction_read_only = on');
# In this one every deletion from the table fails.
$node->safe_psql('failing', q{
	CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql
	  AS $$ BEGIN RAISE EXCEPTION 'deletion refused by the test'; END $$;
	CREATE TRIGGER refuse BEFORE DELETE ON idempotency.keys
	  FOR EACH ROW EXECUTE FUNCTION refuse();
});

$node->safe_psql('postgres', q{
	ALTER SYSTEM SET idempotency.reaper_naptime = '1s';
	SELECT pg_reload_conf();
});

ok( $node->poll_query_until('readonly', 'SELECT count(*) = 0 FROM idempotency.keys'),
	'a database read-only by default is reaped');
ok( $node->poll_query_until('readonly',
		q{SELECT last_reap_error LIKE 'in database "failing": deletion refused by the test%'
		  FROM idempotency.stats}),
	'the failure names its database');

# Two more cycles: the read-only database keeps succeeding after the failure.
my $runs = $node->safe_psql('readonly', 'SELECT reaper_runs FROM idempotency.stats');
ok( $node->poll_query_until('readonly',
		"SELECT reaper_runs >= $runs + 4 FROM idempotency.stats"),
	'the reaper keeps visiting both databases');
like( $node->safe_psql('readonly', 'SELECT last_reap_error FROM idempotency.stats'),
	qr/^in database "failing": /,
	'a success in another database does not hide the failure');

$node->safe_psql('failing', 'DROP TRIGGER refuse ON idempotency.keys');
ok( $node->poll_query_until('failing',
		'SELECT count(*) = 0 FROM idempotency.keys'),
	'once the cause is gone, the database is reaped');
ok( $node->poll_query_until('failing',
		'SELECT last_reap_error IS NULL FROM idempotency.stats'),
	'and its success clears the failure');

$node->stop;
done_testing();
