# Citus: a coordinator and two workers on 127.0.0.1.  The recipe
# (idempotency.citus_distribute) distributes idempotency.keys by scope,
# colocated with a business table, and delegates the API to the worker that
# holds the scope; this file proves, through the coordinator: routing to the
# tenant's worker; 16 concurrent claims of one key give one `new`; complete
# commits and rolls back with the business rows; IK001 aborts them; a NULL
# or missing scope is a clear error, never a crash; calls Citus does not
# delegate fail instead of using the coordinator's table; records follow
# their tenant through citus_move_shard_placement, and a move waits for a
# transaction that holds a claim; the reaper works on the workers; the
# documented way to drop the extension leaves nothing behind.
#
# The NULL-scope tests make calls that crash a node of a cluster without the
# library's guard: they check the coordinator's log for that too.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib $FindBin::RealBin;

use IdemCitus;
use IdemCrash;
use IPC::Run;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use List::Util qw(max);
use Time::HiRes qw(usleep);

citus_skip_unless_installed();

my ($coord, $workers) = citus_cluster(
	worker_conf => "idempotency.reaper_naptime = '1s'");

# Runs SQL on the coordinator's database.
sub cq { return $coord->safe_psql('postgres', $_[0]); }

# Runs SQL on the coordinator; returns its output, or "error SQLSTATE".
sub cq_try
{
	my ($sql) = @_;
	my ($stdout, $stderr);
	my $ret = $coord->psql('postgres', "\\set VERBOSITY verbose\n$sql",
		stdout => \$stdout, stderr => \$stderr);

	return $stdout if $ret == 0;
	return 'error ' . ($stderr =~ /ERROR:  ([0-9A-Z]{5}):/ ? $1 : $stderr);
}

# Polls a query on a node until it returns 't', for at most $seconds.
sub poll_briefly
{
	my ($node, $query, $seconds) = @_;
	my $deadline = time + $seconds;

	while (time < $deadline)
	{
		return 1 if $node->safe_psql('postgres', $query) eq 't';
		usleep(200_000);
	}
	return 0;
}

# ---------------------------------------------------------------------------
# The recipe
# ---------------------------------------------------------------------------

for my $w (@$workers)
{
	is($w->safe_psql('postgres',
			q{SELECT extversion IS NOT NULL FROM pg_extension WHERE extname = 'idempotency'}),
		't', $w->name . ': CREATE EXTENSION on the coordinator reached the worker');
}

cq(q{CREATE TABLE charges (tenant text COLLATE "C" NOT NULL, id bigserial,
	 amount int NOT NULL, PRIMARY KEY (tenant, id));
	 SELECT create_distributed_table('charges', 'tenant');});

# Tables it cannot colocate with are refused before anything changes.
# (bigint, integer, uuid, text and varchar of any collation are taken:
# t/042_citus_tenant_types.pl.)
cq(q{CREATE TABLE by_number (tenant numeric NOT NULL);
	 SELECT create_distributed_table('by_number', 'tenant');
	 CREATE TABLE local_only (tenant text COLLATE "C");});
is(idem_sqlstate($coord, q{SELECT idempotency.citus_distribute('by_number')}),
	'42804', 'a table distributed by a type the records cannot take (numeric) is refused');
is(idem_sqlstate($coord, q{SELECT idempotency.citus_distribute('local_only')}),
	'22023', 'a table that is not distributed is refused');
is(idem_sqlstate($coord, q{SELECT idempotency.citus_distribute(NULL)}),
	'22004', 'a NULL table is refused');
# Records name their owner by role OID, which differs from node to node:
# Citus's binary copies would hand them to another role.
$workers->[1]->safe_psql('postgres',
	'ALTER SYSTEM SET citus.enable_binary_protocol = on; SELECT pg_reload_conf()');
is(idem_sqlstate($coord, q{SELECT idempotency.citus_distribute('charges')}),
	'55000', 'a node where Citus copies in binary is refused');
$workers->[1]->safe_psql('postgres',
	'ALTER SYSTEM RESET citus.enable_binary_protocol; SELECT pg_reload_conf()');
is(cq(q{SELECT count(*) FROM pg_dist_partition
		WHERE logicalrelid = 'idempotency.keys'::regclass}),
	'0', 'the refusals distributed nothing');
is(join(' ', map { $_->safe_psql('postgres',
			q{SELECT format_type(atttypid, NULL) || ' ' || attcollation::regcollation
			  FROM pg_attribute WHERE attrelid = 'idempotency.keys'::regclass
			  AND attname = 'scope'}) } ($coord, @$workers)),
	join(' ', ('text "C"') x 3), 'the refusals changed no node\'s scope column');

cq(q{SELECT idempotency.citus_distribute('charges')});
cq(q{SELECT idempotency.citus_distribute('charges')});
is(cq(q{SELECT count(*) FROM pg_dist_partition p, pg_dist_partition c
		WHERE p.logicalrelid = 'idempotency.keys'::regclass
		AND c.logicalrelid = 'charges'::regclass AND p.colocationid = c.colocationid}),
	'1', 'idempotency.keys is colocated with charges (and a second run changed nothing)');
is(cq(q{SELECT string_agg(objid::regproc::text || ':' || distribution_argument_index
					|| ':' || force_delegation, ' ' ORDER BY objid::regproc::text)
		FROM pg_dist_object WHERE classid = 'pg_proc'::regclass
		AND distribution_argument_index IS NOT NULL}),
	'idempotency.checkpoint:4:true idempotency.claim:2:true idempotency.complete:5:true '
	  . 'idempotency.extend:3:true idempotency.lookup:1:true idempotency.release:2:true',
	'every API function is delegated by its scope argument, with force_delegation');

# ---------------------------------------------------------------------------
# Routing, and answers from the worker's records
# ---------------------------------------------------------------------------

my $w1 = citus_worker_of($coord, $workers, 'acct_1');
my ($other) = grep { $_ != $w1 } @$workers;
my $shard1 = citus_shard_of($coord, 'acct_1');

my ($outcome, $fence) = split /\|/,
  cq(q{SELECT outcome, fence FROM idempotency.claim('k1', '\x01', 'acct_1')});
is($outcome, 'new', 'a claim through the coordinator is new');
is($w1->safe_psql('postgres',
		"SELECT state || ':' || fence FROM idempotency.keys_$shard1 WHERE key = 'k1'"),
	"in_progress:$fence", 'the record is in the shard on the worker that holds acct_1');
is($other->safe_psql('postgres',
		q{SELECT count(*) FROM run_command_on_shards('idempotency.keys',
			$$SELECT count(*) FROM %s WHERE key = 'k1'$$) WHERE result::int > 0}),
	'1', 'exactly one shard of the cluster holds it');
is(cq(q{SELECT pg_relation_size('idempotency.keys')}),
	'0', "the coordinator's own table stays empty");
is(cq(q{SELECT state FROM idempotency.lookup('k1', 'acct_1')}),
	'in_progress', 'lookup through the coordinator reads the worker');

is(cq_try(q{SELECT outcome FROM idempotency.claim('k1', '\x01', 'acct_1')}),
	'in_progress', 'a second claim reads the shard, not the empty shell: in_progress');

# ---------------------------------------------------------------------------
# 16 concurrent claims of one key through the coordinator
# ---------------------------------------------------------------------------

my $race_worker = citus_worker_of($coord, $workers, 'acct_race');
$_->safe_psql('postgres', 'SELECT idempotency.stats_reset()') for ($coord, @$workers);
my $script = "$PostgreSQL::Test::Utils::tmp_check/race.sql";
PostgreSQL::Test::Utils::append_to_file($script,
	qq{SELECT outcome FROM idempotency.claim('race', '\\x01', 'acct_race');\n});
my ($bench_out, $bench_err);
my $bench_ok = IPC::Run::run(
	[ 'pgbench', '-n', '-c', '16', '-j', '2', '-t', '1', '-f', $script,
		$coord->connstr('postgres') ],
	'>', \$bench_out, '2>', \$bench_err);
is($race_worker->safe_psql('postgres', 'SELECT claims_new FROM idempotency.stats'),
	'1', 'of 16 concurrent claims of one key, exactly one is new');
is($race_worker->safe_psql('postgres',
		q{SELECT count(*) || ':' || min(attempt) FROM idempotency.keys_}
		  . citus_shard_of($coord, 'acct_race') . q{ WHERE key = 'race'}),
	'1:1', 'one record, attempt 1');
ok($bench_ok && $bench_out =~ /number of failed transactions: 0\b/,
	'every concurrent claim answered') or diag($bench_out . $bench_err);
is($race_worker->safe_psql('postgres', 'SELECT claims_in_progress FROM idempotency.stats'),
	'15', 'the 15 others are in_progress');

# ---------------------------------------------------------------------------
# complete commits and rolls back with the business rows; IK001 aborts them
# ---------------------------------------------------------------------------

($outcome, $fence) = split /\|/,
  cq(q{SELECT outcome, fence FROM idempotency.claim('pay-1', '\x02', 'acct_1')});
my $complete = "SELECT idempotency.complete('pay-1', $fence, 201, 'charged', NULL, 'acct_1')";
cq("BEGIN; INSERT INTO charges (tenant, amount) VALUES ('acct_1', 10); $complete; ROLLBACK;");
is(cq(q{SELECT count(*) FROM charges WHERE tenant = 'acct_1'}) . ':'
	  . cq(q{SELECT state FROM idempotency.lookup('pay-1', 'acct_1')}),
	'0:in_progress', 'ROLLBACK undoes the charge and the complete');
cq("BEGIN; INSERT INTO charges (tenant, amount) VALUES ('acct_1', 10); $complete; COMMIT;");
is(cq(q{SELECT count(*) FROM charges WHERE tenant = 'acct_1'}) . ':'
	  . cq(q{SELECT state FROM idempotency.lookup('pay-1', 'acct_1')}),
	'1:completed', 'COMMIT keeps the charge and the complete');
is(cq_try(q{SELECT outcome || ':' || encode(body, 'escape')
			FROM idempotency.claim('pay-1', '\x02', 'acct_1')}),
	'replay:charged', 'the retry replays the committed response');
is(idem_sqlstate($coord,
		"BEGIN; INSERT INTO charges (tenant, amount) VALUES ('acct_1', 20);"
		  . " SELECT idempotency.complete('pay-1', $fence, 201, 'again', NULL, 'acct_1'); COMMIT;"),
	'IK001', 'a complete that lost its claim raises IK001 through the coordinator');
is(cq(q{SELECT count(*) FROM charges WHERE tenant = 'acct_1'}),
	'1', 'IK001 aborted the business insert');

# claim's token (1.2), delegated in transaction blocks (force_delegation by
# scope, with the new argument): answered again, and the COMMIT-lost story.
my $token_claim = q{BEGIN; SELECT outcome || ':' || coalesce(fence::text, encode(body, 'escape'))
	FROM idempotency.claim('tok-1', '\x01', 'acct_1', token => '00000000-0000-4000-8000-0000000000c1');
	COMMIT;};
my $first = cq($token_claim);
my ($token_fence) = $first =~ /^new:(\d+)$/;
ok(defined $token_fence, "a claim with a token through the coordinator is new: $first");
is(cq($token_claim), $first, 'the same token is answered new again, with its fence');
my $token_complete = "BEGIN; INSERT INTO charges (tenant, amount) VALUES ('acct_1', 30); "
  . "SELECT idempotency.complete('tok-1', $token_fence, 201, 'tok', NULL, 'acct_1');";
cq("$token_complete ROLLBACK;");
is(cq($token_claim), $first, 'after a ROLLBACK of complete, the token is new with the same fence');
cq("$token_complete COMMIT;");
is(cq($token_claim), 'replay:tok', 'after its COMMIT, the token finds the replay');
is(cq(q{SELECT pg_relation_size('idempotency.keys')}), '0',
	"nothing of it was written on the coordinator's own table");

# ---------------------------------------------------------------------------
# A NULL or missing scope: 22004, never a crash
# ---------------------------------------------------------------------------

my @null_shapes = (
	q{SELECT * FROM idempotency.claim('n', '\x01')},
	q{SELECT * FROM idempotency.claim('n', '\x01', NULL)},
	q{SELECT * FROM idempotency.claim('n', '\x01', scope => NULL)},
	q{SELECT * FROM idempotency.claim('n', '\x01', NULLIF('a', 'a'))},
	q{PREPARE p(text) AS SELECT * FROM idempotency.claim('n', '\x01', $1); EXECUTE p(NULL)},
	q{CREATE FUNCTION pg_temp.wrapped(s text) RETURNS boolean LANGUAGE sql
	  AS $$ SELECT idempotency.release('n', 1, s) $$; SELECT pg_temp.wrapped(NULL)},
	q{SELECT idempotency.complete('n', 1, 200)},
	q{SELECT idempotency.release('n', 1)},
	q{SELECT idempotency.extend('n', 1)},
	q{SELECT idempotency.checkpoint('n', 1, 'step')},
	q{SELECT * FROM idempotency.lookup('n')},
	q{BEGIN; SET LOCAL idempotency.scope = 'acct_1'; SELECT * FROM idempotency.claim('n', '\x01'); COMMIT},
	q{SET plan_cache_mode = force_generic_plan;
	  PREPARE g(text) AS SELECT * FROM idempotency.claim('n', '\x01', $1); EXECUTE g(NULL)});
my $log_offset = -s $coord->logfile;
for my $shape (@null_shapes)
{
	is(idem_sqlstate($coord, $shape), '22004', "22004 for: $shape");
}
is(idem_sqlstate($workers->[0], q{SELECT * FROM idempotency.claim('n', '\x01', NULL)}),
	'22004', 'a worker refuses a NULL scope too');
# A generic plan leaves the scope a parameter: the function itself refuses
# NULL there, instead of using the setting's scope.
is(idem_sqlstate($w1, q{SET idempotency.scope = 'acct_1'; SET plan_cache_mode = force_generic_plan;
	PREPARE g(text) AS SELECT * FROM idempotency.lookup('k1', $1); EXECUTE g(NULL)}),
	'22004', 'a worker refuses a NULL scope in a generic plan, though the setting names a scope it holds');
ok(!citus_crashed($coord, $log_offset), 'no backend of the coordinator crashed');
ok(!citus_crashed($workers->[0], 0), 'no backend of the worker crashed');

# ---------------------------------------------------------------------------
# Calls Citus does not delegate fail; they never use the coordinator's table
# ---------------------------------------------------------------------------

cq(q{SELECT outcome FROM idempotency.claim('held', '\x01', 'acct_1', lease => '1 hour')});
my $held = "SELECT fence || ':' || attempt FROM idempotency.keys_$shard1 WHERE key = 'held'";
my $held_before = $w1->safe_psql('postgres', $held);
cq(q{CREATE TABLE outcomes (outcome text);
	 CREATE FUNCTION app_claim(k text, s text) RETURNS text LANGUAGE plpgsql
	 AS $$ BEGIN RETURN (SELECT outcome FROM idempotency.claim(k, '\x01', s)); END $$;});
my @undelegated = (
	q{SELECT (idempotency.claim('held', '\x01', 'acct_1')).outcome},
	q{SELECT idempotency.claim('held', '\x01', 'acct_1'), 1},
	q{SELECT outcome FROM idempotency.claim('held', '\x01', 'acct_1') WHERE outcome IS NOT NULL},
	q{WITH c AS (SELECT * FROM idempotency.claim('held', '\x01', 'acct_1')) SELECT outcome FROM c},
	q{INSERT INTO outcomes SELECT outcome FROM idempotency.claim('held', '\x01', 'acct_1')},
	q{SELECT outcome FROM idempotency.claim('held', '\x01', (SELECT 'acct_1'))},
	q{SELECT app_claim('held', 'acct_1')},
	q{DO $$ BEGIN PERFORM idempotency.claim('held', '\x01', 'acct_1'); END $$},
	q{SET plan_cache_mode = force_generic_plan;
	  PREPARE g(text) AS SELECT outcome FROM idempotency.claim('held', '\x01', $1); EXECUTE g('acct_1')},
	q{BEGIN; SELECT outcome FROM idempotency.claim('held', '\x01',
	  coalesce(current_setting('app.tenant', true), 'acct_1')); COMMIT});
for my $shape (@undelegated)
{
	my $state = idem_sqlstate($coord, $shape);

	isnt($state, 'no error', "an error, never an answer from the coordinator, for: $shape");
	is($state, 'IK002', "IK002 for: $shape");
}
# A function distributed without force_delegation is not delegated in a
# transaction block; the recipe puts force_delegation back.
cq(q{SELECT create_distributed_function(
		'idempotency.claim(text,bytea,text,interval,interval,interval,uuid)', 'scope',
		colocate_with => 'charges', force_delegation => false)});
my $state = idem_sqlstate($coord,
	q{BEGIN; SELECT outcome FROM idempotency.claim('held', '\x01', 'acct_1'); COMMIT});
isnt($state, 'no error', 'without force_delegation, a claim in a transaction block fails');
is($state, 'IK002', 'with IK002');
cq(q{SELECT idempotency.citus_distribute('charges')});
is(cq(q{SELECT force_delegation FROM pg_dist_object
		WHERE objid = 'idempotency.claim(text,bytea,text,interval,interval,interval,uuid)'::regprocedure}),
	't', 'citus_distribute restores force_delegation');
is($w1->safe_psql('postgres', $held), $held_before,
	'the record held on the worker is untouched by all of them');
is(cq(q{SELECT pg_relation_size('idempotency.keys') || ':' || count(*) FROM outcomes}),
	'0:0', "nothing was written on the coordinator");

# A backend whose read of the shard map failed (here: lock_timeout on
# Citus's catalog) reads it again at its next call, instead of keeping an
# empty map that would send its calls to the coordinator's own table.
my $locker = $coord->background_psql('postgres');
my $session = $coord->background_psql('postgres', on_error_stop => 0);
$session->query_safe('SELECT count(*) FROM idempotency.keys');    # Citus's cache, not ours
$locker->query_safe('BEGIN; LOCK pg_catalog.pg_dist_shard IN ACCESS EXCLUSIVE MODE');
my ($out, $ret) = $session->query(
	q{SET lock_timeout = '300ms'; SELECT (idempotency.claim('held', '\x01', 'acct_1')).outcome});
like($session->{stderr}, qr/lock timeout/, 'the map read fails while the catalog is locked');
$locker->query_safe('COMMIT');
$locker->quit;
$session->{stderr} = '';
($out, $ret) = $session->query(
	q{RESET lock_timeout; SELECT (idempotency.claim('held', '\x01', 'acct_1')).outcome});
like($session->{stderr}, qr/must run on the node that holds the records/,
	'the next call reads the map again: IK002, not an answer from the coordinator');
$session->quit;
is($w1->safe_psql('postgres', $held), $held_before, 'the held record is still untouched');
is(cq(q{SELECT pg_relation_size('idempotency.keys')}), '0', 'the coordinator table is still empty');

# ---------------------------------------------------------------------------
# Records follow their tenant through a shard move
# ---------------------------------------------------------------------------

my $scope = 'acct_move';
my $src = citus_worker_of($coord, $workers, $scope);
my ($dst) = grep { $_ != $src } @$workers;
my $shard = citus_shard_of($coord, $scope);
# Claims key in the moving tenant's scope: (outcome, fence, attempt), or ("error ...").
my $claim = sub {
	my ($key, $extra) = @_;
	return split /\|/,
	  cq_try("SELECT outcome, fence, attempt FROM idempotency.claim('$key', '\\x01', '$scope'$extra)");
};
# The source has handed out many more fences than the target.
$src->safe_psql('postgres', q{SELECT setval('idempotency.fence_seq', 1000000000)});
my (undef, $gone_fence) = $claim->('mv-gone', '');
die "claim before the move failed: $gone_fence" unless $gone_fence =~ /^\d+$/;
cq("SELECT idempotency.release('mv-gone', $gone_fence, '$scope')");
my (undef, $done_fence) = $claim->('mv-done', '');
cq("SELECT idempotency.complete('mv-done', $done_fence, 200, 'moved', NULL, '$scope')");
cq("INSERT INTO charges (tenant, amount) VALUES ('$scope', 5)");
my (undef, $open_fence) = $claim->('mv-open', q{, lease => '1 hour'});
# Fences of records that move may be above anything the target hands out
# (here: the source's sequence an hour ahead of the clock).
$src->safe_psql('postgres', q{SELECT setval('idempotency.fence_seq',
	((extract(epoch FROM now()) - 946684800 + 3600) * 1000000)::bigint)});
my (undef, $take_fence) = $claim->('mv-take', q{, lease => '1 second'});
# A record of an application role (its OID differs on each node).  Citus
# propagates the roles, not grants on the extension's schema: those go to
# every node as the documentation says.
$src->safe_psql('postgres', 'CREATE TABLE oid_shift (a int); DROP TABLE oid_shift');
cq(q{CREATE ROLE app_citus LOGIN; CREATE ROLE app_other LOGIN;
	 SELECT run_command_on_all_nodes(
		'GRANT USAGE ON SCHEMA idempotency TO app_citus, app_other');});
my $role_oid = q{SELECT 'app_citus'::regrole::oid};
isnt($src->safe_psql('postgres', $role_oid), $dst->safe_psql('postgres', $role_oid),
	'the role has another OID on each worker, as in a real cluster');
# Claims key in the moving tenant's scope as role $role; returns the outcome.
my $claim_as = sub {
	my ($role, $key) = @_;
	return cq_try("SET ROLE $role; SELECT outcome FROM idempotency.claim('$key', '\\x01', '$scope')");
};
my $app_fence = cq(qq{SET ROLE app_citus;
	SELECT fence FROM idempotency.claim('mv-app', '\\x01', '$scope')});
cq(qq{SET ROLE app_citus;
	SELECT idempotency.complete('mv-app', $app_fence, 200, 'app', NULL, '$scope')});
is($claim_as->('app_citus', 'mv-app'), 'replay', "an application role's claim replays before the move");

# Moves the tenant's shard from one worker to the other while the
# transaction $txn (a BackgroundPsql) is open; returns whether the shard was
# still on its source 3 seconds into the move.  Then runs $meanwhile (a
# code reference) if given, commits $txn, and waits for the move to finish.
sub move_during
{
	my ($txn, $from, $to, $meanwhile) = @_;
	my $mover = $coord->background_psql('postgres', wait => 0);

	$mover->query_until(qr/moving/, sprintf(qq{\\echo moving
SELECT citus_move_shard_placement(%s, '127.0.0.1', %d, '127.0.0.1', %d);
}, $shard, $from->port, $to->port));
	sleep 3;
	my $waited = cq("SELECT nodeport FROM pg_dist_shard_placement WHERE shardid = $shard")
	  == $from->port;
	$meanwhile->() if $meanwhile;
	$txn->query_safe('COMMIT');
	$txn->quit;
	$mover->quit;
	return $waited;
}

# Whether, on $node, some lock of Citus's placement metadata is awaited in $mode.
sub placement_lock_awaited
{
	my ($node, $mode) = @_;
	return poll_briefly($node,
		qq{SELECT count(*) > 0 FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 8
		   AND mode = '$mode' AND NOT granted}, 20);
}

# A transaction that only read the tenant's records holds the shard's
# placement lock (as Citus's executor does for its writes): the move waits.
# A claim that comes meanwhile waits behind the move, and then finds that
# the shard has left: IK002, never a write into the old placement.
my $reader = $coord->background_psql('postgres');
$reader->query_safe("BEGIN; SELECT state FROM idempotency.lookup('mv-open', '$scope')");
my ($late, $late_out, $late_err);
my $waited = move_during(
	$reader, $src, $dst,
	sub {
		ok(placement_lock_awaited($src, 'ExclusiveLock'),
			"the move awaits the shard's placement lock on its source");
		$late = IPC::Run::start(
			[ 'psql', '-XAtq', '-v', 'VERBOSITY=verbose', '-d', $coord->connstr('postgres'),
				'-c', "SELECT outcome FROM idempotency.claim('mv-late', '\\x01', '$scope')" ],
			'>', \$late_out, '2>', \$late_err);
		ok(placement_lock_awaited($src, 'ShareLock'), 'a claim that comes meanwhile waits behind the move');
	});
ok($waited, 'the move waits for a transaction that read through the API');
$late->finish;
like($late_err // '', qr/ERROR:  IK002:/, 'the claim that waited behind the move raises IK002');
is($src->safe_psql('postgres',
		"SELECT count(*) FROM idempotency.keys_$shard WHERE key = 'mv-late'"),
	'0', "and wrote nothing into the source's old placement of the shard");
is(cq("SELECT nodeport FROM pg_dist_shard_placement WHERE shardid = $shard"),
	$dst->port, 'then the shard moved');
is($dst->safe_psql('postgres',
		"SELECT string_agg(key || ':' || state, ',' ORDER BY key) FROM idempotency.keys_$shard"
		  . " WHERE key LIKE 'mv-%'"),
	'mv-app:completed,mv-done:completed,mv-open:in_progress,mv-take:in_progress',
	"the tenant's records moved with it");
is($dst->safe_psql('postgres',
		"SELECT count(*) FROM charges_" . cq(
			"SELECT get_shard_id_for_distribution_column('charges', '$scope')")),
	'1', "beside the tenant's business rows");
is(cq("SELECT idempotency.complete('mv-open', $open_fence, 200, 'late', NULL, '$scope')"),
	'stored', 'a claim made before the move completes after it with its fence');
is($claim_as->('app_citus', 'mv-app'), 'replay',
	"an application role's completed key replays after the move: the record is still its own");
is($claim_as->('app_other', 'mv-app'), 'new', 'and another role does not see it');

my @after = $claim->('mv-done', '');
is($after[0], 'replay', 'a key completed before the move replays after it');
@after = $claim->('mv-gone', '');
cmp_ok($after[1] // 0, '>', $gone_fence,
	'a key released before the move gets a larger fence after it');
@after = $claim->('mv-take', '');
is($after[0] . ':' . ($after[2] // ''), 'new:2',
	'an ended lease is taken over after the move');
cmp_ok($after[1] // 0, '>', $take_fence,
	'with a larger fence than before the move, though the target is behind');
my @fresh = $claim->('mv-fresh', '');
cmp_ok($fresh[1] // 0, '>', $after[1] // 0,
	"and the target's sequence followed: a new key's fence is larger still");

# And back, while a transaction holds an uncommitted claim: the move cannot
# start replicating before that transaction ends, and the claim arrives.
my $writer = $coord->background_psql('postgres');
$writer->query_safe(
	"BEGIN; SELECT outcome FROM idempotency.claim('mv-txn', '\\x01', '$scope')");
ok(move_during($writer, $dst, $src), 'the move back waits for a transaction with an uncommitted claim');
is($src->safe_psql('postgres',
		"SELECT state FROM idempotency.keys_$shard WHERE key = 'mv-txn'"),
	'in_progress', "the transaction's claim moved with the shard");
is(($claim->('mv-txn', ''))[0], 'in_progress',
	'a key in progress before the move is in_progress after it');

# ---------------------------------------------------------------------------
# A shard split: new hash ranges, shard ids and shard indexes
# ---------------------------------------------------------------------------

# The tenant's shard splits in two halves, one on each worker.
my ($min, $max) = split /\|/,
  cq("SELECT shardminvalue, shardmaxvalue FROM pg_dist_shard WHERE shardid = $shard");
cq(sprintf(q{SELECT citus_split_shard_by_split_points(%s, ARRAY['%d'],
	ARRAY[(SELECT nodeid FROM pg_dist_node WHERE nodeport = %d),
		  (SELECT nodeid FROM pg_dist_node WHERE nodeport = %d)])},
	$shard, int(($min + $max) / 2), $src->port, $dst->port));
my $split_shard = citus_shard_of($coord, $scope);
isnt($split_shard, $shard, 'the split gave the tenant a new shard');
$shard = $split_shard;
is(($claim->('mv-done', ''))[0], 'replay', 'a key completed before the split replays after it');
is(($claim->('mv-txn', ''))[0], 'in_progress',
	'a key in progress before the split is in_progress after it');
# The placement lock's tag holds the shard's index among its colocated
# shards, which the split changed.
my $split_home = citus_worker_of($coord, $workers, $scope);
my ($split_away) = grep { $_ != $split_home } @$workers;
$reader = $coord->background_psql('postgres');
$reader->query_safe("BEGIN; SELECT state FROM idempotency.lookup('mv-open', '$scope')");
ok(move_during($reader, $split_home, $split_away),
	'a move of a shard made by the split waits for a transaction that read through the API');
is(($claim->('mv-done', ''))[0], 'replay', 'and after that move the key still replays');

# ---------------------------------------------------------------------------
# A node added, and the rebalancer
# ---------------------------------------------------------------------------

# Records in many tenants: one completed key and one in progress each.
my @tenants = map { "acct_rb$_" } 1 .. 128;
$coord->safe_psql('postgres', join "\n", map {
	qq{SELECT fence AS f FROM idempotency.claim('rb-done', '\\x01', '$_') \\gset
	   SELECT idempotency.complete('rb-done', :f, 201, 'done $_', scope => '$_');
	   SELECT outcome FROM idempotency.claim('rb-open', '\\x01', '$_', lease => '1 hour');}
} @tenants);
my $w3 = citus_add_worker($coord, 'worker3', "idempotency.reaper_naptime = '1s'");
push @$workers, $w3;
# The documented step after adding a node: the recipe again (it checks the
# new node's settings and raises its fence sequence).
cq(q{SELECT idempotency.citus_distribute('charges')});
cq(q{SELECT rebalance_table_shards('charges', max_shard_moves => 3,
	 shard_transfer_mode => 'block_writes')});
my @moved = grep { citus_worker_of($coord, $workers, $_)->name eq 'worker3' } @tenants;
ok(@moved > 0, scalar(@moved) . ' tenants moved to the new node with the rebalancer');
is($w3->safe_psql('postgres',
		"SET citus.override_table_visibility = off; "
		  . "SELECT count(*) FROM pg_class WHERE relname ~ '^keys_[0-9]+\$'") > 0 ? 1 : 0,
	1, 'the new node holds shards of idempotency.keys');
my @replayed = grep {
	cq("SELECT outcome || ':' || convert_from(body, 'UTF8') FROM idempotency.claim('rb-done', '\\x01', '$_')")
	  eq "replay:done $_"
} @moved;
is(scalar(@replayed), scalar(@moved), "every moved tenant's completed key replays");
my @open = grep {
	cq("SELECT outcome FROM idempotency.claim('rb-open', '\\x01', '$_')") eq 'in_progress'
} @moved;
is(scalar(@open), scalar(@moved), "every moved tenant's key in progress is still in_progress");
my $w3_fence = $w3->safe_psql('postgres', 'SELECT last_value FROM idempotency.fence_seq');
my $largest = max(map { $_->safe_psql('postgres',
	'SELECT last_value FROM idempotency.fence_seq') } @$workers[ 0, 1 ]);
cmp_ok($w3_fence, '>=', $largest,
	"the new node's fence sequence starts above the others' (citus_distribute)");
is(cq(qq{SELECT outcome FROM idempotency.claim('rb-new', '\\x01', '$moved[0]')}), 'new',
	'a new key of a moved tenant is claimed on the new node');

# ---------------------------------------------------------------------------
# The reaper on the workers
# ---------------------------------------------------------------------------

my %expired_on;
for my $i (1 .. 8)
{
	my $s = "acct_exp$i";
	cq("SELECT outcome FROM idempotency.claim('gone', '\\x01', '$s', lease => '1 ms', retention => '1 ms')");
	$expired_on{ citus_worker_of($coord, $workers, $s)->name }++;
}
cmp_ok(scalar(keys %expired_on), '>=', 2, 'expired records on several workers');
ok(poll_briefly($coord,
		q{SELECT count(*) = 0 FROM idempotency.keys WHERE key = 'gone'}, 20),
	'the workers reaped the expired records');
ok(!$_->log_contains(qr/idempotency reaper in database/), $_->name . ': no reaper error')
  for @$workers;
is(idem_sqlstate($coord, 'SELECT idempotency.reap()'), 'no error',
	'reap() on the coordinator, which holds no shard, succeeds');
is(cq(q{SELECT count(*) FROM idempotency.keys WHERE key IN ('mv-open', 'held', 'pay-1')}),
	'3', 'live records stay');

# ---------------------------------------------------------------------------
# Dropping the extension
# ---------------------------------------------------------------------------

# The moves left the old placements of their shards to Citus's deferred
# cleanup (off in these clusters, so that they are surely still there).
is(idem_sqlstate($coord, 'DROP EXTENSION idempotency'), '2BP01',
	'DROP EXTENSION is refused while old placements of moved shards wait for cleanup');
cq(q{CALL citus_cleanup_orphaned_resources(); DROP EXTENSION idempotency;});
for my $node ($coord, @$workers)
{
	is($node->safe_psql('postgres',
			q{SET citus.override_table_visibility = off;
			  SELECT count(*) FROM pg_extension WHERE extname = 'idempotency'}
			  . q{ UNION ALL SELECT count(*) FROM pg_class WHERE relname ~ '^keys_[0-9]+$'}),
		"0\n0", $node->name . ': the cleanup, then DROP EXTENSION, leave nothing behind');
}

ok(!citus_crashed($_, 0), $_->name . ': no backend crashed during the test')
  for ($coord, @$workers);
citus_stop($coord, $workers);
done_testing();
