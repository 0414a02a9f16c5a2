# shellcheck shell=bash
# Shared by examples/test-e2e and examples/demo-http: a throwaway PostgreSQL
# cluster that preloads the extension, the two example apps, and curl.
# Source it from bash; it sources scripts/lib.sh (as_root, as_postgres, PGBIN).

EXAMPLES=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$EXAMPLES/../scripts/lib.sh"

EX_TMP=			# the temp dir: cluster, logs, responses
EX_PGPORT=		# the cluster's port on 127.0.0.1
EX_PIDS=()		# the apps started, each the leader of its process group
APP_PID='' APP_PORT='' APP_URL=''	# the app started last

# Fails, saying what is missing, unless node, npm, curl and psql are at hand.
check_tools() {
	local tool missing=()
	for tool in node npm curl setsid "$PGBIN/initdb" "$PGBIN/psql"; do
		command -v "$tool" >/dev/null || missing+=("$tool")
	done
	[ ${#missing[@]} -eq 0 ] && return 0
	echo "missing: ${missing[*]} (scripts/test installs what the examples need)" >&2
	return 1
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

# Prints a python3 that has Debian's flask and psycopg (a pyenv one may not).
flask_python() {
	local py
	for py in "${PYTHON:-python3}" /usr/bin/python3; do
		if "$py" -c 'import flask, psycopg' 2>/dev/null; then echo "$py"; return 0; fi
	done
	echo "no python3 with flask and psycopg: apt-get install python3-flask python3-psycopg" >&2
	return 1
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
		shared_preload_libraries = 'idempotency'
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

# Runs SQL $2 on the database at URL $1; prints unaligned tuples.
ex_sql() {
	"$PGBIN/psql" "$1" -X -q -At -v ON_ERROR_STOP=1 -c "$2"
}

# Creates database $1 of the cluster with the extension; prints its URL.
create_db() {
	ex_sql "$(db_url postgres)" "CREATE DATABASE $1" >/dev/null
	ex_sql "$(db_url "$1")" "CREATE EXTENSION idempotency" >/dev/null
	db_url "$1"
}

# Installs the Node app's dependencies from the lock file (npm registry).
npm_install() {
	(cd "$EXAMPLES/node" &&
		npm ci --no-audit --no-fund --no-update-notifier --loglevel=error) >/dev/null
}

# Starts app $1 (node or python) on $2 (a DATABASE_URL) on port $3 (default:
# a free one); sets APP_PID, APP_PORT and APP_URL, and waits until GET / answers.
start_app() {
	local kind=$1 url=$2 log=$EX_TMP/$1.log py
	APP_PORT=${3:-$(free_port)}
	APP_URL=http://127.0.0.1:$APP_PORT
	# setsid: npm start runs node as a child; the group is stopped as one.
	case $kind in
	node)	(cd "$EXAMPLES/node" && DATABASE_URL=$url PORT=$APP_PORT exec setsid npm start) \
			>>"$log" 2>&1 & ;;
	python)	py=$(flask_python) || return 1
		(cd "$EXAMPLES/python" && DATABASE_URL=$url PORT=$APP_PORT exec setsid "$py" app.py) \
			>>"$log" 2>&1 & ;;
	*)	echo "unknown app $kind" >&2; return 1 ;;
	esac
	APP_PID=$!
	EX_PIDS+=("$APP_PID")
	local _
	for _ in $(seq 1 300); do
		curl -s -o /dev/null --max-time 2 "$APP_URL/" && return 0
		kill -0 "$APP_PID" 2>/dev/null || break
		sleep 0.1
	done
	echo "the $kind app did not start; its log:" >&2
	cat "$log" >&2
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

# POSTs a payment: pay OUT CREDENTIAL KEY BODY (KEY '' sends no key header).
# Leaves OUT.status, OUT.headers and OUT.body.
pay() {
	local out=$1 cred=$2 key=$3 body=$4
	local args=(-X POST "$APP_URL/payments" -H "Authorization: $cred"
		-H 'Content-Type: application/json')
	[ -n "$key" ] && args+=(-H "Idempotency-Key: $key")
	curl -s --max-time 30 -o "$out.body" -D "$out.headers" -w '%{http_code}' \
		"${args[@]}" -d "$body" >"$out.status" || echo 000 >"$out.status"
}

# Prints header $2 of response OUT $1 (empty when absent).
header_of() {
	grep -i "^$2:" "$1.headers" | head -n 1 | cut -d: -f2- | tr -d '\r' | sed 's/^ *//'
}
