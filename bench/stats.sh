#!/usr/bin/env bash
# What reading idempotency.stats costs against counting the table, and what
# the index of records in progress (keys_in_progress_idx, 1.3 to 1.5; 1.6
# keeps the figures in shared memory instead) costs claims, on a throwaway
# cluster that preloads the library:
#   1. ROWS completed records and IN_PROGRESS ones in progress, vacuumed;
#      pgbench runs `SELECT * FROM idempotency.stats` and `SELECT count(*)
#      FROM idempotency.keys` in alternation, ROUNDS times, one client, for
#      DURATION seconds each; prints median latencies and their ratio.
#   2. claim + complete of new keys (CLIENTS clients), with and without the
#      index, in alternation, ROUNDS times; prints median tps and the ratio.
# Not a test: nothing is asserted.
#
# Usage (as root or a sudo user):  bench/stats.sh
# Settings (environment):
#   ROWS=1000000 IN_PROGRESS=1000   records loaded for part 1
#   ROUNDS=3 DURATION=10            alternations, seconds per pgbench run
#   CLIENTS=4 THREADS=2             pgbench clients and threads of part 2
#   SYNC=off                        synchronous_commit of part 2
#   NO_BUILD=1                      use the installed extension
#   PGPORT_STATS=54349              port (Unix socket only)
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

ROWS=${ROWS:-1000000}
IN_PROGRESS=${IN_PROGRESS:-1000}
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-10}
CLIENTS=${CLIENTS:-4}
THREADS=${THREADS:-2}
SYNC=${SYNC:-off}
PGPORT_STATS=${PGPORT_STATS:-54349}

[ "${NO_BUILD:-0}" = 1 ] || build_and_install
work=$(mktemp -d /tmp/idempotency-stats.XXXXXX)
chown postgres: "$work"
trap 'as_postgres "$PGBIN/pg_ctl" -D "$work/data" -m immediate stop >/dev/null 2>&1; as_root rm -rf "$work"' EXIT

# psql as postgres on the bench database; extra arguments follow.
spsql() {
	as_postgres "$PGBIN/psql" -h "$work" -p "$PGPORT_STATS" -U postgres -X -q -At \
		-v ON_ERROR_STOP=1 -d bench "$@"
}

# pgbench as postgres on the bench database; prints its output.
sbench() {
	as_postgres "$PGBIN/pgbench" -h "$work" -p "$PGPORT_STATS" -U postgres -n -M prepared \
		-T "$DURATION" "$@" bench 2>&1
}

# The median of the numbers on standard input.
median() {
	sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

as_postgres "$PGBIN/initdb" -D "$work/data" -U postgres --auth=trust --encoding=UTF8 \
	--locale=C.UTF-8 >/dev/null
as_postgres tee -a "$work/data/postgresql.conf" >/dev/null <<EOF
listen_addresses = ''
unix_socket_directories = '$work'
port = $PGPORT_STATS
shared_preload_libraries = 'idempotency'
idempotency.reaper_naptime = '1h'
shared_buffers = 1GB
max_wal_size = 16GB
checkpoint_timeout = 30min
max_parallel_workers_per_gather = 0
jit = off
EOF
as_postgres "$PGBIN/pg_ctl" -D "$work/data" -l "$work/server.log" -w start >/dev/null
as_postgres "$PGBIN/createdb" -h "$work" -p "$PGPORT_STATS" -U postgres bench

# Part 1: ROWS completed records, IN_PROGRESS records in progress.
spsql -c 'CREATE EXTENSION idempotency' -c "
	INSERT INTO idempotency.keys (fence, created_at, expires_at, completed_at, attempt,
		status_code, state, owner, scope, key, fingerprint, headers, body, lease, lease_expires_at)
	SELECT nextval('idempotency.fence_seq'), now(), now() + interval '1 day', now(), 1,
		CASE WHEN g > $IN_PROGRESS THEN 201 END,
		CASE WHEN g > $IN_PROGRESS THEN 'completed' ELSE 'in_progress' END::idempotency.state,
		current_user::text::regrole, 'tenant-' || g % 100, gen_random_uuid()::text,
		sha256(int8send(g)), '{\"content-type\": \"application/json\"}',
		convert_to('{\"payment_id\":\"pay_' || g || '\",\"status\":\"succeeded\"}', 'UTF8'),
		CASE WHEN g <= $IN_PROGRESS THEN interval '1 min' END,
		CASE WHEN g <= $IN_PROGRESS THEN now() + interval '1 min' END
	FROM generate_series(1, $ROWS + $IN_PROGRESS) g" \
	-c 'VACUUM ANALYZE idempotency.keys' -c 'CHECKPOINT'
# The rows were written with plain SQL, which shared memory's figures do not
# see (1.6): count them once, as the reaper does after a start.
spsql -c 'SELECT idempotency.stats_recount()' >/dev/null
echo 'SELECT * FROM idempotency.stats;' > "$work/stats.sql"
echo 'SELECT count(*) FROM idempotency.keys;' > "$work/count.sql"
chown postgres: "$work"/*.sql
echo "records: $(spsql -c 'SELECT count(*) FROM idempotency.keys'), stats reads:" \
	"$(spsql -c 'SELECT rows_total, rows_in_progress FROM idempotency.stats')"
: > "$work/lat.stats"; : > "$work/lat.count"
for round in $(seq "$ROUNDS"); do
	for what in stats count; do
		lat=$(sbench -f "$work/$what.sql" | awk '/^latency average/ { print $4 }')
		echo "round $round $what: $lat ms"
		echo "$lat" >> "$work/lat.$what"
	done
done
s=$(median < "$work/lat.stats"); c=$(median < "$work/lat.count")
echo "median latency: stats $s ms, count(*) $c ms; count(*)/stats = $(awk -v s="$s" -v c="$c" 'BEGIN { printf "%.0f", c / s }')"

# Part 2: claim + complete of new keys, with and without the index.
spsql -c 'TRUNCATE idempotency.keys' -c 'VACUUM ANALYZE idempotency.keys' \
	-c "ALTER DATABASE bench SET synchronous_commit = $SYNC"
cat > "$work/fresh.sql" <<'EOF'
\set key random(1, 1000000000000)
SELECT outcome, fence FROM idempotency.claim(:client_id || '-' || :key, '\x01') \gset
SELECT idempotency.complete(:client_id || '-' || :key, :fence, 201, '{"status":"succeeded"}');
EOF
chown postgres: "$work/fresh.sql"
: > "$work/tps.with"; : > "$work/tps.without"
for round in $(seq "$ROUNDS"); do
	for what in with without; do
		if [ "$what" = with ]; then
			spsql -c 'CREATE INDEX IF NOT EXISTS keys_in_progress_idx ON idempotency.keys (created_at)
				WHERE state = '\''in_progress'\'''
		else
			spsql -c 'DROP INDEX IF EXISTS idempotency.keys_in_progress_idx'
		fi
		spsql -c 'CHECKPOINT'
		tps=$(sbench -c "$CLIENTS" -j "$THREADS" -f "$work/fresh.sql" |
			awk '/^tps/ { print $3; exit }')
		echo "round $round claim+complete $what the index: $tps tps"
		echo "$tps" >> "$work/tps.$what"
	done
done
w=$(median < "$work/tps.with"); o=$(median < "$work/tps.without")
echo "median tps (synchronous_commit $SYNC): with the index $w, without $o;" \
	"with/without = $(awk -v w="$w" -v o="$o" 'BEGIN { printf "%.3f", w / o }')"
echo "HOT updates: $(spsql -c "SELECT n_tup_hot_upd || ' of ' || n_tup_upd FROM pg_stat_user_tables WHERE relid = 'idempotency.keys'::regclass")"
