"""The flow every guarded unit of work follows, whatever runs it (the Flask
and ASGI middlewares, the idempotent function): claim it with its token,
asking again when the answer was lost; run it; end it by committing it with
its stored result, or by rolling it back and releasing the key (or storing
what must be kept). Written once, blocking and asyncio, on a Client or an
AsyncClient (or Django's connection: its errors are described by an Errors);
the caller supplies how it takes and gives back a connection.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, NamedTuple, Optional, Tuple

import psycopg

from . import contract
from .client import Claim, ClaimLost, _idle


class Errors(NamedTuple):
    """What a failed call of the client raises (kind), whether its answer
    was lost, and its SQLSTATE (IK001 when not raised as ClaimLost)."""
    kind: type
    lost: Callable[[BaseException], bool]
    sqlstate: Callable[[BaseException], Optional[str]]


PSYCOPG = Errors(psycopg.Error, contract.answer_lost, lambda err: err.sqlstate)


def roll_back(conn, keep_prepared: bool = False) -> None:
    """Rolls back conn's transaction. keep_prepared (the prepare option):
    with a ROLLBACK that psycopg's statement cache does not see, since
    conn.rollback(), or a ROLLBACK it sees, empties that cache (DEALLOCATE
    ALL, then every statement prepared again at its next use)."""
    if not keep_prepared:
        conn.rollback()
    elif not _idle(conn):
        threshold, conn.prepare_threshold = conn.prepare_threshold, None
        try:
            conn.execute("ROLLBACK", prepare=False)
        finally:
            conn.prepare_threshold = threshold


async def aroll_back(conn, keep_prepared: bool = False) -> None:
    """As roll_back, on an AsyncConnection."""
    if not keep_prepared:
        await conn.rollback()
    elif not _idle(conn):
        threshold, conn.prepare_threshold = conn.prepare_threshold, None
        try:
            await conn.execute("ROLLBACK", prepare=False)
        finally:
            conn.prepare_threshold = threshold


def claim_answered(client, pending: contract.Pending, options: contract.Options,
                   take: Callable[[], object], give_back: Callable[[], None],
                   recheck: Callable[[], None], errors: Errors = PSYCOPG) -> Tuple[Claim, bool]:
    """Claims with the token of pending on a fresh connection from take(),
    committed at once (with one transaction: BEGIN and the claim, in one round
    trip, left open for the work); when the answer is lost, gives the
    connection back, rechecks the pool and asks again on another
    (contract.CLAIM_BACKOFF). Returns the claim and whether it was asked again."""
    for tries, pause in enumerate((*contract.CLAIM_BACKOFF, None)):
        try:
            return client.claim(pending.key, pending.fingerprint, scope=pending.scope,
                                lease=options.lease, retention=options.retention, wait=options.wait,
                                token=pending.token, conn=take(),
                                commit=not options.one_transaction, begin=True), tries > 0
        except errors.kind as err:
            if pause is None or not errors.lost(err):
                raise
            _log_lost_claim(pending, err)
        give_back()
        recheck()   # drops the pool's other broken connections
        time.sleep(pause)
    raise AssertionError("unreachable")


async def aclaim_answered(client, pending: contract.Pending, options: contract.Options,
                          take: Callable[[], Awaitable[object]], give_back: Callable[[], Awaitable[None]],
                          recheck: Callable[[], Awaitable[None]]) -> Tuple[Claim, bool]:
    """As claim_answered, on an AsyncClient."""
    for tries, pause in enumerate((*contract.CLAIM_BACKOFF, None)):
        try:
            return await client.claim(pending.key, pending.fingerprint, scope=pending.scope,
                                      lease=options.lease, retention=options.retention,
                                      wait=options.wait, token=pending.token, conn=await take(),
                                      commit=not options.one_transaction, begin=True), tries > 0
        except psycopg.Error as err:
            if pause is None or not contract.answer_lost(err):
                raise
            _log_lost_claim(pending, err)
        await give_back()
        await recheck()
        await asyncio.sleep(pause)
    raise AssertionError("unreachable")


def after_reclaim(claim: Claim, pending: contract.Pending, live: object,
                  options: contract.Options) -> Tuple[Optional[object], contract.Pending]:
    """After a COMMIT whose answer was lost, what the claim asked again with
    the token says. new: it rolled back, the work runs again under the
    claim's fence: (None, that pending). Otherwise the answer to send, and
    pending: live (the work's own response) when it committed, else
    contract.after_lost_commit's answer (pending.stored tells its own replay)."""
    if claim.outcome == "new":
        contract.log.warning("idempotency: the COMMIT of %r rolled back; running it again", pending.key)
        return None, pending._replace(fence=claim.fence)
    return contract.after_lost_commit(claim, live, options, pending.stored), pending


def _log_lost_claim(pending: contract.Pending, err: BaseException) -> None:
    """Says that a claim is asked again."""
    contract.log.warning("idempotency: a claim of %r got no answer, asking again: %s", pending.key, err)


def abandon(client, conn, pending: contract.Pending, options: contract.Options,
            failed: Optional[contract.Answer] = None) -> None:
    """Rolls the work's writes back and ends the claim (end_claim)."""
    try:
        roll_back(conn, client.prepare)
    except psycopg.Error as err:
        conn = _broken(pending, err)
    end_claim(client, conn, pending, options, failed)


def end_claim(client, conn, pending: contract.Pending, options: contract.Options,
              failed: Optional[contract.Answer] = None, errors: Errors = PSYCOPG) -> None:
    """Ends the claim after the work's writes rolled back (_endings says how)."""
    steps = _endings(pending, options, failed, errors)
    step = next(steps, None)
    while step is not None:
        name, arguments = step
        try:
            getattr(client, name)(conn=conn, **arguments)
            outcome = None
        except (ClaimLost, errors.kind) as err:
            outcome = err
        step = _next_step(steps, outcome)


def _endings(pending: contract.Pending, options: contract.Options, failed: Optional[contract.Answer],
             errors: Errors):
    """The calls that end a claim after the work's writes rolled back, as
    (client method, its arguments), each sent back what it raised (None when
    it succeeded): a 5xx response (failed) goes to complete, which releases
    the key or, with idempotency.store_server_errors on, stores the response;
    otherwise, or when complete fails, the key is released for the next
    retry. With one transaction the claim rolled back with the writes: only
    a 5xx kept by that setting is written."""
    if pending.fence is None:
        return
    stored = _failure_to_store(pending, failed, options)
    if options.one_transaction:
        if stored is not None:
            err = yield "keep_server_error", _kept_arguments(pending, stored, options)
            if err is not None:
                _log_unkept(pending, failed, err)
        return
    if stored is not None:
        err = yield "complete", {"key": pending.key, "fence": pending.fence, "status_code": stored.status,
                                 "body": stored.body, "headers": stored.headers, "scope": pending.scope,
                                 "commit": True}
        if err is None or isinstance(err, ClaimLost) or errors.sqlstate(err) == "IK001":
            return  # stored or released; or a retry owns the key: nothing of ours to free
        _log_unended(pending, failed, err)   # 54000 (too large to store) among others
    err = yield "release", {"key": pending.key, "fence": pending.fence, "scope": pending.scope, "commit": True}
    if err is not None:
        _log_unreleased(pending, err)


def _next_step(steps, outcome: Optional[BaseException]):
    """Sends the outcome of a step of _endings; returns the next step, or None."""
    try:
        return steps.send(outcome)
    except StopIteration:
        return None


def _failure_to_store(pending: contract.Pending, failed: Optional[contract.Answer],
                      options: contract.Options) -> Optional[contract.Stored]:
    """What complete() gets of a 5xx (contract.to_store); None without one,
    or when the redact option failed on it (the key is released)."""
    if failed is None:
        return None
    try:
        return contract.to_store(failed, options)
    except contract.RedactFailed as err:
        contract.log.error("idempotency: the %d of %r is not stored: %s", failed.status, pending.key, err)
        return None


def _kept_arguments(pending: contract.Pending, stored: contract.Stored, options: contract.Options) -> dict:
    """The arguments of keep_server_error() for a 5xx in one transaction."""
    return {"key": pending.key, "fingerprint": pending.fingerprint, "status_code": stored.status,
            "body": stored.body, "headers": stored.headers, "scope": pending.scope,
            "lease": options.lease, "retention": options.retention, "wait": options.wait}


async def aabandon(client, conn, pending: contract.Pending, options: contract.Options,
                   failed: Optional[contract.Answer] = None) -> None:
    """As abandon, on an AsyncClient."""
    try:
        await aroll_back(conn, client.prepare)
    except psycopg.Error as err:
        conn = _broken(pending, err)
    steps = _endings(pending, options, failed, PSYCOPG)
    step = next(steps, None)
    while step is not None:
        name, arguments = step
        try:
            await getattr(client, name)(conn=conn, **arguments)
            outcome = None
        except (ClaimLost, psycopg.Error) as err:
            outcome = err
        step = _next_step(steps, outcome)


def _broken(pending: contract.Pending, err: BaseException) -> None:
    """After a failed ROLLBACK: the connection broke and its transaction is
    gone; the claim is ended on a fresh connection of the pool (None)."""
    contract.log.error("idempotency: could not roll back %r: %s", pending.key, err)


def _log_unkept(pending: contract.Pending, failed: contract.Answer, err: BaseException) -> None:
    """Says that a 5xx could not be kept under a claim of its own."""
    contract.log.error("idempotency: could not keep the %d of %r: %s", failed.status, pending.key, err)


def _log_unended(pending: contract.Pending, failed: contract.Answer, err: BaseException) -> None:
    """Says that a 5xx could not end its claim (the key is released instead)."""
    contract.log.error("idempotency: could not end the claim of %r after a %d: %s",
                       pending.key, failed.status, err)


def _log_unreleased(pending: contract.Pending, err: BaseException) -> None:
    """Says that the key could not be released (its lease ends the claim)."""
    contract.log.error("idempotency: could not release %r: %s", pending.key, err)


class Held:
    """A unit of work's connection, taken from the pool afresh when one broke."""

    def __init__(self, pool, keep_prepared: bool = False):
        """Holds nothing yet; keep_prepared: see roll_back."""
        self.pool = pool
        self.keep_prepared = keep_prepared
        self.conn = None
        self.autocommit = False

    def take(self):
        """Gives back the connection held, and takes a fresh one in autocommit:
        the flow sends BEGIN itself, with the claim (psycopg's own BEGIN would
        cost a round trip of its own)."""
        self.give_back()
        self.conn = self.pool.getconn()
        self.autocommit = self.conn.autocommit
        self.conn.autocommit = True
        return self.conn

    def give_back(self) -> None:
        """Returns the connection to the pool idle, in its own autocommit mode
        (a broken one is discarded by the pool)."""
        conn, self.conn = self.conn, None
        if conn is not None:
            try:
                roll_back(conn, self.keep_prepared)
                conn.autocommit = self.autocommit
            except psycopg.Error:
                pass
            self.pool.putconn(conn)


class AsyncHeld:
    """As Held, on an AsyncConnectionPool."""

    def __init__(self, pool, keep_prepared: bool = False):
        """Holds nothing yet; keep_prepared: see roll_back."""
        self.pool = pool
        self.keep_prepared = keep_prepared
        self.conn = None
        self.autocommit = False

    async def take(self):
        """As Held.take."""
        await self.give_back()
        self.conn = await self.pool.getconn()
        self.autocommit = self.conn.autocommit
        await self.conn.set_autocommit(True)
        return self.conn

    async def give_back(self) -> None:
        """As Held.give_back."""
        conn, self.conn = self.conn, None
        if conn is not None:
            try:
                await aroll_back(conn, self.keep_prepared)
                await conn.set_autocommit(self.autocommit)
            except psycopg.Error:
                pass
            await self.pool.putconn(conn)
