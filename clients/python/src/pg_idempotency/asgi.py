"""ASGI middleware (FastAPI, Starlette, any ASGI app): Idempotency-Key on
the idempotency PostgreSQL extension.

For each covered request it reads the body, takes a connection from the
pool, claims the key (committed at once, so that a concurrent retry sees
it), and runs the app with the connection in a transaction at
``request.state.db`` (``scope["state"]["db"]``). It holds the app's response
back, stores it with idempotency.complete() in that transaction and commits,
and only then sends it: the business writes and the stored response commit
together.
"""

from __future__ import annotations

import uuid
from typing import List, Optional, Tuple
from urllib.parse import quote

import psycopg

from . import contract, flow
from .client import AsyncClient, Claim, ClaimLost, _idle


class IdempotencyMiddleware:
    """Guards the app's POST and PATCH requests with Idempotency-Key."""

    def __init__(self, app, *, pool, **options):
        """pool: an open psycopg_pool.AsyncConnectionPool; options: see contract.Options."""
        self.app = app
        self.pool = pool
        self.options = contract.Options(**options)
        self.client = AsyncClient(pool, tracer_provider=self.options.tracer_provider,
                                  prepare=self.options.prepare)

    async def __call__(self, scope, receive, send):
        """Serves one ASGI connection: covered HTTP requests are guarded."""
        if scope["type"] != "http" or not contract.covers(self.options, scope["method"], scope):
            await self.app(scope, receive, send)
            return
        headers = [(name.decode("latin-1").lower(), value) for name, value in scope["headers"]]
        body = await _read_body(receive)
        if body is None:
            return  # the client went away before sending its body
        key, key_scope, refusal = contract.identify(self.options, scope, headers, body)
        if refusal:
            await _send(send, refusal)
            return
        held = flow.AsyncHeld(self.pool, self.client.prepare)
        try:
            answer = await self._serve(held, key, key_scope, scope, body, receive)
            if answer is not None:
                # The answer first: with one transaction, a replay's ROLLBACK comes after it.
                await _send(send, answer)
                return
        finally:
            await held.give_back()
        # fail_open without a connection
        await self.app(_with_db(scope, None), _replayed(body, receive), send)

    async def _serve(self, held: flow.AsyncHeld, key: Optional[str], key_scope: str,
                     scope, body: bytes, receive) -> Optional[contract.Answer]:
        """Claims the key (in key_scope) and runs the app when it is new; returns the answer to send."""
        pending = contract.Pending()
        if key is not None:
            pending = contract.Pending(key, key_scope, None, uuid.uuid4(), _fingerprint(scope, body))
            try:
                claim, asked_again = await self._claim(held, pending)
            except psycopg.Error as err:
                refusal = contract.refused_key(err)
                if refusal or not self.options.fail_open:
                    return refusal or contract.unavailable(err)
                contract.log.error("idempotency: running unguarded: %s", err)
                pending = contract.Pending()
                await held.give_back()   # its transaction may be aborted
            else:
                answer = contract.answer_claim(claim, asked_again and self.options.one_transaction)
                if answer:
                    return answer
                pending = pending._replace(fence=claim.fence)
        if held.conn is None:
            try:
                await held.take()
            except psycopg.Error as err:
                if not self.options.fail_open:
                    return contract.unavailable(err)
                contract.log.error("idempotency: running unguarded: %s", err)
                return None
        return await self._run(held, pending, scope, body, receive)

    async def _run(self, held: flow.AsyncHeld, pending: contract.Pending, scope, body: bytes,
                   receive) -> contract.Answer:
        """Runs the app on held.conn and ends its transaction; when the
        COMMIT's answer is lost, claims again with the token: replay means it
        committed (the app's answer goes out; with one transaction, the
        response stored, which may be a duplicate's that ran after ours
        rolled back), new that it rolled back (the app runs again)."""
        for _ in range(1 + contract.RERUNS):
            response = _Captured()
            try:
                if _idle(held.conn):   # unguarded: no claim began the transaction
                    await held.conn.execute("BEGIN", prepare=False)
                await self.app(_with_db(scope, held.conn), _replayed(body, receive), response.send)
                answer = response.answer()
            except BaseException:
                await self._abandon(held.conn, pending)
                raise
            if contract.unfinished(answer.status) or answer.status >= 500:
                await self._abandon(held.conn, pending, None if answer.status < 500 else answer)
                return answer
            try:
                pending = contract.with_stored(pending, answer, self.options)
                await self._commit(held.conn, pending)
                return answer
            except ClaimLost:
                # Its writes roll back when the connection goes back, before the answer goes out.
                return contract.claim_lost()
            except contract.RedactFailed as err:
                await self._abandon(held.conn, pending)
                return contract.redact_failed(pending, err)
            except psycopg.Error as err:
                if pending.fence is None or not contract.answer_lost(err):
                    await self._abandon(held.conn, pending)
                    return contract.unavailable(err)
                lost = err
            try:
                claim, _ = await self._claim(held, pending)
            except psycopg.Error as err:
                return contract.outcome_unknown(err)
            after, pending = flow.after_reclaim(claim, pending, answer, self.options)
            if after is not None:
                return after
        await self._abandon(held.conn, pending)
        return contract.outcome_unknown(lost)

    async def _claim(self, held: flow.AsyncHeld, pending: contract.Pending) -> Tuple[Claim, bool]:
        """Claims with the request's token on a fresh connection (flow.aclaim_answered)."""
        return await flow.aclaim_answered(self.client, pending, self.options, held.take, held.give_back,
                                          self.pool.check)

    async def _commit(self, conn, pending: contract.Pending) -> None:
        """Stores pending.stored with complete() and commits the app's transaction."""
        if pending.fence is None:
            await conn.commit()
            return
        stored = pending.stored
        await self.client.complete(pending.key, pending.fence, stored.status, stored.body, stored.headers,
                                   scope=pending.scope, conn=conn, commit=True)

    async def _abandon(self, conn, pending: contract.Pending,
                       failed: Optional[contract.Answer] = None) -> None:
        """Rolls the app's writes back and ends the claim (flow.aabandon)."""
        await flow.aabandon(self.client, conn, pending, self.options, failed)


class _Captured:
    """The app's response, held back until its transaction has committed."""

    def __init__(self):
        """Starts with nothing sent."""
        self.start = None
        self.chunks: List[bytes] = []

    async def send(self, message) -> None:
        """Keeps what the app sends instead of sending it."""
        if message["type"] == "http.response.start":
            self.start = message
        elif message["type"] == "http.response.body":
            self.chunks.append(message.get("body", b""))

    def answer(self) -> contract.Answer:
        """Returns the whole response; raises if the app sent none."""
        if self.start is None:
            raise RuntimeError("the ASGI app returned without a response")
        headers = [(name.decode("latin-1"), value.decode("latin-1"))
                   for name, value in self.start.get("headers", [])]
        return contract.Answer(self.start["status"], headers, b"".join(self.chunks))


async def _read_body(receive) -> Optional[bytes]:
    """Reads the whole request body; None when the client disconnects first."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replayed(body: bytes, receive):
    """Returns a receive callable that hands the app the body already read."""
    sent = False

    async def replay():
        """The body first, then whatever the server says (a disconnect)."""
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}
    return replay


def _with_db(scope, conn):
    """Returns a copy of scope whose state holds the request's connection."""
    return {**scope, "state": {**scope.get("state", {}), "db": conn}}


def _fingerprint(scope, body: bytes) -> bytes:
    """Returns the fingerprint of the request as sent: raw path, query and body."""
    raw = scope.get("raw_path")
    if raw is None:
        raw = quote(scope["path"], safe=contract.PATH_CHARS).encode()
    path, _ = contract.split_target(raw)
    return contract.request_fingerprint(scope["method"], path, scope.get("query_string"), body)


async def _send(send, answer: contract.Answer) -> None:
    """Sends an answer, with its Content-Length."""
    headers = [(name.encode("latin-1"), value.encode("latin-1"))
               for name, value in answer.headers if name.lower() != "content-length"]
    headers.append((b"content-length", str(len(answer.body)).encode()))
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body})
