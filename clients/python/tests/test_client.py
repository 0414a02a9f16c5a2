"""Client and AsyncClient against the database. The api fixture drives
both with the same tests: an AsyncClient's calls run on one event loop."""

import asyncio
import threading
import time
from datetime import datetime, timedelta

import psycopg
import pytest
from psycopg.pq import TransactionStatus
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from conftest import DATABASE_URL
from helpers import value
from pg_idempotency import AsyncClient, ClaimLost, Client, Record

FP = b"\x01" * 32
OTHER_FP = b"\x02" * 32


class Blocking:
    """Calls an AsyncClient's methods to completion on one event loop."""

    def __init__(self, client, loop):
        """Wraps client, whose pool lives on loop."""
        self.client, self.loop = client, loop

    def __getattr__(self, name):
        """Returns the method as a blocking function."""
        method = getattr(self.client, name)
        return lambda *args, **kwargs: self.loop.run_until_complete(method(*args, **kwargs))


@pytest.fixture(params=["sync", "async"])
def api(request, pool):
    """A Client, or an AsyncClient behind Blocking."""
    if request.param == "sync":
        yield Client(pool)
        return
    loop = asyncio.new_event_loop()
    apool = AsyncConnectionPool(DATABASE_URL, min_size=1, max_size=2, open=False)
    loop.run_until_complete(apool.open())
    yield Blocking(AsyncClient(apool), loop)
    loop.run_until_complete(apool.close())
    loop.close()


def test_new_then_replay_with_the_stored_response(api):
    first = api.claim("k1", FP, scope="acct")
    assert (first.outcome, first.attempt, first.status_code) == ("new", 1, None)
    assert isinstance(first.fence, int)
    assert api.complete("k1", first.fence, 201, b"\x00body", {"Content-Type": "x/y"},
                        scope="acct") == "stored"
    replay = api.claim("k1", FP, scope="acct")
    assert (replay.outcome, replay.status_code, replay.body) == ("replay", 201, b"\x00body")
    assert replay.headers == {"Content-Type": "x/y"} and replay.fence is None
    assert api.claim("k1", FP, scope="other").outcome == "new"


def test_in_progress_and_mismatch(api):
    api.claim("k1", FP, lease="30 seconds")
    busy = api.claim("k1", FP)
    assert busy.outcome == "in_progress" and 1 <= busy.retry_after <= 30
    assert api.claim("k1", OTHER_FP).outcome == "mismatch"


def test_a_server_error_is_released(api):
    claim = api.claim("k1", FP)
    assert api.complete("k1", claim.fence, 503, b"down") == "released"
    assert api.lookup("k1") is None
    assert api.claim("k1", FP).outcome == "new"


def test_release_frees_the_key_once(api):
    claim = api.claim("k1", FP)
    assert api.release("k1", claim.fence) is True
    assert api.release("k1", claim.fence) is False
    assert api.claim("k1", FP).outcome == "new"


def test_a_stale_fence_gets_claim_lost(api):
    old = api.claim("k1", FP, lease=timedelta(milliseconds=10))
    time.sleep(0.05)
    new = api.claim("k1", FP)
    assert (new.outcome, new.attempt) == ("new", 2) and new.fence > old.fence
    for call in (lambda: api.complete("k1", old.fence, 200),
                 lambda: api.extend("k1", old.fence),
                 lambda: api.checkpoint("k1", old.fence, "step")):
        with pytest.raises(ClaimLost) as lost:
            call()
        assert lost.value.__cause__.sqlstate == "IK001"
    assert api.complete("k1", new.fence, 200) == "stored"


def test_extend_returns_the_new_end_of_the_lease(api):
    claim = api.claim("k1", FP, lease="1 second")
    end = api.extend("k1", claim.fence, "1 hour")
    assert isinstance(end, datetime)
    assert api.lookup("k1").lease_expires_at == end
    assert end - api.lookup("k1").created_at > timedelta(minutes=59)


def test_a_takeover_resumes_from_the_checkpoint(api):
    first = api.claim("k1", FP, lease=timedelta(milliseconds=200))
    api.checkpoint("k1", first.fence, "charged", {"charge": 7})
    time.sleep(0.3)
    second = api.claim("k1", FP)
    assert (second.outcome, second.attempt) == ("new", 2)
    assert (second.recovery_point, second.recovery_state) == ("charged", {"charge": 7})


def test_lookup_shows_the_record_without_its_fence(api):
    assert api.lookup("k1") is None
    claim = api.claim("k1", FP, scope="acct", retention="1 hour")
    record = api.lookup("k1", scope="acct")
    assert isinstance(record, Record) and not hasattr(record, "fence")
    assert (record.scope, record.key, record.fingerprint, record.state) == ("acct", "k1", FP, "in_progress")
    assert record.expires_at - record.created_at == timedelta(hours=1)
    api.complete("k1", claim.fence, 200, b"ok", scope="acct")
    assert api.lookup("k1", scope="acct").body == b"ok"
    assert api.lookup("k1") is None


def test_a_claim_can_wait_for_the_owner(api, pool):
    owner = Client(pool).claim("k1", FP)

    def finish():
        """Completes the owner's claim a little later."""
        time.sleep(0.3)
        Client(pool).complete("k1", owner.fence, 201, b"done")
    thread = threading.Thread(target=finish)
    thread.start()
    waited = api.claim("k1", FP, wait="10 seconds")
    thread.join()
    assert (waited.outcome, waited.body) == ("replay", b"done")


def test_bad_input_is_a_clear_error(api):
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="idempotency key"):
        api.claim("", FP)
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        api.claim("k1", FP, lease="-1 second")
    claim = api.claim("k1", FP)
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        api.complete("k1", claim.fence, 200, headers={"X-Count": 1})
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        api.complete("k1", claim.fence, 700)
    assert api.lookup("k1").state == "in_progress"


def test_complete_joins_the_callers_transaction(pool, admin):
    client = Client(pool)
    claim = client.claim("k1", FP)
    with pool.connection() as conn:
        conn.execute("INSERT INTO charges (amount) VALUES (1)")
        client.complete("k1", claim.fence, 201, b"x", conn=conn)
        assert conn.info.transaction_status == TransactionStatus.INTRANS
        conn.rollback()
    assert value(admin, "SELECT count(*) FROM charges") == 0
    assert client.lookup("k1").state == "in_progress"


def test_commit_true_commits_the_business_write_with_the_response(pool, admin):
    client = Client(pool)
    claim = client.claim("k1", FP)
    with pool.connection() as conn:
        conn.execute("INSERT INTO charges (amount) VALUES (1)")
        assert client.complete("k1", claim.fence, 201, b"x", conn=conn, commit=True) == "stored"
        assert conn.info.transaction_status == TransactionStatus.IDLE
    assert value(admin, "SELECT count(*) FROM charges") == 1
    assert client.lookup("k1").state == "completed"


def test_a_lost_claim_aborts_the_business_write(pool, admin):
    client = Client(pool)
    claim = client.claim("k1", FP)
    client.release("k1", claim.fence)
    with pool.connection() as conn:
        conn.execute("INSERT INTO charges (amount) VALUES (1)")
        with pytest.raises(ClaimLost):
            client.complete("k1", claim.fence, 201, b"x", conn=conn, commit=True)
        assert conn.info.transaction_status == TransactionStatus.INERROR
        conn.rollback()
    assert value(admin, "SELECT count(*) FROM charges") == 0


def test_a_claim_committed_alone_leaves_the_connection_as_it_was(pool, admin):
    with pool.connection() as conn:
        claim = Client(pool).claim("k1", FP, conn=conn, commit=True)
        assert conn.info.transaction_status == TransactionStatus.IDLE and not conn.autocommit
    assert value(admin, "SELECT state FROM idempotency.lookup('k1')") == "in_progress"
    assert claim.outcome == "new"


def test_the_async_client_joins_and_commits_a_transaction(admin):
    async def scenario():
        """Business write + complete in one transaction, then a lost one."""
        async with AsyncConnectionPool(DATABASE_URL, min_size=1, max_size=2) as apool:
            client = AsyncClient(apool)
            claim = await client.claim("k1", FP)
            async with apool.connection() as conn:
                await conn.execute("INSERT INTO charges (amount) VALUES (1)")
                await client.complete("k1", claim.fence, 201, b"x", conn=conn, commit=True)
                stale = await client.claim("k2", FP)
                await client.release("k2", stale.fence)
                await conn.execute("INSERT INTO charges (amount) VALUES (2)")
                with pytest.raises(ClaimLost):
                    await client.complete("k2", stale.fence, 201, conn=conn, commit=True)
                await conn.rollback()
    asyncio.run(scenario())
    assert value(admin, "SELECT array_agg(amount)::text FROM charges") == "{1}"


@pytest.mark.parametrize("prepare", [False, True])
def test_prepare_sends_the_calls_as_statements_prepared_once_per_connection(admin, prepare):
    with ConnectionPool(DATABASE_URL, min_size=1, max_size=1) as one:
        client = Client(one, prepare=prepare)
        for n in range(3):
            claim = client.claim(f"p{n}", FP)
            assert client.complete(f"p{n}", claim.fence, 201, b"x") == "stored"
        assert client.claim("p0", FP).outcome == "replay"
        with one.connection() as conn:
            statements = [row[0] for row in conn.execute(
                "SELECT statement FROM pg_catalog.pg_prepared_statements", prepare=False)]
    assert len(statements) == (2 if prepare else 0)
    assert all("idempotency.claim(" in s or "idempotency.complete(" in s for s in statements)
