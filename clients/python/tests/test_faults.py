"""When the database's answer is lost (issue 22, docs/http-contract.md):
Flask, ASGI and Django behind the project's fault proxy
(examples/faultproxy, run with node; FAULTPROXY names another copy), which
lets the server finish a statement and cuts the app's connection before the
answer arrives, or drops every connection and refuses the next. After each
fault the payment is charged once, the client gets the handler's answer (a
201, never a 409 for its own claim nor a 503), the record ends completed,
its retry replays, and the app still answers."""

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from django.db import connections
from django.test import Client as DjangoClient
from django.test.utils import override_settings
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import test_django  # noqa: F401 - Django's settings and the views
from apps import SERVERS
from conftest import DATABASE_URL
from helpers import ALICE, pay, scope_of, value
from test_redact import redact_charge

FAULTPROXY = Path(os.environ.get("FAULTPROXY") or
                  Path(__file__).resolve().parents[3] / "examples" / "faultproxy" / "faultproxy.js")


class Proxy:
    """The fault proxy in front of the test database, in a process of its own."""

    def __init__(self):
        """Starts it; reads its ports from the line it prints."""
        params = conninfo_to_dict(DATABASE_URL)
        target = f"{params.get('host') or '127.0.0.1'}:{params.get('port') or 5432}"
        self.process = subprocess.Popen(["node", str(FAULTPROXY), "--target", target],
                                        stdout=subprocess.PIPE, text=True)
        ports = json.loads(self.process.stdout.readline())
        self.port = ports["listen"]
        self.control = httpx.Client(base_url=f"http://127.0.0.1:{ports['control']}", timeout=10)
        self.url = make_conninfo(DATABASE_URL, host="127.0.0.1", port=self.port, sslmode="disable")

    def command(self, method, path):
        """Sends a control request; returns its JSON answer."""
        answer = self.control.request(method, path)
        answer.raise_for_status()
        return answer.json()

    def stop(self):
        """Stops the proxy."""
        self.process.terminate()
        self.process.wait(10)


@pytest.fixture(scope="module")
def proxy():
    """One proxy for the module; Django's "faults" alias goes through it."""
    if not FAULTPROXY.is_file() or not shutil.which("node"):
        pytest.skip(f"no fault proxy at {FAULTPROXY} (or no node)")
    proxy = Proxy()
    faults = {**connections.settings["default"], "HOST": "127.0.0.1", "PORT": str(proxy.port),
              "OPTIONS": {"sslmode": "disable"}}
    connections.settings["faults"] = faults
    yield proxy
    connections["faults"].close()
    proxy.stop()


@pytest.fixture
def app_options():
    """The middleware's options beside the mode (a test may parametrize them)."""
    return {}


@pytest.fixture(params=["flask", "asgi", "django"])
def app(request, proxy, mode, app_options):
    """A client on the test app of this kind, in this mode, whose database is behind the proxy."""
    proxy.command("POST", "/reset")
    options = {"one_transaction": mode == "one transaction", **app_options}
    if request.param == "django":
        with override_settings(IDEMPOTENCY={"using": "faults", **options}):
            yield DjangoHttp(DjangoClient(raise_request_exception=False))
        connections["faults"].close()
        return
    server = SERVERS[request.param](proxy.url, {"min_size": 2, "max_size": 4, "timeout": 5}, options)
    yield httpx.Client(base_url=server.url, timeout=30, limits=httpx.Limits(max_keepalive_connections=0))
    server.stop()


class DjangoHttp:
    """Django's test client with the calls pay() makes of an httpx client."""

    def __init__(self, client):
        """Wraps client."""
        self.client = client

    def request(self, method, path, headers, content):
        """Sends a request; the answer has status_code, headers and content."""
        return getattr(self.client, method.lower())(path, content, content_type="application/json",
                                                    headers=dict(headers))

    def get(self, path):
        """GET path."""
        return self.client.get(path)


def assert_exactly_once(app, admin, answer, key):
    """One charge, named by the handler's 201; the record completed; the
    retry replays it byte for byte; the app still answers."""
    assert answer.status_code == 201, answer.content
    charges = admin.execute("SELECT id FROM charges").fetchall()
    assert len(charges) == 1
    assert json.loads(answer.content) == {"charge": charges[0][0]}
    assert value(admin, "SELECT state FROM idempotency.lookup(%s, %s)", key, scope_of(ALICE)) == "completed"
    again = pay(app, key)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.content == answer.content
    assert value(admin, "SELECT count(*) FROM charges") == 1
    assert app.get("/db").status_code == 200


def test_a_claim_whose_answer_was_lost_is_asked_again_with_its_token(app, proxy, admin):
    proxy.command("POST", "/cut?match=idempotency%5C.claim&scope=transaction")
    answer = pay(app, "lost-claim-1")
    assert proxy.command("GET", "/stats")["cuts"] == 1
    assert_exactly_once(app, admin, answer, "lost-claim-1")
    assert value(admin, "SELECT attempt FROM idempotency.lookup('lost-claim-1', %s)", scope_of(ALICE)) == 1


def test_a_commit_whose_answer_was_lost_is_resolved_by_a_claim_replay(app, proxy, admin):
    proxy.command("POST", "/cut?match=idempotency%5C.complete&scope=transaction")
    answer = pay(app, "lost-commit-1")
    assert proxy.command("GET", "/stats")["cuts"] == 1
    assert_exactly_once(app, admin, answer, "lost-commit-1")


@pytest.mark.parametrize("app_options", [{"redact": redact_charge}])
def test_a_lost_commits_answer_is_the_handlers_own_response_not_the_redacted_one(app, proxy, admin):
    proxy.command("POST", "/cut?match=idempotency%5C.complete&scope=transaction")
    answer = pay(app, "lost-redacted-1")
    assert proxy.command("GET", "/stats")["cuts"] == 1
    assert answer.status_code == 201, answer.content
    assert json.loads(answer.content) == {"charge": value(admin, "SELECT id FROM charges")}
    assert "Idempotent-Replayed" not in answer.headers
    assert json.loads(pay(app, "lost-redacted-1").content) == {"charge": "redacted"}


def test_a_complete_whose_answer_was_lost_before_its_commit_runs_the_handler_again(app, proxy, admin):
    # Django sends complete and then COMMIT: cut after complete, the
    # transaction rolls back, the claim says new with the same fence, and
    # the view runs again (its first charge's id is gone). Flask and ASGI
    # send complete and COMMIT in one pipeline: the cut comes after the
    # COMMIT, and the claim says replay.
    ids = "SELECT pg_sequence_last_value(pg_get_serial_sequence('charges', 'id'))"
    before = value(admin, ids) or 0
    proxy.command("POST", "/cut?match=idempotency%5C.complete&scope=statement")
    answer = pay(app, "lost-complete-1")
    assert proxy.command("GET", "/stats")["cuts"] == 1
    assert_exactly_once(app, admin, answer, "lost-complete-1")
    if isinstance(app, DjangoHttp):
        assert value(admin, ids) - before == 2, "the view ran twice, its first run rolled back"


def test_a_handler_whose_connection_broke_is_released_and_its_retry_runs(app, proxy, admin):
    proxy.command("POST", "/cut?match=INSERT%20INTO%20charges&scope=statement")
    failed = pay(app, "lost-insert-1")
    assert failed.status_code == 500
    assert value(admin, "SELECT count(*) FROM idempotency.keys") == 0, "released on a fresh connection"
    answer = pay(app, "lost-insert-1")
    assert_exactly_once(app, admin, answer, "lost-insert-1")


def test_dropped_connections_and_a_refused_one_are_survived(app, proxy, admin):
    assert pay(app, "warm-1").status_code == 201       # the pool holds connections
    admin.execute("TRUNCATE charges")
    proxy.command("POST", "/drop")
    proxy.command("POST", "/refuse?count=1")
    answer = pay(app, "dropped-1")
    assert_exactly_once(app, admin, answer, "dropped-1")


def test_a_claim_cut_on_the_apps_side_only_is_never_a_409_for_its_own_claim(app, proxy, admin, mode):
    # Half-open: the server keeps the connection and the transaction it was in.
    proxy.command("POST", "/cut?match=idempotency%5C.claim&scope=statement&keep=server")
    try:
        answer = pay(app, "half-open-1")
        assert proxy.command("GET", "/stats")["cuts"] == 1
        if mode == "one transaction":
            # The claim never committed and holds the key until the server
            # learns its connection is gone: asked again, a 503, nothing kept.
            assert answer.status_code == 503, answer.content
            assert json.loads(answer.content)["code"] == "idempotency_unavailable"
            assert value(admin, "SELECT count(*) FROM charges") == 0
            proxy.command("POST", "/drop")
            wait_until_no_open_write(admin)
            answer = pay(app, "half-open-1")
        assert_exactly_once(app, admin, answer, "half-open-1")
    finally:
        proxy.command("POST", "/drop")   # what the server kept open, also after a failure


def wait_until_no_open_write(admin):
    """Waits (bounded) until no other backend is idle in a transaction that wrote."""
    for _ in range(100):
        if value(admin, "SELECT count(*) FROM pg_stat_activity WHERE pid <> pg_backend_pid()"
                        " AND state LIKE 'idle in transaction%%' AND backend_xid IS NOT NULL") == 0:
            return
        time.sleep(0.1)
    raise AssertionError("a backend still holds a transaction open")


@pytest.fixture
def commit_lost_once(monkeypatch, kind):
    """The first COMMIT of a request never reaches the server: the
    middleware's connection is closed just before (the server rolls the
    transaction back), so the COMMIT fails as a lost answer does. Flask and
    ASGI send complete with the COMMIT, which the proxy cannot cut apart."""
    if kind == "flask":
        from pg_idempotency.flask import Idempotency as middleware
    else:
        from pg_idempotency.asgi import IdempotencyMiddleware as middleware
    commit = middleware._commit
    closed = []

    def first_lost(self, *args):
        """Closes the connection the first time; then commits as before."""
        if not closed:
            closed.append(True)
            from flask import g
            (g.db if kind == "flask" else args[0]).pgconn.finish()
        return commit(self, *args)
    monkeypatch.setattr(middleware, "_commit", first_lost)
    return closed


def test_a_commit_lost_before_the_server_got_it_runs_the_handler_again(serve, admin, commit_lost_once):
    client = serve()
    ids = "SELECT pg_sequence_last_value(pg_get_serial_sequence('charges', 'id'))"
    before = value(admin, ids) or 0
    answer = pay(client, "rolled-back-1")
    assert commit_lost_once == [True]
    assert_exactly_once(client, admin, answer, "rolled-back-1")
    assert value(admin, ids) - before == 2, "the handler ran twice, its first run rolled back"
