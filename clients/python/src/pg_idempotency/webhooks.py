"""Webhook receivers: each event runs its handler once however often the
sender delivers it. The key is the sender's event id, the scope the sender.

    from pg_idempotency.webhooks import StandardWebhooks, WebhookReceiver

    def on_event(run, event):                  # run: pg_idempotency.Run
        run.conn.execute("INSERT ...")         # commits with the stored answer
        return {"charge": ...}

    receiver = WebhookReceiver(pool, StandardWebhooks("whsec_...", sender="acme"), on_event)
    answer = receiver.receive(request_headers, raw_body)    # a contract.Answer to send

- StandardWebhooks: ``webhook-id`` is the key, verified first (signature
  and timestamp tolerance, with the ``standardwebhooks`` library: the
  ``webhooks`` extra): an event that does not verify is refused with 401 and
  never claimed.
- BodyKey: the key is a field of the body (Stripe's ``id``), after the
  sender's own verification (a callable given; e.g. Stripe's construct_event).

Or as a middleware's key source, the view guarded as any other::

    Idempotency(blueprint, pool=pool, **standard_webhook("whsec_...", sender="acme"))

Answers of a WebhookReceiver: 200 with the handler's result as JSON (a
redelivery gets the stored one, ``Idempotent-Replayed: true``); 409 +
Retry-After while a delivery of the event runs; 422 when the event id comes
again with another payload; 400 when the handler raised a final error
(``final=``: stored, every redelivery gets it); 500 when it raised another
(the key is released: the sender's retry runs it); 503 when the database
cannot be reached.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from typing import Any, Callable, Iterable, NamedTuple, Tuple

import psycopg

from . import contract
from .contract import Unverified
from .function import InProgress, Mismatch, Outcome, idempotent_function, is_final

Headers = Iterable[Tuple[str, str]]


class Event(NamedTuple):
    """A verified delivery: the sender's event id (the key), the sender, the
    body as received and its JSON."""
    key: str
    sender: str
    body: bytes
    payload: Any

    @property
    def scope(self) -> str:
        """The scope of the event's key: "webhook:" and the sender."""
        return "webhook:" + self.sender


class StandardWebhooks:
    """Standard Webhooks deliveries: webhook-id, webhook-timestamp and
    webhook-signature verified by the standardwebhooks library."""

    def __init__(self, secret: str, *, sender: str):
        """secret: the endpoint's secret (whsec_...); sender: who sends (the scope)."""
        from standardwebhooks.webhooks import Webhook
        self.webhook = Webhook(secret)
        self.sender = sender

    def event(self, headers: Headers, body: bytes) -> Event:
        """The verified event; Unverified when the signature or the
        timestamp does not verify, or a header is missing."""
        from standardwebhooks.webhooks import WebhookVerificationError
        fields = {name.lower(): value for name, value in headers}
        try:
            payload = self.webhook.verify(body, fields)
        except WebhookVerificationError as err:
            raise Unverified(f"The webhook did not verify: {err}.") from None
        except ValueError:
            raise Unverified("The webhook's body is not JSON.") from None
        return Event(fields["webhook-id"], self.sender, body, payload)


class BodyKey:
    """Deliveries whose event id is a field of the body (Stripe's "id")."""

    def __init__(self, verify: Callable[[dict, bytes], Any], *, sender: str, field: str = "id"):
        """verify(headers, body): the sender's own verification, raising on a
        delivery that does not verify (its message is not shown to the caller);
        sender: the scope; field: the body's field that holds the event id."""
        self.verify, self.sender, self.field = verify, sender, field

    def event(self, headers: Headers, body: bytes) -> Event:
        """The verified event; Unverified when verify raised or the field is missing."""
        fields = {name.lower(): value for name, value in headers}
        try:
            self.verify(fields, body)
            payload = json.loads(body)
        except Exception:   # whatever the sender's library raises
            raise Unverified("The webhook did not verify.") from None
        key = payload.get(self.field) if isinstance(payload, dict) else None
        if not isinstance(key, str) or not key:
            raise Unverified(f"The webhook's body has no {self.field!r} string.")
        return Event(key, self.sender, body, payload)


def standard_webhook(secret: str, *, sender: str) -> dict:
    """The options of a middleware (Flask, ASGI, Django) that receives
    Standard Webhooks deliveries: POST only, the key the verified
    webhook-id, the scope the sender; a delivery that does not verify is
    401 webhook_unverified and never claimed."""
    return {"methods": ("POST",), "source": StandardWebhooks(secret, sender=sender)}


def body_key(field: str = "id", *, verify: Callable[[dict, bytes], Any], sender: str) -> dict:
    """The options of a middleware that receives deliveries whose event id
    is a field of the JSON body (Stripe's "id"), after verify(headers, body),
    the sender's own verification (see BodyKey)."""
    return {"methods": ("POST",), "source": BodyKey(verify, sender=sender, field=field)}


def _event_fingerprint(arguments: dict) -> bytes:
    """The fingerprint of a delivery: SHA-256 of its body as received."""
    return hashlib.sha256(arguments["event"].body).digest()


class WebhookReceiver:
    """Runs handler(run, event) once per event of source (StandardWebhooks or
    BodyKey). An async handler needs an AsyncConnectionPool and areceive."""

    def __init__(self, pool, source, handler: Callable, *, one_transaction: bool = True,
                 wait: contract.Interval = None, lease=None, retention: contract.Interval = None,
                 final=(), tracer_provider=None):
        """The options are idempotent_function's; the scope is "webhook:" and the sender."""
        self.source = source
        self.final = final
        options = {"one_transaction": one_transaction, "wait": wait, "retention": retention,
                   "final": final, "tracer_provider": tracer_provider, "fingerprint": _event_fingerprint,
                   "key": lambda event: event.key, "scope": lambda event: event.scope}
        if lease is not None:
            options["lease"] = lease
        if inspect.iscoroutinefunction(handler):
            async def run_event(run, event):
                """The handler, under the event's claim."""
                return await handler(run, event)
        else:
            def run_event(run, event):
                """The handler, under the event's claim."""
                return handler(run, event)
        self.run = idempotent_function(pool, **options)(run_event)

    def receive(self, headers: Headers, body: bytes) -> contract.Answer:
        """Verifies the delivery, then runs its handler once; returns the answer to send."""
        try:
            event = self.source.event(headers, body)
        except Unverified as err:
            return _refused(err)
        try:
            return _answer(self.run.outcome(event))
        except Exception as err:   # what the handler raised, or the store
            return self._failed(err, event)

    async def areceive(self, headers: Headers, body: bytes) -> contract.Answer:
        """As receive, for an async handler."""
        try:
            event = self.source.event(headers, body)
        except Unverified as err:
            return _refused(err)
        try:
            return _answer(await self.run.outcome(event))
        except Exception as err:
            return self._failed(err, event)


    def _failed(self, err: Exception, event: Event) -> contract.Answer:
        """The answer when the event did not run to a result here: a final
        error (stored: every redelivery gets it) is the sender's fault (400)."""
        if isinstance(err, InProgress):
            return contract.problem("idempotency_key_in_progress",
                                    "A delivery of this event is still running; retry later.", err.retry_after)
        if isinstance(err, Mismatch):
            return contract.problem("idempotency_key_mismatch",
                                    "This event id was delivered before with another payload.")
        if isinstance(err, psycopg.Error):
            return contract.refused_key(err) or contract.unavailable(err)
        if is_final(self.final, err):
            return contract.problem("webhook_rejected", str(err))
        contract.log.error("idempotency: the handler of webhook event %r failed: %r", event.key, err)
        return contract.problem("webhook_handler_failed")


def _refused(err: Unverified) -> contract.Answer:
    """The 401 of a delivery that did not verify."""
    return contract.problem("webhook_unverified", str(err))


def _answer(outcome: Outcome) -> contract.Answer:
    """The 200 with the handler's result (stored or just made)."""
    headers = [("Content-Type", "application/json")]
    if outcome.replayed:
        headers.append(("Idempotent-Replayed", "true"))
    return contract.Answer(200, headers, json.dumps(outcome.result).encode())


