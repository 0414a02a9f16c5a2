"""The client, and the Flask and ASGI middlewares in both modes, through
pgbouncer in transaction pooling, with psycopg's default settings
(prepare_threshold 5): the client's own statements must
never be prepared, since the next transaction may run on another server
connection, where a prepared statement does not exist. Skips without a
pgbouncer binary (Debian: the pgbouncer package)."""

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
from psycopg_pool import ConnectionPool

from conftest import DATABASE_URL
from helpers import pay, value, wait_for
from test_http import charges_locked, handlers_blocked, in_background
from pg_idempotency import Client, fingerprint

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


@pytest.fixture(scope="module")
def bouncer():
    """A pgbouncer in transaction mode before the test database; yields its conninfo."""
    if not os.path.exists(PGBOUNCER):
        pytest.skip("no pgbouncer")
    params = conninfo_to_dict(DATABASE_URL)
    # A folder of its own that the postgres user can reach (pytest's are root's only).
    here = Path(tempfile.mkdtemp(prefix="pg-idempotency-pgbouncer-"))
    here.chmod(0o755)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
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
    process.terminate()
    process.wait(10)
    shutil.rmtree(here)


def test_the_client_works_through_pgbouncer_in_transaction_mode(bouncer):
    with ConnectionPool(bouncer, min_size=2, max_size=2) as pool, \
            psycopg.connect(bouncer) as other:
        client = Client(pool)
        with pool.connection() as conn:
            # More calls on one connection than psycopg's prepare_threshold.
            for n in range(8):
                claim = client.claim(f"pb-{n}", fingerprint("POST", "/"), conn=conn, commit=True)
                assert claim.outcome == "new"
                client.complete(f"pb-{n}", claim.fence, 201, b"{}", conn=conn, commit=True)
            # Another client holds the server connection those calls used:
            # the next call runs on another one.
            other.execute("SELECT 1")
            for n in range(8):
                assert client.claim(f"pb-{n}", fingerprint("POST", "/"),
                                    conn=conn, commit=True).outcome == "replay"
            other.rollback()


def test_the_middlewares_work_through_pgbouncer_in_transaction_mode(serve, bouncer, admin):
    # The handler's own INSERT would be prepared after psycopg's fifth use
    # (prepare_threshold): an app behind pgbouncer before 1.21 turns that off.
    # The middleware's statements are never prepared, whatever the setting.
    client = serve(conninfo=bouncer, pool_options={"min_size": 1, "max_size": 2,
                                                   "kwargs": {"prepare_threshold": None}})
    for n in range(8):
        assert pay(client, f"pb-http-{n}", {"amount": 10 + n}).status_code == 201
    for n in range(8):
        assert pay(client, f"pb-http-{n}", {"amount": 10 + n}).headers["idempotent-replayed"] == "true"
    assert pay(client, "pb-http-0", {"amount": 99}).status_code == 422
    assert pay(client, "pb-http-fail", {"amount": 5, "fail": True}).status_code == 500
    assert value(admin, "SELECT count(*) FROM charges") == 8
    assert value(admin, "SELECT count(*) FROM idempotency.keys WHERE state = 'completed'") == 8


def test_one_transaction_a_duplicate_waits_and_replays_through_pgbouncer(serve, bouncer, admin, mode):
    if mode != "one transaction":
        pytest.skip("one transaction only")
    client = serve(conninfo=bouncer, wait="60 seconds")
    with charges_locked():
        first = in_background(lambda: pay(client, "pb-wait", {"amount": 41}))
        handlers_blocked(admin, 1)
        duplicate = in_background(lambda: pay(client, "pb-wait", {"amount": 41}))
        wait_for(admin, """SELECT count(*) = 2 FROM pg_stat_activity
                            WHERE datname = current_database() AND state = 'active'
                              AND query LIKE '%%idempotency.claim%%'""")
    assert first().status_code == 201
    assert duplicate().headers["idempotent-replayed"] == "true"
    assert value(admin, "SELECT count(*) FROM charges") == 1
