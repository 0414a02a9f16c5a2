# shellcheck shell=bash
# Shared by clients/python/pack, clients/python/test and examples/python/run:
# which Python, and virtualenvs with packages from PyPI.

# pip's own cache, for the downloads that fill a wheelhouse.
export PIP_CACHE_DIR=${PIP_CACHE_DIR:-/tmp/pip-cache-pg-idempotency}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

# Prints the Python to build virtualenvs with: $PYTHON, else pyenv's python3
# (Debian's lacks the venv module), else the first python3 on PATH.
py_python() {
	local py
	for py in "${PYTHON:-}" "${PYENV_ROOT:-$HOME/.pyenv}/shims/python3" "$(command -v python3 || true)"; do
		[ -n "$py" ] && [ -x "$py" ] && "$py" -c 'import venv, ensurepip' 2>/dev/null && { echo "$py"; return 0; }
	done
	echo "no python3 with the venv module: set PYTHON" >&2
	return 1
}

# Makes a fresh virtualenv at $1 (whatever was there goes).
py_fresh_venv() {
	rm -rf "$1"
	"$(py_python)" -m venv "$1"
}

# Prints a key of requirements file $1 and of the Python that installs it.
py_key() {
	{ "$(py_python)" --version; cat "$1"; } | sha256sum | cut -c1-16
}

# Prints the path of a wheelhouse under /tmp holding every wheel of
# requirements file $1 (all pinned), downloaded from PyPI once: installs
# from it ask no index (py_install).
py_wheelhouse() {
	local dir
	dir=/tmp/pg-idempotency-wheels-$(py_key "$1")
	if [ ! -f "$dir/.complete" ]; then
		py_fresh_venv "$dir.venv" >&2
		"$dir.venv/bin/pip" download --quiet --only-binary=:all: -d "$dir" -r "$1" >&2
		rm -rf "$dir.venv"
		touch "$dir/.complete"
	fi
	echo "$dir"
}

# Installs into virtualenv $1, from the wheelhouse of requirements file $2
# only, those requirements and the further arguments (a wheel and its extras).
py_install() {
	local venv=$1 requirements=$2
	shift 2
	"$venv/bin/pip" install --quiet --no-index --find-links "$(py_wheelhouse "$requirements")" \
		-r "$requirements" "$@"
}

# Prints the path of a virtualenv holding requirements file $1, made once
# and kept under /tmp, named $2 and keyed by the file's content.
py_venv_for() {
	local venv
	venv=/tmp/pg-idempotency-venv-$2-$(py_key "$1")
	if [ ! -f "$venv/.complete" ]; then
		py_fresh_venv "$venv" >&2
		py_install "$venv" "$1" >&2
		touch "$venv/.complete"
	fi
	echo "$venv"
}
