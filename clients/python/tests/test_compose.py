"""The middlewares composed with the middleware apps put around them, in the
orders users write (README, "Composing it"): a timeout, compression, a
body-size limit, and authentication that gives the scope. FastAPI on
uvicorn and Flask on werkzeug, over real HTTP, against the database."""

import asyncio
import gzip
import hashlib
import json

import httpx
import pytest
from starlette.middleware.gzip import GZipMiddleware

from apps import AsgiServer, FlaskServer
from conftest import DATABASE_URL
from helpers import assert_problem, pay, value, wait_for

POOL = {"min_size": 1, "max_size": 4}
# The same caller before and after its OAuth access token was refreshed.
TOKENS = {"Bearer token-before-refresh": "acct_42", "Bearer token-after-refresh": "acct_42"}


class Timeout:
    """A request timeout as apps write it: cancels the rest of the chain
    after `seconds` and answers `status`, unless the answer has begun."""

    def __init__(self, app, seconds: float, status: int = 504):
        """Wraps app."""
        self.app, self.seconds, self.status = app, seconds, status

    async def __call__(self, scope, receive, send):
        """Runs the app under the timeout."""
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def sending(message):
            """Notes that the answer has begun."""
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            async with asyncio.timeout(self.seconds):
                await self.app(scope, receive, sending)
        except TimeoutError:
            if not started:
                await send({"type": "http.response.start", "status": self.status, "headers": []})
                await send({"type": "http.response.body", "body": b"timed out"})


class BodyLimit:
    """Refuses a request whose declared body is over `limit` bytes with 413."""

    def __init__(self, app, limit: int):
        """Wraps app."""
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        """Answers 413 or runs the app."""
        length = dict(scope.get("headers", [])).get(b"content-length", b"0")
        if scope["type"] == "http" and int(length) > self.limit:
            await send({"type": "http.response.start", "status": 413, "headers": []})
            await send({"type": "http.response.body", "body": b"too large"})
            return
        await self.app(scope, receive, send)


class Authenticate:
    """Authentication as apps write it: resolves the bearer token to the
    account it belongs to, in scope["state"]["principal"]; 401 without one."""

    def __init__(self, app):
        """Wraps app."""
        self.app = app

    async def __call__(self, scope, receive, send):
        """Sets the principal, or answers 401."""
        token = dict(scope.get("headers", [])).get(b"authorization", b"").decode()
        if scope["type"] == "http" and token not in TOKENS:
            await send({"type": "http.response.start", "status": 401, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        scope["state"] = {**scope.get("state", {}), "principal": TOKENS.get(token)}
        await self.app(scope, receive, send)


def principal(scope) -> str:
    """The scope option: the authenticated account, not the token."""
    return scope["state"]["principal"]


@pytest.fixture
def asgi(mode):
    """serve(**options) starts the FastAPI app with these options, in this
    mode of the middleware; returns a client."""
    servers = []

    def start(**options):
        """Serves it; returns an httpx client on it."""
        options = {"one_transaction": mode == "one transaction", **options}
        servers.append(AsgiServer(DATABASE_URL, POOL, options))
        return httpx.Client(base_url=servers[-1].url, timeout=30,
                            limits=httpx.Limits(max_keepalive_connections=0))
    yield start
    for server in servers:
        server.stop()


def test_a_timeout_outside_rolls_the_cancelled_handler_back_and_frees_the_key(asgi, admin):
    client = asgi(outer=[(Timeout, {"seconds": 3})])
    assert pay(client, "t-1", {"amount": 1, "delay_ms": 60_000}).status_code == 504
    wait_for(admin, "SELECT NOT EXISTS (SELECT FROM idempotency.keys)")
    assert value(admin, "SELECT count(*) FROM charges") == 0
    assert pay(client, "t-1", {"amount": 1}).status_code == 201


def test_a_timeout_inside_that_answers_408_rolls_the_cancelled_handler_back_and_frees_the_key(asgi, admin):
    client = asgi(inner=[(Timeout, {"seconds": 3, "status": 408})])
    # The handler charges, then is cancelled while it waits.
    assert pay(client, "t-408", {"amount": 2, "after_ms": 60_000}).status_code == 408
    assert value(admin, "SELECT count(*) FROM charges") == 0
    assert value(admin, "SELECT count(*) FROM idempotency.keys") == 0
    assert pay(client, "t-408", {"amount": 2}).status_code == 201
    assert value(admin, "SELECT count(*) FROM charges") == 1


def test_a_timeout_inside_answers_5xx_so_the_handlers_writes_roll_back(asgi, admin):
    client = asgi(inner=[(Timeout, {"seconds": 3})])
    assert pay(client, "t-2", {"amount": 2, "delay_ms": 60_000}).status_code == 504
    assert value(admin, "SELECT count(*) FROM idempotency.keys") == 0
    assert value(admin, "SELECT count(*) FROM charges") == 0
    assert pay(client, "t-2", {"amount": 2}).status_code == 201


@pytest.mark.parametrize("where", ["outer", "inner"])
def test_gzip_either_side_replays_a_body_the_client_can_read(asgi, where):
    client = asgi(**{where: [(GZipMiddleware, {"minimum_size": 1})]})
    first = pay(client, "g-1", {"amount": 3})
    again = pay(client, "g-1", {"amount": 3})
    assert first.headers["content-encoding"] == again.headers["content-encoding"] == "gzip"
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json() == first.json()


def test_gzip_inside_stores_the_encoding_with_the_encoded_body(asgi, admin):
    client = asgi(inner=[(GZipMiddleware, {"minimum_size": 1})])
    pay(client, "g-2", {"amount": 3})
    headers, body = admin.execute("SELECT headers, body FROM idempotency.keys").fetchone()
    assert headers["content-encoding"] == "gzip"
    assert json.loads(gzip.decompress(body))["charge"] >= 1


def test_a_body_limit_outside_refuses_before_any_claim(asgi, admin):
    client = asgi(outer=[(BodyLimit, {"limit": 64})])
    assert pay(client, "b-1", {"amount": 1, "pad": "x" * 100}).status_code == 413
    assert value(admin, "SELECT count(*) FROM idempotency.keys") == 0
    assert pay(client, "b-1", {"amount": 1}).status_code == 201


def test_flasks_body_limit_refuses_before_any_claim(admin):
    server = FlaskServer(DATABASE_URL, POOL, {})
    try:
        server.server.app.config["MAX_CONTENT_LENGTH"] = 64
        with httpx.Client(base_url=server.url, timeout=30) as client:
            assert pay(client, "b-2", {"amount": 1, "pad": "x" * 100}).status_code == 413
            assert pay(client, "b-2", {"amount": 1}).status_code == 201
    finally:
        server.stop()
    assert value(admin, "SELECT count(*) FROM charges") == 1


def test_scope_from_the_authenticated_principal_survives_a_token_refresh(asgi, admin):
    client = asgi(outer=[(Authenticate, {})], scope=principal)
    before = pay(client, "o-1", caller={"Authorization": "Bearer token-before-refresh"})
    after = pay(client, "o-1", caller={"Authorization": "Bearer token-after-refresh"})
    assert after.headers["idempotent-replayed"] == "true" and after.content == before.content
    assert value(admin, "SELECT count(*) FROM charges") == 1
    assert value(admin, "SELECT scope FROM idempotency.keys") == "acct_42"


def test_the_default_scope_is_the_token_so_a_refreshed_token_runs_again(asgi, admin):
    # What the README warns about: the default hashes the Authorization header.
    client = asgi(outer=[(Authenticate, {})])
    pay(client, "o-2", caller={"Authorization": "Bearer token-before-refresh"})
    after = pay(client, "o-2", caller={"Authorization": "Bearer token-after-refresh"})
    assert "idempotent-replayed" not in after.headers
    assert value(admin, "SELECT count(*) FROM charges") == 2
    assert value(admin, "SELECT count(DISTINCT scope) FROM idempotency.keys") == 2
    assert hashlib.sha256(b"authorization:Bearer token-after-refresh").hexdigest() in [
        row[0] for row in admin.execute("SELECT scope FROM idempotency.keys")]


def test_a_scope_option_that_answers_none_leaves_the_default(asgi, admin):
    client = asgi(scope=lambda scope: None)
    pay(client, "o-4", caller={"Authorization": "Bearer token-before-refresh"})
    assert value(admin, "SELECT scope FROM idempotency.keys") == hashlib.sha256(
        b"authorization:Bearer token-before-refresh").hexdigest()


def test_authentication_outside_answers_401_before_any_claim(asgi, admin):
    client = asgi(outer=[(Authenticate, {})], scope=principal)
    assert pay(client, "o-3", caller={"Authorization": "Bearer unknown"}).status_code == 401
    missing = pay(client, None, caller={"Authorization": "Bearer token-after-refresh"})
    assert_problem(missing, 400, "idempotency_key_missing")
    assert value(admin, "SELECT count(*) FROM idempotency.keys") == 0
