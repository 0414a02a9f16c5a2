# The API through a PL/Proxy proxy (1 proxy, 2 shards, pgbouncer in
# transaction pooling in front of the shards, all on 127.0.0.1): the same
# functions as on a shard, routed by the documented hash; one winner among
# concurrent claims; byte-identical replays; SQLSTATEs kept; a business
# function on the shard that rolls back with IK001; waits woken by complete;
# statement_timeout and cancel reach the shard.

use strict;
use warnings FATAL => 'all';
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time usleep);
use FindBin;
use lib $FindBin::RealBin;
use IdemProxy;

my $missing = proxy_requirements_missing();
plan skip_all => $missing if $missing;

my $c = proxy_cluster(shards => 2);
my $proxy = $c->{proxy};
my @shards = @{ $c->{shards} };

# Runs $sql on the proxy.
sub on_proxy { return $proxy->safe_psql('postgres', $_[0]); }

# The shard node that holds $scope by the rule (2 shards).
sub shard_of
{
	my ($scope) = @_;
	return $shards[ on_proxy("SELECT idempotency.shard_of('$scope', 2)") ];
}

# --- The rule: the documented vectors, the same on the proxy and the shards.
my %vectors = (
	'' => -474954686,
	'acct_42' => 1496260889,
	'acct_17' => 353627363,
	'a' => -896040686,
	'tenant:0001' => -2013900505,
	'Zürich' => 1112631390,
	'東京' => 318772914,
	'🙂' => -798026459);
my $vectors_sql =
    "SELECT string_agg(s || '=' || idempotency.shard_hash(s) || '/' || idempotency.shard_of(s, 2), ' ' ORDER BY s) FROM (VALUES "
  . join(', ', map { "('$_')" } sort keys %vectors)
  . ') v(s)';
my $expected_vectors = join ' ',
  map { "$_=$vectors{$_}/" . ($vectors{$_} & 1) } sort keys %vectors;
is(on_proxy($vectors_sql), $expected_vectors,
	'the proxy computes the documented shard hashes');
is($_->safe_psql('postgres', $vectors_sql),
	$expected_vectors, $_->name . ' computes the same hashes')
  for @shards;

# --- The proxy offers the shard's functions: names, arguments with their
# defaults, and results, from the catalogs.
my $signature_sql = q{
SELECT string_agg(p.proname || '(' || pg_get_function_arguments(p.oid) || ') -> '
		|| CASE WHEN p.proretset THEN 'SETOF ' ELSE '' END || pg_get_function_result(p.oid),
		E'\n' ORDER BY p.proname)
FROM pg_proc p WHERE p.pronamespace = 'idempotency'::regnamespace AND p.proname IN (%s)};
my @public = split /\n/,
  on_proxy(
	"SELECT proname FROM pg_proc WHERE pronamespace = 'idempotency'::regnamespace "
	  . "AND proname NOT LIKE '\\_%' ORDER BY proname");
is( join(' ', @public),
	'checkpoint claim complete extend fingerprint fingerprint_json lookup release shard_hash shard_of',
	'the proxy offers the API');
my $names = join ', ', map { "'$_'" } @public;
is( on_proxy(sprintf($signature_sql, $names)),
	$shards[0]->safe_psql('postgres', sprintf($signature_sql, $names)),
	'every function has the same arguments, defaults and result columns as on a shard');

# A proxy holds no records: the two extensions never share a database.
is(sqlstate_of($shards[0], 'CREATE EXTENSION idempotency_proxy CASCADE'),
	'55000', 'idempotency_proxy refuses a database that has idempotency');
isnt(sqlstate_of($proxy, 'CREATE EXTENSION idempotency'),
	'no error', 'and idempotency cannot be added to the proxy');

# A database owner pre-creates schema idempotency with an overload of claim
# that would catch an application's calls: the install refuses the schema.
$proxy->safe_psql('postgres',
	"CREATE ROLE proxy_db_owner LOGIN; CREATE DATABASE attacked OWNER proxy_db_owner");
$proxy->safe_psql(
	'attacked', q{
SET ROLE proxy_db_owner;
CREATE SCHEMA idempotency;
CREATE FUNCTION idempotency.claim(key text, fingerprint text) RETURNS text
	LANGUAGE sql AS $$ SELECT 'new' $$;
});
my ($stdout, $stderr);
$proxy->psql('attacked', "\\set VERBOSITY verbose\nCREATE EXTENSION idempotency_proxy CASCADE",
	stdout => \$stdout, stderr => \$stderr);
like($stderr, qr/42P06: schema "idempotency" already exists/,
	'idempotency_proxy refuses a schema it did not create');
is($proxy->safe_psql('attacked', "SELECT count(*) FROM pg_extension WHERE extname = 'idempotency_proxy'"),
	'0', 'and is not installed there');
$proxy->safe_psql('postgres', "DROP DATABASE attacked; DROP ROLE proxy_db_owner");

# --- Placement: each record sits on the shard the rule names.
my @scopes = ('', 'acct_42', map { "acct_$_" } 1 .. 30);
on_proxy(join ";\n",
	map { "SELECT idempotency.claim('placed', '\\x01', '$_')" } @scopes);
my @counts = map {
	$shards[$_]->safe_psql('postgres',
		"SELECT count(*) || '/' || count(*) FILTER (WHERE idempotency.shard_of(scope, 2) = $_) "
		  . "FROM idempotency.keys WHERE key = 'placed'")
} 0 .. 1;
my ($n0, $ok0) = split m{/}, $counts[0];
my ($n1, $ok1) = split m{/}, $counts[1];
ok($n0 > 0 && $n1 > 0, "both shards hold records ($n0 and $n1)");
is($n0 + $n1, scalar(@scopes), 'every claim made a record');
is("$ok0/$ok1", "$n0/$n1", 'every record sits on the shard that shard_of names');
is( $shards[1]->safe_psql(
		'postgres', "SELECT count(*) FROM idempotency.keys WHERE scope = 'acct_42'"),
	'1',
	'acct_42 (hash 1496260889) is on shard 1');

# --- claim's token (1.2) reaches the shard: the same token is answered again.
my $tok = '00000000-0000-4000-8000-0000000000aa';
my $first = on_proxy(
	"SELECT outcome || ' ' || fence FROM idempotency.claim('tok', '\\x01', 'acct_42', token => '$tok')");
is( on_proxy(
		"SELECT outcome || ' ' || fence FROM idempotency.claim('tok', '\\x01', 'acct_42', token => '$tok') "
		  . "UNION ALL SELECT outcome FROM idempotency.claim('tok', '\\x01', 'acct_42')"),
	"$first\nin_progress",
	'through the proxy, the same token is answered new again with its fence, no token in_progress');

# The update of the proxy from 1.1 gives what a fresh 1.2 install gives.
$proxy->safe_psql('postgres', 'CREATE DATABASE proxy_up');
$proxy->safe_psql('proxy_up',
	"CREATE EXTENSION idempotency_proxy VERSION '1.1' CASCADE; "
	  . "ALTER EXTENSION idempotency_proxy UPDATE TO '1.2'");
my $definitions_sql = q{
SELECT string_agg(p.proname || '(' || pg_get_function_identity_arguments(p.oid) || ') '
		|| replace(pg_get_functiondef(p.oid), E'\n', ' ') || ' '
		|| coalesce(obj_description(p.oid, 'pg_proc'), '') || ' ' || coalesce(p.proacl::text, ''),
		E'\n' ORDER BY p.proname, pg_get_function_identity_arguments(p.oid))
FROM pg_proc p WHERE p.pronamespace = 'idempotency'::regnamespace};
is($proxy->safe_psql('proxy_up', $definitions_sql),
	on_proxy($definitions_sql),
	'idempotency_proxy 1.1 -> 1.2: the same functions, definitions, comments and privileges as a fresh 1.2');
$proxy->safe_psql('postgres', 'DROP DATABASE proxy_up');

# --- The scope: the argument, else the proxy session's setting, else ''.
on_proxy(
	"SET idempotency.scope = 'acct_42'; SELECT idempotency.claim('scoped', '\\x01')");
on_proxy("SELECT idempotency.claim('scoped', '\\x01')");
on_proxy(
	"SET idempotency.scope = 'acct_42'; SELECT idempotency.claim('scoped', '\\x01', 'acct_17')");
is( join(',', map { $_->safe_psql('postgres',
	"SELECT string_agg(quote_literal(scope), ',' ORDER BY scope) FROM idempotency.keys WHERE key = 'scoped'") } @shards),
	"'',\'acct_17\','acct_42'",
	"the scope is the proxy session's setting, else '', and an argument wins");

# The scope resolution uses no name from the caller's search_path.
$proxy->safe_psql(
	'postgres', q{
CREATE SCHEMA evil;
CREATE FUNCTION evil.current_setting(text, boolean) RETURNS text
	LANGUAGE sql AS $$ SELECT 'hijacked' $$;
GRANT USAGE ON SCHEMA evil TO PUBLIC;
});
my $hostile = "SET ROLE app; SET search_path = evil, pg_catalog; SET idempotency.scope = 'acct_17';";
my $path_fence = on_proxy("$hostile SELECT fence FROM idempotency.claim('path', '\\x01')");
is( shard_of('acct_17')->safe_psql('postgres',
		"SELECT scope FROM idempotency.keys WHERE key = 'path'"),
	'acct_17', "a hostile search_path does not change the scope of claim");
is( on_proxy(
		"$hostile SELECT state FROM idempotency.lookup('path'); "
		  . "SELECT idempotency.release('path', $path_fence)"),
	"in_progress\nt", 'nor that of lookup and release');

# --- Privileges: USAGE on the schema and on the server.
$proxy->safe_psql('postgres',
	'CREATE ROLE stranger; GRANT USAGE ON SCHEMA idempotency TO stranger');
is( sqlstate_of(
		$proxy, "SELECT idempotency.claim('p', '\\x01', 'acct_1')",
		role => 'stranger'),
	'42501',
	'a role without USAGE on the server cannot use the cluster');
is( on_proxy(
		"SET ROLE app; SELECT outcome FROM idempotency.claim('p', '\\x01', 'acct_1')"),
	'new', 'a role with USAGE on the schema and the server can');

# --- 16 concurrent claims of one key through the proxy: exactly one new.
# They all reach the shard and queue behind a table lock, then race.
my $race_shard = shard_of('acct_race');
my $lock = $race_shard->background_psql('postgres');
$lock->query_safe('BEGIN; LOCK TABLE idempotency.keys IN ACCESS EXCLUSIVE MODE');
my @racers = map {
	psql_start($proxy,
		"SELECT outcome FROM idempotency.claim('race', '\\x01', 'acct_race')")
} 1 .. 16;
ok( wait_until(
		sub {
			$race_shard->safe_psql('postgres',
				"SELECT count(*) FROM pg_locks WHERE NOT granted") == 16;
		},
		'16 claims wait on the shard'),
	'the 16 claims wait together on the shard');
$lock->query_safe('COMMIT');
$lock->quit;
my %outcomes;
$outcomes{ (psql_finish($_))[0] }++ for @racers;
is_deeply(\%outcomes, { new => 1, in_progress => 15 },
	'of 16 concurrent claims of one key through the proxy, exactly one is new');

# --- A replay through the proxy is byte for byte a replay on the shard.
my $fence = on_proxy(
	"SELECT fence FROM idempotency.claim('bytes', '\\x02', 'acct_17')");
is( on_proxy(
		"SELECT idempotency.complete('bytes', $fence, 201, "
		  . "(SELECT decode(string_agg(lpad(to_hex(i), 2, '0'), ''), 'hex') FROM generate_series(0, 255) i), "
		  . "'{\"Content-Type\": \"application/octet-stream\", \"Link\": [\"<a>\", \"<b>\"]}', 'acct_17')"),
	'stored',
	'a 256-byte binary response is stored through the proxy');
my $replay_sql = "SELECT r::text FROM idempotency.claim('bytes', '\\x02', 'acct_17') r";
my $through_proxy = on_proxy($replay_sql);
my $direct = shard_of('acct_17')->safe_psql('postgres', "SET ROLE idem_proxy; $replay_sql");
like($through_proxy, qr/^\(replay,,,201,/, 'the proxy replays');
is($through_proxy, $direct,
	'the replay through the proxy equals the replay on the shard');
my $lookup_sql = "SELECT r::text FROM idempotency.lookup('bytes', 'acct_17') r";
is(on_proxy($lookup_sql),
	shard_of('acct_17')->safe_psql('postgres', "SET ROLE idem_proxy; $lookup_sql"),
	'lookup through the proxy equals lookup on the shard');

# --- Errors reach the client with their SQLSTATE.
is(sqlstate_of($proxy, "SELECT idempotency.complete('bytes', $fence + 1000, 200, 'x', scope => 'acct_17')"),
	'IK001', 'IK001 from the shard');
is(sqlstate_of($proxy, "SELECT idempotency.claim('', '\\x01', 'acct_17')"),
	'22023', '22023 from the shard');
is(sqlstate_of($proxy, "SELECT idempotency.claim(NULL, '\\x01', 'acct_17')"),
	'22004', '22004 from the shard');
is(sqlstate_of($proxy, "SELECT idempotency.shard_of('acct_17', 3)"),
	'22023', '22023 from the proxy');
$fence = on_proxy("SELECT fence FROM idempotency.claim('big', '\\x01', 'acct_17')");
is( sqlstate_of(
		$proxy,
		"SELECT idempotency.complete('big', $fence, 200, convert_to(repeat('x', 1048577), 'UTF8'), scope => 'acct_17')"),
	'54000',
	'54000 from the shard');

# A claim commits on its shard by itself: a ROLLBACK on the proxy keeps it.
on_proxy("BEGIN; SELECT idempotency.claim('rolled-back', '\\x01', 'acct_17'); ROLLBACK");
is(on_proxy("SELECT state FROM idempotency.lookup('rolled-back', 'acct_17')"),
	'in_progress', 'a ROLLBACK on the proxy does not undo a claim');

# --- A business function on the shard: its write and complete commit
# together, and IK001 rolls its write back.
foreach my $shard (@shards)
{
	$shard->safe_psql(
		'postgres', q{
CREATE TABLE charges (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
	scope text NOT NULL, key text NOT NULL, amount integer NOT NULL);
CREATE FUNCTION pay(scope text, key text, fence bigint, amount integer)
RETURNS text LANGUAGE plpgsql AS $$
DECLARE
	charge bigint;
BEGIN
	INSERT INTO charges (scope, key, amount) VALUES (pay.scope, pay.key, pay.amount)
		RETURNING id INTO charge;
	RETURN idempotency.complete(pay.key, pay.fence, 201,
		convert_to(json_build_object('charge', charge)::text, 'UTF8'),
		'{"Content-Type": "application/json"}', pay.scope);
END
$$;
GRANT SELECT, INSERT ON charges TO idem_proxy;
});
}
on_proxy(q{
CREATE FUNCTION pay(scope text, key text, fence bigint, amount integer)
RETURNS text LANGUAGE plproxy AS $$
	CLUSTER 'idempotency';
	RUN ON idempotency.shard_hash(scope);
$$;
});
my $pay_shard = shard_of('acct_42');
my $f1 = on_proxy(
	"SELECT fence FROM idempotency.claim('pay-1', '\\x01', 'acct_42', lease => '200 ms')");
usleep(300_000);
my ($outcome, $f2) = split /\|/,
  on_proxy("SELECT outcome, fence FROM idempotency.claim('pay-1', '\\x01', 'acct_42')");
is($outcome, 'new', 'a retry takes over the ended lease');
is(sqlstate_of($proxy, "SELECT pay('acct_42', 'pay-1', $f1, 10)"),
	'IK001', 'the first owner\'s business function gets IK001');
is($pay_shard->safe_psql('postgres', "SELECT count(*) FROM charges WHERE key = 'pay-1'"),
	'0', 'and its charge rolled back');
is(on_proxy("SELECT pay('acct_42', 'pay-1', $f2, 10)"),
	'stored', "the new owner's business function stores the response");
my $charge = $pay_shard->safe_psql('postgres', "SELECT id FROM charges WHERE key = 'pay-1'");
is( on_proxy(
		"SELECT outcome, convert_from(body, 'UTF8') FROM idempotency.claim('pay-1', '\\x01', 'acct_42')"),
	"replay|{\"charge\" : $charge}",
	'the retry replays the response committed with the charge');

# --- A claim waiting through the proxy is woken by a complete.
my $wait_shard = shard_of('acct_17');
$fence = on_proxy("SELECT fence FROM idempotency.claim('wait-1', '\\x01', 'acct_17')");
my $started = time;
my $waiter = psql_start($proxy,
	"SELECT outcome, status_code FROM idempotency.claim('wait-1', '\\x01', 'acct_17', wait => '60 s')");

# Whether a claim of $key is running on $shard.
sub claim_running
{
	my ($shard, $key) = @_;
	return $shard->safe_psql('postgres',
		"SELECT count(*) FROM pg_stat_activity WHERE state = 'active' "
		  . "AND query LIKE '%idempotency.claim%' AND pid <> pg_backend_pid()") > 0;
}
ok(wait_until(sub { claim_running($wait_shard) }, 'the claim waits on the shard'),
	'the waiting claim reached the shard');
on_proxy("SELECT idempotency.complete('wait-1', $fence, 200, 'done', scope => 'acct_17')");
is((psql_finish($waiter))[0], 'replay|200', 'the waiting claim replays');
ok(time - $started < 20, 'woken by the complete, long before its wait ended');

# --- statement_timeout and cancel on the proxy end the claim on the shard.
$fence = on_proxy("SELECT fence FROM idempotency.claim('wait-2', '\\x01', 'acct_17')");
$started = time;
my ($out, $err) = psql_finish(psql_start($proxy,
	"SET statement_timeout = '500ms'; "
	  . "SELECT outcome FROM idempotency.claim('wait-2', '\\x01', 'acct_17', wait => '120 s')"));
like($err, qr/57014/, 'statement_timeout ends a waiting claim through the proxy');
ok(wait_until(sub { !claim_running($wait_shard) }, 'the claim ends on the shard', 10),
	'and the claim on the shard ends too');

$waiter = psql_start($proxy,
	"SELECT outcome FROM idempotency.claim('wait-2', '\\x01', 'acct_17', wait => '120 s')");
ok(wait_until(sub { claim_running($wait_shard) }, 'the claim waits on the shard'),
	'a second waiting claim reached the shard');
$proxy->safe_psql('postgres',
	"SELECT pg_cancel_backend(pid) FROM pg_stat_activity "
	  . "WHERE query LIKE '%wait-2%' AND pid <> pg_backend_pid()");
($out, $err) = psql_finish($waiter);
like($err, qr/57014/, 'a cancel on the proxy ends the waiting claim');
ok(wait_until(sub { !claim_running($wait_shard) }, 'the claim ends on the shard', 10),
	'and the claim on the shard ends too');
ok(time - $started < 60, 'both ended long before their waits');

proxy_stop($c);
done_testing();
