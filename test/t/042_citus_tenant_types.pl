# Citus: business tables distributed by bigint, uuid, integer, or varchar of
# a collation other than "C".  citus_distribute gives idempotency.keys.scope
# the tenant column's type and collation and colocates the records with the
# table; the application passes the tenant id, written as text, as the
# scope.  For each type, on a cluster of its own (a coordinator and two
# workers): the adoption with the one call (on every node, the records
# already on the coordinator included), every record beside its tenant's
# rows (a join on each colocated pair of placements), and 22P02, naming the
# type, for a scope that is not a value of it, writing nothing.  For bigint
# and uuid also, through the coordinator: 16 concurrent claims of one key
# give one `new`; the token; complete commits and rolls back with the
# business rows, IK001 aborts them; a NULL scope is 22004, never a crash;
# an undelegated call is IK002; the records follow their tenant through a
# shard move.  For bigint, a node added later: its table gets the tenant's
# type from the next citus_distribute (before that, a call there is refused
# rather than hashed as text), and takes the tenant's shard; and a DBA's
# ALTER TABLE on a shard itself is seen by a session that had used it.

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

citus_skip_unless_installed();

# The tenant types, each with: the column's declaration, tenant ids (as the
# application writes them), a scope that is not a value of the type, and
# whether the whole set of checks runs (else the adoption, the join and
# 22P02 only).
my @types = (
	{
		decl => 'bigint', type => 'bigint', full => 1, add_node => 1, alter_shard => 1,
		ids => [ map { 1000 + $_ } 1 .. 4 ], bad => 'acct_1',
		gen => 'g::bigint', alt => sub { "0$_[0]" }
	},
	{
		decl => 'uuid', type => 'uuid', full => 1,
		ids => [
			'8a0f5ad2-4b1c-4e5e-9d2a-1c6b1f0e7a01', '2d7c1e4b-9f3a-4c2d-8e1f-6a5b4c3d2e10',
			'f1e2d3c4-b5a6-4978-8a9b-0c1d2e3f4a5b', '0b1c2d3e-4f50-4617-8283-94a5b6c7d8e9'
		],
		bad => 'not-a-uuid',
		gen => q{md5(g::text)::uuid}, alt => sub { uc $_[0] }
	},
	{
		decl => 'integer', type => 'integer', full => 0,
		ids => [ 7, 8, 9, 10 ], bad => '4294967296',
		gen => 'g'
	},
	{
		decl => 'varchar(64) COLLATE "en-x-icu"', type => 'character varying',
		collation => 'en-x-icu', full => 0,
		ids => [ 'Acme', 'acme', 'Globex', 'Initech' ], bad => undef,
		gen => q{'tenant-' || g}
	});

foreach my $t (@types)
{
	subtest "tenant column $t->{decl}" => sub { tenant_checks($t) };
}

done_testing();

# Runs the checks for one tenant type on a cluster of its own.
sub tenant_checks
{
	my ($t) = @_;
	my ($coord, $workers) = citus_cluster(prefix => ($t->{type} =~ s/\W//gr) . '_');
	my $type = $t->{type};
	my @ids = @{ $t->{ids} };
	my $cq = sub { $coord->safe_psql('postgres', $_[0]) };
	my $lit = sub { "'$_[0]'" };

	$cq->(qq{CREATE TABLE charges (tenant $t->{decl} NOT NULL, id bigserial,
		 amount int NOT NULL, PRIMARY KEY (tenant, id));
		 SELECT create_distributed_table('charges', 'tenant');});

	# A record the coordinator held before: one whose scope is no tenant id
	# makes the call refuse, changing nothing; released, the call adopts the
	# others, which keep their scope.
	$cq->(qq{SELECT outcome FROM idempotency.claim('before', '\\x01', '$ids[0]')});
	if (defined $t->{bad})
	{
		my $f = $cq->(qq{SELECT fence FROM idempotency.claim('stray', '\\x01', '$t->{bad}')});
		is(idem_sqlstate($coord, q{SELECT idempotency.citus_distribute('charges')}),
			'22P02', 'a record whose scope is not a tenant id is refused (22P02)');
		is($cq->(q{SELECT count(*) FROM pg_dist_partition
				WHERE logicalrelid = 'idempotency.keys'::regclass}) . ' '
			  . $cq->(q{SELECT format_type(atttypid, NULL) FROM pg_attribute
				WHERE attrelid = 'idempotency.keys'::regclass AND attname = 'scope'}),
			'0 text', 'and changed nothing');
		$cq->(qq{SELECT idempotency.release('stray', $f, '$t->{bad}')});
	}
	$cq->(q{SELECT idempotency.citus_distribute('charges')});
	$cq->(q{SELECT idempotency.citus_distribute('charges')});

	my $want = $type . ' ' . ($t->{collation} ? qq{"$t->{collation}"} : '-');
	is(join(',', map { $_->safe_psql('postgres',
					q{SELECT format_type(atttypid, NULL) || ' ' || attcollation::regcollation
					  FROM pg_attribute WHERE attrelid = 'idempotency.keys'::regclass
					  AND attname = 'scope'}) } ($coord, @$workers)),
		join(',', ($want) x 3), "every node's scope column is $want");
	is($cq->(q{SELECT count(DISTINCT colocationid) FROM pg_dist_partition
			WHERE logicalrelid IN ('idempotency.keys'::regclass, 'charges'::regclass)}),
		'1', 'idempotency.keys is colocated with charges (a second run changed nothing)');
	is($cq->(qq{SELECT outcome FROM idempotency.claim('before', '\\x01', '$ids[0]')}),
		'in_progress', 'the record made before is in its tenant\'s shard');

	# Every record beside its tenant's rows: 60 tenants, a charge and a
	# claim each, through the coordinator; on each colocated pair of
	# placements, the records join the charges of their tenant.
	my @tenants = split /\n/, $cq->(qq{SELECT $t->{gen} FROM generate_series(1, 60) g});
	$cq->(join '', map {
		qq{INSERT INTO charges (tenant, amount) VALUES ('$_', 1);
		SELECT outcome FROM idempotency.claim('join', '\\x01', '$_');\n}
	} @tenants);
	is($cq->(q{SELECT sum(result::int) FROM run_command_on_colocated_placements(
			'charges', 'idempotency.keys',
			$$SELECT count(*) FROM %s c JOIN %s k ON k.scope = c.tenant AND k.key = 'join'$$)}),
		'60', 'each of 60 records sits in the placement of its tenant\'s charges');

	# A scope that is not a value of the type: 22P02 naming it, through the
	# coordinator and on a worker, nothing written.
	if (defined $t->{bad})
	{
		my ($stdout, $stderr);
		$coord->psql('postgres',
			qq{SELECT * FROM idempotency.claim('bad', '\\x01', '$t->{bad}')},
			stdout => \$stdout, stderr => \$stderr);
		like($stderr, qr/\b$type\b/, "the error names the type ($type)");
		foreach my $node ($coord, $workers->[0])
		{
			foreach my $call (
				qq{SELECT * FROM idempotency.claim('bad', '\\x01', '$t->{bad}')},
				qq{SELECT idempotency.complete('bad', 1, 200, NULL, NULL, '$t->{bad}')},
				qq{SELECT * FROM idempotency.lookup('bad', '$t->{bad}')})
			{
				is(idem_sqlstate($node, $call), '22P02',
					$node->name . ": 22P02 (out of range too) for $call");
			}
		}
		is($cq->(q{SELECT count(*) FROM idempotency.keys WHERE key = 'bad'}),
			'0', 'a scope of another type wrote nothing');
	}

	wake_checks($coord, $workers, $t) if $t->{alt};
	full_checks($coord, $workers, $t) if $t->{full};
	added_node_checks($coord, $workers, $t) if $t->{add_node};
	shard_altered_checks($coord, $workers, $t) if $t->{alter_shard};

	ok(!grep({ citus_crashed($_) } ($coord, @$workers)), 'no backend crashed');
	citus_stop($coord, $workers);
}

# A claim waiting for an owner is woken by the owner's complete also when
# the two wrote the tenant id differently ('01003' and '1003', a uuid in
# upper and lower case): the wake-up is keyed by the value, not its text.
# Without a wake-up the waiter rechecks once a second after it started; so
# that a missed one shows, each complete is sent 0.2 s past one of those
# rechecks (counted from the waiter's query_start on the worker), where it
# costs about 0.8 s.  Five rounds, on the tenant's worker; the median delay
# from the complete to the waiter's answer must be under 0.5 s.  (Before
# the fix these keys' texts hashed to other slots, so the waiters woke only
# at their rechecks.)
sub wake_checks
{
	my ($coord, $workers, $t) = @_;
	my $tenant = $t->{ids}[2];
	my $spelled = $t->{alt}->($tenant);
	my $home = citus_worker_of($coord, $workers, $tenant);
	my $q = sub { $home->safe_psql('postgres', $_[0]) };
	my @delays;

	foreach my $round (1 .. 5)
	{
		my $key = "wake-$round";
		my $fence = $q->(qq{SELECT fence FROM idempotency.claim('$key', '\\x01', '$spelled',
			lease => '1 hour')});
		my ($out, $err) = ('', '');
		my $waiter = IPC::Run::start(
			[ 'psql', '-XAtq', '-v', 'ON_ERROR_STOP=1', '-d', $home->connstr('postgres'),
				'-c', qq{SELECT outcome, clock_timestamp() FROM idempotency.claim('$key',
					'\\x01', '$tenant', wait => '1 min')} ],
			'>', \$out, '2>', \$err);
		my $waiting = qq{FROM pg_stat_activity WHERE wait_event_type = 'Extension'
			AND query LIKE '%claim(''$key''%' AND pid <> pg_backend_pid()};
		$home->poll_query_until('postgres', "SELECT count(*) = 1 $waiting")
		  or die "the waiter of $key never slept";
		my ($sent, $completed) = split /\n/, $q->(qq{
			SELECT clock_timestamp() FROM pg_sleep((SELECT ceil(e - 0.2) + 0.2 - e
				FROM (SELECT extract(epoch FROM clock_timestamp() - query_start) AS e
					$waiting) w));
			SELECT idempotency.complete('$key', $fence, 200, NULL, NULL, '$spelled');});
		$waiter->finish;
		chomp $out;
		my ($outcome, $answered) = split /\|/, $out;
		is("$completed:$outcome", 'stored:replay',
			"round $round: completed as $spelled, the waiter of $tenant replays") or diag($err);
		push @delays, $q->(qq{SELECT extract(epoch FROM '$answered'::timestamptz
			- '$sent'::timestamptz)});
	}
	my @sorted = sort { $a <=> $b } @delays;
	cmp_ok($sorted[2], '<', 0.5,
		"a waiter is woken by a complete that spelled the tenant otherwise (delays: @delays s)");
	return;
}

# Through the coordinator: the race, the token, the business atomicity,
# IK001, NULL scopes, an undelegated call, a shard move.
sub full_checks
{
	my ($coord, $workers, $t) = @_;
	my @ids = @{ $t->{ids} };
	my $cq = sub { $coord->safe_psql('postgres', $_[0]) };
	my $tenant = $ids[1];
	my $shard = citus_shard_of($coord, $tenant);
	my $home = citus_worker_of($coord, $workers, $tenant);
	my ($away) = grep { $_ != $home } @$workers;

	# 16 concurrent claims of one key
	$_->safe_psql('postgres', 'SELECT idempotency.stats_reset()') for ($coord, @$workers);
	my $script = "$PostgreSQL::Test::Utils::tmp_check/race-$t->{type}.sql";
	PostgreSQL::Test::Utils::append_to_file($script,
		qq{SELECT outcome FROM idempotency.claim('race', '\\x01', '$tenant');\n});
	my ($out, $err);
	my $ran = IPC::Run::run(
		[ 'pgbench', '-n', '-c', '16', '-j', '2', '-t', '1', '-f', $script,
			$coord->connstr('postgres') ],
		'>', \$out, '2>', \$err);
	ok($ran && $out =~ /number of failed transactions: 0\b/, 'every concurrent claim answered')
	  or diag($out . $err);
	is($home->safe_psql('postgres',
			'SELECT claims_new || \':\' || claims_in_progress FROM idempotency.stats'),
		'1:15', 'of 16 concurrent claims of one key, one is new, 15 in_progress');

	# The token answers its own claim again; another is in progress.
	my $tok = '6f1c0a7e-0000-4000-8000-000000000001';
	my $first = $cq->(qq{SELECT outcome || ':' || fence FROM idempotency.claim('tok', '\\x01',
		'$tenant', token => '$tok')});
	is($cq->(qq{SELECT outcome || ':' || fence FROM idempotency.claim('tok', '\\x01',
			'$tenant', token => '$tok')}),
		$first, 'the same token answers new again, with the same fence');
	is($cq->(qq{SELECT outcome FROM idempotency.claim('tok', '\\x01', '$tenant',
			token => '6f1c0a7e-0000-4000-8000-000000000002')}),
		'in_progress', 'another token is in_progress');

	# complete commits and rolls back with the business rows; IK001 aborts them.
	my $fence = $cq->(qq{SELECT fence FROM idempotency.claim('pay', '\\x02', '$tenant')});
	my $insert = "INSERT INTO charges (tenant, amount) VALUES ('$tenant', 10)";
	my $complete = "SELECT idempotency.complete('pay', $fence, 201, 'charged', NULL, '$tenant')";
	my $charges = "SELECT count(*) FROM charges WHERE tenant = '$tenant' AND amount = 10";
	$cq->("BEGIN; $insert; $complete; ROLLBACK;");
	is($cq->($charges) . ':' . $cq->(qq{SELECT state FROM idempotency.lookup('pay', '$tenant')}),
		'0:in_progress', 'ROLLBACK undoes the charge and the complete');
	$cq->("BEGIN; $insert; $complete; COMMIT;");
	is($cq->($charges) . ':' . $cq->(qq{SELECT state FROM idempotency.lookup('pay', '$tenant')}),
		'1:completed', 'COMMIT keeps the charge and the complete');
	is($cq->(qq{SELECT outcome || ':' || encode(body, 'escape')
			FROM idempotency.claim('pay', '\\x02', '$tenant')}),
		'replay:charged', 'the retry replays the committed response');
	is(idem_sqlstate($coord, "BEGIN; $insert; $complete; COMMIT;"),
		'IK001', 'a complete that lost its claim raises IK001 through the coordinator');
	is($cq->($charges), '1', 'IK001 aborted the business insert');

	# NULL scopes: 22004, never a crash; an undelegated call: IK002.
	foreach my $call (q{SELECT * FROM idempotency.claim('n', '\x01')},
		q{SELECT * FROM idempotency.claim('n', '\x01', NULL)},
		q{SELECT idempotency.complete('n', 1, 200, scope => NULL)})
	{
		is(idem_sqlstate($coord, $call), '22004', "22004 for: $call");
	}
	is(idem_sqlstate($coord,
			qq{SELECT (idempotency.claim('shape', '\\x01', '$tenant')).outcome}),
		'IK002', 'a call Citus does not delegate raises IK002');
	is($cq->(qq{SELECT count(*) FROM idempotency.keys WHERE key IN ('n', 'shape')}),
		'0', 'and they wrote nothing');

	# A shard move: the records and the charges go together, a completed key
	# replays, a claim in progress completes with its fence.
	my $open = $cq->(qq{SELECT fence FROM idempotency.claim('open', '\\x03', '$tenant')});
	$cq->(sprintf(q{SELECT citus_move_shard_placement(%s, '127.0.0.1', %d, '127.0.0.1', %d)},
			$shard, $home->port, $away->port));
	is(citus_worker_of($coord, $workers, $tenant)->port, $away->port,
		'the tenant\'s shard moved');
	is($away->safe_psql('postgres',
			"SELECT count(*) FROM idempotency.keys_$shard WHERE scope = '$tenant'")
		  . ':' . $cq->($charges),
		'4:1', 'its records (race, tok, pay, open) and its charge moved');
	is($cq->(qq{SELECT outcome || ':' || encode(body, 'escape')
			FROM idempotency.claim('pay', '\\x02', '$tenant')}),
		'replay:charged', 'a completed key replays after the move');
	is($cq->(qq{SELECT outcome FROM idempotency.claim('open', '\\x03', '$tenant')}),
		'in_progress', 'a key in progress is still in progress');
	is($cq->(qq{BEGIN; INSERT INTO charges (tenant, amount) VALUES ('$tenant', 30);
			SELECT idempotency.complete('open', $open, 201, 'late', NULL, '$tenant'); COMMIT;}),
		'stored', 'the claim made before the move completes after it, with its charge');
	return;
}

# A node added to a cluster whose records have the tenant type bigint: Citus
# creates the extension on it with a text scope unless it is there already,
# and then refuses to add it (the colocation's types differ); prepared as
# docs/citus.md says, it is added and takes the tenant's shard.  A node
# whose table drifted from the tenant type refuses calls until
# citus_distribute puts it back.
sub added_node_checks
{
	my ($coord, $workers, $t) = @_;
	my $tenant = $t->{ids}[1];
	my $shard = citus_shard_of($coord, $tenant);
	my $from = citus_worker_of($coord, $workers, $tenant);
	my $scope_type = q{SELECT format_type(atttypid, NULL) FROM pg_attribute
		WHERE attrelid = 'idempotency.keys'::regclass AND attname = 'scope'};
	my $new = citus_add_worker($coord, 'bigint_worker3', '',
		q{CREATE EXTENSION idempotency;
		  ALTER TABLE idempotency.keys ALTER COLUMN scope TYPE bigint USING scope::bigint;});

	push @$workers, $new;
	$coord->safe_psql('postgres', q{SELECT idempotency.citus_distribute('charges')});
	$new->safe_psql('postgres', q{BEGIN; SET LOCAL citus.enable_ddl_propagation = off;
		ALTER TABLE idempotency.keys ALTER COLUMN scope TYPE text COLLATE "C"; COMMIT;});
	is(idem_sqlstate($new, qq{SELECT * FROM idempotency.claim('k', '\\x01', '$tenant')}),
		'55000', 'a node whose table\'s scope is not the tenant type refuses calls');
	$coord->safe_psql('postgres', q{SELECT idempotency.citus_distribute('charges')});
	is($new->safe_psql('postgres', $scope_type), 'bigint',
		'citus_distribute gives it the tenant type again');
	$coord->safe_psql('postgres',
		sprintf(q{SELECT citus_move_shard_placement(%s, '127.0.0.1', %d, '127.0.0.1', %d)},
			$shard, $from->port, $new->port));
	is($coord->safe_psql('postgres', qq{SELECT outcome || ':' || encode(body, 'escape')
			FROM idempotency.claim('pay', '\\x02', '$tenant')}),
		'replay:charged', 'on the added node, a completed key replays');
	is($coord->safe_psql('postgres',
			qq{SELECT outcome FROM idempotency.claim('on-new', '\\x01', '$tenant')})
		  . ':' . $new->safe_psql('postgres',
			"SELECT count(*) FROM idempotency.keys_$shard WHERE key = 'on-new'"),
		'new:1', 'and a new claim is written there');
	return;
}

# A DBA's ALTER TABLE on a shard itself, its scope column made text (as a
# shard made before citus_distribute has it): a session on its worker that
# had claimed there reads the shard's columns again, and its next claim is
# written as text: never the old type's value in the new column.
sub shard_altered_checks
{
	my ($coord, $workers, $t) = @_;
	my $tenant = $t->{ids}[3];
	my $shard = citus_shard_of($coord, $tenant);
	my $home = citus_worker_of($coord, $workers, $tenant);
	my $session = $home->background_psql('postgres');
	my $claim = sub {
		$session->query_safe(qq{SELECT outcome FROM idempotency.claim('$_[0]', '\\x01', '$tenant')});
	};

	is($claim->('altered-before'), 'new', 'a claim on the worker, in the tenant\'s shard');
	$home->safe_psql('postgres', qq{SET citus.enable_manual_changes_to_shards = on;
		ALTER TABLE idempotency.keys_$shard ALTER COLUMN scope TYPE text COLLATE "C"});
	is($claim->('altered-after'), 'new', 'after its shard\'s scope became text, the same session claims there');
	is($home->safe_psql('postgres', qq{SELECT string_agg(key, ',' ORDER BY key)
			FROM idempotency.keys_$shard WHERE key LIKE 'altered-%' AND scope = '$tenant'}),
		'altered-after,altered-before', 'both records are there, with the tenant\'s scope as text');
	is($session->query_safe(qq{SELECT state FROM idempotency.lookup('altered-before', '$tenant')}),
		'in_progress', 'and the session reads the one made before');
	$session->quit;
	return;
}
