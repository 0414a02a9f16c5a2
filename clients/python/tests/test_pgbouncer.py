"""The client, and the Flask and ASGI middlewares in both modes, through
pgbouncer in transaction pooling, with psycopg's default settings
(prepare_threshold 5): the client's own statements must
never be prepared, since the next transaction may run on another server
connection, where a prepared statement does not exist. Skips without a
pgbouncer binary (Debian: the pgbouncer package). Django's middleware
through pgbouncer: test_django.py."""

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from helpers import pay, pgbouncer, value, wait_for
from test_http import charges_locked, handlers_blocked, in_background
from pg_idempotency import Client, fingerprint, idempotent_function

@pytest.fixture(scope="module")
def bouncer():
    """A pgbouncer in transaction mode before the test database; yields its conninfo."""
    with pgbouncer() as conninfo:
        yield conninfo


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
        wait_for(admin, """SELECT count(*) = 1 FROM pg_stat_activity
                            WHERE datname = current_database() AND state = 'active'
                              AND pid <> pg_backend_pid() AND query LIKE '%%idempotency.claim%%'""")
    assert first().status_code == 201
    assert duplicate().headers["idempotent-replayed"] == "true"
    assert value(admin, "SELECT count(*) FROM charges") == 1


@pytest.mark.parametrize("one_transaction", [True, False])
def test_the_idempotent_function_works_through_pgbouncer_in_transaction_mode(bouncer, admin, one_transaction):
    runs = []
    with ConnectionPool(bouncer, min_size=1, max_size=2, kwargs={"prepare_threshold": None}) as pool:
        @idempotent_function(pool, key="order", one_transaction=one_transaction, final=ValueError)
        def charge(run, order, amount):
            runs.append(order)
            run.conn.execute("INSERT INTO charges (amount) VALUES (%s)", (amount,))
            if not one_transaction:
                run.checkpoint("charged")
            if amount < 0:
                raise ValueError("a negative amount")
            return {"order": order}

        # More calls than psycopg's prepare_threshold, each run and replayed.
        for n in range(8):
            assert charge(f"pb-fn-{n}", 10) == {"order": f"pb-fn-{n}"}
            assert charge(f"pb-fn-{n}", 10) == {"order": f"pb-fn-{n}"}
        for _ in range(2):
            with pytest.raises(ValueError):
                charge("pb-fn-negative", -1)
    assert len(runs) == 9 and value(admin, "SELECT count(*) FROM charges") == 8 + (0 if one_transaction else 1)
