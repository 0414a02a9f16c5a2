# Shared by scripts/test, scripts/demo and bench/run: packages, build, users.
PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}
# The server binaries beside that pg_config (a private copy of the installation works too).
PGBIN=${PGBIN:-$(dirname "$PG_CONFIG")}

# Runs a command as root (directly, or through sudo for a normal user).
as_root() {
	if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

# Runs a command as the postgres OS user (initdb refuses root).
as_postgres() {
	if [ "$(id -un)" = postgres ]; then "$@"
	elif [ "$(id -u)" -eq 0 ]; then runuser -u postgres -- "$@"
	else sudo -u postgres "$@"; fi
}

# Installs the Debian packages that building and testing need, when missing.
install_packages() {
	local want=(postgresql-15 postgresql-server-dev-15 postgresql-contrib
		libssl-dev libipc-run-perl build-essential pgbouncer libfaketime postgresql-15-plproxy
		curl ca-certificates python3-psycopg nodejs npm prometheus-postgres-exporter
		debootstrap debhelper postgresql-server-dev-all unzip ${EXTRA_PACKAGES:-})
	local list
	# Each client package and example app lists the Debian packages it needs.
	for list in clients/*/debian-packages.txt examples/*/debian-packages.txt; do
		[ -f "$list" ] && want+=($(grep -v '^#' "$list"))
	done
	local missing=()
	for p in "${want[@]}"; do
		dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
	done
	# nodejs may come from elsewhere than Debian (then npm comes with it).
	if command -v node >/dev/null && command -v npm >/dev/null; then
		local keep=()
		for p in "${missing[@]}"; do [[ $p == nodejs || $p == npm ]] || keep+=("$p"); done
		missing=("${keep[@]}")
	fi
	if [ ${#missing[@]} -gt 0 ]; then
		echo "installing: ${missing[*]}"
		as_root apt-get update -qq
		as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
	fi
}

# Copies the checkout's tracked and unignored files into DIR: a clean copy,
# without object files built for another PostgreSQL.
clean_copy() {
	mkdir -p "$1"
	git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$1"
}

# Builds the extension and installs it into the server's directories.
build_and_install() {
	make -s COPT=-Werror PG_CONFIG="$PG_CONFIG"
	as_root make -s install PG_CONFIG="$PG_CONFIG"
}
