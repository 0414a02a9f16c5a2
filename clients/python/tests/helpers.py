"""What the tests share: callers, requests, reading the database, and a
pgbouncer before it."""

import contextlib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from conftest import DATABASE_URL

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"

ALICE = {"Authorization": "Bearer sk_test_alice"}
BOB = {"Authorization": "Bearer sk_test_bob"}


def scope_of(credential_headers):
    """Returns the scope the middlewares derive from an Authorization header."""
    return hashlib.sha256(b"authorization:" + credential_headers["Authorization"].encode()).hexdigest()


def pay(client, key, body=None, caller=ALICE, method="POST", path="/payments"):
    """Sends a payment; key is the Idempotency-Key field as sent (None: no
    field; a list: the field that many times); body a dict or raw bytes."""
    headers = list(caller.items()) + [("Content-Type", "application/json")]
    keys = [] if key is None else key if isinstance(key, list) else [key]
    headers += [("Idempotency-Key", k) for k in keys]
    content = body if isinstance(body, bytes) else json.dumps(body or {"amount": 10}).encode()
    return client.request(method, path, headers=headers, content=content)


def value(conn, sql, *params):
    """Returns the single value of a query."""
    return conn.execute(sql, params).fetchone()[0]


def assert_problem(response, status, code):
    """Checks an RFC 9457 problem answer with the contract's code."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    problem = response.json()
    assert problem["status"] == status and problem["code"] == code
    assert problem["type"] == "about:blank"
    assert problem["title"] and problem["detail"]


def wait_for(admin, sql, *params, timeout=10):
    """Waits until a query answers true (bounded)."""
    deadline = time.monotonic() + timeout
    while not value(admin, sql, *params):
        assert time.monotonic() < deadline, f"timed out waiting for {sql}"
        time.sleep(0.02)


def free_port():
    """Returns a TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def pgbouncer(port=None):
    """Runs a pgbouncer in transaction mode, default settings otherwise, on
    127.0.0.1:port (default any free one) before the test database; yields
    its conninfo. Skips the test without a pgbouncer binary (Debian: the
    pgbouncer package)."""
    if not os.path.exists(PGBOUNCER):
        pytest.skip("no pgbouncer")
    params = conninfo_to_dict(DATABASE_URL)
    # A folder of its own that the postgres user can reach (pytest's are root's only).
    here = Path(tempfile.mkdtemp(prefix="pg-idempotency-pgbouncer-"))
    here.chmod(0o755)
    port = port or free_port()
    user = params.get("user", "postgres")
    (here / "users.txt").write_text(f'"{user}" ""\n')
    (here / "pgbouncer.ini").write_text(f"""[databases]
* = host={params.get("host", "127.0.0.1")} port={params.get("port", 5432)}
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {here}/users.txt
pool_mode = transaction
default_pool_size = 4
logfile = {here}/pgbouncer.log
""")
    command = [PGBOUNCER, str(here / "pgbouncer.ini")]
    if os.geteuid() == 0:   # pgbouncer refuses to run as root
        shutil.chown(here, "postgres")
        for name in ("users.txt", "pgbouncer.ini"):
            shutil.chown(here / name, "postgres")
        command = ["runuser", "-u", "postgres", "--", *command]
    process = subprocess.Popen(command)
    conninfo = make_conninfo(DATABASE_URL, host="127.0.0.1", port=port)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                psycopg.connect(conninfo, connect_timeout=2).close()
                break
            except psycopg.OperationalError:
                assert time.monotonic() < deadline and process.poll() is None, \
                    "pgbouncer did not start: " + (here / "pgbouncer.log").read_text(errors="replace")
                time.sleep(0.1)
        yield conninfo
    finally:
        process.terminate()
        process.wait(10)
        shutil.rmtree(here)
