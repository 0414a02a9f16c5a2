"""The package installed every way users install it: pip from the folder,
pip from a git URL with #subdirectory=, a wheel made by pip wheel or by
python -m build from the folder, and the sdist. Each goes into a virtualenv
of its own with pip's default (isolated) build, and must hold the sources'
modules, the licence, and work against the database (without
opentelemetry-api, which only the extra brings).

The test script gives the folder (PG_IDEMPOTENCY_SOURCE), a Python with
`build` (PG_IDEMPOTENCY_BUILD_PYTHON) and pip's wheelhouses (PIP_FIND_LINKS,
PIP_NO_INDEX): no index is asked. Without them these tests skip."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from conftest import DATABASE_URL

SOURCE = os.environ.get("PG_IDEMPOTENCY_SOURCE")
BUILD_PYTHON = os.environ.get("PG_IDEMPOTENCY_BUILD_PYTHON")
pytestmark = pytest.mark.skipif(not (SOURCE and BUILD_PYTHON),
                                reason="run by clients/python/test (PG_IDEMPOTENCY_SOURCE)")

# Runs in the fresh virtualenv: prints what it installed, and uses it.
CHECK = """
import hashlib, importlib.metadata, importlib.util, json, pathlib, sys
import pg_idempotency
from psycopg_pool import ConnectionPool
from pg_idempotency import Client, fingerprint
package = pathlib.Path(pg_idempotency.__file__).parent
dist = importlib.metadata.distribution("pg-idempotency")
licences = [f for f in dist.files or [] if f.name == "LICENSE"]
with ConnectionPool(sys.argv[1], min_size=1, max_size=1) as pool:
    claim = Client(pool).claim("install-" + sys.argv[2], fingerprint("POST", "/"))
print(json.dumps({
    "where": str(package),
    "modules": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in package.glob("*.py")},
    "licence": [f.locate().read_text() for f in licences],
    "license_expression": dist.metadata.get("License-Expression"),
    "outcome": claim.outcome,
    "opentelemetry": importlib.util.find_spec("opentelemetry") is not None,
}))
"""


def run(*args, cwd=None):
    """Runs a command (without PYTHONPATH: only the install may be found);
    fails the test with its output when it fails."""
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def copy_of_folder(into: Path) -> Path:
    """Copies clients/python as a checkout has it (what git tracks or would
    track, as in the working tree: the scripts beside pyproject.toml too)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                            cwd=SOURCE, capture_output=True)
    names = [n for n in listed.stdout.decode().split("\0") if n] if listed.returncode == 0 else []
    assert names, "clients/python is not in a git checkout"
    for name in names:
        if (Path(SOURCE) / name).is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(Path(SOURCE) / name, into / name)
    return into


def git_repository(into: Path) -> str:
    """A git repository holding the folder at clients/python; returns the pip requirement on it."""
    copy_of_folder(into / "clients" / "python")
    git = ["git", "-C", into, "-c", "user.name=test", "-c", "user.email=test@example.com"]
    run(*git, "init", "-q")
    run(*git, "add", "-A")
    run(*git, "commit", "-q", "-m", "the package")
    return f"git+file://{into}#subdirectory=clients/python"


def built_wheel(tool: str, folder: Path, out: Path) -> Path:
    """Makes the wheel from the folder with pip wheel or python -m build (isolated, as users do)."""
    if tool == "pip wheel":
        run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", out, folder)
    elif tool == "python -m build --wheel":
        run(BUILD_PYTHON, "-m", "build", "--wheel", "--outdir", out, folder)
    else:
        run(BUILD_PYTHON, "-m", "build", "--sdist", "--outdir", out, folder)
    found = list(out.glob("*.whl")) + list(out.glob("*.tar.gz"))
    assert len(found) == 1, found
    return found[0]


WAYS = ["pip install FOLDER", "pip install git+file://...#subdirectory=",
        "pip wheel", "python -m build --wheel", "python -m build --sdist"]


@pytest.mark.parametrize("way", WAYS)
def test_the_package_installs(way, tmp_path):
    folder = copy_of_folder(tmp_path / "python")
    if way == "pip install FOLDER":
        requirement = str(folder)
    elif way.startswith("pip install git"):
        requirement = git_repository(tmp_path / "repo")
    else:
        requirement = str(built_wheel(way, folder, tmp_path / "dist"))
    target = tmp_path / "venv"
    venv.create(target, with_pip=False)
    python = target / "bin" / "python"
    run(sys.executable, "-m", "pip", "--python", python, "install", "--quiet", requirement)
    found = json.loads(run(python, "-c", CHECK, DATABASE_URL, way, cwd=tmp_path))
    assert found["where"].startswith(str(target)), found["where"]
    sources = Path(SOURCE) / "src" / "pg_idempotency"
    assert found["modules"] == {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                                for p in sources.glob("*.py")}
    assert found["licence"] == [(Path(SOURCE) / "LICENSE").read_text()]
    assert found["license_expression"] == "PostgreSQL"
    assert found["outcome"] == "new"
    assert not found["opentelemetry"]   # an optional dependency: the client works without it


def test_the_packages_licence_is_the_projects():
    assert (Path(SOURCE) / "LICENSE").read_text() == (Path(SOURCE) / ".." / ".." / "LICENSE").read_text()
