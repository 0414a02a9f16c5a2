"""Django middleware: Idempotency-Key on the idempotency PostgreSQL extension,
through Django's own database connection (the postgresql backend on psycopg 3).

    MIDDLEWARE = [..., "pg_idempotency.django.IdempotencyMiddleware", ...]
    IDEMPOTENCY = {"lease": "60 seconds"}          # optional: see contract.Options, plus "using"

For each covered request it claims the key in autocommit (committed at
once, so that a concurrent retry sees it), then runs the view inside
``transaction.atomic()`` and stores the view's response with
idempotency.complete() in that same transaction: the view's ORM writes and
the stored response commit together. A 5xx or a view that raised rolls back.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Optional

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.db import DatabaseError, connections, transaction
from django.http import HttpResponse
from django.utils.module_loading import import_string

from . import contract
from .client import CLAIM, COMPLETE, RELEASE, Claim, _json

IK001 = "IK001"


class IdempotencyMiddleware:
    """Guards the project's POST and PATCH requests with Idempotency-Key.
    Settings: IDEMPOTENCY, a dict of contract.Options and "using" (the
    database alias, default "default"); "scope" may be a dotted path."""

    def __init__(self, get_response):
        """Reads settings.IDEMPOTENCY once, when Django loads the middleware."""
        self.get_response = get_response
        options = dict(getattr(settings, "IDEMPOTENCY", {}))
        self.using = options.pop("using", "default")
        if isinstance(options.get("scope"), str):
            options["scope"] = import_string(options["scope"])
        self.options = contract.Options(**options)

    def __call__(self, request):
        """Serves one request: covered methods are guarded."""
        if request.method not in self.options.methods:
            return self.get_response(request)
        headers = [(name.lower(), value.encode("latin-1")) for name, value in request.headers.items()]
        key, refusal = contract.read_key(headers, self.options)
        if refusal:
            return _response(refusal)
        try:
            body = request.body
        except RequestDataTooBig:
            return _response(contract.problem("request_body_too_large"))
        pending = contract.Pending()
        if key is not None:
            scope = self.options.scope(request) if self.options.scope else contract.credential_scope(headers)
            pending = contract.Pending(key, scope, None, uuid.uuid4(),
                                       contract.wsgi_fingerprint(request.META, request.method, body))
            try:
                claim = self._claim(pending)
            except DatabaseError as err:
                refusal = contract.refused_key(err.__cause__) if _sqlstate(err) else None
                if refusal or not self.options.fail_open:
                    return _response(refusal or contract.unavailable(err))
                contract.log.error("idempotency: running unguarded: %s", err)
                pending = contract.Pending()
            else:
                answer = contract.answer_claim(claim)
                if answer:
                    return _response(answer)
                pending = pending._replace(fence=claim.fence)
        return self._run(request, pending)

    def process_exception(self, request, exception):
        """Notes that the view raised: its key is released whatever Django answers."""
        request._idempotency_raised = True

    def _run(self, request, pending: contract.Pending):
        """Runs the view in a transaction that commits with its stored
        response; when the COMMIT's answer is lost, claims again with the
        token: replay means it committed (the view's response goes out), new
        that it rolled back (the view runs again)."""
        for _ in range(1 + contract.RERUNS):
            try:
                with transaction.atomic(using=self.using):
                    response = self.get_response(request)
                    body = _content(response)
                    failed = _failed(request, response)
                    if failed:
                        transaction.set_rollback(True, using=self.using)
                    elif pending.fence is not None:
                        self._call(COMPLETE, pending.key, pending.fence, response.status_code, body,
                                   _json(contract.headers_to_store(response.items(), self.options)),
                                   pending.scope)
            except DatabaseError as err:
                if _sqlstate(err) == IK001:
                    return _response(contract.claim_lost())
                if pending.fence is None or not contract.answer_lost(err.__cause__):
                    self._abandon(pending)
                    return _response(contract.unavailable(err))
                lost = err
            else:
                if failed:
                    raised = getattr(request, "_idempotency_raised", False)
                    self._abandon(pending, None if raised else
                                  contract.Answer(response.status_code, list(response.items()), body))
                return response
            try:
                claim = self._claim(pending)
            except DatabaseError as err:
                return _response(contract.outcome_unknown(err))
            if claim.outcome == "replay":
                return response     # it committed: this is the response stored
            if claim.outcome != "new":   # another request took the key over
                return _response(contract.claim_lost())
            pending = pending._replace(fence=claim.fence)
            request._idempotency_raised = False
            contract.log.warning("idempotency: the COMMIT of %r rolled back; running it again", pending.key)
        self._abandon(pending)
        return _response(contract.outcome_unknown(lost))

    def _abandon(self, pending: contract.Pending, failed: Optional[contract.Answer] = None) -> None:
        """Ends the claim after its writes rolled back: a 5xx response
        (failed) goes to complete, which releases the key or, with
        idempotency.store_server_errors on, stores the response; otherwise,
        or when complete fails, the key is released for the next retry."""
        if pending.fence is None:
            return
        if failed is not None:
            try:
                self._call(COMPLETE, pending.key, pending.fence, failed.status, failed.body,
                           _json(contract.headers_to_store(failed.headers, self.options)), pending.scope)
                return
            except DatabaseError as err:
                if _sqlstate(err) == IK001:
                    return  # a retry owns the key: nothing of ours to free
                contract.log.error("idempotency: could not end the claim of %r after a %d: %s",
                                   pending.key, failed.status, err)
        try:
            self._call(RELEASE, pending.key, pending.fence, pending.scope)
        except DatabaseError as err:
            contract.log.error("idempotency: could not release %r: %s", pending.key, err)

    def _claim(self, pending: contract.Pending) -> Claim:
        """Claims with the request's token in autocommit (it commits at once);
        when the answer is lost, asks again on a fresh connection
        (contract.CLAIM_BACKOFF)."""
        for pause in (*contract.CLAIM_BACKOFF, None):
            try:
                return self._claim_once(pending)
            except DatabaseError as err:
                if pause is None or not contract.answer_lost(err.__cause__):
                    raise
                contract.log.warning("idempotency: a claim of %r got no answer, asking again: %s",
                                     pending.key, err)
            connections[self.using].close()
            time.sleep(pause)
        raise AssertionError("unreachable")

    def _claim_once(self, pending: contract.Pending) -> Claim:
        """One claim on Django's connection."""
        with connections[self.using].cursor() as cursor:
            cursor.execute(CLAIM, (pending.key, pending.fingerprint, pending.scope, self.options.lease,
                                   self.options.retention, None, pending.token))
            row = dict(zip((column.name for column in cursor.description), cursor.fetchone()))
        if isinstance(row["headers"], str):   # Django loads jsonb as text
            row["headers"] = json.loads(row["headers"])
        if row["body"] is not None:
            row["body"] = bytes(row["body"])
        return Claim(**row)

    def _call(self, sql: str, *params):
        """Runs one of the extension's functions on Django's connection."""
        with connections[self.using].cursor() as cursor:
            cursor.execute(sql, params)
            return cursor.fetchone()[0]


def _failed(request, response) -> bool:
    """True when the view raised or answered 5xx: its writes roll back."""
    return getattr(request, "_idempotency_raised", False) or response.status_code >= 500


def _content(response) -> bytes:
    """Returns the whole body; a streamed response is read and kept for sending."""
    if getattr(response, "streaming", False):
        body = b"".join(response.streaming_content)
        response.streaming_content = [body]
        return body
    return response.content


def _sqlstate(err: DatabaseError) -> Optional[str]:
    """The SQLSTATE of psycopg's error under Django's."""
    return getattr(err.__cause__, "sqlstate", None)


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
