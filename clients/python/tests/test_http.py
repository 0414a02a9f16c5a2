"""docs/http-contract.md over real HTTP, for both middlewares (the kind
fixture runs each test against Flask and against FastAPI) in both modes
(the mode fixture: two transactions, one transaction)."""

import contextlib
import hashlib
import threading
import time
from datetime import datetime, timedelta

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from conftest import DATABASE_URL
from helpers import ALICE, BOB, assert_problem, pay, scope_of, value, wait_for
from pg_idempotency import Client, fingerprint
from pg_idempotency.contract import Options


def test_first_request_runs_and_its_retry_replays_byte_for_byte(serve, admin):
    client = serve()
    first = pay(client, '"order-42"')
    assert first.status_code == 201
    assert "idempotent-replayed" not in first.headers
    again = pay(client, '"order-42"')
    assert again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert again.headers["content-type"] == first.headers["content-type"]
    assert value(admin, "SELECT count(*) FROM charges") == 1


def test_replay_repeats_binary_bodies_and_only_the_stored_headers(serve):
    client = serve()
    first = pay(client, "h-1", path="/headers")
    again = pay(client, "h-1", path="/headers")
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content == b"\x00\xffbinary"
    assert again.headers["content-type"] == "application/octet-stream"
    assert again.headers["location"] == "/payments/7"
    assert "set-cookie" not in again.headers and "x-request-id" not in again.headers


def test_store_headers_option_chooses_what_a_replay_repeats(serve):
    client = serve(store_headers=["Content-Type", "X-Request-Id"])
    pay(client, "h-2", path="/headers")
    again = pay(client, "h-2", path="/headers")
    assert again.headers["x-request-id"] == "r-1"
    assert "location" not in again.headers


def test_a_bare_key_is_its_quoted_form(serve, admin):
    client = serve()
    first = pay(client, '"order-42"')
    bare = pay(client, "order-42")
    assert bare.headers["idempotent-replayed"] == "true"
    assert bare.content == first.content


def test_an_escaped_key_is_stored_unescaped(serve, admin):
    client = serve()
    assert pay(client, r'"say \"hi\" \\ bye"').status_code == 201
    assert value(admin, "SELECT count(*) FROM idempotency.lookup(%s, %s)",
                 'say "hi" \\ bye', scope_of(ALICE)) == 1


def test_same_key_other_request_is_422(serve, admin):
    client = serve()
    pay(client, "order-42", {"amount": 10})
    assert_problem(pay(client, "order-42", {"amount": 99}), 422, "idempotency_key_mismatch")
    assert value(admin, "SELECT count(*) FROM charges") == 1


def test_a_missing_key_is_400(serve, admin):
    assert_problem(pay(serve(), None), 400, "idempotency_key_missing")
    assert value(admin, "SELECT count(*) FROM charges") == 0


@pytest.mark.parametrize("field", [
    '"unterminated', '"abc";x=1', '?1', ':YWJj:', '(a b)', '""', '"a\\qb"', '"a", "b"',
    'a b', '', '"a\tb"', '"' + "k" * 256 + '"', "k" * 256, ["a", "b"]])
def test_a_malformed_key_is_400(serve, admin, field):
    assert_problem(pay(serve(), field), 400, "idempotency_key_invalid")
    assert value(admin, "SELECT count(*) FROM charges") == 0


def test_a_key_of_255_bytes_is_accepted(serve):
    assert pay(serve(), "k" * 255).status_code == 201


def test_keys_belong_to_their_caller_as_a_hash_of_the_credential(serve, admin):
    client = serve()
    alice = pay(client, "order-42")
    bob = pay(client, "order-42", caller=BOB)
    keyed = pay(client, "order-42", caller={"X-API-Key": "k_carol"})
    anonymous = pay(client, "order-42", caller={})
    assert [r.status_code for r in (alice, bob, keyed, anonymous)] == [201] * 4
    assert len({r.content for r in (alice, bob, keyed, anonymous)}) == 4
    scopes = {row[0] for row in admin.execute("SELECT scope FROM idempotency.keys")}
    assert scopes == {scope_of(ALICE), scope_of(BOB), "",
                      hashlib.sha256(b"x-api-key:k_carol").hexdigest()}
    assert value(admin, "SELECT count(*) FROM idempotency.keys WHERE scope ~ 'sk_test|k_carol'") == 0


def test_the_scope_option_replaces_the_credential(serve, admin):
    client = serve(scope=lambda request: "tenant-7")
    pay(client, "order-42")
    assert pay(client, "order-42", caller=BOB).headers["idempotent-replayed"] == "true"
    assert value(admin, "SELECT scope FROM idempotency.keys") == "tenant-7"


def test_the_fingerprint_is_the_databases_of_the_raw_request(serve, admin):
    client = serve()
    body = b'{"amount": 5}'
    pay(client, "fp-1", body, path="/payments?b=%20x&a=1")
    pay(client, "fp-2", b"", path="/payments?")
    for key, args in (("fp-1", ("POST", "/payments", body, "b=%20x&a=1")),
                      ("fp-2", ("POST", "/payments", None, None))):
        stored = value(admin, "SELECT fingerprint FROM idempotency.lookup(%s, %s)",
                       key, scope_of(ALICE))
        assert stored == value(admin, "SELECT idempotency.fingerprint(%s, %s, %s, %s)", *args)


def test_an_exempt_request_passes_through_without_a_key(serve, admin):
    client = serve(exempt=lambda request: (request["path"] if isinstance(request, dict)
                                           else request.path) == "/headers")
    assert client.post("/headers").status_code == 200      # no Idempotency-Key, not a 400
    assert_problem(pay(client, None), 400, "idempotency_key_missing")
    assert value(admin, "SELECT count(*) FROM idempotency.keys") == 0


def test_other_methods_pass_through_without_a_connection(serve, admin):
    client = serve()
    assert client.get("/db").json() == {"db": False}
    assert pay(client, None, method="PUT", path="/db").json() == {"db": False}
    assert value(admin, "SELECT count(*) FROM idempotency.keys") == 0


def test_patch_is_covered(serve):
    client = serve()
    assert_problem(pay(client, None, method="PATCH"), 400, "idempotency_key_missing")
    pay(client, "p-1", method="PATCH")
    assert pay(client, "p-1", method="PATCH").headers["idempotent-replayed"] == "true"


def test_an_optional_key_runs_unguarded_in_a_transaction(serve, admin):
    client = serve(required=False)
    assert pay(client, None).status_code == 201
    assert pay(client, None, {"amount": 3, "fail": True}).status_code == 500
    assert value(admin, "SELECT count(*) FROM charges") == 1
    assert value(admin, "SELECT count(*) FROM idempotency.keys") == 0


def in_background(call):
    """Runs call in a thread; returns a function that joins it and gives its result."""
    result = []
    thread = threading.Thread(target=lambda: result.append(call()))
    thread.start()
    return lambda: (thread.join(), result[0])[1]


def test_a_retry_while_the_first_runs_is_409_then_replays(serve, admin, mode):
    if mode == "one transaction":
        pytest.skip("the claim is not seen until it commits: test_one_transaction_*")
    client = serve()
    slow = {"amount": 30, "delay_ms": 1500}
    first = in_background(lambda: pay(client, "slow-1", slow))
    wait_for(admin, "SELECT EXISTS (SELECT FROM idempotency.lookup(%s, %s) WHERE state = 'in_progress')",
             "slow-1", scope_of(ALICE))
    busy = pay(client, "slow-1", slow)
    assert_problem(busy, 409, "idempotency_key_in_progress")
    assert int(busy.headers["retry-after"]) >= 1
    assert first().status_code == 201
    assert pay(client, "slow-1", slow).headers["idempotent-replayed"] == "true"


def with_settings(**settings):
    """DATABASE_URL with these idempotency.* settings in every session it opens."""
    return make_conninfo(DATABASE_URL, options=" ".join(
        f"-c idempotency.{name}={setting}" for name, setting in settings.items()))


@pytest.mark.parametrize("failure", [{"fail": True}, {"raise": True}])
@pytest.mark.parametrize("settings", [{}, {"store_server_errors": "off"}])
def test_a_server_error_rolls_back_and_releases_the_key(serve, admin, failure, settings):
    client = serve(conninfo=with_settings(**settings))
    first = pay(client, "fail-1", {"amount": 40, **failure})
    assert first.status_code == 500
    assert value(admin, "SELECT count(*) FROM idempotency.lookup(%s, %s)", "fail-1", scope_of(ALICE)) == 0
    again = pay(client, "fail-1", {"amount": 40, **failure})
    assert again.status_code == 500 and "idempotent-replayed" not in again.headers
    if "fail" in failure:  # the body names the charge: the retry ran and charged anew
        assert again.content != first.content
    assert value(admin, "SELECT count(*) FROM charges") == 0


def test_a_408_says_the_handler_did_not_finish_its_writes_roll_back_and_the_key_is_free(serve, admin):
    client = serve(conninfo=with_settings(store_server_errors="on"))
    assert pay(client, "k-408", {"amount": 8, "status": 408}).status_code == 408
    assert value(admin, "SELECT count(*) FROM charges") == 0
    assert value(admin, "SELECT count(*) FROM idempotency.keys") == 0
    assert pay(client, "k-408", {"amount": 8}).status_code == 201


def test_with_store_server_errors_a_server_error_is_stored_and_replayed(serve, admin):
    client = serve(conninfo=with_settings(store_server_errors="on"))
    first = pay(client, "fail-2", {"amount": 40, "fail": True})
    assert first.status_code == 500 and "idempotent-replayed" not in first.headers
    assert value(admin, "SELECT status_code FROM idempotency.lookup(%s, %s) WHERE state = 'completed'",
                 "fail-2", scope_of(ALICE)) == 500
    again = pay(client, "fail-2", {"amount": 40, "fail": True})
    assert again.status_code == 500
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert again.headers["content-type"] == first.headers["content-type"]
    assert value(admin, "SELECT count(*) FROM charges") == 0, "its writes still rolled back"


def test_with_store_server_errors_a_handler_that_raises_still_releases(serve, admin):
    client = serve(conninfo=with_settings(store_server_errors="on"))
    assert pay(client, "raise-1", {"raise": True}).status_code == 500
    assert value(admin, "SELECT count(*) FROM idempotency.lookup(%s, %s)", "raise-1", scope_of(ALICE)) == 0
    again = pay(client, "raise-1", {"raise": True})
    assert again.status_code == 500 and "idempotent-replayed" not in again.headers


def test_with_store_server_errors_a_server_error_too_large_to_store_is_released(serve, admin):
    client = serve(conninfo=with_settings(store_server_errors="on", max_response_bytes=8))
    first = pay(client, "big-1", {"amount": 40, "fail": True})
    assert first.status_code == 500, "the handler's answer, not a 503"
    assert b"declined" in first.content
    assert value(admin, "SELECT count(*) FROM idempotency.lookup(%s, %s)", "big-1", scope_of(ALICE)) == 0
    again = pay(client, "big-1", {"amount": 40, "fail": True})
    assert again.status_code == 500 and "idempotent-replayed" not in again.headers
    assert again.content != first.content
    assert value(admin, "SELECT count(*) FROM charges") == 0


def test_a_claim_lost_to_a_takeover_rolls_back_and_is_409(serve, admin, pool, mode):
    if mode == "one transaction":
        pytest.skip("an uncommitted claim cannot be taken over: test_one_transaction_*")
    client = serve(lease="1 second")
    body = b'{"amount": 70, "delay_ms": 2000}'
    first = in_background(lambda: pay(client, "lease-1", body))
    scope = scope_of(ALICE)
    wait_for(admin, "SELECT EXISTS (SELECT FROM idempotency.lookup(%s, %s)"
                    " WHERE lease_expires_at < clock_timestamp())", "lease-1", scope)
    takeover = Client(pool).claim("lease-1", fingerprint("POST", "/payments", body), scope=scope)
    assert (takeover.outcome, takeover.attempt) == ("new", 2)
    lost = first()
    assert_problem(lost, 409, "idempotency_claim_lost")
    assert int(lost.headers["retry-after"]) >= 1
    assert value(admin, "SELECT count(*) FROM charges") == 0
    assert value(admin, "SELECT state FROM idempotency.lookup(%s, %s)", "lease-1", scope) == "in_progress"


def test_an_unreachable_database_is_503_and_nothing_runs(serve):
    client = serve(conninfo="postgresql://postgres@127.0.0.1:1/none?connect_timeout=1",
                   pool_options={"min_size": 1, "timeout": 1})
    down = pay(client, "down-1")
    assert_problem(down, 503, "idempotency_unavailable")
    assert down.headers["retry-after"] == "1"


@pytest.fixture
def no_usage_role(admin):
    """A role that may write charges but not use the extension: claims fail
    while the database works. Yields its connection string."""
    role = "idempotency_test_python_no_usage"
    admin.execute(f"DROP ROLE IF EXISTS {role}")
    admin.execute(f"CREATE ROLE {role} LOGIN; GRANT ALL ON charges TO {role}")
    yield make_conninfo(DATABASE_URL, user=role)
    admin.execute(f"DROP OWNED BY {role}; DROP ROLE {role}")


def test_a_failing_claim_is_503_with_nothing_charged(serve, admin, no_usage_role):
    client = serve(conninfo=no_usage_role)
    assert_problem(pay(client, "store-1"), 503, "idempotency_unavailable")
    assert value(admin, "SELECT count(*) FROM charges") == 0


def test_fail_open_runs_the_request_unguarded(serve, admin, no_usage_role):
    client = serve(conninfo=no_usage_role, fail_open=True)
    assert pay(client, "store-1").status_code == 201
    assert pay(client, "store-1").status_code == 201
    assert value(admin, "SELECT count(*) FROM charges") == 2
    assert value(admin, "SELECT count(*) FROM idempotency.keys") == 0


def test_a_bad_scope_is_the_applications_fault_503_not_400(serve, admin):
    client = serve(scope=lambda request: "s" * 300)
    assert_problem(pay(client, "k-1"), 503, "idempotency_unavailable")


def test_connections_go_back_to_the_pool_after_every_kind_of_answer(serve, admin):
    client = serve(pool_options={"min_size": 1, "max_size": 1, "timeout": 2})
    answers = [pay(client, "c-1").status_code, pay(client, "c-1").status_code,
               pay(client, "c-1", {"amount": 2}).status_code, pay(client, '"bad').status_code,
               pay(client, "c-2", {"fail": True}).status_code,
               pay(client, "c-3", {"raise": True}).status_code,
               pay(client, "c-4").status_code]
    assert answers == [201, 201, 422, 400, 500, 500, 201]
    assert value(admin, "SELECT count(*) FROM charges") == 2


def test_a_pool_of_autocommit_connections_still_gives_one_transaction(serve, admin):
    client = serve(pool_options={"min_size": 1, "max_size": 1, "kwargs": {"autocommit": True}})
    assert pay(client, "ac-1", {"amount": 5, "fail": True}).status_code == 500
    assert pay(client, "ac-2", {"amount": 6, "raise": True}).status_code == 500
    assert value(admin, "SELECT count(*) FROM charges") == 0
    assert pay(client, "ac-3").status_code == 201
    assert pay(client, "ac-3").headers["idempotent-replayed"] == "true"


@contextlib.contextmanager
def charges_locked():
    """Holds the charges table locked: a handler's INSERT waits until the block ends."""
    with psycopg.connect(DATABASE_URL) as locker:
        locker.execute("LOCK TABLE charges IN ACCESS EXCLUSIVE MODE")
        yield
        locker.rollback()


def handlers_blocked(admin, count):
    """Waits until count statements of the app wait for the lock on charges."""
    wait_for(admin, """SELECT count(*) = %s FROM pg_stat_activity
                        WHERE datname = current_database() AND wait_event_type = 'Lock'
                          AND query LIKE 'INSERT INTO charges%%'""", count)


def test_one_transaction_a_duplicate_waits_for_the_first_and_replays_what_committed(serve, admin, mode):
    if mode != "one transaction":
        pytest.skip("one transaction only")
    client = serve(wait="60 seconds")
    with charges_locked():
        first = in_background(lambda: pay(client, "wait-1", {"amount": 31}))
        handlers_blocked(admin, 1)
        duplicate = in_background(lambda: pay(client, "wait-1", {"amount": 31}))
        wait_for(admin, """SELECT count(*) = 1 FROM pg_stat_activity
                            WHERE datname = current_database() AND state = 'active'
                              AND pid <> pg_backend_pid() AND query LIKE '%%idempotency.claim%%'""")
    assert first().status_code == 201
    again = duplicate()
    assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"
    assert value(admin, "SELECT count(*) FROM charges") == 1


def test_one_transaction_a_duplicate_is_409_when_its_wait_ends_even_after_the_lease(serve, admin, mode):
    if mode != "one transaction":
        pytest.skip("one transaction only")
    client = serve(wait="1 second", lease="1 second")
    with charges_locked():
        first = in_background(lambda: pay(client, "wait-2", {"amount": 32}))
        handlers_blocked(admin, 1)
        time.sleep(1.5)   # the first's lease has ended: still no takeover of an uncommitted claim
        busy = pay(client, "wait-2", {"amount": 32})
        assert_problem(busy, 409, "idempotency_key_in_progress")
        assert int(busy.headers["retry-after"]) >= 1
    assert first().status_code == 201
    assert pay(client, "wait-2", {"amount": 32}).headers["idempotent-replayed"] == "true"
    assert value(admin, "SELECT count(*) FROM charges") == 1


def test_one_transaction_needs_a_positive_wait():
    for wait in ("0 seconds", "-2 seconds", "1 second ago", timedelta(seconds=-1), timedelta(0)):
        with pytest.raises(ValueError, match="positive wait"):
            Options(one_transaction=True, wait=wait)
    assert Options(one_transaction=True, wait=timedelta(milliseconds=500)).wait == timedelta(milliseconds=500)
    assert Options(one_transaction=True).wait == "2 seconds"
    assert Options().wait is None


@pytest.mark.parametrize("prepare", [False, True])
def test_the_prepare_option_prepares_the_calls_once_per_connection(serve, admin, prepare):
    # One connection: what is prepared on it is the middleware's (and the
    # handler's INSERT, after psycopg's fifth use).
    client = serve(prepare=prepare, pool_options={"min_size": 1, "max_size": 1})
    assert pay(client, "prep-1").status_code == 201
    before = value(admin, "SELECT clock_timestamp()")
    # Replays roll back (psycopg's rollback() would forget what it
    # prepared), then fresh keys: no call is prepared again.
    for key in ("prep-1", "prep-1", "prep-2", "prep-2", "prep-3", "prep-4"):
        assert pay(client, key).status_code == 201
    listed = pay(client, "prep-list", path="/prepared")
    assert listed.status_code == 200
    ours = [s for s in listed.json()["statements"] if "idempotency." in s["statement"]]
    calls = sorted(name for name in ("claim", "complete") if any(f"idempotency.{name}(" in s["statement"] for s in ours))
    assert calls == (["claim", "complete"] if prepare else [])
    assert len(ours) == len(calls)
    assert all(datetime.fromisoformat(s["prepared"]) < before for s in ours)
    assert pay(client, "prep-1").headers["idempotent-replayed"] == "true"
    assert value(admin, "SELECT count(*) FROM charges") == 4
