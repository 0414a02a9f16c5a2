# Every version step that the extension directory offers (idempotency--A--B.sql)
# gives, with ALTER EXTENSION idempotency UPDATE, exactly what a fresh
# CREATE EXTENSION of B gives: the same member objects, definitions, comments
# and privileges (the DBA's grants made before the update included); so does
# the whole path from the oldest version to the default one, which has an
# install script of its own.  Records written under A survive the update
# (columns the update adds are NULL) and still replay; fences keep growing.
# Every object a step adds has a comment.  A session that ran claims before
# the update to 1.2 writes tokens after it.  From 1.3, records in progress
# before the update are in idempotency.in_flight and counted by stats.

use strict;
use warnings FATAL => 'all';
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use FindBin;
use lib $FindBin::RealBin;
use IdemCrash;

my $node = idem_node('upgrade');
$node->append_conf('postgresql.conf', "idempotency.reaper_naptime = '1h'");
idem_start($node);

# The steps, from the file names in the installation's extension directory.
my $extdir = $node->config_data('--sharedir') . '/extension';
my @steps = sort map { m{/idempotency--([^-/]+)--([^-/]+)\.sql$} ? [ $1, $2 ] : () }
  glob("$extdir/idempotency--*--*.sql");
ok(@steps >= 1, 'the extension directory offers version steps: '
	  . join(', ', map { "$_->[0] -> $_->[1]" } @steps));

my $default = $node->safe_psql('postgres',
	"SELECT default_version FROM pg_available_extensions WHERE name = 'idempotency'");
ok(-f "$extdir/idempotency--$default.sql",
	"the default version $default has an install script of its own, "
	  . 'so that a fresh install is not the update path again');
# The whole path, in one ALTER EXTENSION UPDATE, when it has several steps.
push @steps, [ $steps[0][0], $default ] if $steps[0][0] ne $steps[-1][0];
is( $node->safe_psql(
		'postgres',
		"SELECT string_agg(source, ',' ORDER BY source) FROM pg_extension_update_paths('idempotency') "
		  . "WHERE target = '$default' AND source <> '$default' AND path IS NULL"),
	'',
	"every older version updates to the default version $default");

$node->safe_psql('postgres', 'CREATE ROLE upgrade_app');

# One line per fact about the extension's member objects (pg_depend deptype
# 'e'): identity, definition, comments, privileges and initial privileges.
# Definitions are flattened to one line each, so that sorting keeps them whole.
my $snapshot_sql = q{
WITH members AS (
	SELECT d.classid, d.objid, i.type, i.identity
	FROM pg_catalog.pg_depend d
	CROSS JOIN LATERAL pg_catalog.pg_identify_object(d.classid, d.objid, 0) i
	WHERE d.refclassid = 'pg_catalog.pg_extension'::regclass
	  AND d.refobjid = (SELECT oid FROM pg_catalog.pg_extension WHERE extname = 'idempotency')
	  AND d.deptype = 'e'
)
SELECT line FROM (
	SELECT m.type || ' ' || m.identity AS line FROM members m
  UNION ALL
	SELECT 'comment ' || m.identity || coalesce('.' || c.objsubid, '') || ': ' || c.description
	FROM members m JOIN pg_catalog.pg_description c
	  ON c.classoid = m.classid AND c.objoid = m.objid
  UNION ALL
	SELECT 'initprivs ' || m.identity || ' ' || p.objsubid || ' ' || p.privtype::text || ' ' || p.initprivs::text
	FROM members m JOIN pg_catalog.pg_init_privs p
	  ON p.classoid = m.classid AND p.objoid = m.objid
  UNION ALL
	SELECT 'function ' || pg_catalog.replace(pg_catalog.pg_get_functiondef(p.oid), E'\n', ' ') || ' acl ' || coalesce(p.proacl::text, 'default')
	FROM members m JOIN pg_catalog.pg_proc p ON m.classid = 'pg_catalog.pg_proc'::regclass AND p.oid = m.objid
  UNION ALL
	SELECT 'relation ' || m.identity || ' kind ' || c.relkind::text || ' acl ' || coalesce(c.relacl::text, 'default')
		|| ' options ' || coalesce(c.reloptions::text, '') || ' persistence ' || c.relpersistence::text
		|| ' rls ' || c.relrowsecurity
	FROM members m JOIN pg_catalog.pg_class c ON m.classid = 'pg_catalog.pg_class'::regclass AND c.oid = m.objid
  UNION ALL
	SELECT 'column ' || m.identity || '.' || a.attname || ' ' || a.attnum || ' '
		|| pg_catalog.format_type(a.atttypid, a.atttypmod) || ' notnull ' || a.attnotnull
		|| ' collation ' || coalesce(co.collname, '') || ' default ' || coalesce(pg_catalog.pg_get_expr(ad.adbin, ad.adrelid), '')
		|| ' acl ' || coalesce(a.attacl::text, 'default')
	FROM members m
	JOIN pg_catalog.pg_attribute a ON m.classid = 'pg_catalog.pg_class'::regclass AND a.attrelid = m.objid
	LEFT JOIN pg_catalog.pg_collation co ON co.oid = a.attcollation
	LEFT JOIN pg_catalog.pg_attrdef ad ON ad.adrelid = a.attrelid AND ad.adnum = a.attnum
	WHERE a.attnum > 0 AND NOT a.attisdropped
  UNION ALL
	SELECT 'index ' || pg_catalog.pg_get_indexdef(x.indexrelid)
	FROM members m JOIN pg_catalog.pg_index x ON m.classid = 'pg_catalog.pg_class'::regclass AND x.indrelid = m.objid
  UNION ALL
	SELECT 'constraint ' || m.identity || ' ' || k.conname || ' ' || pg_catalog.pg_get_constraintdef(k.oid)
	FROM members m JOIN pg_catalog.pg_constraint k ON m.classid = 'pg_catalog.pg_class'::regclass AND k.conrelid = m.objid
  UNION ALL
	SELECT 'trigger ' || pg_catalog.pg_get_triggerdef(t.oid)
	FROM members m JOIN pg_catalog.pg_trigger t ON m.classid = 'pg_catalog.pg_class'::regclass AND t.tgrelid = m.objid
	WHERE NOT t.tgisinternal
  UNION ALL
	SELECT 'view ' || m.identity || ' ' || pg_catalog.replace(pg_catalog.pg_get_viewdef(m.objid), E'\n', ' ')
	FROM members m JOIN pg_catalog.pg_class c ON m.classid = 'pg_catalog.pg_class'::regclass AND c.oid = m.objid
	WHERE c.relkind IN ('v', 'm')
  UNION ALL
	SELECT 'sequence ' || m.identity || ' ' || s.seqtypid::regtype || ' ' || s.seqstart || ' ' || s.seqincrement
		|| ' ' || s.seqmax || ' ' || s.seqmin || ' ' || s.seqcache || ' ' || s.seqcycle
	FROM members m JOIN pg_catalog.pg_sequence s ON m.classid = 'pg_catalog.pg_class'::regclass AND s.seqrelid = m.objid
  UNION ALL
	SELECT 'type ' || m.identity || ' acl ' || coalesce(t.typacl::text, 'default') || ' labels '
		|| coalesce((SELECT string_agg(e.enumlabel, ',' ORDER BY e.enumsortorder)
					 FROM pg_catalog.pg_enum e WHERE e.enumtypid = t.oid), '')
	FROM members m JOIN pg_catalog.pg_type t ON m.classid = 'pg_catalog.pg_type'::regclass AND t.oid = m.objid
  UNION ALL
	SELECT 'schema ' || n.nspname || ' acl ' || coalesce(n.nspacl::text, 'default')
	FROM pg_catalog.pg_namespace n WHERE n.nspname = 'idempotency'
  UNION ALL
	SELECT 'extension ' || e.extname || ' ' || e.extversion || ' relocatable ' || e.extrelocatable
		|| ' config ' || coalesce((SELECT string_agg(r::regclass::text, ',' ORDER BY r::regclass::text)
								   FROM unnest(e.extconfig) r), '')
		|| ' conditions ' || coalesce(e.extcondition::text, '')
	FROM pg_catalog.pg_extension e WHERE e.extname = 'idempotency'
) facts ORDER BY line};

# What a DBA does after installing: grants that an update must keep.
my $dba_sql = q{
GRANT USAGE ON SCHEMA idempotency TO upgrade_app;
REVOKE EXECUTE ON FUNCTION idempotency.reap(integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION idempotency.reap(integer) TO upgrade_app;
GRANT SELECT ON idempotency.stats TO upgrade_app;
};

# Returns the snapshot of database $db as a list of lines.
sub snapshot
{
	my ($db) = @_;
	return [ split /\n/, $node->safe_psql($db, $snapshot_sql) ];
}

# The extension's member objects in $db that are not listed in its table
# public.members_before: with comments => 0, only those without a comment.
sub added_members
{
	my ($db, %opts) = @_;
	my $uncommented = $opts{comments} // 1
	  ? ''
	  : 'AND NOT EXISTS (SELECT FROM pg_description c WHERE c.classoid = d.classid '
	  . 'AND c.objoid = d.objid AND c.objsubid = 0)';
	return [
		split /\n/,
		$node->safe_psql(
			$db, qq{
SELECT i.type || ' ' || i.identity
FROM pg_depend d CROSS JOIN LATERAL pg_identify_object(d.classid, d.objid, 0) i
WHERE d.refclassid = 'pg_extension'::regclass AND d.deptype = 'e'
  AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'idempotency')
  AND (d.classid, d.objid) NOT IN (SELECT classid, objid FROM public.members_before)
  -- a table's row type and its array (members from PG 17) go with the table
  AND NOT EXISTS (SELECT FROM pg_type t WHERE d.classid = 'pg_type'::regclass AND t.oid = d.objid
                  AND (t.typrelid <> 0 OR EXISTS (SELECT FROM pg_type e
                                                  WHERE e.oid = t.typelem AND e.typrelid <> 0)))
  $uncommented
ORDER BY 1})
	];
}

# The records, every column (of the list $_[0], quoted) as JSON.
sub records_sql
{
	my ($columns) = @_;
	return qq{SELECT (SELECT jsonb_object_agg(e.key, e.value) FROM jsonb_each(to_jsonb(k)) e
						WHERE e.key IN ($columns))::text
			  FROM idempotency.keys k ORDER BY scope, key};
}
my $columns_sql = q{SELECT string_agg(quote_literal(attname), ',') FROM pg_attribute
					WHERE attrelid = 'idempotency.keys'::regclass AND attnum > 0 AND NOT attisdropped};

my $n = 0;
foreach my $step (@steps)
{
	my ($from, $to) = @$step;
	my ($up, $fresh) = ('up_' . ++$n, "fresh_$n");

	# A database at $from with the DBA's grants and some records.
	$node->safe_psql('postgres', "CREATE DATABASE $up");
	$node->safe_psql($up,
		"CREATE EXTENSION idempotency VERSION '$from';\n$dba_sql");
	my $done_fence = $node->safe_psql(
		$up, q{
SELECT fence FROM idempotency.claim('done', '\x0a', 'acct_1');
});
	$node->safe_psql($up,
		"SELECT idempotency.complete('done', $done_fence, 201, '\\x00ff0d0a', "
		  . "'{\"Content-Type\": \"application/octet-stream\"}', 'acct_1')");
	my $open_fence = $node->safe_psql($up,
		"SELECT fence FROM idempotency.claim('open', '\\x0b', 'acct_2', lease => '1 hour')");
	# A session that claims (a takeover, an SPI plan) before the update to 1.2.
	my $session;
	if ($to eq '1.2')
	{
		$session = $node->background_psql($up);
		$session->query_safe(
			q{SELECT idempotency.claim('old', '\x0d', 'acct_3', lease => '1 ms');
			  SELECT pg_sleep(0.01);
			  SELECT outcome FROM idempotency.claim('old', '\x0d', 'acct_3')});
	}
	my $columns_before = $node->safe_psql($up, $columns_sql);
	my $records_before = $node->safe_psql($up, records_sql($columns_before));
	$node->safe_psql($up,
		"CREATE TABLE public.members_before AS SELECT classid, objid FROM pg_depend "
		  . "WHERE refclassid = 'pg_extension'::regclass AND deptype = 'e' AND refobjid = "
		  . "(SELECT oid FROM pg_extension WHERE extname = 'idempotency')");

	# The update to 1.2 makes the table again: it refuses one that a DBA
	# added to, and changes nothing.
	if ($to eq '1.2')
	{
		$node->safe_psql($up, 'CREATE INDEX dba_idx ON idempotency.keys (created_at)');
		my ($ret, $stdout, $stderr) =
		  $node->psql($up, "ALTER EXTENSION idempotency UPDATE TO '$to'");
		like($stderr, qr/would lose\nDETAIL:  The update makes the table again; it has index dba_idx\./,
			"$from -> $to: refused while the table has a DBA's index: $stderr");
		is( $node->safe_psql(
				$up, "SELECT extversion FROM pg_extension WHERE extname = 'idempotency'"),
			$from,
			"$from -> $to: the refused update changed nothing");
		$node->safe_psql($up, 'DROP INDEX idempotency.dba_idx');
	}
	$node->safe_psql($up, "ALTER EXTENSION idempotency UPDATE TO '$to'");

	$node->safe_psql('postgres', "CREATE DATABASE $fresh");
	$node->safe_psql($fresh,
		"CREATE EXTENSION idempotency VERSION '$to';\n$dba_sql");

	is_deeply(snapshot($up), snapshot($fresh),
		"$from -> $to: the updated extension equals a fresh install of $to "
		  . '(objects, definitions, comments, privileges)');

	my @added = @{ added_members($up) };
	my @uncommented = @{ added_members($up, comments => 0) };
	note("$from -> $to adds: " . join(', ', @added));
	is_deeply(\@uncommented, [], "$from -> $to: every object it adds has a comment");

	is($node->safe_psql($up, records_sql($columns_before)),
		$records_before, "$from -> $to: the records are unchanged by the update");
	is( $node->safe_psql(
			$up,
			"SELECT count(*) FROM idempotency.keys k, jsonb_each(to_jsonb(k)) e "
			  . "WHERE e.key NOT IN ($columns_before) AND e.value <> 'null'"),
		'0',
		"$from -> $to: the columns it adds are NULL in the records");

	if ($session)
	{
		# The takeover's plan, made before the update, must now write the token.
		my $t1 = '00000000-0000-4000-8000-000000000001';
		my $t2 = '00000000-0000-4000-8000-000000000002';
		my $answers = $session->query_safe(
			qq{SELECT idempotency.claim('tok', '\x0d', 'acct_3', lease => '1 ms', token => '$t1');
			   SELECT pg_sleep(0.01);
			   SELECT outcome || ' ' || fence FROM idempotency.claim('tok', '\x0d', 'acct_3', token => '$t2');
			   SELECT outcome || ' ' || fence FROM idempotency.claim('tok', '\x0d', 'acct_3', token => '$t2')});
		my @lines = grep { /^new / } split /\n/, $answers;
		ok(@lines == 2 && $lines[0] eq $lines[1],
			"$from -> $to: a session older than the update writes the token of a takeover "
			  . "(its claim is answered again): $answers");
		$session->quit;
	}
	is( $node->safe_psql(
			$up,
			"SELECT outcome, status_code, body, headers FROM idempotency.claim('done', '\\x0a', 'acct_1')"),
		"replay|201|\\x00ff0d0a|{\"Content-Type\": \"application/octet-stream\"}",
		"$from -> $to: a completed record replays after the update");
	# From 1.3 the records in progress are indexed: those written before
	# the update are in it.
	if ($to ge '1.3')
	{
		is( $node->safe_psql(
				$up,
				"SELECT string_agg(scope || '/' || key || ' ' || attempt, ',') FROM idempotency.in_flight "
				  . "WHERE key = 'open'"),
			'acct_2/open 1',
			"$from -> $to: in_flight lists the record in progress from before the update");
		is( $node->safe_psql(
				$up,
				"SELECT s.rows_in_progress = (SELECT count(*) FROM idempotency.keys WHERE state = 'in_progress') "
				  . "FROM idempotency.stats s"),
			't',
			"$from -> $to: stats counts the records in progress from before the update");
	}
	is( $node->safe_psql(
			$up, "SELECT idempotency.complete('open', $open_fence, 200, 'ok', scope => 'acct_2')"),
		'stored',
		"$from -> $to: the owner of a claim made before the update completes it");
	ok( $node->safe_psql($up,
			"SELECT fence FROM idempotency.claim('later', '\\x0c', 'acct_1')") >
		  $open_fence,
		"$from -> $to: fences keep growing");
}

$node->stop;
done_testing();
