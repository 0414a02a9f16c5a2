# shellcheck shell=bash
# Sourced by clients/go/test, clients/go/bench/overhead and examples/go/run:
# picks the Go toolchain and the caches. Module mode; modules come from the Go
# module proxy into GOMODCACHE (Go's default, ~/go/pkg/mod), checked against
# the committed go.sum.

# Go 1.26 from go.dev lives in /usr/local/go, which need not be on PATH (a
# Debian /usr/bin/go first on PATH is too old for go.mod). GO overrides both.
GO=${GO:-$(if [ -x /usr/local/go/bin/go ]; then echo /usr/local/go/bin/go; else command -v go || echo go; fi)}
[ -x "$GO" ] || GO=$(command -v "$GO") || { echo "no Go toolchain: install Go 1.26 or later into /usr/local/go" >&2; return 1; }
unset GOROOT	# the toolchain finds its own; another's would shadow it
# The toolchain at hand, never one downloaded behind our back; a build cache
# that lives as long as /tmp, so that a second build only compiles what changed.
export GOTOOLCHAIN=local
export GOCACHE=${GOCACHE:-/tmp/idempotency-go-cache}
