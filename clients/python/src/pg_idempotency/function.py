"""The idempotent function: any unit of work (a job, a webhook event, a
message) runs once per key, as a request does behind the middlewares.

    @idempotent_function(pool, key="order_id")
    def charge(run, order_id, amount):
        run.conn.execute("INSERT INTO charges ...")      # commits with the result
        return {"charge": ...}

    charge(order_id=7, amount=10)    # runs, stores {"charge": ...}
    charge(order_id=7, amount=10)    # returns the stored result, does not run
    charge(order_id=7, amount=99)    # raises Mismatch

The function's first parameter receives a Run: the connection whose
transaction commits with the stored result (``run.conn``), the claim's
attempt and, on a takeover, the recovery point the last attempt saved.
The other arguments are its payload: their canonical JSON's SHA-256 is the
record's fingerprint. ``async def`` functions are wrapped the same way, on
an AsyncConnectionPool.

One transaction (the default): the claim, the function's writes and the
stored result commit together; a duplicate waits up to ``wait`` for them,
then gets the result or InProgress. Two transactions (``one_transaction=False``):
the claim commits at once, for work that calls out (a payment provider);
the lease is extended while the function runs, and ``run.checkpoint()``
commits the writes so far with a recovery point a takeover resumes after.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import functools
import hashlib
import inspect
import json
import threading
import uuid
from datetime import date, datetime, time as daytime, timedelta
from decimal import Decimal
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple, Type, Union

import psycopg

from . import contract, flow
from .client import AsyncClient, Claim, ClaimLost, Client

# The status codes of the record: a result, and a final error stored.
RESULT_STATUS = 200
ERROR_STATUS = 422
# How long a lease lasts when neither the call nor the database says.
FALLBACK_LEASE_SECONDS = 60.0
# The lease a claim without one gets: the setting idempotency.lease, in seconds.
SETTING_LEASE = """SELECT pg_catalog.date_part('epoch', COALESCE(
  pg_catalog.current_setting('idempotency.lease', true)::pg_catalog.interval,
  pg_catalog.make_interval(secs => %s)))"""


class IdempotencyError(Exception):
    """What the idempotent function raises instead of running the function."""


class InProgress(IdempotencyError):
    """Another call holds the key (after waiting up to ``wait``);
    retry_after: seconds until its lease ends, at least 1."""

    def __init__(self, key: str, retry_after: int):
        """Says which key is held, and for how long at most."""
        super().__init__(f"the work of key {key!r} is in progress elsewhere; retry in {retry_after} s")
        self.key = key
        self.retry_after = retry_after


class Mismatch(IdempotencyError):
    """The key was first used with other arguments (422 over HTTP)."""

    def __init__(self, key: str):
        """Says which key."""
        super().__init__(f"key {key!r} was used with other arguments")
        self.key = key


class FinalError(IdempotencyError):
    """A final error stored by the first call, replayed: raised when its
    class is not among ``final`` (else that class is raised again)."""

    def __init__(self, error_type: str, args: Sequence[Any]):
        """Keeps the stored error's type name and arguments."""
        super().__init__(f"{error_type}: {', '.join(map(str, args))}")
        self.error_type = error_type
        self.error_args = list(args)


class JSONSerializer:
    """The default result serializer: JSON (a result must be JSON-serializable;
    a replay gets back what JSON gives: lists for tuples, str keys)."""

    @staticmethod
    def dumps(value: Any) -> bytes:
        """Returns the result as JSON bytes."""
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()

    @staticmethod
    def loads(data: bytes) -> Any:
        """Returns the result the JSON bytes hold."""
        return json.loads(data)


def canonical_json(value: Any) -> bytes:
    """The canonical serialization of arguments, the same bytes in every
    client (clients/testdata/function-fingerprints.json): JavaScript's
    JSON.stringify with object keys sorted by UTF-16 code units and no
    spaces; ints as their digits, floats as JavaScript writes a number (1.0
    is 1, 1e21 is 1e+21); datetimes, UUIDs, decimals, bytes, sets and
    dataclasses written unambiguously; anything else is a TypeError (pass
    fingerprint=)."""
    out: List[str] = []
    _write_canonical(value, out)
    return "".join(out).encode()


def _write_canonical(value: Any, out: List[str]) -> None:
    """Appends the canonical JSON of value to out."""
    if value is None or isinstance(value, (bool, str)):
        out.append(json.dumps(value, ensure_ascii=False))
    elif isinstance(value, int):
        out.append(int.__repr__(value))
    elif isinstance(value, float):
        out.append(_js_number(value))
    elif isinstance(value, (list, tuple)):
        out.append("[")
        for i, item in enumerate(value):
            out.append("," if i else "")
            _write_canonical(item, out)
        out.append("]")
    elif isinstance(value, dict):
        fields = sorted(((_json_key(k), v) for k, v in value.items()), key=lambda f: f[0].encode("utf-16-be"))
        out.append("{")
        for i, (name, item) in enumerate(fields):
            out.append(("," if i else "") + json.dumps(name, ensure_ascii=False) + ":")
            _write_canonical(item, out)
        out.append("}")
    else:
        _write_canonical(_jsonable(value), out)


def _json_key(key: Any) -> str:
    """An object key as JSON has it: a str (ints written as their digits)."""
    if isinstance(key, str):
        return key
    if isinstance(key, int) and not isinstance(key, bool):
        return int.__repr__(key)
    raise TypeError(f"a dict key of type {type(key).__name__} has no canonical JSON form")


def _js_number(x: float) -> str:
    """x as JavaScript writes a number (ECMAScript Number::toString): the
    shortest digits that read back as x, without exponent from 1e-6 up to
    1e21, an integral value without ".0"."""
    if x != x or x in (float("inf"), float("-inf")):
        raise TypeError(f"{x} has no canonical JSON form")
    if x == 0:
        return "0"
    sign, digits, exponent = Decimal(repr(x)).normalize().as_tuple()
    s = "".join(map(str, digits))
    n = len(s) + exponent   # x = 0.s * 10**n
    if len(s) <= n <= 21:
        text = s + "0" * (n - len(s))
    elif 0 < n <= 21:
        text = s[:n] + "." + s[n:]
    elif -6 < n <= 0:
        text = "0." + "0" * -n + s
    else:
        mantissa = s[0] + ("." + s[1:] if len(s) > 1 else "")
        text = f"{mantissa}e{'+' if n > 0 else '-'}{abs(n - 1)}"
    return ("-" if sign else "") + text


def _jsonable(value: Any) -> Any:
    """What canonical_json writes for a value JSON has no form of."""
    if isinstance(value, (datetime, date, daytime)):
        return value.isoformat()
    if isinstance(value, (uuid.UUID, Decimal)):
        return str(value)
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode()
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=canonical_json)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if hasattr(value, "model_dump"):   # a pydantic model
        return value.model_dump(mode="json")
    raise TypeError(f"an argument of type {type(value).__name__} has no canonical JSON form: "
                    "pass fingerprint= to idempotent_function")


def arguments_fingerprint(arguments: dict) -> bytes:
    """The fingerprint of a call: SHA-256 of "pg-idempotency function\\n"
    and its arguments' canonical JSON, as every client makes it."""
    return hashlib.sha256(b"pg-idempotency function\n" + canonical_json(arguments)).digest()


class Run:
    """What the function gets as its first argument: the connection whose
    transaction commits with its result, the claim it runs under, and the
    recovery point and state a takeover resumes after (None on a first run)."""

    def __init__(self, work: "_Work", conn, claim: Claim):
        """A run of work's pending claim on conn."""
        self._work = work
        self.conn = conn
        self.key = work.pending.key
        self.scope = work.pending.scope
        self.fence = claim.fence
        self.attempt = claim.attempt
        self.recovery_point: Optional[str] = claim.recovery_point
        self.recovery_state: Any = claim.recovery_state

    def checkpoint(self, recovery_point: str, recovery_state: Any = None) -> None:
        """Two transactions only: commits the writes so far with a recovery
        point (and state, JSON) that a takeover gets, and renews the lease;
        the function goes on in a new transaction. ClaimLost when the lease
        was taken over."""
        self._work.require_two_transactions()
        self._work.client.checkpoint(self.key, self.fence, recovery_point, recovery_state,
                                     scope=self.scope, conn=self.conn, commit=True, begin=True)
        self.recovery_point, self.recovery_state = recovery_point, recovery_state


class AsyncRun(Run):
    """As Run, for an async function: checkpoint is awaited."""

    async def checkpoint(self, recovery_point: str, recovery_state: Any = None) -> None:
        """As Run.checkpoint."""
        self._work.require_two_transactions()
        await self._work.client.checkpoint(self.key, self.fence, recovery_point, recovery_state,
                                           scope=self.scope, conn=self.conn, commit=True, begin=True)
        self.recovery_point, self.recovery_state = recovery_point, recovery_state


class Outcome(NamedTuple):
    """What a call gave: the result, and whether it is a stored one (the function did not run)."""
    result: Any
    replayed: bool


KeyOption = Union[str, Callable[..., str]]   # a parameter's name (key) or a fixed scope, or a callable


class _Spec:
    """What idempotent_function was given, and what it makes of a call."""

    def __init__(self, fn, key: KeyOption, scope, options: contract.Options, final, serializer,
                 fingerprint):
        """Checks the options once, when the function is decorated."""
        self.fn = fn
        self.signature = inspect.signature(fn)
        if not self.signature.parameters:
            raise TypeError(f"{fn.__qualname__} must take the Run as its first parameter")
        if isinstance(key, str) and key not in list(self.signature.parameters)[1:]:
            raise TypeError(f"key={key!r} names no parameter of {fn.__qualname__}")
        self.key, self.scope, self.options = key, scope, options
        self.final = final
        self.serializer = serializer
        self.fingerprint = fingerprint or arguments_fingerprint

    def pending(self, args, kwargs) -> contract.Pending:
        """The claim a call makes: its key, scope, a token of its own and the
        fingerprint of its arguments (the Run's parameter left out)."""
        bound = self.signature.bind(None, *args, **kwargs)
        bound.apply_defaults()
        arguments = dict(list(bound.arguments.items())[1:])
        key = self.key(*args, **kwargs) if callable(self.key) else arguments[self.key]
        if not isinstance(key, str):
            raise TypeError(f"the key of {self.fn.__qualname__} must be a str, not {type(key).__name__}")
        scope = self.scope(*args, **kwargs) if callable(self.scope) else self.scope
        return contract.Pending(key, scope, None, uuid.uuid4(), self.fingerprint(arguments))

    def is_final(self, err: BaseException) -> bool:
        """True when err is stored as the work's outcome instead of releasing the key."""
        return is_final(self.final, err)

    def result_of(self, claim: Claim) -> Any:
        """Returns the stored result of a replay, or raises the stored final error."""
        body = bytes(claim.body or b"")
        if claim.status_code != ERROR_STATUS:
            return self.serializer.loads(body)
        stored = json.loads(body)
        for cls in self._final_classes():
            if _type_name(cls) == stored["type"]:
                raise cls(*stored["args"])
        raise FinalError(stored["type"], stored["args"])

    def _final_classes(self) -> Tuple[Type[BaseException], ...]:
        """The exception classes final names (none when it is a predicate)."""
        if isinstance(self.final, type):
            return (self.final,)
        return tuple(self.final) if isinstance(self.final, tuple) else ()


def is_final(final, err: BaseException) -> bool:
    """True when the final option (classes, or a predicate) makes err final;
    a FinalError replayed is final too."""
    if isinstance(err, FinalError):
        return True
    return isinstance(err, Exception) and (
        final(err) if callable(final) and not isinstance(final, type) else isinstance(err, final))


def _type_name(cls: type) -> str:
    """An exception class as the record names it."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _error_body(err: BaseException) -> bytes:
    """The record of a final error: its class and its arguments (their text
    when they are not JSON)."""
    try:
        args = json.loads(canonical_json(list(err.args)))
    except (TypeError, ValueError):
        args = [str(arg) for arg in err.args]
    return json.dumps({"type": _type_name(type(err)), "args": args}).encode()


def not_won(claim: Claim, key: str, options: contract.Options, after_lost_commit: bool) -> None:
    """Raises for a claim that must not run: in_progress, mismatch. After a
    COMMIT whose answer was lost: with two transactions, in_progress means a
    takeover (ClaimLost); with one, most likely the lost attempt's own
    transaction, not yet ended by the server (InProgress: retry later)."""
    if claim.outcome == "in_progress":
        if after_lost_commit and not options.one_transaction:
            raise ClaimLost(f"the claim of {key!r} was taken over while its COMMIT's answer was lost")
        raise InProgress(key, claim.retry_after or 1)
    if claim.outcome == "mismatch":
        raise Mismatch(key)


class _Work:
    """One call of the function: its claim, its connection, and how it ends."""

    def __init__(self, spec: _Spec, client, pending: contract.Pending):
        """A call of spec's function on client's pool."""
        self.spec, self.client, self.pending = spec, client, pending
        self.options = spec.options

    def require_two_transactions(self) -> None:
        """Refuses what only two transactions can do: one commits all at the end."""
        if self.options.one_transaction:
            raise RuntimeError("checkpoint needs two transactions (one_transaction=False): "
                               "with one, nothing commits before the result")

    def store_error_args(self, err: BaseException) -> dict:
        """The arguments of complete() for a final error."""
        return {"key": self.pending.key, "fence": self.pending.fence, "status_code": ERROR_STATUS,
                "body": _error_body(err), "scope": self.pending.scope}

    def kept_error_args(self, err: BaseException) -> dict:
        """With one transaction, the arguments of a claim that stores a final
        error by itself after the work rolled back (STORE_FINAL)."""
        o = self.options
        return {"key": self.pending.key, "fingerprint": self.pending.fingerprint,
                "status": ERROR_STATUS, "body": _error_body(err), "scope": self.pending.scope,
                "lease": o.lease, "retention": o.retention, "wait": o.wait}


# With one transaction, after a final error rolled the claim back with the
# work: claims the key again and stores the error, in one statement.
STORE_FINAL = """SELECT idempotency.complete(%(key)s, c.fence, %(status)s, %(body)s, NULL, %(scope)s)
  FROM idempotency.claim(%(key)s, %(fingerprint)s, scope => %(scope)s, lease => %(lease)s::interval,
                         retention => %(retention)s::interval, wait => %(wait)s::interval) AS c
 WHERE c.outcome OPERATOR(pg_catalog.=) 'new'"""


class _Heartbeat:
    """Extends the lease of a two-transaction claim while its function runs,
    every third of the lease, on a connection of its own."""

    def __init__(self, work: _Work):
        """Starts extending, unless the work runs in one transaction (its
        uncommitted claim holds the key until it ends: no lease to renew)."""
        self.work = work
        self.stop = threading.Event()
        self.lost: Optional[ClaimLost] = None
        self.thread = None
        if not work.options.one_transaction:
            self.thread = threading.Thread(target=self._beat, daemon=True, name="idempotency-lease")
            self.thread.start()

    def _beat(self) -> None:
        """Renews the lease until stopped or lost."""
        pending, lease = self.work.pending, self.work.options.lease
        if lease is None:
            with self.work.client.pool.connection() as conn:
                lease = timedelta(seconds=conn.execute(SETTING_LEASE, (FALLBACK_LEASE_SECONDS,)).fetchone()[0])
        period = _period(lease)
        while not self.stop.wait(period):
            try:
                self.work.client.extend(pending.key, pending.fence, self.work.options.lease,
                                        scope=pending.scope)
            except ClaimLost as lost:
                self.lost = lost
                return
            except psycopg.Error as err:
                contract.log.warning("idempotency: could not extend the lease of %r: %s", pending.key, err)

    def end(self) -> None:
        """Stops extending."""
        self.stop.set()
        if self.thread is not None:
            self.thread.join()


class _AsyncHeartbeat:
    """As _Heartbeat, as a task on the function's event loop."""

    def __init__(self, work: _Work):
        """As _Heartbeat."""
        self.work = work
        self.lost: Optional[ClaimLost] = None
        self.task = None
        if not work.options.one_transaction:
            self.task = asyncio.ensure_future(self._beat())

    async def _beat(self) -> None:
        """As _Heartbeat._beat."""
        pending, lease = self.work.pending, self.work.options.lease
        if lease is None:
            async with self.work.client.pool.connection() as conn:
                row = await (await conn.execute(SETTING_LEASE, (FALLBACK_LEASE_SECONDS,))).fetchone()
                lease = timedelta(seconds=row[0])
        period = _period(lease)
        while True:
            await asyncio.sleep(period)
            try:
                await self.work.client.extend(pending.key, pending.fence, self.work.options.lease,
                                              scope=pending.scope)
            except ClaimLost as lost:
                self.lost = lost
                return
            except psycopg.Error as err:
                contract.log.warning("idempotency: could not extend the lease of %r: %s", pending.key, err)

    async def end(self) -> None:
        """As _Heartbeat.end."""
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass


def _period(lease: timedelta) -> float:
    """How often a lease is renewed: a third of it."""
    return lease.total_seconds() / 3


def _run_sync(spec: _Spec, client: Client, args, kwargs) -> "Outcome":
    """One call of a blocking function: claim, run, then commit with the
    result; after a COMMIT whose answer was lost, the claim asked again
    with the token says what happened (replay: it committed; new: run again)."""
    work = _Work(spec, client, spec.pending(args, kwargs))
    held = flow.Held(client.pool)
    try:
        asked_again = False
        for _ in range(1 + contract.RERUNS):
            claim, _ = flow.claim_answered(client, work.pending, work.options, held.take,
                                               held.give_back, client.pool.check)
            if claim.outcome == "replay":
                return Outcome(spec.result_of(claim), True)
            not_won(claim, work.pending.key, work.options, asked_again)
            work.pending = work.pending._replace(fence=claim.fence)
            result, lost = _run_once(work, held, claim, args, kwargs)
            if lost is None:
                return Outcome(result, False)
            asked_again = True
        raise lost
    finally:
        held.give_back()


def _run_once(work: _Work, held: flow.Held, claim: Claim, args, kwargs):
    """Runs the function under claim and ends its transaction: returns
    (result, None), or (None, the error) when the COMMIT's answer was lost
    and it must be claimed again."""
    heartbeat = _Heartbeat(work)
    try:
        result = work.spec.fn(Run(work, held.conn, claim), *args, **kwargs)
    except BaseException as err:
        heartbeat.end()
        _end_failed(work, held.conn, err)
        raise
    heartbeat.end()
    if heartbeat.lost is not None:
        flow.abandon(work.client, held.conn, work.pending, work.options)
        raise heartbeat.lost
    try:
        work.client.complete(work.pending.key, work.pending.fence, RESULT_STATUS,
                             work.spec.serializer.dumps(result), scope=work.pending.scope,
                             conn=held.conn, commit=True)
        return result, None
    except ClaimLost:
        flow.abandon(work.client, held.conn, work.pending, work.options)
        raise
    except psycopg.Error as err:
        if not contract.answer_lost(err):
            flow.abandon(work.client, held.conn, work.pending, work.options)
            raise
        contract.log.warning("idempotency: the COMMIT of %r lost its answer; claiming again", work.pending.key)
        return None, err


def _end_failed(work: _Work, conn, err: BaseException) -> None:
    """After the function raised: its writes roll back; a final error is
    stored as the outcome, any other releases the key."""
    if not work.spec.is_final(err):
        flow.abandon(work.client, conn, work.pending, work.options)
        return
    try:
        conn.rollback()
        if work.options.one_transaction:
            with conn.cursor() as cur:   # the claim rolled back too: claim and store again
                cur.execute(STORE_FINAL, work.kept_error_args(err), prepare=False)
        else:
            work.client.complete(**work.store_error_args(err), conn=conn, commit=True)
    except psycopg.Error as store_err:
        contract.log.error("idempotency: could not store the final error of %r: %s",
                           work.pending.key, store_err)
        flow.abandon(work.client, conn, work.pending, work.options)


async def _run_async(spec: _Spec, client: AsyncClient, args, kwargs) -> "Outcome":
    """As _run_sync, for an async function."""
    work = _Work(spec, client, spec.pending(args, kwargs))
    held = flow.AsyncHeld(client.pool)
    try:
        asked_again = False
        for _ in range(1 + contract.RERUNS):
            claim, _ = await flow.aclaim_answered(client, work.pending, work.options, held.take,
                                                      held.give_back, client.pool.check)
            if claim.outcome == "replay":
                return Outcome(spec.result_of(claim), True)
            not_won(claim, work.pending.key, work.options, asked_again)
            work.pending = work.pending._replace(fence=claim.fence)
            result, lost = await _arun_once(work, held, claim, args, kwargs)
            if lost is None:
                return Outcome(result, False)
            asked_again = True
        raise lost
    finally:
        await held.give_back()


async def _arun_once(work: _Work, held: flow.AsyncHeld, claim: Claim, args, kwargs):
    """As _run_once, for an async function."""
    heartbeat = _AsyncHeartbeat(work)
    try:
        result = await work.spec.fn(AsyncRun(work, held.conn, claim), *args, **kwargs)
    except BaseException as err:
        await heartbeat.end()
        await _aend_failed(work, held.conn, err)
        raise
    await heartbeat.end()
    if heartbeat.lost is not None:
        await flow.aabandon(work.client, held.conn, work.pending, work.options)
        raise heartbeat.lost
    try:
        await work.client.complete(work.pending.key, work.pending.fence, RESULT_STATUS,
                                   work.spec.serializer.dumps(result), scope=work.pending.scope,
                                   conn=held.conn, commit=True)
        return result, None
    except ClaimLost:
        await flow.aabandon(work.client, held.conn, work.pending, work.options)
        raise
    except psycopg.Error as err:
        if not contract.answer_lost(err):
            await flow.aabandon(work.client, held.conn, work.pending, work.options)
            raise
        contract.log.warning("idempotency: the COMMIT of %r lost its answer; claiming again", work.pending.key)
        return None, err


async def _aend_failed(work: _Work, conn, err: BaseException) -> None:
    """As _end_failed, for an async function."""
    if not work.spec.is_final(err):
        await flow.aabandon(work.client, conn, work.pending, work.options)
        return
    try:
        await conn.rollback()
        if work.options.one_transaction:
            async with conn.cursor() as cur:
                await cur.execute(STORE_FINAL, work.kept_error_args(err), prepare=False)
        else:
            await work.client.complete(**work.store_error_args(err), conn=conn, commit=True)
    except psycopg.Error as store_err:
        contract.log.error("idempotency: could not store the final error of %r: %s",
                           work.pending.key, store_err)
        await flow.aabandon(work.client, conn, work.pending, work.options)


def idempotent_function(pool, *, key: KeyOption, scope: Optional[KeyOption] = None,
                        one_transaction: bool = True, lease: Union[timedelta, float, None] = None,
                        retention: contract.Interval = None, wait: contract.Interval = None,
                        final: Union[Type[BaseException], Tuple[Type[BaseException], ...],
                                     Callable[[BaseException], bool]] = (),
                        serializer: Any = JSONSerializer, fingerprint: Optional[Callable[[dict], bytes]] = None,
                        tracer_provider: Any = None):
    """Makes a function run once per key (see the module's documentation);
    its ``outcome(...)`` also says whether the result was a stored one.

    pool: a psycopg_pool ConnectionPool (AsyncConnectionPool for an async
    function) on a database with the extension. key: the name of the
    parameter that holds the key, or a callable of the call's arguments that
    returns it; scope: a fixed string or such a callable (None: the
    idempotency.scope setting). lease: a timedelta or seconds (None: the
    database's idempotency.lease, renewed by its own length); retention and
    wait: intervals (one transaction waits 2 seconds unless told). final: the
    exception classes (or a predicate) stored as the outcome, raised again to
    every duplicate; any other exception releases the key. serializer: dumps
    and loads of the result (JSON). fingerprint: a callable of the arguments
    (a dict by name) returning at most 64 bytes, instead of their canonical JSON's SHA-256.
    """
    if lease is not None and not isinstance(lease, timedelta):
        lease = timedelta(seconds=lease)
    options = contract.Options(lease=lease, retention=retention, wait=wait,
                               one_transaction=one_transaction, tracer_provider=tracer_provider)

    def decorate(fn):
        """Wraps fn."""
        spec = _Spec(fn, key, scope, options, final, serializer, fingerprint)
        if inspect.iscoroutinefunction(fn):
            client = AsyncClient(pool, tracer_provider=tracer_provider)

            async def outcome(*args, **kwargs) -> Outcome:
                """Runs fn once per key; says whether the result was stored."""
                return await _run_async(spec, client, args, kwargs)

            @functools.wraps(fn)
            async def run_async(*args, **kwargs):
                """Runs fn once per key."""
                return (await outcome(*args, **kwargs)).result
            run_async.outcome = outcome
            return run_async
        client = Client(pool, tracer_provider=tracer_provider)

        def outcome(*args, **kwargs) -> Outcome:
            """Runs fn once per key; says whether the result was stored."""
            return _run_sync(spec, client, args, kwargs)

        @functools.wraps(fn)
        def run_sync(*args, **kwargs):
            """Runs fn once per key."""
            return outcome(*args, **kwargs).result
        run_sync.outcome = outcome
        return run_sync
    return decorate
