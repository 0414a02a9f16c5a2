"""The Django middleware under ASGI: Django's ASGI application served by
uvicorn over real HTTP, against the database, with the middleware in its
async mode and async views whose writes go through sync_to_async (as the
async ORM's do)."""

import json
import socket

import httpx
import pytest
from asgiref.sync import iscoroutinefunction
from django.core.asgi import get_asgi_application
from django.test.utils import override_settings

import test_django
from apps import UvicornServer
from helpers import ALICE, assert_problem, pay, value, wait_for
from pg_idempotency.django import IdempotencyMiddleware


@pytest.fixture(scope="module", params=["two transactions", "one transaction"])
def django_asgi(request):
    """Django's ASGI app (the settings and views of test_django) on uvicorn,
    in each mode of the middleware."""
    with override_settings(IDEMPOTENCY={"one_transaction": request.param == "one transaction"}):
        server = UvicornServer(get_asgi_application(), lifespan="off")
    yield server
    server.stop()


@pytest.fixture
def client(django_asgi):
    """An HTTP client on it."""
    with httpx.Client(base_url=django_asgi.url, timeout=30) as client:
        yield client


def test_the_middleware_is_async_capable():
    async def view(request):
        """An async get_response."""
    assert IdempotencyMiddleware.sync_capable and IdempotencyMiddleware.async_capable
    assert iscoroutinefunction(IdempotencyMiddleware(view))
    assert not iscoroutinefunction(IdempotencyMiddleware(lambda request: None))


def test_an_async_views_write_commits_with_its_stored_response(client, admin):
    first = pay(client, "a-1", path="/async/payments")
    assert first.status_code == 201 and "idempotent-replayed" not in first.headers
    again = pay(client, "a-1", path="/async/payments")
    assert again.headers["idempotent-replayed"] == "true" and again.content == first.content
    assert value(admin, "SELECT count(*) FROM charges") == 1
    assert value(admin, "SELECT state FROM idempotency.keys") == "completed"


def test_a_sync_view_under_asgi_is_guarded_too(client, admin):
    assert pay(client, "s-1").status_code == 201
    assert pay(client, "s-1").headers["idempotent-replayed"] == "true"
    assert value(admin, "SELECT count(*) FROM charges") == 1


@pytest.mark.parametrize("failure", [{"fail": True}, {"raise": True}])
def test_an_async_view_that_fails_rolls_back_and_releases_the_key(client, admin, failure):
    assert pay(client, "f-1", {"amount": 4, **failure}, path="/async/payments").status_code == 500
    assert value(admin, "SELECT count(*) FROM charges") == 0
    assert value(admin, "SELECT count(*) FROM idempotency.keys") == 0


def test_a_retry_while_the_async_view_runs_is_409(client, admin, django_asgi):
    slow = {"amount": 5, "delay_ms": 60_000}
    test_django.CHARGED.clear()
    with socket.create_connection(("127.0.0.1", django_asgi.port)) as first:
        first.sendall(raw_request("busy-1", slow))
        assert test_django.CHARGED.wait(30)
        assert_problem(pay(client, "busy-1", slow, path="/async/payments"), 409, "idempotency_key_in_progress")
    # Closing the connection cancels the view (Django 5): see below.
    wait_for(admin, "SELECT NOT EXISTS (SELECT FROM idempotency.keys)")


def raw_request(key, body):
    """An HTTP/1.1 POST /async/payments with Idempotency-Key key, as bytes."""
    content = json.dumps(body).encode()
    head = (f"POST /async/payments HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: {ALICE['Authorization']}\r\n"
            f"Idempotency-Key: {key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(content)}\r\n\r\n")
    return head.encode() + content


def test_a_view_cancelled_by_the_clients_disconnect_commits_nothing_and_frees_the_key(client, admin, django_asgi):
    # Django cancels the view when the client goes away, after its charge was
    # written: the charge rolls back, nothing is stored, and the retry runs.
    test_django.CHARGED.clear()
    with socket.create_connection(("127.0.0.1", django_asgi.port)) as gone:
        gone.sendall(raw_request("gone-1", {"amount": 6, "delay_ms": 60_000}))
        assert test_django.CHARGED.wait(30)
    wait_for(admin, "SELECT NOT EXISTS (SELECT FROM idempotency.keys)")
    assert value(admin, "SELECT count(*) FROM charges") == 0
    retry = pay(client, "gone-1", {"amount": 6}, path="/async/payments")
    assert retry.status_code == 201 and "idempotent-replayed" not in retry.headers


def test_a_timeout_inside_that_answers_408_rolls_the_cancelled_view_back_and_frees_the_key(client, admin):
    # The view charges, then is cancelled while it waits; test_django.Timeout answers 408.
    headers = {**ALICE, "Idempotency-Key": "t-408", "X-Timeout": "2"}
    timed_out = client.post("/async/payments", json={"amount": 3, "delay_ms": 60_000}, headers=headers)
    assert timed_out.status_code == 408
    assert value(admin, "SELECT count(*) FROM charges") == 0
    assert value(admin, "SELECT count(*) FROM idempotency.keys") == 0
    assert pay(client, "t-408", {"amount": 3}, path="/async/payments").status_code == 201


def test_under_asgi_the_redact_setting_decides_what_is_stored(admin):
    with override_settings(IDEMPOTENCY={"redact": "test_redact.redact_charge"}):
        server = UvicornServer(get_asgi_application(), lifespan="off")
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            first = pay(client, "r-a", path="/async/payments")
            again = pay(client, "r-a", path="/async/payments")
    finally:
        server.stop()
    assert isinstance(first.json()["charge"], int)
    assert again.headers["idempotent-replayed"] == "true" and again.json() == {"charge": "redacted"}
