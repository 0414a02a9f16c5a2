"""Fixtures: the database (DATABASE_URL, with CREATE EXTENSION idempotency
done), a clean table per test, and the test apps over real HTTP."""

import os

import httpx
import psycopg
import pytest
from psycopg_pool import ConnectionPool

from apps import SERVERS

DATABASE_URL = os.environ.get("DATABASE_URL", "")


def pytest_configure(config):
    """Refuses to run without a database to run against."""
    if not DATABASE_URL:
        raise pytest.UsageError("set DATABASE_URL to a database with the idempotency extension")


@pytest.fixture(scope="session")
def admin():
    """A superuser connection in autocommit, for setting up and checking."""
    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        conn.execute("""CREATE TABLE IF NOT EXISTS charges (
                            id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                            amount numeric NOT NULL)""")
        yield conn


@pytest.fixture(autouse=True)
def clean(admin):
    """Every test starts without charges and without records."""
    admin.execute("TRUNCATE charges; DELETE FROM idempotency.keys")


@pytest.fixture(scope="session")
def pool():
    """A small blocking pool on the test database."""
    with ConnectionPool(DATABASE_URL, min_size=1, max_size=4) as pool:
        yield pool


@pytest.fixture(params=sorted(SERVERS))
def kind(request):
    """Each HTTP test runs against both middlewares: flask and asgi."""
    return request.param


@pytest.fixture(params=["two transactions", "one transaction"])
def mode(request):
    """Each HTTP test runs in both modes of the middlewares."""
    return request.param


@pytest.fixture
def serve(kind, mode):
    """Starts the test app of this kind: serve(conninfo=..., pool options..., middleware
    options...) returns an httpx client on it; every server stops after the test."""
    servers = []

    def start(conninfo=DATABASE_URL, pool_options=None, **options):
        """Serves the app with these options; returns a client on it."""
        options = {"one_transaction": mode == "one transaction", **options}
        server = SERVERS[kind](conninfo, pool_options or {"min_size": 1, "max_size": 4}, options)
        servers.append(server)
        # No keep-alive: uvicorn closes a connection whose app raised, and a
        # request sent on it meanwhile would fail.
        return httpx.Client(base_url=server.url, timeout=30,
                            limits=httpx.Limits(max_keepalive_connections=0))

    yield start
    for server in servers:
        server.stop()

