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

from typing import List, Optional
from urllib.parse import quote

import psycopg

from . import contract
from .client import AsyncClient, ClaimLost


class IdempotencyMiddleware:
    """Guards the app's POST and PATCH requests with Idempotency-Key."""

    def __init__(self, app, *, pool, **options):
        """pool: an open psycopg_pool.AsyncConnectionPool; options: see contract.Options."""
        self.app = app
        self.pool = pool
        self.client = AsyncClient(pool)
        self.options = contract.Options(**options)

    async def __call__(self, scope, receive, send):
        """Serves one ASGI connection: covered HTTP requests are guarded."""
        if scope["type"] != "http" or scope["method"] not in self.options.methods:
            await self.app(scope, receive, send)
            return
        headers = [(name.decode("latin-1").lower(), value) for name, value in scope["headers"]]
        key, refusal = contract.read_key(headers, self.options)
        if refusal:
            await _send(send, refusal)
            return
        body = await _read_body(receive)
        if body is None:
            return  # the client went away before sending its body
        try:
            conn = await self.pool.getconn()
        except psycopg.Error as err:
            if not self.options.fail_open:
                await _send(send, contract.unavailable(err))
                return
            contract.log.error("idempotency: running unguarded: %s", err)
            await self.app(_with_db(scope, None), _replayed(body, receive), send)
            return
        autocommit = conn.autocommit
        try:
            await conn.set_autocommit(False)
            answer = await self._serve(conn, key, headers, scope, body, receive)
        finally:
            await _reset(conn, autocommit)
            await self.pool.putconn(conn)
        await _send(send, answer)

    async def _serve(self, conn, key: Optional[str], headers: contract.Headers,
                     scope, body: bytes, receive) -> contract.Answer:
        """Claims the key and runs the app when it is new; returns the answer to send."""
        pending = contract.Pending()
        if key is not None:
            claim_scope = self.options.scope(scope) if self.options.scope else contract.credential_scope(headers)
            try:
                claim = await self.client.claim(
                    key, _fingerprint(scope, body), scope=claim_scope, lease=self.options.lease,
                    retention=self.options.retention, conn=conn, commit=True)
            except psycopg.Error as err:
                refusal = contract.refused_key(err)
                if refusal or not self.options.fail_open:
                    return refusal or contract.unavailable(err)
                contract.log.error("idempotency: running unguarded: %s", err)
            else:
                answer = contract.answer_claim(claim)
                if answer:
                    return answer
                pending = contract.Pending(key, claim_scope, claim.fence)
        response = _Captured()
        try:
            await self.app(_with_db(scope, conn), _replayed(body, receive), response.send)
            answer = response.answer()
        except BaseException:
            await self._abandon(conn, pending)
            raise
        return await self._finish(conn, pending, answer)

    async def _finish(self, conn, pending: contract.Pending,
                      response: contract.Answer) -> contract.Answer:
        """Ends the app's transaction: complete and commit, or (5xx) roll back and abandon."""
        if response.status >= 500:
            await self._abandon(conn, pending, response)
            return response
        try:
            if pending.fence is None:
                await conn.commit()
            else:
                await self.client.complete(
                    pending.key, pending.fence, response.status, response.body,
                    contract.headers_to_store(response.headers, self.options),
                    scope=pending.scope, conn=conn, commit=True)
        except ClaimLost:
            # Its writes roll back in _reset, before the answer goes out.
            return contract.claim_lost()
        except psycopg.Error as err:
            await self._abandon(conn, pending)
            return contract.unavailable(err)
        return response

    async def _abandon(self, conn, pending: contract.Pending,
                       failed: Optional[contract.Answer] = None) -> None:
        """Rolls the app's writes back and ends the claim: a 5xx response
        (failed) goes to complete, which releases the key or, with
        idempotency.store_server_errors on, stores the response; otherwise,
        or when complete fails, the key is released for the next retry."""
        try:
            await conn.rollback()
        except psycopg.Error as err:
            contract.log.error("idempotency: could not roll back %r: %s", pending.key, err)
            return  # a broken connection: the key frees itself when its lease ends
        if pending.fence is None:
            return
        if failed is not None:
            try:
                await self.client.complete(
                    pending.key, pending.fence, failed.status, failed.body,
                    contract.headers_to_store(failed.headers, self.options),
                    scope=pending.scope, conn=conn, commit=True)
                return
            except ClaimLost:
                return  # a retry owns the key: nothing of ours to free
            except psycopg.Error as err:  # 54000 (too large to store) among others
                contract.log.error("idempotency: could not end the claim of %r after a %d: %s",
                                   pending.key, failed.status, err)
        try:
            await self.client.release(pending.key, pending.fence, scope=pending.scope,
                                      conn=conn, commit=True)
        except psycopg.Error as err:
            contract.log.error("idempotency: could not release %r: %s", pending.key, err)


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


async def _reset(conn, autocommit: bool) -> None:
    """Leaves the connection idle in its own autocommit mode for the pool."""
    try:
        await conn.rollback()
        await conn.set_autocommit(autocommit)
    except psycopg.Error:
        pass  # a broken connection: the pool discards it


async def _send(send, answer: contract.Answer) -> None:
    """Sends an answer, with its Content-Length."""
    headers = [(name.encode("latin-1"), value.encode("latin-1"))
               for name, value in answer.headers if name.lower() != "content-length"]
    headers.append((b"content-length", str(len(answer.body)).encode()))
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body})
