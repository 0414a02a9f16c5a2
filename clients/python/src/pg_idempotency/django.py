"""Django middleware: Idempotency-Key on the idempotency PostgreSQL extension,
through Django's own database connection (the postgresql backend on psycopg 3).

    MIDDLEWARE = [..., "pg_idempotency.django.IdempotencyMiddleware", ...]
    IDEMPOTENCY = {"lease": "60 seconds"}          # optional: see contract.Options, plus "using"

For each covered request it claims the key in autocommit (committed at
once, so that a concurrent retry sees it), then runs the view inside
``transaction.atomic()`` and stores the view's response with
idempotency.complete() in that same transaction: the view's ORM writes and
the stored response commit together. A 5xx or a view that raised rolls back.

It is sync and async capable. Under ASGI the rest of the chain is awaited on
the event loop; the middleware's own database work (the claim, the atomic
block, complete) runs through Django's thread-sensitive executor on the
request's connection, where the async ORM (``await Model.objects.acreate()``)
and ``sync_to_async`` code of the view run too, so their writes are in the
block. A view cancelled there (the client went away) rolls back and releases
the key.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from typing import NamedTuple, Optional

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.db import DatabaseError, connections, transaction
from django.http import HttpResponse
from django.utils.module_loading import import_string

from . import contract, flow
from .client import Claim, Client, _first_column

IK001 = "IK001"


class _Attempt(NamedTuple):
    """One run of the view in its transaction: its response and body, whether
    it failed (rolled back), or the DatabaseError that ended the transaction.
    With one transaction also the claim made in it (pending), and whether the
    claim answered instead of the view (settled) or the view must run
    unguarded (fail_open after a failed claim)."""
    response: Optional[HttpResponse] = None
    body: bytes = b""
    failed: bool = False
    error: Optional[DatabaseError] = None
    pending: Optional[contract.Pending] = None
    settled: bool = False
    unguarded: bool = False


class _Step(NamedTuple):
    """What follows an attempt: the response to send, or the claim to run again with."""
    response: Optional[HttpResponse] = None
    pending: Optional[contract.Pending] = None
    lost: Optional[DatabaseError] = None
    claim_lost: bool = False   # one transaction: the answer lost was the claim's


class IdempotencyMiddleware:
    """Guards the project's POST and PATCH requests with Idempotency-Key.
    Settings: IDEMPOTENCY, a dict of contract.Options and "using" (the
    database alias, default "default"); "scope", "exempt", "redact",
    "source" and "tracer_provider" may be dotted paths."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        """Reads settings.IDEMPOTENCY once, when Django loads the middleware."""
        self.get_response = get_response
        self.async_mode = iscoroutinefunction(get_response)
        if self.async_mode:
            markcoroutinefunction(self)
        options = dict(getattr(settings, "IDEMPOTENCY", {}))
        self.using = options.pop("using", "default")
        for name in ("scope", "exempt", "tracer_provider", "redact", "source"):
            if isinstance(options.get(name), str):
                options[name] = import_string(options[name])
        self.options = contract.Options(**options)
        if self.options.prepare:
            raise ValueError("prepare is not an option of the Django middleware: its statements follow "
                             "the OPTIONS of DATABASES (server_side_binding, prepare_threshold)")
        self.calls = _DjangoClient(self.using, self.options.tracer_provider)

    def __call__(self, request):
        """Serves one request: covered methods are guarded."""
        if self.async_mode:
            return self.__acall__(request)
        if not contract.covers(self.options, request.method, request):
            return self.get_response(request)
        answer, pending = self._begin(request)
        if answer is not None:
            return answer
        tries = _Tries(pending)
        for pending, again in tries:
            if tries.settled(self._settle(request, pending, self._attempt(request, pending, again))):
                return tries.step.response
        if self._run_unguarded(tries):
            return self._settle(request, tries.pending, self._attempt(request, tries.pending)).response
        return self._give_up(tries)

    async def __acall__(self, request):
        """Serves one request under ASGI: as __call__, the view awaited."""
        if not contract.covers(self.options, request.method, request):
            return await self.get_response(request)
        begin = asyncio.ensure_future(sync_to_async(self._begin)(request))
        try:
            answer, pending = await asyncio.shield(begin)
        except asyncio.CancelledError:
            # The claim runs on to its end on the request's thread: free it.
            _, pending = await begin
            if pending is not None:
                await sync_to_async(self._abandon)(pending)
            raise
        if answer is not None:
            return answer
        tries = _Tries(pending)
        for pending, again in tries:
            attempt = await self._aattempt(request, pending, again)
            if tries.settled(await sync_to_async(self._settle)(request, pending, attempt)):
                return tries.step.response
        if self._run_unguarded(tries):
            attempt = await self._aattempt(request, tries.pending)
            return (await sync_to_async(self._settle)(request, tries.pending, attempt)).response
        return await sync_to_async(self._give_up)(tries)

    def process_exception(self, request, exception):
        """Notes that the view raised: its key is released whatever Django answers."""
        request._idempotency_raised = True

    def _begin(self, request):
        """Reads the key and claims it: returns (the answer, None) when the
        view must not run, else (None, the claim to run it under)."""
        headers = [(name.lower(), value.encode("latin-1")) for name, value in request.headers.items()]
        try:
            body = request.body
        except RequestDataTooBig:
            return _response(contract.problem("request_body_too_large")), None
        key, scope, refusal = contract.identify(self.options, request, headers, body)
        if refusal:
            return _response(refusal), None
        if key is None:
            return None, contract.Pending()
        pending = contract.Pending(key, scope, None, uuid.uuid4(),
                                   contract.wsgi_fingerprint(request.META, request.method, body))
        if self.options.one_transaction:
            return None, pending   # claimed in the view's block
        try:
            claim = self._claim(pending)
        except DatabaseError as err:
            refusal = contract.refused_key(err.__cause__) if _sqlstate(err) else None
            if refusal or not self.options.fail_open:
                return _response(refusal or contract.unavailable(err)), None
            contract.log.error("idempotency: running unguarded: %s", err)
            return None, contract.Pending()
        answer = contract.answer_claim(claim)
        if answer:
            return _response(answer), None
        return None, pending._replace(fence=claim.fence)

    def _attempt(self, request, pending: contract.Pending, again: bool = False) -> _Attempt:
        """Runs the view in a transaction that commits with its stored response
        (with one transaction, after the claim in that transaction; again:
        the claim of the attempt before lost its answer)."""
        attempt = _Attempt(pending=pending)
        try:
            with transaction.atomic(using=self.using):
                attempt = self._claim_in_block(request, pending, again)
                if attempt.settled or attempt.unguarded:
                    return attempt
                pending = attempt.pending
                response = self.get_response(request)
                attempt = _Attempt(response, _content(response), pending=pending)
                attempt = self._store(request, attempt)
            return attempt   # the block committed (a failed COMMIT: below, with this attempt)
        except DatabaseError as err:
            return attempt._replace(error=err)

    async def _aattempt(self, request, pending: contract.Pending, again: bool = False) -> _Attempt:
        """As _attempt, the view awaited between entering and leaving the
        block on the request's thread; a view cancelled or raising past
        Django rolls back and releases the key."""
        atomic = transaction.atomic(using=self.using)
        await sync_to_async(atomic.__enter__)()
        attempt = _Attempt(pending=pending)
        try:
            attempt = await sync_to_async(self._claim_in_block)(request, pending, again)
            if not (attempt.settled or attempt.unguarded):
                pending = attempt.pending
                response = await self.get_response(request)
                attempt = _Attempt(response, await _acontent(response), pending=pending)
                attempt = await sync_to_async(self._store)(request, attempt)
        except BaseException as err:
            # One call, so that it runs to its end even if this task is cancelled again.
            await sync_to_async(self._leave_failed)(atomic, err, attempt.pending)
            if isinstance(err, DatabaseError):
                return attempt._replace(error=err)
            raise
        try:
            await sync_to_async(atomic.__exit__)(None, None, None)
        except DatabaseError as err:
            return attempt._replace(error=err)
        return attempt

    def _claim_in_block(self, request, pending: contract.Pending, again: bool = False) -> _Attempt:
        """With one transaction, in the view's block: claims the key (again:
        after a claim whose answer was lost). Returns the attempt to go
        on with (its pending holds the fence), or one settled by the claim's
        answer (its transaction rolls back: the view's own response when it
        replays what the view stored before a lost COMMIT), or one to run
        unguarded; raises when the claim's answer is lost."""
        if not (self.options.one_transaction and pending.key is not None):
            return _Attempt(pending=pending)
        try:
            claim = self._claim_once(pending)
        except DatabaseError as err:
            transaction.set_rollback(True, using=self.using)
            if contract.answer_lost(err.__cause__):
                raise
            refusal = contract.refused_key(err.__cause__) if _sqlstate(err) else None
            if refusal or not self.options.fail_open:
                return _Attempt(_response(refusal or contract.unavailable(err)), settled=True)
            contract.log.error("idempotency: running unguarded: %s", err)
            return _Attempt(unguarded=True)
        answer = contract.answer_claim(claim, asked_again=again)
        if answer:
            transaction.set_rollback(True, using=self.using)
            if contract.own_replay(claim, pending.stored):
                return _Attempt(request._idempotency_ran, settled=True)
            return _Attempt(_response(answer), settled=True)
        return _Attempt(pending=pending._replace(fence=claim.fence))

    def _leave_failed(self, atomic, err: BaseException, pending: contract.Pending) -> None:
        """Leaves the block after err (it rolls back); what is not a database
        error (a cancellation) also releases the key."""
        try:
            atomic.__exit__(type(err), err, err.__traceback__)
        except DatabaseError as exit_err:
            contract.log.error("idempotency: could not roll back %r: %s", pending.key, exit_err)
        if not isinstance(err, DatabaseError):
            self._abandon(pending)

    def _store(self, request, attempt: _Attempt) -> _Attempt:
        """In the view's block: marks a failed view's writes for rollback, or
        stores its response with complete(); returns the attempt, failed or
        not (a redact option that raised fails it: its answer is a 500)."""
        response = attempt.response
        if _failed(request, response):
            transaction.set_rollback(True, using=self.using)
            return attempt._replace(failed=True)
        if attempt.pending.fence is not None:
            try:
                attempt = attempt._replace(pending=contract.with_stored(attempt.pending, contract.Answer(
                    response.status_code, list(response.items()), attempt.body), self.options))
                self._complete(attempt.pending)
            except contract.RedactFailed as err:
                transaction.set_rollback(True, using=self.using)
                request._idempotency_raised = True   # released, not stored
                return attempt._replace(response=_response(contract.redact_failed(attempt.pending, err)),
                                        failed=True)
        return attempt

    def _settle(self, request, pending: contract.Pending, attempt: _Attempt) -> _Step:
        """After an attempt: the response to send, or the claim to run the view
        again under (the attempt's COMMIT, or claim, lost its answer)."""
        if attempt.settled:
            return _Step(attempt.response)
        if attempt.unguarded:
            return _Step(None, contract.Pending())
        pending = attempt.pending or pending
        err = attempt.error
        if err is None:
            if attempt.failed:
                self._abandon(pending, _failure(request, attempt))
            return _Step(attempt.response)
        if _sqlstate(err) == IK001:
            return _Step(_response(contract.claim_lost()))
        if self.options.one_transaction:
            request._idempotency_ran = attempt.response   # what a replay of its own sends
            return self._settle_lost(pending, err)
        if pending.fence is None or not contract.answer_lost(err.__cause__):
            self._abandon(pending)
            return _Step(_response(contract.unavailable(err)))
        return self._reclaim(request, pending, attempt.response, err)

    def _reclaim(self, request, pending: contract.Pending, response, lost: DatabaseError) -> _Step:
        """Two transactions, after a COMMIT whose answer was lost: claims again
        with the token (flow.after_reclaim): replay means it committed (the
        view's response goes out), new that it rolled back (the view runs again)."""
        try:
            claim = self._claim(pending)
        except DatabaseError as again:
            return _Step(_response(contract.outcome_unknown(again)))
        after, pending = flow.after_reclaim(claim, pending, response, self.options)
        if after is not None:
            return _Step(response if after is response else _response(after))
        request._idempotency_raised = False
        return _Step(None, pending, lost)

    def _settle_lost(self, pending: contract.Pending, err: DatabaseError) -> _Step:
        """With one transaction, after the block failed: nothing of it
        committed but when its COMMIT's answer was lost, so the attempt runs
        again on a fresh connection and its claim tells: replay (it committed,
        or a duplicate did after it) or new (the view runs again)."""
        if pending.key is None or not contract.answer_lost(err.__cause__):
            return _Step(_response(contract.unavailable(err)))
        connections[self.using].close()
        contract.log.warning("idempotency: the transaction of %r lost its answer; claiming again", pending.key)
        return _Step(None, pending._replace(fence=None), err, claim_lost=pending.fence is None)

    def _run_unguarded(self, tries: "_Tries") -> bool:
        """After contract.RERUNS claims that lost their answers (one
        transaction: nothing ran), fail_open runs the view unguarded."""
        if tries.may_have_run or not self.options.fail_open:
            return False
        contract.log.error("idempotency: running unguarded: %s", tries.step.lost)
        tries.pending = contract.Pending()
        return True

    def _give_up(self, tries: "_Tries") -> HttpResponse:
        """After contract.RERUNS attempts that lost their answers: 503. When
        only claims lost theirs (one transaction), nothing ran; else the key
        is released, and whether the request took effect is not known."""
        if not tries.may_have_run:
            return _response(contract.unavailable(tries.step.lost))
        self._abandon(tries.pending)
        return _response(contract.outcome_unknown(tries.step.lost))

    def _abandon(self, pending: contract.Pending, failed: Optional[contract.Answer] = None) -> None:
        """Ends the claim after its writes rolled back (flow.end_claim)."""
        flow.end_claim(self.calls, None, pending, self.options, failed, DJANGO_ERRORS)

    def _claim(self, pending: contract.Pending) -> Claim:
        """Claims with the request's token in autocommit (it commits at once);
        when the answer is lost, asks again on a fresh connection
        (flow.claim_answered)."""
        claim, _ = flow.claim_answered(self.calls, pending, self.options, _nothing,
                                       connections[self.using].close, _nothing, DJANGO_ERRORS)
        return claim

    def _claim_once(self, pending: contract.Pending) -> Claim:
        """One claim on Django's connection."""
        return self.calls.claim(pending.key, pending.fingerprint, scope=pending.scope,
                                lease=self.options.lease, retention=self.options.retention,
                                wait=self.options.wait, token=pending.token)

    def _complete(self, pending: contract.Pending) -> str:
        """Stores pending.stored with complete() on Django's connection."""
        stored = pending.stored
        return self.calls.complete(pending.key, pending.fence, stored.status, stored.body, stored.headers,
                                   scope=pending.scope)


class _DjangoClient(Client):
    """Client's calls, and their spans, on Django's connection: in
    autocommit, or in the atomic block they are called in. A failure raises
    Django's DatabaseError (IK001 too: DJANGO_ERRORS tells it apart)."""

    def __init__(self, using: str, tracer_provider=None):
        """Calls on the connection of database alias using."""
        super().__init__(None, tracer_provider=tracer_provider)
        self.using = using

    def _call(self, conn, commit: bool, sql: str, params, row_factory=_first_column, begin: bool = False):
        """Runs one of the extension's functions on Django's connection (conn,
        commit and begin are the block's, or autocommit's, to decide)."""
        with connections[self.using].cursor() as cursor:
            cursor.execute(sql, params)
            values = cursor.fetchone()
            row = None if values is None else row_factory(cursor.cursor)(values)
        return _loaded(row) if isinstance(row, Claim) else row


def _loaded(claim: Claim) -> Claim:
    """The claim with its stored headers as a dict and its body as bytes
    (Django loads jsonb as text)."""
    headers = json.loads(claim.headers) if isinstance(claim.headers, str) else claim.headers
    body = None if claim.body is None else bytes(claim.body)
    return dataclasses.replace(claim, headers=headers, body=body)


class _Tries:
    """The attempts of one request, at most 1 + contract.RERUNS, each after
    the last lost its answer: iterates (pending, again: the last attempt's
    claim lost its answer); whether the view may have run so far."""

    def __init__(self, pending: contract.Pending):
        """Starts with the claim made before the first attempt."""
        self.pending = pending
        self.step = _Step()
        self.may_have_run = False

    def __iter__(self):
        """Yields the claim of each attempt until one settles or none is left."""
        for _ in range(1 + contract.RERUNS):
            yield self.pending, self.step.claim_lost

    def settled(self, step: _Step) -> bool:
        """Takes an attempt's step: True when it has the response to send."""
        self.step = step
        if step.response is not None:
            return True
        self.may_have_run = self.may_have_run or not step.claim_lost
        self.pending = step.pending
        return False


def _nothing() -> None:
    """Nothing to take or recheck: Django's connection is the request's."""


def _failure(request, attempt: _Attempt) -> Optional[contract.Answer]:
    """The 5xx a failed view answered, for complete (it is released, or
    kept with idempotency.store_server_errors); None when it raised or did
    not finish (the key is released)."""
    status = attempt.response.status_code
    if getattr(request, "_idempotency_raised", False) or status < 500:
        return None
    return contract.Answer(status, list(attempt.response.items()), attempt.body)


def _failed(request, response) -> bool:
    """True when the view raised, answered 5xx, or did not finish (a 408
    from a timeout inside): its writes roll back."""
    return (getattr(request, "_idempotency_raised", False) or response.status_code >= 500
            or contract.unfinished(response.status_code))


def _content(response) -> bytes:
    """Returns the whole body; a streamed response is read and kept for sending."""
    if getattr(response, "streaming", False):
        body = b"".join(response.streaming_content)
        response.streaming_content = [body]
        return body
    return response.content


async def _acontent(response) -> bytes:
    """As _content, for a response that may stream asynchronously."""
    if getattr(response, "is_async", False):
        body = b"".join([chunk async for chunk in response.streaming_content])
        response.streaming_content = [body]
        return body
    return await sync_to_async(_content)(response)


def _sqlstate(err: DatabaseError) -> Optional[str]:
    """The SQLSTATE of psycopg's error under Django's."""
    return getattr(err.__cause__, "sqlstate", None)


# How the flow tells Django's errors apart: psycopg's error is the cause.
DJANGO_ERRORS = flow.Errors(DatabaseError, lambda err: contract.answer_lost(err.__cause__), _sqlstate)


def _response(answer: contract.Answer) -> HttpResponse:
    """Turns an answer of the contract into a Django response with exactly its headers."""
    response = HttpResponse(answer.body, status=answer.status)
    del response["Content-Type"]
    for name, value in answer.headers:
        if name.lower() in response.headers and name.lower() != "content-type":
            response.headers[name] = response.headers[name] + ", " + value
        else:
            response.headers[name] = value
    return response
