"""The Django middleware with Django's test client against the database
(DATABASE_URL through Django's postgresql backend on psycopg 3): this module
is the project's settings' ROOT_URLCONF, its views write through Django's
connection inside the middleware's transaction.atomic()."""

import asyncio
import json
import threading
import time

import django
import psycopg
import pytest
from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.conf import settings
from django.db import connection, connections
from django.http import HttpResponse, JsonResponse, StreamingHttpResponse
from django.test import Client as DjangoClient
from django.test.utils import override_settings
from django.urls import path
from psycopg.conninfo import conninfo_to_dict

from conftest import DATABASE_URL
from helpers import ALICE, BOB, assert_problem, pgbouncer, scope_of, value, wait_for
from pg_idempotency import contract


def configure():
    """Django's settings for these tests: the test database, the middleware."""
    params = conninfo_to_dict(DATABASE_URL)
    database = {"ENGINE": "django.db.backends.postgresql", "NAME": params.get("dbname", ""),
                "USER": params.get("user", ""), "PASSWORD": params.get("password", ""),
                "HOST": params.get("host", ""), "PORT": params.get("port", "")}
    settings.configure(
        DEBUG=False, ALLOWED_HOSTS=["testserver", "127.0.0.1"], ROOT_URLCONF=__name__, SECRET_KEY="test",
        MIDDLEWARE=["pg_idempotency.django.IdempotencyMiddleware", f"{__name__}.Timeout"],
        DATABASES={"default": database,
                   "down": {**database, "HOST": "127.0.0.1", "PORT": "1",
                            "OPTIONS": {"connect_timeout": 1}},
                   # test_through_pgbouncer_in_transaction_mode's pgbouncer (its port set there)
                   "bouncer": {**database, "HOST": "127.0.0.1", "PORT": "1", "CONN_MAX_AGE": None}},
        USE_TZ=True)
    django.setup()


if not settings.configured:
    configure()


def db():
    """Django's connection the middleware uses (IDEMPOTENCY["using"]): the views write through it."""
    return connections[getattr(settings, "IDEMPOTENCY", {}).get("using", "default")]


def charge(request):
    """POST /payments {"amount", "delay_ms", "fail", "raise", "stolen", "status"}:
    charges through Django's connection; 201 (or status) {"charge": id}."""
    data = json.loads(request.body or b"{}")
    time.sleep(data.get("delay_ms", 0) / 1000)
    with db().cursor() as cursor:
        cursor.execute("INSERT INTO charges (amount) VALUES (%s) RETURNING id", [data.get("amount", 1)])
        charge_id = cursor.fetchone()[0]
    if data.get("stolen"):
        # The claim goes while the view runs (as if a takeover or the reaper took it).
        with psycopg.connect(DATABASE_URL, autocommit=True) as other:
            other.execute("DELETE FROM idempotency.keys")
    if data.get("raise"):
        raise RuntimeError("the view failed")
    if data.get("fail"):
        return JsonResponse({"error": f"charge {charge_id} was declined"}, status=500)
    if data.get("stream"):
        return StreamingHttpResponse(iter([b'{"charge": ', str(charge_id).encode(), b"}"]),
                                     status=201, content_type="application/json")
    return JsonResponse({"charge": charge_id}, status=data.get("status", 201))


def binary(request):
    """POST /headers: binary bytes and headers of every kind."""
    response = HttpResponse(b"\x00\xffbinary", content_type="application/octet-stream")
    response["Location"] = "/payments/7"
    response["X-Request-Id"] = "r-1"
    response.set_cookie("session", "secret")
    return response


def in_transaction(request):
    """GET or PUT /db: whether the view runs inside a transaction."""
    return JsonResponse({"atomic": db().in_atomic_block})


def insert_charge(amount) -> int:
    """Inserts a charge through Django's connection; returns its id."""
    with db().cursor() as cursor:
        cursor.execute("INSERT INTO charges (amount) VALUES (%s) RETURNING id", [amount])
        return cursor.fetchone()[0]


class Timeout:
    """A request timeout inside the idempotency middleware, as an async
    middleware writes it: the seconds of the X-Timeout header, then 408.
    Passes through in sync mode and without the header."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        """Wraps get_response."""
        self.get_response = get_response
        self.async_mode = iscoroutinefunction(get_response)
        if self.async_mode:
            markcoroutinefunction(self)

    def __call__(self, request):
        """Runs the view, under the timeout when asked."""
        if not self.async_mode:
            return self.get_response(request)
        return self.timed(request)

    async def timed(self, request):
        """Answers 408 when the view outlives X-Timeout."""
        seconds = request.headers.get("X-Timeout")
        if seconds is None:
            return await self.get_response(request)
        try:
            async with asyncio.timeout(float(seconds)):
                return await self.get_response(request)
        except TimeoutError:
            return HttpResponse(b"timed out", status=408)


# Set by the async view once its charge is written (tests under ASGI wait for it).
CHARGED = threading.Event()


async def charge_async(request):
    """POST /async/payments {"amount", "delay_ms", "fail", "raise"}: an async
    view; its write goes through sync_to_async, as the async ORM's do."""
    data = json.loads(request.body or b"{}")
    charge_id = await sync_to_async(insert_charge)(data.get("amount", 1))
    CHARGED.set()
    await asyncio.sleep(data.get("delay_ms", 0) / 1000)
    if data.get("raise"):
        raise RuntimeError("the view failed")
    if data.get("fail"):
        return JsonResponse({"error": f"charge {charge_id} was declined"}, status=500)
    return JsonResponse({"charge": charge_id}, status=201)


urlpatterns = [path("payments", charge), path("headers", binary), path("db", in_transaction),
               path("async/payments", charge_async)]


def tenant_scope(request):
    """A scope of the application's own (the IDEMPOTENCY "scope" setting, by dotted path)."""
    return "tenant-7"


@pytest.fixture(autouse=True, params=["two transactions", "one transaction"])
def mode(request):
    """Each test runs in both modes of the middleware (a test that sets
    IDEMPOTENCY itself runs in the mode it sets)."""
    with override_settings(IDEMPOTENCY={"one_transaction": request.param == "one transaction"}):
        yield request.param


@pytest.fixture
def client():
    """Django's test client; a view that raises is answered 500, as in production."""
    yield DjangoClient(raise_request_exception=False)
    connection.close()


def pay(client, key, body=None, caller=ALICE, method="post", path="/payments"):
    """Sends a payment with Idempotency-Key key (None: without one)."""
    headers = dict(caller)
    if key is not None:
        headers["Idempotency-Key"] = key
    content = body if isinstance(body, bytes) else json.dumps(body or {"amount": 10}).encode()
    return getattr(client, method)(path, content, content_type="application/json", headers=headers)


@pytest.fixture
def database_setting(admin):
    """Sets idempotency.NAME for the sessions of the test database opened from now on."""
    database = value(admin, "SELECT current_database()")
    set_names = []

    def set_setting(name, setting):
        """ALTER DATABASE ... SET idempotency.name = setting."""
        admin.execute(f'ALTER DATABASE "{database}" SET idempotency.{name} = {setting}')
        set_names.append(name)
    yield set_setting
    for name in set_names:
        admin.execute(f'ALTER DATABASE "{database}" RESET idempotency.{name}')


def test_first_request_runs_and_its_retry_replays_byte_for_byte(client, admin):
    first = pay(client, '"order-42"')
    assert first.status_code == 201 and not first.has_header("Idempotent-Replayed")
    again = pay(client, "order-42")
    assert again.status_code == 201
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert again["Content-Type"] == first["Content-Type"] == "application/json"
    assert value(admin, "SELECT count(*) FROM charges") == 1
    assert value(admin, "SELECT state FROM idempotency.keys") == "completed"


def test_the_view_runs_in_the_transaction_that_stores_its_response(client):
    assert pay(client, "tx-1", path="/db").json() == {"atomic": True}


def test_a_replay_repeats_binary_bodies_and_only_the_stored_headers(client):
    first = pay(client, "h-1", path="/headers")
    again = pay(client, "h-1", path="/headers")
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content == b"\x00\xffbinary"
    assert again["Content-Type"] == "application/octet-stream"
    assert again["Location"] == "/payments/7"
    assert not again.has_header("X-Request-Id") and "session" not in again.cookies


def test_a_streamed_response_is_stored_whole(client):
    first = pay(client, "s-1", {"amount": 3, "stream": True})
    again = pay(client, "s-1", {"amount": 3, "stream": True})
    assert b"".join(first.streaming_content) == again.content
    assert again["Idempotent-Replayed"] == "true"


def test_same_key_other_request_is_422(client, admin):
    pay(client, "order-42", {"amount": 10})
    assert_problem(pay(client, "order-42", {"amount": 99}), 422, "idempotency_key_mismatch")
    assert value(admin, "SELECT count(*) FROM charges") == 1


@pytest.mark.parametrize("field", [None, '"unterminated', '"abc";x=1', "?1", '""', "a, b", "k" * 256])
def test_a_missing_or_malformed_key_is_400(client, admin, field):
    answer = pay(client, field)
    assert_problem(answer, 400, "idempotency_key_missing" if field is None else "idempotency_key_invalid")
    assert value(admin, "SELECT count(*) FROM charges") == 0


def test_keys_belong_to_their_caller(client, admin):
    assert pay(client, "order-42").content != pay(client, "order-42", caller=BOB).content
    assert value(admin, "SELECT array_agg(scope ORDER BY scope) FROM idempotency.keys") == sorted(
        [scope_of(ALICE), scope_of(BOB)])


def test_the_scope_setting_is_a_dotted_path(admin):
    with override_settings(IDEMPOTENCY={"scope": f"{__name__}.tenant_scope"}):
        client = DjangoClient()
        pay(client, "order-42")
        assert pay(client, "order-42", caller=BOB)["Idempotent-Replayed"] == "true"
    assert value(admin, "SELECT scope FROM idempotency.keys") == "tenant-7"


def test_the_fingerprint_is_the_databases_of_the_raw_request(client, admin):
    body = b'{"amount": 5}'
    pay(client, "fp-1", body, path="/payments?b=%20x&a=1")
    assert value(admin, "SELECT fingerprint FROM idempotency.keys") == value(
        admin, "SELECT idempotency.fingerprint('POST', '/payments', %s, 'b=%%20x&a=1')", body)


def test_other_methods_pass_through_outside_a_transaction(client, admin):
    assert client.get("/db").json() == {"atomic": False}
    assert client.put("/db").json() == {"atomic": False}
    assert value(admin, "SELECT count(*) FROM idempotency.keys") == 0


def test_a_retry_while_the_first_runs_is_409(admin, mode):
    if mode == "one transaction":
        pytest.skip("the claim is not seen until it commits: test_one_transaction_*")
    slow = {"amount": 30, "delay_ms": 1500}
    done = []
    thread = threading.Thread(target=lambda: (done.append(pay(DjangoClient(), "slow-1", slow)),
                                              connection.close()))
    thread.start()
    wait_for(admin, "SELECT EXISTS (SELECT FROM idempotency.keys WHERE state = 'in_progress')")
    busy = pay(DjangoClient(), "slow-1", slow)
    assert_problem(busy, 409, "idempotency_key_in_progress")
    assert int(busy["Retry-After"]) >= 1
    thread.join()
    assert done[0].status_code == 201
    assert pay(DjangoClient(), "slow-1", slow)["Idempotent-Replayed"] == "true"


@pytest.mark.parametrize("failure", [{"fail": True}, {"raise": True}])
def test_a_server_error_rolls_back_and_releases_the_key(client, admin, failure):
    first = pay(client, "fail-1", {"amount": 40, **failure})
    assert first.status_code == 500
    assert value(admin, "SELECT count(*) FROM idempotency.keys") == 0
    assert value(admin, "SELECT count(*) FROM charges") == 0
    assert pay(client, "fail-1", {"amount": 40, **failure}).status_code == 500
    assert not pay(client, "fail-1", {"amount": 40, **failure}).has_header("Idempotent-Replayed")


def test_with_store_server_errors_a_5xx_is_stored_and_a_raise_still_releases(client, admin, database_setting):
    database_setting("store_server_errors", "on")
    first = pay(client, "fail-2", {"amount": 40, "fail": True})
    again = pay(client, "fail-2", {"amount": 40, "fail": True})
    assert again.status_code == 500 and again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert pay(client, "raise-2", {"raise": True}).status_code == 500
    assert value(admin, "SELECT array_agg(key) FROM idempotency.keys") == ["fail-2"]
    assert value(admin, "SELECT count(*) FROM charges") == 0


def test_a_408_says_the_view_did_not_finish_its_writes_roll_back_and_the_key_is_free(client, admin,
                                                                                   database_setting):
    database_setting("store_server_errors", "on")
    assert pay(client, "k-408", {"amount": 8, "status": 408}).status_code == 408
    assert value(admin, "SELECT count(*) FROM charges") == 0
    assert value(admin, "SELECT count(*) FROM idempotency.keys") == 0
    assert pay(client, "k-408", {"amount": 8}).status_code == 201


def test_a_response_that_cannot_be_stored_rolls_the_views_writes_back(client, admin, database_setting):
    # complete() runs in the view's transaction: when it fails, the charge goes too.
    database_setting("max_response_bytes", "8")
    assert_problem(pay(client, "big-1"), 503, "idempotency_unavailable")
    assert value(admin, "SELECT count(*) FROM charges") == 0
    assert value(admin, "SELECT count(*) FROM idempotency.keys") == 0, "released"


def test_a_claim_lost_while_the_view_ran_rolls_back_and_is_409(client, admin, mode):
    if mode == "one transaction":
        pytest.skip("an uncommitted claim cannot be taken: test_one_transaction_*")
    lost = pay(client, "lost-1", {"amount": 70, "stolen": True})
    assert_problem(lost, 409, "idempotency_claim_lost")
    assert lost["Retry-After"] == "1"
    assert value(admin, "SELECT count(*) FROM charges") == 0


@pytest.mark.parametrize("one_transaction", [False, True])
def test_an_unreachable_database_is_503_and_nothing_runs(admin, one_transaction):
    with override_settings(IDEMPOTENCY={"using": "down", "one_transaction": one_transaction}):
        down = pay(DjangoClient(), "down-1")
    assert_problem(down, 503, "idempotency_unavailable")
    assert down["Retry-After"] == "1"
    # Not "the outcome is not known": no claim was ever answered.
    assert json.loads(down.content)["detail"] == contract.PROBLEMS["idempotency_unavailable"][1]
    assert value(admin, "SELECT count(*) FROM charges") == 0


def test_an_optional_key_runs_unguarded_in_a_transaction(admin):
    with override_settings(IDEMPOTENCY={"required": False}):
        client = DjangoClient(raise_request_exception=False)
        assert pay(client, None).status_code == 201
        assert pay(client, None, {"amount": 3, "fail": True}).status_code == 500
    assert value(admin, "SELECT count(*) FROM charges") == 1
    assert value(admin, "SELECT count(*) FROM idempotency.keys") == 0


def exempt_payments(request):
    """The exempt setting's function: /payments is not guarded."""
    return request.path == "/payments"


def test_an_exempt_request_passes_through_without_a_key(admin):
    with override_settings(IDEMPOTENCY={"exempt": f"{__name__}.exempt_payments"}):
        assert pay(DjangoClient(), None).status_code == 201
    assert value(admin, "SELECT count(*) FROM idempotency.keys") == 0


def test_a_body_over_djangos_limit_is_413(client, admin):
    with override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=10):
        assert_problem(pay(client, "big-2", {"amount": 1, "pad": "x" * 20}), 413, "request_body_too_large")
    assert value(admin, "SELECT count(*) FROM idempotency.keys") == 0


@pytest.fixture
def atomic_requests():
    """ATOMIC_REQUESTS = True on this thread's default connection."""
    connection.settings_dict["ATOMIC_REQUESTS"] = True
    yield
    connection.settings_dict["ATOMIC_REQUESTS"] = False


def test_atomic_requests_nest_inside_the_middlewares_transaction(client, admin, atomic_requests):
    assert pay(client, "ar-1").status_code == 201
    assert pay(client, "ar-1")["Idempotent-Replayed"] == "true"
    assert pay(client, "ar-2", {"raise": True}).status_code == 500
    assert value(admin, "SELECT count(*) FROM charges") == 1
    assert value(admin, "SELECT array_agg(key) FROM idempotency.keys") == ["ar-1"]


def test_one_transaction_a_duplicate_waits_for_the_first_and_then_replays_or_is_409(admin, mode):
    if mode != "one transaction":
        pytest.skip("one transaction only")
    done = []
    with psycopg.connect(DATABASE_URL) as locker:
        locker.execute("LOCK TABLE charges IN ACCESS EXCLUSIVE MODE")   # the first's INSERT waits
        thread = threading.Thread(target=lambda: (done.append(pay(DjangoClient(), "wait-1")),
                                                  connection.close()))
        thread.start()
        wait_for(admin, """SELECT EXISTS (SELECT FROM pg_stat_activity
                            WHERE datname = current_database() AND wait_event_type = 'Lock'
                              AND query LIKE 'INSERT INTO charges%%')""")
        with override_settings(IDEMPOTENCY={"one_transaction": True, "wait": "1 second"}):
            busy = pay(DjangoClient(), "wait-1")
        assert_problem(busy, 409, "idempotency_key_in_progress")
        assert value(admin, "SELECT count(*) FROM idempotency.keys") == 0, "the first's claim is not committed"
        locker.rollback()
    thread.join()
    assert done[0].status_code == 201
    assert pay(DjangoClient(), "wait-1")["Idempotent-Replayed"] == "true"
    assert value(admin, "SELECT count(*) FROM charges") == 1


def test_through_pgbouncer_in_transaction_mode(admin, mode):
    """Django's connection through pgbouncer in transaction mode, Django's
    and pgbouncer's default settings, kept open across requests
    (CONN_MAX_AGE None): the middleware's statements and the view's run on
    whichever server connection each transaction gets, so none may be a
    prepared statement (with OPTIONS server_side_binding and a
    prepare_threshold, this test fails: "prepared statement does not exist")."""
    with pgbouncer() as bouncer, psycopg.connect(bouncer) as other, \
            override_settings(IDEMPOTENCY={"one_transaction": mode == "one transaction", "using": "bouncer"}):
        connections["bouncer"].close()
        connections["bouncer"].settings_dict["PORT"] = conninfo_to_dict(bouncer)["port"]
        client = DjangoClient(raise_request_exception=False)
        try:
            # More requests on one client connection than psycopg's prepare_threshold.
            for n in range(8):
                assert pay(client, f"pb-django-{n}", {"amount": 10 + n}).status_code == 201
            # Another client holds the server connection those used (pgbouncer
            # hands out the last one released): what follows runs on another.
            other.execute("SELECT 1")
            for n in range(8):
                again = pay(client, f"pb-django-{n}", {"amount": 10 + n})
                assert again.status_code == 201 and again["Idempotent-Replayed"] == "true"
            assert pay(client, "pb-django-0", {"amount": 99}).status_code == 422
            assert pay(client, "pb-django-fail", {"amount": 5, "fail": True}).status_code == 500
            assert pay(client, "pb-django-fail", {"amount": 5}).status_code == 201
        finally:
            other.rollback()
            connections["bouncer"].close()
    assert value(admin, "SELECT count(*) FROM charges") == 9
    assert value(admin, "SELECT count(*) FROM idempotency.keys WHERE state = 'completed'") == 9


def test_the_redact_setting_decides_what_is_stored_and_replayed(admin, mode):
    with override_settings(IDEMPOTENCY={"one_transaction": mode == "one transaction",
                                        "redact": "test_redact.redact_charge"}):
        client = DjangoClient()
        first = pay(client, "r-1", {"amount": 7})
        assert first.status_code == 201 and isinstance(json.loads(first.content)["charge"], int)
        again = pay(client, "r-1", {"amount": 7})
    assert again["Idempotent-Replayed"] == "true" and again["X-Redacted"] == "yes"
    assert json.loads(again.content) == {"charge": "redacted"}
    assert value(admin, "SELECT count(*) FROM charges") == 1


def test_a_redact_setting_that_raises_stores_nothing_and_frees_the_key(admin, mode):
    with override_settings(IDEMPOTENCY={"one_transaction": mode == "one transaction",
                                        "redact": "test_redact.redact_nothing_possible"}):
        client = DjangoClient()
        assert_problem(pay(client, "r-bad", {"amount": 7}), 500, "idempotency_redact_failed")
        assert_problem(pay(client, "r-bad", {"amount": 7}), 500, "idempotency_redact_failed")
    assert value(admin, "SELECT count(*) FROM charges") == 0
    assert value(admin, "SELECT count(*) FROM idempotency.keys") == 0


def test_standard_webhooks_as_the_key_source(admin, mode):
    from test_webhooks import SECRET, delivery
    from pg_idempotency.webhooks import standard_webhook
    with override_settings(IDEMPOTENCY={"one_transaction": mode == "one transaction",
                                        **standard_webhook(SECRET, sender="acme")}):
        client = DjangoClient()
        headers, body = delivery("msg_d1", {"amount": 6})
        send = {f"HTTP_{name.upper().replace('-', '_')}": value for name, value in headers}
        first = client.post("/payments", body, content_type="application/json", **send)
        again = client.post("/payments", body, content_type="application/json", **send)
        forged = client.post("/payments", json.dumps({"amount": 60}), content_type="application/json", **send)
    assert first.status_code == 201 and again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert_problem(forged, 401, "webhook_unverified")
    assert admin.execute("SELECT scope, key FROM idempotency.keys").fetchall() == [("webhook:acme", "msg_d1")]
    assert value(admin, "SELECT count(*) FROM charges") == 1


def test_prepare_is_refused_its_statements_follow_djangos_options():
    from pg_idempotency.django import IdempotencyMiddleware
    with override_settings(IDEMPOTENCY={"prepare": True}), pytest.raises(ValueError, match="OPTIONS"):
        IdempotencyMiddleware(lambda request: HttpResponse())
