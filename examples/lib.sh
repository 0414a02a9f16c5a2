# shellcheck shell=bash
# Shared by examples/test-e2e and examples/demo-http: a throwaway PostgreSQL
# cluster that preloads the extension, the example apps (each started by its
# run script), and curl.
# Source it from bash; it sources scripts/lib.sh (as_root, as_postgres, PGBIN).

EXAMPLES=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$EXAMPLES/../scripts/lib.sh"

EX_TMP=			# the temp dir: cluster, logs, responses
EX_PGPORT=		# the cluster's port on 127.0.0.1
EX_PIDS=()		# the apps started, each the leader of its process group
APP_PID='' APP_PORT='' APP_URL=''	# the app started last

# Fails, saying what is missing, unless curl, node (JSON checks, free ports) and psql are at hand.
check_tools() {
	local tool missing=()
	for tool in node curl setsid "$PGBIN/initdb" "$PGBIN/psql"; do
		command -v "$tool" >/dev/null || missing+=("$tool")
	done
	[ ${#missing[@]} -eq 0 ] && return 0
	echo "missing: ${missing[*]} (scripts/test installs what the examples need)" >&2
	return 1
}

# Prints the example apps: the directories of examples/ with an executable
# run, but the job examples (*-jobs: workers, not HTTP apps).
example_apps() {
	local d
	for d in "$EXAMPLES"/*/; do
		[[ $d == *-jobs/ ]] && continue
		[ -x "$d/run" ] && basename "$d"
	done
	return 0
}

# Runs a command as root; as postgres (when that is who runs us), directly.
as_admin() {
	if [ "$(id -un)" = postgres ]; then "$@"; else as_root "$@"; fi
}

# Prints a free TCP port on 127.0.0.1.
free_port() {
	node -e 'const s = require("net").createServer();
		s.listen(0, "127.0.0.1", () => { console.log(s.address().port); s.close(); });'
}

# Runs pg_ctl as postgres, from a directory postgres can read.
ex_pg_ctl() {
	(cd "$EX_TMP" && as_postgres "$PGBIN/pg_ctl" -D "$EX_TMP/pg/data" -w -s "$@")
}

# Creates the temp dir $EX_TMP (logs, responses; the cluster if any).
make_tmp() {
	EX_TMP=$(mktemp -d /tmp/idempotency-examples.XXXXXX)
	chmod 711 "$EX_TMP"
}

# Creates $EX_TMP and in it a cluster preloading the extension, on 127.0.0.1
# (trust authentication: it lives only as long as the script) and a socket in $EX_TMP/pg.
# With EX_EDITION=portable it preloads nothing, and create_db installs the
# portable edition (portable/idempotency.sql) instead of CREATE EXTENSION.
start_cluster() {
	make_tmp
	as_admin install -d -o postgres -g postgres -m 700 "$EX_TMP/pg"
	EX_PGPORT=$(free_port)
	if ! (cd "$EX_TMP" && as_postgres "$PGBIN/initdb" -D "$EX_TMP/pg/data" -U postgres \
			-A trust -E UTF8 --no-sync) >"$EX_TMP/initdb.log" 2>&1; then
		cat "$EX_TMP/initdb.log" >&2
		return 1
	fi
	as_postgres tee -a "$EX_TMP/pg/data/postgresql.conf" >/dev/null <<-EOF
		shared_preload_libraries = '$([ "${EX_EDITION:-}" = portable ] || echo idempotency)'
		listen_addresses = '127.0.0.1'
		port = $EX_PGPORT
		unix_socket_directories = '$EX_TMP/pg'
		fsync = off
	EOF
	pg_up
}

# Starts the cluster (again).
pg_up() {
	ex_pg_ctl -l "$EX_TMP/pg/server.log" start
}

# Stops the cluster, as a crash or an outage would look to the apps.
pg_down() {
	ex_pg_ctl -m fast stop
}

# Prints the URL of database $1 of the cluster (as the superuser).
db_url() {
	echo "postgresql://postgres@127.0.0.1:$EX_PGPORT/$1"
}

# Prints the URL of database $1 through the cluster's Unix socket (libpq's ?host=/dir form).
socket_url() {
	echo "postgresql://postgres@/$1?host=$EX_TMP/pg&port=$EX_PGPORT"
}

# Runs SQL $2 on the database at URL $1; prints unaligned tuples.
ex_sql() {
	"$PGBIN/psql" "$1" -X -q -At -v ON_ERROR_STOP=1 -c "$2"
}

# Creates database $1 of the cluster with the extension; prints its URL.
create_db() {
	ex_sql "$(db_url postgres)" "CREATE DATABASE $1" >/dev/null
	if [ "${EX_EDITION:-}" = portable ]; then
		"$PGBIN/psql" "$(db_url "$1")" -X -q -v ON_ERROR_STOP=1 -f "$EXAMPLES/../portable/idempotency.sql" >/dev/null
	else
		ex_sql "$(db_url "$1")" "CREATE EXTENSION idempotency" >/dev/null
	fi
	db_url "$1"
}

# Starts app $1 (a directory of examples/ with a run script) on $2 (a
# DATABASE_URL) on port $3 (default: a free one); sets APP_PID, APP_PORT and
# APP_URL, and waits until GET / answers. The first start may build the app:
# it may take up to APP_START_TIMEOUT seconds (default 900) while run lives.
start_app() {
	local kind=$1 url=$2 log=$EX_TMP/$1.log
	APP_PORT=${3:-$(free_port)}
	APP_URL=http://127.0.0.1:$APP_PORT
	[ -x "$EXAMPLES/$kind/run" ] || { echo "no executable examples/$kind/run" >&2; return 1; }
	# setsid: run may start the app as a child; the group is stopped as one.
	(cd "$EXAMPLES/$kind" && DATABASE_URL=$url PORT=$APP_PORT exec setsid ./run) >>"$log" 2>&1 &
	APP_PID=$!
	EX_PIDS+=("$APP_PID")
	local deadline=$((SECONDS + ${APP_START_TIMEOUT:-900}))
	while [ $SECONDS -lt $deadline ]; do
		curl -s -o /dev/null --max-time 2 "$APP_URL/" && return 0
		kill -0 "$APP_PID" 2>/dev/null || break
		sleep 0.1
	done
	echo "the $kind app did not start; its log:" >&2
	tail -n 100 "$log" >&2
	return 1
}

# Stops the app started last and waits for it to exit.
stop_app() {
	kill -TERM -- "-$APP_PID" 2>/dev/null || kill -TERM "$APP_PID" 2>/dev/null || true
	wait "$APP_PID" 2>/dev/null || true
	local pid rest=()
	for pid in "${EX_PIDS[@]}"; do [ "$pid" = "$APP_PID" ] || rest+=("$pid"); done
	EX_PIDS=("${rest[@]}")
}

# Stops whatever is still running and removes the temp dir (an EXIT trap).
ex_cleanup() {
	local pid
	for pid in "${EX_PIDS[@]}"; do
		[ -n "$pid" ] || continue
		kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
	done
	if [ -n "$EX_TMP" ]; then
		[ -z "$EX_PGPORT" ] || ex_pg_ctl -m immediate stop >/dev/null 2>&1 || true
		as_admin rm -rf "$EX_TMP"
	fi
}

# Prints the scope the apps derive from a credential (Authorization header value).
scope_of() {
	printf 'authorization:%s' "$1" | sha256sum | cut -c1-64
}

# Waits until key $2 of caller $3 is in progress in the database at URL $1 (bounded).
wait_in_progress() {
	local _ query
	query="SELECT state FROM idempotency.lookup('$2', '$(scope_of "$3")')"
	for _ in $(seq 1 200); do
		[ "$(ex_sql "$1" "$query")" = in_progress ] && return 0
		sleep 0.05
	done
	return 1
}

# POSTs a payment: pay OUT CREDENTIAL KEY BODY [KEY...]. KEY is the
# Idempotency-Key field value as sent ('' sends none; more KEYs send the
# field more than once). Leaves OUT.status, OUT.headers and OUT.body.
pay() {
	local out=$1 cred=$2 key=$3 body=$4 extra
	local args=(-X POST "$APP_URL/payments" -H "Authorization: $cred"
		-H 'Content-Type: application/json')
	[ -n "$key" ] && args+=(-H "Idempotency-Key: $key")
	for extra in "${@:5}"; do args+=(-H "Idempotency-Key: $extra"); done
	curl -s --max-time 30 -o "$out.body" -D "$out.headers" -w '%{http_code}' \
		"${args[@]}" -d "$body" >"$out.status" || echo 000 >"$out.status"
}

# Prints header $2 of response OUT $1 (empty when absent).
header_of() {
	grep -i "^$2:" "$1.headers" | head -n 1 | cut -d: -f2- | tr -d '\r' | sed 's/^ *//'
}

# The checks of the suites (test-e2e, test-faults): each records its result
# in PASSED and FAILED, under the app in APP; sql_is reads the app's database at $DB.

# Records one check: check NAME COMMAND...; the command's output explains a failure.
check() {
	local name=$1 out
	shift
	if out=$("$@" 2>&1); then
		echo "PASS: $APP: $name"
		PASSED=$((PASSED + 1))
	else
		echo "FAIL: $APP: $name"
		[ -z "$out" ] || echo "    ${out//$'\n'/$'\n'    }"
		FAILED=$((FAILED + 1))
	fi
}

# True when response $1 has status $2.
status_is() {
	[ "$(cat "$1.status")" = "$2" ] && return 0
	echo "expected status $2, got $(cat "$1.status"): $(cat "$1.body" 2>/dev/null)"
	return 1
}

# True when response $1 has header $2 with value $3 ('' for: absent).
header_is() {
	local got
	got=$(header_of "$1" "$2")
	[ "$got" = "$3" ] && return 0
	echo "expected $2: '$3', got '$got'"
	return 1
}

# True when the bodies of responses $1 and $2 are the same bytes.
same_body() {
	cmp -s "$1.body" "$2.body" && return 0
	echo "bodies differ: '$(cat "$1.body")' and '$(cat "$2.body")'"
	return 1
}

# True when SQL $1 on the app's database prints $2.
sql_is() {
	local got
	got=$(ex_sql "$DB" "$1")
	[ "$got" = "$2" ] && return 0
	echo "expected '$2' from $1, got '$got'"
	return 1
}
