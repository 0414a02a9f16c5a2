"""The redact option (docs/operations.md, "Data handling"): what complete()
stores is what redact returns; the live response goes out as the handler
made it, and a replay sends what was stored. For Flask and FastAPI (the kind
fixture) in both modes, and Django."""

import json

import pytest

from helpers import ALICE, assert_problem, pay, scope_of, value
from pg_idempotency.contract import Stored
from test_http import with_settings

seen = []


def redact_charge(stored: Stored) -> Stored:
    """Stores the charge's id as "redacted", and the Location header only;
    notes what it was given."""
    seen.append(stored)
    body = json.loads(stored.body)
    if "charge" in body:
        body["charge"] = "redacted"
    if "error" in body:
        body["error"] = "declined"
    return stored._replace(body=json.dumps(body).encode(), headers={"X-Redacted": "yes"})


def redact_nothing_possible(stored: Stored) -> Stored:
    """A redact hook that fails."""
    raise ValueError("cannot parse the body")


def record(admin, key):
    """The stored status, headers and body of key (Alice's)."""
    return admin.execute("SELECT status_code, headers, body FROM idempotency.lookup(%s, %s)",
                         (key, scope_of(ALICE))).fetchone()


@pytest.fixture(autouse=True)
def forget():
    """Each test sees only the calls of the hook its own requests made."""
    seen.clear()


def test_the_live_response_is_the_handlers_and_a_replay_sends_what_redact_returned(serve, admin):
    client = serve(redact=redact_charge)
    first = pay(client, "r-1", {"amount": 7})
    assert first.status_code == 201 and isinstance(first.json()["charge"], int)
    assert "x-redacted" not in first.headers
    [given] = seen
    assert (given.status, given.body) == (201, first.content)
    assert [name.lower() for name in given.headers] == ["content-type"], "the headers a replay would repeat"
    status, headers, body = record(admin, "r-1")
    assert (status, headers, json.loads(bytes(body))) == (201, {"X-Redacted": "yes"}, {"charge": "redacted"})
    again = pay(client, "r-1", {"amount": 7})
    assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"
    assert again.json() == {"charge": "redacted"} and again.headers["x-redacted"] == "yes"
    assert value(admin, "SELECT count(*) FROM charges") == 1


def test_a_stored_server_error_is_redacted_too(serve, admin):
    client = serve(conninfo=with_settings(store_server_errors="on"), redact=redact_charge)
    first = pay(client, "r-500", {"amount": 7, "fail": True})
    assert first.status_code == 500 and "declined" in first.json()["error"] and "charge" in first.json()["error"]
    again = pay(client, "r-500", {"amount": 7, "fail": True})
    assert again.headers["idempotent-replayed"] == "true" and again.json() == {"error": "declined"}


def test_a_redact_that_raises_stores_nothing_rolls_back_and_frees_the_key(serve, admin):
    client = serve(redact=redact_nothing_possible)
    assert_problem(pay(client, "r-bad", {"amount": 7}), 500, "idempotency_redact_failed")
    assert value(admin, "SELECT count(*) FROM charges") == 0
    assert value(admin, "SELECT count(*) FROM idempotency.keys") == 0
    assert_problem(pay(client, "r-bad", {"amount": 7}), 500, "idempotency_redact_failed")
