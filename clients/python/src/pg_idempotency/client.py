"""The extension's functions for Python code: claim, complete, release,
extend, checkpoint and lookup, on psycopg 3 and a psycopg_pool pool.

Each call takes a connection from the pool and commits on its own, unless
it is given ``conn=``: then it runs in that connection's transaction, and
``commit=True`` commits that transaction together with the call in one round
trip (the call and the business writes commit together or not at all).
"""

from __future__ import annotations

from contextlib import AsyncExitStack, nullcontext
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Optional, Tuple, Union
from uuid import UUID

import psycopg
from psycopg import AsyncClientCursor, ClientCursor
from psycopg.pq import TransactionStatus
from psycopg.rows import class_row
from psycopg.types.json import Jsonb

from .telemetry import Telemetry, outcome, release_outcome

Interval = Union[str, timedelta, None]

CLAIM = """SELECT * FROM idempotency.claim(%s, %s, scope => %s, lease => %s::interval,
                                          retention => %s::interval, wait => %s::interval,
                                          token => %s::uuid)"""
COMPLETE = "SELECT idempotency.complete(%s, %s, %s, %s, %s, %s)"
# With one transaction, after a 5xx rolled the claim back with the rest:
# claims the key again and stores the 5xx in one statement, when
# idempotency.store_server_errors is on (else it does nothing: the key is free).
KEEP_SERVER_ERROR = """SELECT idempotency.complete(%(key)s, c.fence, %(status)s, %(body)s, %(headers)s,
                                               %(scope)s)
  FROM idempotency.claim(%(key)s, %(fingerprint)s, scope => %(scope)s, lease => %(lease)s::interval,
                         retention => %(retention)s::interval, wait => %(wait)s::interval) AS c
 WHERE pg_catalog.current_setting('idempotency.store_server_errors', true)::boolean
   AND c.outcome OPERATOR(pg_catalog.=) 'new'"""
RELEASE = "SELECT idempotency.release(%s, %s, %s)"
EXTEND = "SELECT idempotency.extend(%s, %s, %s::interval, %s)"
CHECKPOINT = "SELECT idempotency.checkpoint(%s, %s, %s, %s, %s)"
LOOKUP = "SELECT * FROM idempotency.lookup(%s, %s)"


class ClaimLost(Exception):
    """The fence no longer owns the claim (SQLSTATE IK001): a retry took it
    over, or it was released or reaped. The transaction it ran in is
    aborted: roll it back."""


@dataclass(frozen=True)
class Claim:
    """The answer of claim(): outcome is new, replay, in_progress or mismatch."""
    outcome: str
    fence: Optional[int]
    attempt: Optional[int]
    status_code: Optional[int]
    headers: Optional[dict]
    body: Optional[bytes]
    recovery_point: Optional[str]
    recovery_state: Any
    retry_after: Optional[int]
    created_at: Optional[datetime]


@dataclass(frozen=True)
class Record:
    """A record as lookup() shows it (every column but the fence)."""
    scope: str
    key: str
    fingerprint: bytes
    state: str
    attempt: int
    lease: Optional[timedelta]          # None once completed
    lease_expires_at: Optional[datetime]
    recovery_point: Optional[str]
    recovery_state: Any
    status_code: Optional[int]
    headers: Optional[dict]
    body: Optional[bytes]
    created_at: datetime
    completed_at: Optional[datetime]
    expires_at: datetime


def _json(value: Any) -> Optional[Jsonb]:
    """Wraps a value for a jsonb argument (None stays NULL)."""
    return None if value is None else Jsonb(value)


def _kept(key, fingerprint, status, body, headers, scope, lease, retention, wait) -> dict:
    """The parameters of KEEP_SERVER_ERROR."""
    return {"key": key, "fingerprint": fingerprint, "status": status, "body": body,
            "headers": _json(headers), "scope": scope, "lease": lease, "retention": retention,
            "wait": wait}


def _first_column(_cursor):
    """A row factory: each row is the value of its one column."""
    return lambda values: values[0]


def _pipeline(conn):
    """conn's pipeline, where libpq has one (14 or later): what is sent in
    it travels together; else a block that does nothing (one round trip each)."""
    return conn.pipeline() if psycopg.Pipeline.is_supported() else nullcontext()


def _async_pipeline(conn):
    """As _pipeline, for an AsyncConnection."""
    return conn.pipeline() if psycopg.AsyncPipeline.is_supported() else AsyncExitStack()


def _idle(conn) -> bool:
    """True when conn has no transaction open."""
    return conn.info.transaction_status == TransactionStatus.IDLE


def _around(conn, commit: bool, begin: bool) -> Optional[Tuple[tuple, tuple]]:
    """The statements sent with a call in its round trip, before it and
    after it; None when it goes alone. With commit: COMMIT after it. With
    begin, on an idle connection in autocommit: BEGIN before it (it runs
    in that transaction) or, with commit too, BEGIN, it, COMMIT, BEGIN (it
    commits in a transaction of its own, then the next opens: without the
    first BEGIN, statements sent together would share one implicit
    transaction, which the last BEGIN would take over, and it would not
    commit). With begin and commit in a transaction (autocommit on): it,
    COMMIT, BEGIN (a checkpoint between two phases)."""
    if begin and conn.autocommit and _idle(conn):
        return ("BEGIN",), (("COMMIT", "BEGIN") if commit else ())
    if begin and commit and conn.autocommit:
        return (), ("COMMIT", "BEGIN")
    if commit and not _idle(conn):
        return (), ("COMMIT",)
    return None


def _prepares(prepare: bool, conn) -> bool:
    """True when the calls go as prepared statements on conn: the prepare
    option, unless psycopg's prepared statements are off on conn
    (prepare_threshold None). Never by default: behind pgbouncer in
    transaction mode (before 1.21) the next transaction may run on a
    server connection without the statement."""
    return prepare and conn.prepare_threshold is not None


class Client:
    """The extension's functions on a psycopg_pool.ConnectionPool (blocking)."""

    def __init__(self, pool, *, tracer_provider=None, prepare: bool = False):
        """pool: a psycopg_pool.ConnectionPool on a database with the
        extension; tracer_provider: OpenTelemetry's (None: the global one);
        prepare: send the functions' calls as statements prepared once per
        connection (psycopg's prepare=True), not parsed and planned at every
        call; off, they work through any pooler."""
        self.pool = pool
        self.telemetry = Telemetry(tracer_provider)
        self.prepare = prepare

    def claim(self, key: str, fingerprint: bytes, *, scope: Optional[str] = None,
              lease: Interval = None, retention: Interval = None, wait: Interval = None,
              token: Optional[UUID] = None, conn=None, commit: bool = False,
              begin: bool = False) -> Claim:
        """Claims key: see Claim.outcome. Commit the claim at once (the
        default without conn) so that a concurrent retry sees it. token: this
        attempt's id; claimed again with it, the live claim it made answers
        new again with the same fence (its answer was lost). begin, with
        conn idle in autocommit: opens a transaction on conn in the same round
        trip, for the claim (without commit) or after it (with commit)."""
        with self.telemetry.span("claim", key) as span:
            claim = self._call(conn, commit, CLAIM,
                               (key, fingerprint, scope, lease, retention, wait, token), class_row(Claim),
                               begin)
            outcome(span, claim.outcome, claim.attempt)
            return claim

    def complete(self, key: str, fence: int, status_code: int, body: Optional[bytes] = None,
                 headers: Optional[dict] = None, *, scope: Optional[str] = None,
                 conn=None, commit: bool = False) -> str:
        """Stores the response: 'stored', or 'released' for a 5xx; ClaimLost when the fence lost."""
        with self.telemetry.span("complete", key) as span:
            answer = self._call(conn, commit, COMPLETE,
                                (key, fence, status_code, body, _json(headers), scope))
            outcome(span, answer)
            return answer

    def keep_server_error(self, key: str, fingerprint: bytes, status_code: int, body: Optional[bytes],
                          headers: Optional[dict], *, scope: Optional[str] = None,
                          lease: Interval = None, retention: Interval = None, wait: Interval = None,
                          conn=None) -> Optional[str]:
        """After a 5xx in one transaction (the claim rolled back with it):
        stores the 5xx under a claim of its own, committed at once, when
        idempotency.store_server_errors is on; None when it is off or
        another request holds the key."""
        with self.telemetry.span("complete", key) as span:
            answer = self._call(conn, True, KEEP_SERVER_ERROR, _kept(
                key, fingerprint, status_code, body, headers, scope, lease, retention, wait))
            outcome(span, answer or "released")   # not kept: the key is free
            return answer

    def release(self, key: str, fence: int, *, scope: Optional[str] = None,
                conn=None, commit: bool = False) -> bool:
        """Frees the key for the next retry; False when this fence no longer owns it."""
        with self.telemetry.span("release", key) as span:
            released = self._call(conn, commit, RELEASE, (key, fence, scope))
            outcome(span, release_outcome(released))
            return released

    def extend(self, key: str, fence: int, lease: Interval = None, *,
               scope: Optional[str] = None, conn=None, commit: bool = False) -> datetime:
        """Renews the lease; returns its new end; ClaimLost when the fence lost."""
        return self._call(conn, commit, EXTEND, (key, fence, lease, scope))

    def checkpoint(self, key: str, fence: int, recovery_point: str, recovery_state: Any = None,
                   *, scope: Optional[str] = None, conn=None, commit: bool = False,
                   begin: bool = False) -> None:
        """Saves progress for a takeover to resume from; ClaimLost when the fence lost."""
        self._call(conn, commit, CHECKPOINT,
                   (key, fence, recovery_point, _json(recovery_state), scope), _first_column, begin)

    def lookup(self, key: str, *, scope: Optional[str] = None, conn=None) -> Optional[Record]:
        """Returns the record as claim would see it, or None (read only)."""
        return self._call(conn, False, LOOKUP, (key, scope), class_row(Record))

    def _call(self, conn, commit: bool, sql: str, params: tuple, row_factory=_first_column,
              begin: bool = False):
        """Runs one function on conn, or alone on a connection of the pool."""
        if conn is None:
            with self.pool.connection() as conn:
                return self._call(conn, True, sql, params, row_factory)
        try:
            return self._execute(conn, commit, sql, params, row_factory, begin)
        except psycopg.Error as err:
            if err.sqlstate == "IK001":
                raise ClaimLost(str(err)) from err
            raise

    def _execute(self, conn, commit: bool, sql: str, params: tuple, row_factory, begin: bool = False):
        """Executes sql, with the statements _around says in the same round
        trip; alone, on an idle connection out of autocommit, with commit, it
        commits by itself (no BEGIN, no COMMIT)."""
        around = _around(conn, commit, begin)
        if around is not None:
            return self._together(conn, *around, sql, params, row_factory)
        cur = conn.cursor(row_factory=row_factory)
        if not (commit and _idle(conn) and not conn.autocommit):
            return cur.execute(sql, params, prepare=self.prepare).fetchone()
        conn.autocommit = True
        try:
            return cur.execute(sql, params, prepare=self.prepare).fetchone()
        finally:
            conn.autocommit = False

    def _together(self, conn, before: tuple, after: tuple, sql: str, params: tuple, row_factory):
        """Sends the statements before, sql and the statements after in one
        round trip; returns sql's row. As one query text, the parameters
        bound into it (ClientCursor): the least work for psycopg and the
        server; or, with prepare, in a pipeline (where libpq has one), sql a
        statement prepared once per connection."""
        if not _prepares(self.prepare, conn):
            cur = ClientCursor(conn, row_factory=row_factory)
            cur.execute("; ".join((*before, sql, *after)), params)
            for _ in before:
                cur.nextset()
            return cur.fetchone()
        cur = conn.cursor(row_factory=row_factory)
        with _pipeline(conn):
            for statement in before:
                conn.execute(statement, prepare=False)
            cur.execute(sql, params, prepare=True)
            for statement in after:
                conn.execute(statement, prepare=False)
        return cur.fetchone()


class AsyncClient:
    """The same functions on a psycopg_pool.AsyncConnectionPool (asyncio)."""

    def __init__(self, pool, *, tracer_provider=None, prepare: bool = False):
        """As Client, on a psycopg_pool.AsyncConnectionPool."""
        self.pool = pool
        self.telemetry = Telemetry(tracer_provider)
        self.prepare = prepare

    async def claim(self, key: str, fingerprint: bytes, *, scope: Optional[str] = None,
                    lease: Interval = None, retention: Interval = None, wait: Interval = None,
                    token: Optional[UUID] = None, conn=None, commit: bool = False,
                    begin: bool = False) -> Claim:
        """As Client.claim."""
        with self.telemetry.span("claim", key) as span:
            claim = await self._call(conn, commit, CLAIM,
                                     (key, fingerprint, scope, lease, retention, wait, token),
                                     class_row(Claim), begin)
            outcome(span, claim.outcome, claim.attempt)
            return claim

    async def complete(self, key: str, fence: int, status_code: int, body: Optional[bytes] = None,
                       headers: Optional[dict] = None, *, scope: Optional[str] = None,
                       conn=None, commit: bool = False) -> str:
        """As Client.complete."""
        with self.telemetry.span("complete", key) as span:
            answer = await self._call(conn, commit, COMPLETE,
                                      (key, fence, status_code, body, _json(headers), scope))
            outcome(span, answer)
            return answer

    async def keep_server_error(self, key: str, fingerprint: bytes, status_code: int,
                                body: Optional[bytes], headers: Optional[dict], *,
                                scope: Optional[str] = None, lease: Interval = None,
                                retention: Interval = None, wait: Interval = None,
                                conn=None) -> Optional[str]:
        """As Client.keep_server_error."""
        with self.telemetry.span("complete", key) as span:
            answer = await self._call(conn, True, KEEP_SERVER_ERROR, _kept(
                key, fingerprint, status_code, body, headers, scope, lease, retention, wait))
            outcome(span, answer or "released")   # not kept: the key is free
            return answer

    async def release(self, key: str, fence: int, *, scope: Optional[str] = None,
                      conn=None, commit: bool = False) -> bool:
        """As Client.release."""
        with self.telemetry.span("release", key) as span:
            released = await self._call(conn, commit, RELEASE, (key, fence, scope))
            outcome(span, release_outcome(released))
            return released

    async def extend(self, key: str, fence: int, lease: Interval = None, *,
                     scope: Optional[str] = None, conn=None, commit: bool = False) -> datetime:
        """As Client.extend."""
        return await self._call(conn, commit, EXTEND, (key, fence, lease, scope))

    async def checkpoint(self, key: str, fence: int, recovery_point: str, recovery_state: Any = None,
                         *, scope: Optional[str] = None, conn=None, commit: bool = False,
                         begin: bool = False) -> None:
        """As Client.checkpoint."""
        await self._call(conn, commit, CHECKPOINT,
                         (key, fence, recovery_point, _json(recovery_state), scope), _first_column, begin)

    async def lookup(self, key: str, *, scope: Optional[str] = None, conn=None) -> Optional[Record]:
        """As Client.lookup."""
        return await self._call(conn, False, LOOKUP, (key, scope), class_row(Record))

    async def _call(self, conn, commit: bool, sql: str, params: tuple, row_factory=_first_column,
                    begin: bool = False):
        """As Client._call."""
        if conn is None:
            async with self.pool.connection() as conn:
                return await self._call(conn, True, sql, params, row_factory)
        try:
            return await self._execute(conn, commit, sql, params, row_factory, begin)
        except psycopg.Error as err:
            if err.sqlstate == "IK001":
                raise ClaimLost(str(err)) from err
            raise

    async def _execute(self, conn, commit: bool, sql: str, params: tuple, row_factory,
                       begin: bool = False):
        """As Client._execute."""
        around = _around(conn, commit, begin)
        if around is not None:
            return await self._together(conn, *around, sql, params, row_factory)
        cur = conn.cursor(row_factory=row_factory)
        if not (commit and _idle(conn) and not conn.autocommit):
            return await (await cur.execute(sql, params, prepare=self.prepare)).fetchone()
        await conn.set_autocommit(True)
        try:
            return await (await cur.execute(sql, params, prepare=self.prepare)).fetchone()
        finally:
            await conn.set_autocommit(False)

    async def _together(self, conn, before: tuple, after: tuple, sql: str, params: tuple, row_factory):
        """As Client._together."""
        if not _prepares(self.prepare, conn):
            cur = AsyncClientCursor(conn, row_factory=row_factory)
            await cur.execute("; ".join((*before, sql, *after)), params)
            for _ in before:
                cur.nextset()
            return await cur.fetchone()
        cur = conn.cursor(row_factory=row_factory)
        async with _async_pipeline(conn):
            for statement in before:
                await conn.execute(statement, prepare=False)
            await cur.execute(sql, params, prepare=True)
            for statement in after:
                await conn.execute(statement, prepare=False)
        return await cur.fetchone()
