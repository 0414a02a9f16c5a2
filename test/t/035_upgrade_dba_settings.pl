# The update from 1.1 to 1.2 makes idempotency.keys again.  What a DBA set
# on the table comes along (owner, reloptions of the table, its TOAST table
# and its indexes, tablespaces, columns' storage, compression, statistics
# target and options, an index expression's statistics target, statistics
# objects, the CLUSTER mark, the replica identity, UNLOGGED, comments); what
# it cannot carry (a view or another object that depends on the table,
# inheritance, partitioning, column privileges, a column's changed type,
# default or NOT NULL, a sequence owned by a column, row-level security)
# makes it refuse with 55000, naming each, and change nothing.

use strict;
use warnings FATAL => 'all';
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use FindBin;
use lib $FindBin::RealBin;
use IdemCrash;

my $node = idem_node('upgrade_settings');
$node->append_conf('postgresql.conf', "idempotency.reaper_naptime = '1h'");
idem_start($node);
$node->safe_psql('postgres',
	'CREATE ROLE keys_keeper NOLOGIN; CREATE ROLE stats_keeper NOLOGIN; CREATE ROLE reader NOLOGIN');

# A database with the extension at 1.1 and three records.
sub database_at_1_1
{
	my ($db) = @_;
	$node->safe_psql('postgres', "CREATE DATABASE $db");
	$node->safe_psql(
		$db, q{
CREATE EXTENSION idempotency VERSION '1.1';
SELECT idempotency.complete('done', (SELECT fence FROM idempotency.claim('done', '\x0a', 'acct_1')),
							201, 'stored body', scope => 'acct_1');
SELECT idempotency.claim('open', '\x0b', 'acct_2', lease => '1 hour');
SELECT idempotency.claim('other', '\x0c', 'acct_1', lease => '1 hour');
});
	return;
}

# The records, as text, in a fixed order.
my $records_sql = q{SELECT string_agg(format('%s %s %s %s %s', scope, key, state, fence, body), '; '
									  ORDER BY scope, key) FROM idempotency.keys};

# Each setting a DBA may make, with the statement that makes it and a query
# that reads it back.
my @settings = (
	[ 'the owner of the table',
		'ALTER TABLE idempotency.keys OWNER TO keys_keeper; GRANT USAGE ON SCHEMA idempotency TO keys_keeper',
		q{SELECT relowner::regrole FROM pg_class WHERE oid = 'idempotency.keys'::regclass} ],
	[ 'the reloptions of the table',
		q{ALTER TABLE idempotency.keys SET (fillfactor = 70, autovacuum_vacuum_scale_factor = 0.01,
										   autovacuum_analyze_threshold = 500)},
		q{SELECT reloptions FROM pg_class WHERE oid = 'idempotency.keys'::regclass} ],
	[ 'the reloptions of its TOAST table',
		'ALTER TABLE idempotency.keys SET (toast.autovacuum_enabled = false)',
		q{SELECT t.reloptions FROM pg_class c JOIN pg_class t ON t.oid = c.reltoastrelid
		  WHERE c.oid = 'idempotency.keys'::regclass} ],
	[ 'the reloptions of the primary key',
		'ALTER INDEX idempotency.keys_pkey SET (fillfactor = 80)',
		q{SELECT reloptions FROM pg_class WHERE oid = 'idempotency.keys_pkey'::regclass} ],
	[ 'the reloptions of the expiry index',
		'ALTER INDEX idempotency.keys_expiry_second_idx SET (fillfactor = 60, deduplicate_items = off)',
		q{SELECT reloptions FROM pg_class WHERE oid = 'idempotency.keys_expiry_second_idx'::regclass} ],
	[ 'the storage of columns',
		'ALTER TABLE idempotency.keys ALTER COLUMN body SET STORAGE EXTERNAL, ALTER COLUMN headers SET STORAGE MAIN',
		q{SELECT string_agg(attname || '=' || attstorage::text, ',' ORDER BY attname) FROM pg_attribute
		  WHERE attrelid = 'idempotency.keys'::regclass AND attname IN ('body', 'headers')} ],
	[ 'the statistics targets of columns',
		'ALTER TABLE idempotency.keys ALTER COLUMN scope SET STATISTICS 1000, ALTER COLUMN expires_at SET STATISTICS 0',
		q{SELECT string_agg(attname || '=' || attstattarget, ',' ORDER BY attname) FROM pg_attribute
		  WHERE attrelid = 'idempotency.keys'::regclass AND attname IN ('scope', 'expires_at')} ],
	[ 'the compression of a column',
		'ALTER TABLE idempotency.keys ALTER COLUMN recovery_state SET COMPRESSION pglz',
		q{SELECT attcompression::text FROM pg_attribute
		  WHERE attrelid = 'idempotency.keys'::regclass AND attname = 'recovery_state'} ],
	[ 'the options of a column',
		'ALTER TABLE idempotency.keys ALTER COLUMN scope SET (n_distinct = 50)',
		# (Debian's 15.20 adds an option pg_attver of its own)
		q{SELECT array_agg(o) FROM pg_attribute, unnest(attoptions) o
		  WHERE attrelid = 'idempotency.keys'::regclass AND attname = 'scope' AND o NOT LIKE 'pg_attver=%'} ],
	[ 'the statistics target of the expiry index\'s expression',
		'ALTER INDEX idempotency.keys_expiry_second_idx ALTER COLUMN 1 SET STATISTICS 400',
		q{SELECT attstattarget FROM pg_attribute
		  WHERE attrelid = 'idempotency.keys_expiry_second_idx'::regclass AND attnum = 1} ],
	[ 'a statistics object, its owner, target and comment',
		q{CREATE STATISTICS public.keys_scope_owner (ndistinct, dependencies) ON scope, owner FROM idempotency.keys;
		  ALTER STATISTICS public.keys_scope_owner OWNER TO stats_keeper;
		  ALTER STATISTICS public.keys_scope_owner SET STATISTICS 300;
		  COMMENT ON STATISTICS public.keys_scope_owner IS 'the scopes of each role'},
		q{SELECT pg_get_statisticsobjdef(oid) || ' owner ' || stxowner::regrole || ' target ' || stxstattarget
				 || ' comment ' || obj_description(oid, 'pg_statistic_ext')
				 || ' member ' || EXISTS (SELECT FROM pg_depend WHERE objid = s.oid AND deptype = 'e')
		  FROM pg_statistic_ext s WHERE stxrelid = 'idempotency.keys'::regclass} ],
	[ 'the CLUSTER mark',
		'ALTER TABLE idempotency.keys CLUSTER ON keys_expiry_second_idx',
		q{SELECT string_agg(indexrelid::regclass::text, ',') FROM pg_index
		  WHERE indrelid = 'idempotency.keys'::regclass AND indisclustered} ],
	[ 'the UNLOGGED mark',
		'ALTER TABLE idempotency.keys SET UNLOGGED',
		q{SELECT relpersistence::text FROM pg_class WHERE oid = 'idempotency.keys'::regclass} ],
	[ 'the comments on the table, a column, an index and the primary key constraint',
		q{COMMENT ON TABLE idempotency.keys IS 'records of the payments API';
		  COMMENT ON COLUMN idempotency.keys.body IS 'the response body';
		  COMMENT ON INDEX idempotency.keys_expiry_second_idx IS 'for the reaper';
		  COMMENT ON CONSTRAINT keys_pkey ON idempotency.keys IS 'one record per key'},
		q{SELECT obj_description('idempotency.keys'::regclass, 'pg_class') || ' / '
				 || col_description('idempotency.keys'::regclass,
									(SELECT attnum FROM pg_attribute WHERE attrelid = 'idempotency.keys'::regclass
									 AND attname = 'body')) || ' / '
				 || obj_description('idempotency.keys_expiry_second_idx'::regclass, 'pg_class') || ' / '
				 || obj_description((SELECT oid FROM pg_constraint WHERE conname = 'keys_pkey'
									 AND conrelid = 'idempotency.keys'::regclass), 'pg_constraint')} ],
);

# Settings that today's update refused: a replica identity, tablespaces.
my $tablespace_dir = PostgreSQL::Test::Utils::tempdir();
$node->safe_psql('postgres', "CREATE TABLESPACE keys_space LOCATION '$tablespace_dir'");
my @refused_before = (
	[ 'the replica identity',
		'ALTER TABLE idempotency.keys REPLICA IDENTITY FULL',
		q{SELECT relreplident::text FROM pg_class WHERE oid = 'idempotency.keys'::regclass} ],
	[ 'the tablespace of the table',
		'ALTER TABLE idempotency.keys SET TABLESPACE keys_space',
		q{SELECT spcname FROM pg_class c JOIN pg_tablespace t ON t.oid = c.reltablespace
		  WHERE c.oid = 'idempotency.keys'::regclass} ],
	[ 'the tablespace of the primary key',
		'ALTER INDEX idempotency.keys_pkey SET TABLESPACE keys_space',
		q{SELECT spcname FROM pg_class c JOIN pg_tablespace t ON t.oid = c.reltablespace
		  WHERE c.oid = 'idempotency.keys_pkey'::regclass} ],
);

# Makes each setting in $db, updates, and checks that each is still there
# and the records are unchanged.
sub check_carried
{
	my ($db, @list) = @_;
	database_at_1_1($db);
	my %before;
	foreach my $s (@list)
	{
		my ($name, $make, $read) = @$s;
		my $default = $node->safe_psql($db, $read);
		$node->safe_psql($db, $make);
		$before{$name} = $node->safe_psql($db, $read);
		isnt($before{$name}, $default, "$db: $name set on 1.1: $before{$name}");
	}
	my $records = $node->safe_psql($db, $records_sql);
	my ($ret, $stdout, $stderr) =
	  $node->psql($db, "ALTER EXTENSION idempotency UPDATE TO '1.2'");
	is($ret, 0, "$db: the update to 1.2 succeeds $stderr");
	foreach my $s (@list)
	{
		my ($name, undef, $read) = @$s;
		is($node->safe_psql($db, $read), $before{$name}, "$db: the update keeps $name");
	}
	is($node->safe_psql($db, $records_sql), $records, "$db: the records are unchanged");
	is( $node->safe_psql(
			$db, q{SELECT outcome || ' ' || convert_from(body, 'UTF8')
				   FROM idempotency.claim('done', '\x0a', 'acct_1')}),
		'replay stored body',
		"$db: a completed record replays after the update");
	return;
}

check_carried('carried', @settings);
check_carried('carried_refused_before', @refused_before);

# What the update cannot carry: each is refused, named, and nothing changes.
sub check_refused
{
	my ($db, $setup, @names) = @_;
	database_at_1_1($db);
	$node->safe_psql($db, $setup);
	my $state_sql = qq{SELECT extversion || ' ' || 'idempotency.keys'::regclass::oid || ' ' || ($records_sql)
					   FROM pg_extension WHERE extname = 'idempotency'};
	my $state = $node->safe_psql($db, $state_sql);
	my ($ret, $stdout, $stderr) = $node->psql($db,
		"\\set VERBOSITY verbose\nALTER EXTENSION idempotency UPDATE TO '1.2'");
	like($stderr, qr/ERROR:  55000: idempotency.keys carries objects that the update to 1.2 would lose/,
		"$db: the update is refused with 55000: $stderr");
	foreach my $name (@names)
	{
		like($stderr, qr/DETAIL:  The update makes the table again; it has [^\n]*\Q$name\E/,
			"$db: the refusal names $name");
	}
	unlike($stderr, qr/idempotency\.keys[^,]* depending on it/,
		"$db: the table's own objects are named once, not as objects depending on it");
	is($node->safe_psql($db, $state_sql), $state,
		"$db: the refused update changed nothing (version, table, records)");
	return;
}

check_refused(
	'refused', q{
ALTER TABLE idempotency.keys ALTER COLUMN status_code TYPE bigint;
ALTER TABLE idempotency.keys ALTER COLUMN lease SET DEFAULT '1 minute';
UPDATE idempotency.keys SET recovery_point = '';
ALTER TABLE idempotency.keys ALTER COLUMN recovery_point SET NOT NULL;
CREATE VIEW public.open_keys AS SELECT scope, key FROM idempotency.keys WHERE state = 'in_progress';
CREATE TABLE public.orders (key text COLLATE "C", scope text COLLATE "C", owner regrole,
							FOREIGN KEY (key, scope, owner) REFERENCES idempotency.keys);
CREATE TABLE public.archive (record idempotency.keys);
CREATE TABLE public.keys_child () INHERITS (idempotency.keys);
CREATE TABLE public.keys_parent ();
ALTER TABLE idempotency.keys INHERIT public.keys_parent;
GRANT SELECT (scope, key) ON idempotency.keys TO reader;
CREATE SEQUENCE idempotency.keys_serial OWNED BY idempotency.keys.attempt;
ALTER TABLE idempotency.keys ADD CONSTRAINT attempt_positive CHECK (attempt > 0);
ALTER TABLE idempotency.keys FORCE ROW LEVEL SECURITY;
},
	'view public.open_keys depending on it',
	'orders_key_scope_owner_fkey',
	'table public.archive',
	'inheritance child public.keys_child',
	'inheritance parent public.keys_parent',
	'column privileges',
	'column status_code of type bigint',
	'default of column lease',
	'NOT NULL on column recovery_point',
	'sequence idempotency.keys_serial',
	'constraint attempt_positive',
	'row-level security');

check_refused(
	'refused_partition', q{
CREATE TABLE public.all_keys (LIKE idempotency.keys) PARTITION BY LIST (scope);
ALTER TABLE public.all_keys ATTACH PARTITION idempotency.keys FOR VALUES IN ('acct_1', 'acct_2');
},
	'partition of public.all_keys');

$node->stop;
done_testing();
