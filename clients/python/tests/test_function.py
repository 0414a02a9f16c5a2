"""The idempotent function against the database: once per key, the stored
result for duplicates, mismatches, exceptions (released or final), races
of threads and processes, the lease extended while it runs, checkpoints a
takeover resumes after (the first process killed), and COMMITs whose answer
was lost, in both modes and for sync and async functions."""

import asyncio
import multiprocessing
import os
import signal
import subprocess
import tempfile
import sys
import textwrap
import threading
from datetime import timedelta

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from conftest import DATABASE_URL
from helpers import value, wait_for
from pg_idempotency import ClaimLost, FinalError, InProgress, Mismatch, idempotent_function
from pg_idempotency.client import AsyncClient, Client
from pg_idempotency.function import arguments_fingerprint


class CardDeclined(Exception):
    """A final error: the same charge would be declined again."""


@pytest.fixture(params=["one transaction", "two transactions"])
def one_transaction(request):
    """Every flow test runs in both modes."""
    return request.param == "one transaction"


def charges(admin):
    """How many charges were written."""
    return value(admin, "SELECT count(*) FROM charges")


def make_charge(pool, runs, **options):
    """A function that charges amount under order_id, counting its runs."""
    @idempotent_function(pool, key="order_id", **options)
    def charge(run, order_id, amount, decline=False, crash=False):
        runs.append(run.attempt)
        charge_id = run.conn.execute("INSERT INTO charges (amount) VALUES (%s) RETURNING id",
                                     (amount,)).fetchone()[0]
        if decline:
            raise CardDeclined(f"card declined for {amount}")
        if crash:
            raise RuntimeError("the provider timed out")
        return {"charge": charge_id, "amount": amount}
    return charge


def test_runs_once_and_a_duplicate_gets_the_stored_result(pool, admin, one_transaction):
    runs = []
    charge = make_charge(pool, runs, one_transaction=one_transaction)
    first = charge("o-1", 10)
    assert charge(order_id="o-1", amount=10) == first
    assert runs == [1] and charges(admin) == 1
    record = value(admin, "SELECT row(state, status_code, convert_from(body, 'UTF8'))::text "
                          "FROM idempotency.keys WHERE key = 'o-1'")
    assert record.startswith("(completed,200,") and '"charge"' in record


def test_the_writes_commit_with_the_result_or_not_at_all(pool, admin, one_transaction):
    runs = []
    charge = make_charge(pool, runs, one_transaction=one_transaction)
    with pytest.raises(RuntimeError):
        charge("o-2", 10, crash=True)
    assert charges(admin) == 0
    assert value(admin, "SELECT count(*) FROM idempotency.keys") == 0   # released
    assert charge("o-2", 10, crash=False)["amount"] == 10               # runs again
    assert runs == [1, 1] and charges(admin) == 1


def test_a_key_with_other_arguments_is_a_mismatch(pool, admin, one_transaction):
    runs = []
    charge = make_charge(pool, runs, one_transaction=one_transaction)
    charge("o-3", 10)
    with pytest.raises(Mismatch):
        charge("o-3", 99)
    assert runs == [1] and charges(admin) == 1


def test_the_fingerprint_is_of_the_arguments_however_passed(pool):
    assert arguments_fingerprint({"a": 1, "b": [1, 2]}) == arguments_fingerprint({"b": [1, 2], "a": 1})
    runs = []
    charge = make_charge(pool, runs)
    charge("o-4", 10)
    charge(amount=10, order_id="o-4", decline=False)
    assert runs == [1]


def test_a_final_error_is_stored_and_raised_again(pool, admin, one_transaction):
    runs = []
    charge = make_charge(pool, runs, one_transaction=one_transaction, final=CardDeclined)
    with pytest.raises(CardDeclined, match="card declined for 10"):
        charge("o-5", 10, decline=True)
    with pytest.raises(CardDeclined, match="card declined for 10"):
        charge("o-5", 10, decline=True)
    assert runs == [1] and charges(admin) == 0      # its writes rolled back


def test_a_final_error_of_a_predicate_replays_as_final_error(pool, one_transaction):
    runs = []
    charge = make_charge(pool, runs, one_transaction=one_transaction,
                         final=lambda err: isinstance(err, CardDeclined))
    with pytest.raises(CardDeclined):
        charge("o-6", 10, decline=True)
    with pytest.raises(FinalError) as replayed:
        charge("o-6", 10, decline=True)
    assert replayed.value.error_type.endswith("CardDeclined")
    assert replayed.value.error_args == ["card declined for 10"]


def test_other_errors_release_the_key(pool, admin, one_transaction):
    runs = []
    charge = make_charge(pool, runs, one_transaction=one_transaction, final=CardDeclined)
    with pytest.raises(RuntimeError):
        charge("o-7", 10, crash=True)
    charge("o-7", 10)
    assert runs == [1, 1] and charges(admin) == 1


@pytest.mark.parametrize("wait", [None, "30 seconds"])
def test_threads_racing_one_key_run_it_once(admin, one_transaction, wait):
    runs, results, errors = [], [], []
    release = threading.Event()
    with ConnectionPool(DATABASE_URL, min_size=1, max_size=10) as pool:
        @idempotent_function(pool, key="order_id", one_transaction=one_transaction,
                             wait=wait or ("100 milliseconds" if one_transaction else None))
        def slow_charge(run, order_id, amount):
            runs.append(1)
            run.conn.execute("INSERT INTO charges (amount) VALUES (%s)", (amount,))
            release.wait(30)
            return "charged"

        def call():
            try:
                results.append(slow_charge("o-8", 10))
            except InProgress as err:
                errors.append(err)
        threads = [threading.Thread(target=call) for _ in range(8)]
        threads[0].start()
        wait_for(admin, "SELECT count(*) > 0 FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
                        "WHERE a.query LIKE '%%INSERT INTO charges%%'") if one_transaction else \
            wait_for(admin, "SELECT count(*) > 0 FROM idempotency.keys WHERE key = 'o-8'")
        for thread in threads[1:]:
            thread.start()
        if wait is None:
            for thread in threads[1:]:
                thread.join()
        release.set()
        for thread in threads:
            thread.join()
    assert len(runs) == 1 and charges(admin) == 1
    if wait:
        assert results == ["charged"] * 8
    else:
        assert results == ["charged"] and len(errors) == 7
        assert all(err.retry_after >= 1 and err.key == "o-8" for err in errors)


def _race_in_a_process(barrier, key):
    """One process of the race: calls the charge once its siblings are ready."""
    with ConnectionPool(DATABASE_URL, min_size=1, max_size=2) as pool:
        @idempotent_function(pool, key="order_id", wait="30 seconds")
        def charge(run, order_id):
            run.conn.execute("INSERT INTO charges (amount) VALUES (1)")
            return os.getpid()
        barrier.wait()
        return charge(key)


def test_processes_racing_one_key_run_it_once(admin):
    context = multiprocessing.get_context("spawn")
    barrier = context.Manager().Barrier(4)
    with context.Pool(4) as processes:
        winners = processes.starmap(_race_in_a_process, [(barrier, "o-9")] * 4)
    assert len(set(winners)) == 1 and charges(admin) == 1


def test_the_lease_is_extended_while_the_function_runs(pool, admin):
    release = threading.Event()
    runs = []

    @idempotent_function(pool, key="job", one_transaction=False, lease=timedelta(seconds=1))
    def long_job(run, job):
        runs.append(run.attempt)
        release.wait(30)
        return "done"

    worker = threading.Thread(target=long_job, args=("j-1",))
    worker.start()
    try:
        # Renewed at least three times: it has outlived its first lease twice over.
        wait_for(admin, "SELECT count(*) > 0 FROM idempotency.keys WHERE key = 'j-1' "
                        "AND lease_expires_at > created_at + interval '3 seconds'", timeout=20)
        with pytest.raises(InProgress):
            long_job("j-1")
    finally:
        release.set()
        worker.join()
    assert runs == [1]
    assert value(admin, "SELECT attempt FROM idempotency.keys WHERE key = 'j-1'") == 1
    assert long_job("j-1") == "done"


def test_without_a_lease_the_database_setting_decides_and_is_renewed(admin):
    # A role whose idempotency.lease is 1 second (as ALTER ROLE ... SET
    # gives it): the claim takes that lease, and the renewals keep it alive.
    release = threading.Event()
    with ConnectionPool(DATABASE_URL, min_size=1, max_size=4,
                        kwargs={"options": "-c idempotency.lease=1s"}) as short_pool:
        @idempotent_function(short_pool, key="job", one_transaction=False)
        def long_job(run, job):
            release.wait(30)
            return "done"

        worker = threading.Thread(target=long_job, args=("j-setting",))
        worker.start()
        try:
            wait_for(admin, "SELECT count(*) > 0 FROM idempotency.keys WHERE key = 'j-setting' "
                            "AND lease = interval '1 second'", timeout=20)
            wait_for(admin, "SELECT count(*) > 0 FROM idempotency.keys WHERE key = 'j-setting' "
                            "AND lease_expires_at > created_at + interval '3 seconds'", timeout=20)
            assert value(admin, "SELECT attempt FROM idempotency.keys WHERE key = 'j-setting'") == 1
        finally:
            release.set()
            worker.join()
        assert long_job("j-setting") == "done"


def test_checkpoint_needs_two_transactions(pool):
    @idempotent_function(pool, key="job")
    def job(run, job):
        run.checkpoint("halfway")

    with pytest.raises(RuntimeError, match="two transactions"):
        job("j-2")


KILLED_WORKER = textwrap.dedent("""
    import sys, time
    from psycopg_pool import ConnectionPool
    from pg_idempotency import idempotent_function

    with ConnectionPool(sys.argv[1], min_size=1, max_size=2) as pool:
        @idempotent_function(pool, key="order_id", one_transaction=False, lease=1)
        def charge(run, order_id, amount):
            charge_id = run.conn.execute(
                "INSERT INTO charges (amount) VALUES (%s) RETURNING id", (amount,)).fetchone()[0]
            run.checkpoint("charged", {"charge": charge_id})
            print("checkpointed", flush=True)
            time.sleep(600)     # killed here, before its result is stored
        charge("o-10", 10)
""")


def test_a_takeover_resumes_after_the_last_checkpoint_of_a_killed_process(pool, admin):
    worker = subprocess.Popen([sys.executable, "-c", KILLED_WORKER, DATABASE_URL],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline().strip() == "checkpointed"
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait()
    seen = []

    @idempotent_function(pool, key="order_id", one_transaction=False, lease=1, wait="30 seconds")
    def charge(run, order_id, amount):
        seen.append((run.attempt, run.recovery_point, run.recovery_state))
        if run.recovery_point != "charged":
            raise AssertionError("the checkpoint was not handed over")
        return run.recovery_state

    result = charge("o-10", 10)    # waits for the killed owner's lease to end, then takes over
    assert seen == [(2, "charged", result)] and charges(admin) == 1
    assert result["charge"] == value(admin, "SELECT id FROM charges")
    assert charge("o-10", 10) == result


@pytest.mark.parametrize("committed", [True, False])
def test_a_commit_whose_answer_was_lost_is_resolved_by_the_token(pool, admin, monkeypatch,
                                                                 one_transaction, committed):
    real_complete, lost = Client.complete, []

    def complete_losing_its_answer(self, *args, **kwargs):
        if lost:
            return real_complete(self, *args, **kwargs)
        lost.append(1)
        if committed:
            real_complete(self, *args, **kwargs)
        else:
            kwargs["conn"].rollback()
        raise psycopg.OperationalError("the server closed the connection unexpectedly")

    monkeypatch.setattr(Client, "complete", complete_losing_its_answer)
    runs = []
    charge = make_charge(pool, runs, one_transaction=one_transaction)
    result = charge("o-11", 10)
    assert runs == ([1] if committed else [1, 1]) and charges(admin) == 1
    assert charge("o-11", 10) == result


def test_a_takeover_makes_the_first_owner_fail_with_claim_lost(pool, admin):
    started, release = threading.Event(), threading.Event()
    outcome = []

    @idempotent_function(pool, key="job", one_transaction=False, lease=timedelta(seconds=30))
    def job(run, job):
        started.set()
        release.wait(30)
        run.conn.execute("INSERT INTO charges (amount) VALUES (1)")
        return "done"

    def first():
        try:
            outcome.append(job("j-3"))
        except ClaimLost as err:
            outcome.append(err)
    worker = threading.Thread(target=first)
    worker.start()
    started.wait(30)
    # Another owner takes over: the lease is ended by hand.
    admin.execute("UPDATE idempotency.keys SET lease_expires_at = now() WHERE key = 'j-3'")
    assert job("j-3") == "done"
    release.set()
    worker.join()
    assert isinstance(outcome[0], ClaimLost) and charges(admin) == 1


@pytest.fixture
def apool():
    """An AsyncConnectionPool and the loop it lives on."""
    loop = asyncio.new_event_loop()
    pool = AsyncConnectionPool(DATABASE_URL, min_size=1, max_size=10, open=False)
    loop.run_until_complete(pool.open())
    yield pool, loop
    loop.run_until_complete(pool.close())
    loop.close()


def test_an_async_function_runs_once_and_races_run_once(apool, admin, one_transaction):
    pool, loop = apool
    runs = []

    @idempotent_function(pool, key="order_id", one_transaction=one_transaction, wait="30 seconds",
                         final=CardDeclined)
    async def charge(run, order_id, amount, decline=False):
        runs.append(run.attempt)
        cur = await run.conn.execute("INSERT INTO charges (amount) VALUES (%s) RETURNING id", (amount,))
        charge_id = (await cur.fetchone())[0]
        await asyncio.sleep(0.05)
        if decline:
            raise CardDeclined("declined")
        return {"charge": charge_id}

    async def scenario():
        results = await asyncio.gather(*(charge("o-12", 10) for _ in range(6)))
        assert len({r["charge"] for r in results}) == 1
        with pytest.raises(Mismatch):
            await charge("o-12", 11)
        for _ in range(2):
            with pytest.raises(CardDeclined):
                await charge("o-13", 10, decline=True)
    loop.run_until_complete(scenario())
    assert runs == [1, 1] and charges(admin) == 1


def test_an_async_function_checkpoints_and_extends(apool, admin):
    pool, loop = apool
    gate = {}

    @idempotent_function(pool, key="job", one_transaction=False, lease=1)
    async def job(run, job):
        await run.conn.execute("INSERT INTO charges (amount) VALUES (1)")
        await run.checkpoint("step-1", {"n": 1})
        await gate["open"].wait()
        return run.recovery_state

    async def scenario():
        gate["open"] = asyncio.Event()
        running = asyncio.ensure_future(job("j-4"))
        client = AsyncClient(pool)
        for _ in range(400):
            record = await client.lookup("j-4")
            if record and record.recovery_point == "step-1" and \
                    record.lease_expires_at - record.created_at > timedelta(seconds=3):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the lease was not extended")
        assert charges(admin) == 1    # the checkpoint committed the writes before it
        gate["open"].set()
        return await running
    assert loop.run_until_complete(scenario()) == {"n": 1}


def round_trips(pool, call):
    """The round trips of call() on the pool's one connection: the
    ReadyForQuery messages of its libpq trace (bench/overhead.py's count)."""
    with tempfile.TemporaryFile("w+") as trace:
        with pool.connection() as conn:
            conn.pgconn.trace(trace.fileno())
        call()
        with pool.connection() as conn:
            conn.pgconn.untrace()
        trace.seek(0)
        return sum("\tReadyForQuery\t" in line for line in trace)


def test_no_round_trip_over_the_middlewares(one_transaction):
    # The middlewares' counts (README, "Round trips in 0.3.0"): a fresh key
    # 2 + the handler's, a replay 2 (the claim's pipeline, then ROLLBACK).
    with ConnectionPool(DATABASE_URL, min_size=1, max_size=1) as pool:
        charge = make_charge(pool, [], one_transaction=one_transaction)
        charge("o-0", 1)    # the connection's first statements, untraced
        assert round_trips(pool, lambda: charge("o-14", 10)) == 2 + 1
        assert round_trips(pool, lambda: charge("o-14", 10)) == 2
