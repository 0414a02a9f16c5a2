# Sourced by clients/rust/test, clients/rust/bench/overhead and
# examples/rust/run: finds rustup's cargo even when ~/.cargo/bin is not on
# PATH (a Debian /usr/bin/cargo is too old for edition 2024), and sets one
# target directory under /tmp per pair of lock files, so that a fresh clone
# (CI) reuses what an earlier run with the same dependencies compiled.
rust_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ -z "${CARGO:-}" ]; then
	for CARGO in "$HOME/.cargo/bin/cargo" /root/.cargo/bin/cargo "$(command -v cargo || true)"; do
		[ -x "$CARGO" ] && break
	done
fi
[ -x "$CARGO" ] || { echo "cargo not found: install Rust with rustup (https://rustup.rs)" >&2; exit 1; }
export CARGO PATH="$(dirname "$CARGO"):$PATH"
unset RUSTC RUSTDOC
if [ -z "${CARGO_TARGET_DIR:-}" ]; then
	locks=$(cat "$rust_dir/Cargo.lock" "$rust_dir/../../examples/rust/Cargo.lock" 2>/dev/null | sha256sum | cut -c1-16)
	export CARGO_TARGET_DIR=/tmp/idempotency-rust-target-$locks
fi
# The crate's version, as cargo package names its .crate.
crate_version=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$rust_dir/Cargo.toml" | head -n 1)
