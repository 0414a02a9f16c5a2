#!/usr/bin/env bash
# Benchmarks the background reaper on a throwaway cluster that preloads the
# library.  Each round:
#   - loads ROWS expired records; pgbench runs claim+complete (new keys) for
#     DURATION seconds, every transaction logged with its time; after IDLE_S
#     seconds (plus one of warm-up) the reaper is woken and deletes them;
#     claims per second are counted in the IDLE_S seconds before the run and
#     during it, and the reaper's rows per second under that load noted;
#   - loads them again and times the reaper alone.
# The reaper's count and elapsed time come from its own log line.  Prints
# each round and the medians.  Not a test: nothing is asserted.
#
# Usage (as root or a sudo user):  bench/reap.sh
# Settings (environment):
#   ROWS=1000000           expired records per load
#   LIVE=0                 live records interleaved with them
#   ROUNDS=3               rounds
#   DURATION=12            seconds of the pgbench run of each round
#   IDLE_S=3               seconds of it measured before the reaper starts
#   CLIENTS=4 THREADS=2    pgbench clients and threads
#   BATCH=10000            idempotency.reaper_batch
#   SYNC=on                synchronous_commit of the pgbench clients
#   INDEX=second           how expired records are found: second (as shipped:
#                          a btree on the second each expires), btree (on
#                          expires_at itself), brin (on expires_at) or none
#   MODE=reap              or claims: claim+complete tps with each index
#                          (none, second, btree, brin) in alternation, on a table of
#                          LIVE live records
#   NO_BUILD=1             use the installed extension, do not build it
#   KEEP=1                 keep the cluster's directory
#   PGPORT_REAP=54339      port (Unix socket only)
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

ROWS=${ROWS:-1000000}
LIVE=${LIVE:-0}
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-12}
IDLE_S=${IDLE_S:-3}
CLIENTS=${CLIENTS:-4}
THREADS=${THREADS:-2}
BATCH=${BATCH:-10000}
SYNC=${SYNC:-on}
INDEX=${INDEX:-second}
PGPORT_REAP=${PGPORT_REAP:-54339}
MODE=${MODE:-reap}

work=

# Stops the cluster and removes its directory.
cleanup() {
	local rc=$?
	set +e
	if [ -n "$work" ] && [ -d "$work/data" ]; then
		as_postgres "$PGBIN/pg_ctl" -D "$work/data" -m immediate stop >/dev/null 2>&1
	fi
	if [ -n "$work" ]; then
		if [ "${KEEP:-0}" = 1 ]; then echo "kept $work"; else as_root rm -rf "$work"; fi
	fi
	exit $rc
}

# Runs psql as postgres on the bench database; extra arguments follow.
rpsql() {
	as_postgres "$PGBIN/psql" -h "$work" -p "$PGPORT_REAP" -U postgres -X -q -At \
		-v ON_ERROR_STOP=1 -d bench "$@"
}

# Creates and starts the cluster: sized for 2 cores, checkpoints kept out of
# the timed runs, the reaper asleep until a round wakes it.
start_cluster() {
	as_postgres "$PGBIN/initdb" -D "$work/data" -U postgres --auth=trust \
		--encoding=UTF8 --locale=C.UTF-8 >/dev/null
	as_postgres tee -a "$work/data/postgresql.conf" >/dev/null <<-EOF

	# bench/reap.sh
	listen_addresses = ''
	unix_socket_directories = '$work'
	port = $PGPORT_REAP
	log_line_prefix = '%n [%p] '
	shared_preload_libraries = 'idempotency'
	idempotency.reaper_naptime = '1h'
	idempotency.reaper_batch = $BATCH
	shared_buffers = 2GB
	maintenance_work_mem = 512MB
	wal_buffers = 16MB
	max_wal_size = 16GB
	checkpoint_timeout = 30min
	max_parallel_workers_per_gather = 0
	jit = off
	EOF
	as_postgres "$PGBIN/pg_ctl" -D "$work/data" -l "$work/server.log" -w start >/dev/null
	as_postgres "$PGBIN/createdb" -h "$work" -p "$PGPORT_REAP" -U postgres bench
	rpsql -c 'CREATE EXTENSION idempotency'
}

# Makes the reaper's index the shipped one (a btree on the second each record
# expires), a btree on expires_at itself, a BRIN, or none.
set_index() {
	rpsql -c 'SET client_min_messages = warning' \
		-c 'DROP INDEX IF EXISTS idempotency.keys_expires_at_idx' \
		-c 'DROP INDEX IF EXISTS idempotency.keys_expiry_second_idx'
	case $1 in
		second) rpsql -c 'CREATE INDEX keys_expiry_second_idx ON idempotency.keys (idempotency._expiry_second(expires_at))' ;;
		btree) rpsql -c 'CREATE INDEX keys_expires_at_idx ON idempotency.keys (expires_at)' ;;
		brin) rpsql -c 'CREATE INDEX keys_expires_at_idx ON idempotency.keys USING brin (expires_at)' ;;
		none) ;;
		*) echo "INDEX must be second, btree, brin or none" >&2; exit 2 ;;
	esac
}

# Replaces the table's content with ROWS expired, completed records that
# look like real ones (uuid keys, a SHA-256 fingerprint, a small response),
# evenly interleaved with LIVE live ones, as in a table long churned;
# vacuumed and checkpointed so that every round starts alike.
load_expired() {
	rpsql -c 'TRUNCATE idempotency.keys' -c "
		INSERT INTO idempotency.keys (fence, created_at, expires_at, completed_at,
			lease, attempt, status_code, state, owner, scope, key, fingerprint, headers, body)
		SELECT nextval('idempotency.fence_seq'), t - interval '1 day', t, t - interval '1 day',
			interval '1 min', 1, 201, 'completed', current_user::text::regrole, 'tenant-' || g % 100,
			gen_random_uuid()::text, sha256(int8send(g)),
			'{\"content-type\": \"application/json\"}',
			convert_to('{\"payment_id\":\"pay_' || g || '\",\"status\":\"succeeded\"}', 'UTF8')
		FROM generate_series(1::bigint, $((ROWS + LIVE))) g,
			LATERAL (SELECT g * $ROWS / $((ROWS + LIVE)) > (g - 1) * $ROWS / $((ROWS + LIVE))) x(expired),
			LATERAL (SELECT CASE WHEN expired THEN now() - interval '2 hours'
								 ELSE now() + interval '23 hours' END
							+ g * interval '1 ms') e(t)" \
		-c 'VACUUM ANALYZE idempotency.keys' -c 'CHECKPOINT'
}

# Sets the naptime and reloads; 1s wakes the launcher at once.
set_naptime() {
	rpsql -c "ALTER SYSTEM SET idempotency.reaper_naptime = '$1'" -c 'SELECT pg_reload_conf()' >/dev/null
}

# Waits for the worker's "deleted N ... elapsed: S s" line after byte offset
# $1 of the server log, and prints "N S END" (END: the line's epoch time).
wait_reaped() {
	local offset=$1 line
	for _ in $(seq 1 6000); do
		line=$(tail -c +"$((offset + 1))" "$work/server.log" |
			grep -m1 'idempotency reaper deleted' || true)
		if [ -n "$line" ]; then
			sed -E 's/^([0-9.]+) .*deleted ([0-9]+) expired.*elapsed: ([0-9.]+) s.*/\2 \3 \1/' <<<"$line"
			return
		fi
		sleep 0.1
	done
	echo "the reaper did not finish" >&2
	exit 1
}

# Runs the claim+complete workload in the background for DURATION seconds,
# logging every transaction under $work/tx-$1 (run number $1 makes its keys
# new); sets pgbench_pid.
start_claims() {
	rm -f "$work"/tx-"$1".*
	as_postgres env PGOPTIONS="-c synchronous_commit=$SYNC" \
		"$PGBIN/pgbench" -h "$work" -p "$PGPORT_REAP" -U postgres -n -M prepared \
		-c "$CLIENTS" -j "$THREADS" -T "$DURATION" -D P="$1" -D seq=0 \
		-l --log-prefix="$work/tx-$1" -f "$work/claim.sql" bench \
		>"$work/pgbench-$1.log" 2>&1 &
	pgbench_pid=$!
}

# Prints the claim+complete transactions per second of run $1 that ended
# between epoch times $2 and $3.
claim_tps_between() {
	cat "$work"/tx-"$1".* | awk -v from="$2" -v to="$3" '
		{ t = $5 + $6 / 1e6; if (t >= from && t < to) n++ }
		END { printf "%.0f", n / (to - from) }'
}

# Prints the epoch time of run $1's last transaction.
claims_end() {
	cat "$work"/tx-"$1".* | awk '{ t = $5 + $6 / 1e6; if (t > m) m = t }
		END { printf "%.3f", m }'
}

# Runs the claim+complete workload for DURATION seconds in the foreground
# (run number $1 makes its keys new); prints its tps.
claim_tps() {
	local log="$work/pgbench-$1.log" tps
	as_postgres env PGOPTIONS="-c synchronous_commit=$SYNC" \
		"$PGBIN/pgbench" -h "$work" -p "$PGPORT_REAP" -U postgres -n -M prepared \
		-c "$CLIENTS" -j "$THREADS" -T "$DURATION" -D P="$1" -D seq=0 \
		-f "$work/claim.sql" bench >"$log" 2>&1 || true
	tps=$(sed -n 's/^tps = \([0-9.]*\) .*/\1/p' "$log")
	[ -n "$tps" ] || { cat "$log" >&2; exit 1; }
	printf '%.0f' "$tps"
}

# MODE=claims: the cost of each index on claims.  In alternation, ROUNDS
# times: the table reloaded (LIVE live records, no expired one), the index
# set, then claim+complete tps for DURATION seconds.
bench_claims() {
	local -A tps
	local round idx run=0 kinds="none second btree brin" line
	echo "claim cost of the reaper's index: LIVE=$LIVE ROUNDS=$ROUNDS" \
		"DURATION=$DURATION CLIENTS=$CLIENTS THREADS=$THREADS SYNC=$SYNC, $(nproc) cores"
	for round in $(seq 1 "$ROUNDS"); do
		line="round $round:"
		for idx in $kinds; do
			set_index none
			ROWS=0 load_expired
			set_index "$idx"
			rpsql -c 'CHECKPOINT'
			run=$((run + 1))
			tps[$idx]+=" $(claim_tps "$run")"
			line+=" $idx ${tps[$idx]##* }"
		done
		echo "$line"
	done
	line="median tps:"
	local none
	none=$(median ${tps[none]})
	for idx in $kinds; do
		line+=" $idx $(median ${tps[$idx]}) ($(awk -v a="$(median ${tps[$idx]})" -v b="$none" \
			'BEGIN { printf "%.3f", a / b }')x)"
	done
	echo "$line"
}

# Prints the median of its arguments.
median() {
	printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END {
		if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

trap cleanup EXIT
install_packages
[ "${NO_BUILD:-0}" = 1 ] || build_and_install

work=$(mktemp -d /tmp/idempotency-reap.XXXXXX)
chown postgres: "$work"
# The workload: claim a key no one used, then complete it (two autocommit
# calls, as an HTTP handler does).
as_postgres tee "$work/claim.sql" >/dev/null <<-'EOF'
	\set seq :seq + 1
	\set key permute(:P * 1000000000000 + :client_id * 1000000000 + :seq, 1000000000000000000, 42)
	SELECT fence FROM idempotency.claim(:key, '\x01') \gset
	SELECT idempotency.complete(:key, :fence, 201, '\x7b7d');
EOF
start_cluster
if [ "$MODE" = claims ]; then
	bench_claims
	exit 0
fi
set_index "$INDEX"

echo "reaper benchmark: ROWS=$ROWS LIVE=$LIVE ROUNDS=$ROUNDS DURATION=$DURATION CLIENTS=$CLIENTS" \
	"THREADS=$THREADS BATCH=$BATCH SYNC=$SYNC INDEX=$INDEX, $(nproc) cores"
row='%-7s %12s %17s %9s %12s %7s\n'
printf "$row" round 'reap rows/s' 'rows/s under load' 'idle tps' 'reaping tps' ratio
declare -a r_alone r_loaded t_idle t_reap ratios
for round in $(seq 1 "$ROUNDS"); do
	# Claims run; after IDLE_S seconds (and one of warm-up) the reaper starts.
	load_expired
	start_claims "$round"
	sleep "$((IDLE_S + 1))"
	offset=$(stat -c %s "$work/server.log")
	set_naptime 1s
	read -r n s end <<<"$(wait_reaped "$offset")"
	set_naptime 1h
	wait "$pgbench_pid" || { cat "$work/pgbench-$round.log" >&2; exit 1; }
	begin=$(awk -v e="$end" -v s="$s" 'BEGIN { printf "%.3f", e - s }')
	if awk -v e="$end" -v c="$(claims_end "$round")" 'BEGIN { exit !(c < e) }'; then
		echo "warning: pgbench ended before the reaper did; raise DURATION" >&2
	fi
	loaded=$(awk -v n="$n" -v s="$s" 'BEGIN { printf "%.0f", n / s }')
	idle=$(claim_tps_between "$round" "$(awk -v b="$begin" -v i="$IDLE_S" \
		'BEGIN { printf "%.3f", b - i }')" "$begin")
	reaping=$(claim_tps_between "$round" "$begin" "$end")

	# The reaper alone on the same load.
	load_expired
	offset=$(stat -c %s "$work/server.log")
	set_naptime 1s
	read -r n s end <<<"$(wait_reaped "$offset")"
	set_naptime 1h
	[ "$n" = "$ROWS" ] || echo "warning: the run deleted $n records, not $ROWS" >&2
	alone=$(awk -v n="$n" -v s="$s" 'BEGIN { printf "%.0f", n / s }')

	ratio=$(awk -v a="$reaping" -v b="$idle" 'BEGIN { printf "%.3f", a / b }')
	printf "$row" "$round" "$alone" "$loaded" "$idle" "$reaping" "$ratio"
	r_alone+=("$alone") r_loaded+=("$loaded") t_idle+=("$idle") t_reap+=("$reaping")
	ratios+=("$ratio")
done
printf "$row" median "$(median "${r_alone[@]}")" "$(median "${r_loaded[@]}")" \
	"$(median "${t_idle[@]}")" "$(median "${t_reap[@]}")" "$(median "${ratios[@]}")"
