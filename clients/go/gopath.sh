# shellcheck shell=bash
# Sourced by clients/go/test and examples/go/run: the environment that builds
# this module offline in GOPATH mode. Debian's Go libraries
# (golang-github-jackc-pgx-v4-dev) are in /usr/share/gocode; a GOPATH of our
# own holds a symlink from the module path to this directory.

GO_MODULE=github.com/idempotency/idempotency/clients/go
# Debian's go (golang-go, Go 1.19), not whichever is first on PATH: a
# /usr/local/go there would build against other standard libraries.
GO=/usr/bin/go
GO_CLIENT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# Makes a GOPATH in directory $1 and exports the GOPATH-mode environment; sets
# GO_PACKAGE_DIR, the package's directory as seen through that GOPATH. Build
# with "$GO", not go. The build cache is shared, so a second build only
# compiles what changed.
gopath_setup() {
	local link=$1/src/$GO_MODULE
	mkdir -p "$(dirname "$link")"
	[ "$(readlink "$link" 2>/dev/null)" = "$GO_CLIENT_DIR" ] || ln -sfn "$GO_CLIENT_DIR" "$link"
	[ -x "$GO" ] || { echo "$GO is missing: apt-get install golang-go" >&2; return 1; }
	unset GOROOT	# Debian's go finds its own; another's would shadow it
	export GO111MODULE=off GOPROXY=off GOFLAGS='' GOPATH=$1:/usr/share/gocode
	export GOCACHE=${GOCACHE:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/idempotency-go}
	GO_PACKAGE_DIR=$link/idempotency
}
