"""Webhook receivers against the database: a Standard Webhooks delivery is
verified before any claim, runs its handler once, and every redelivery
gets the stored answer; a key read from the body (Stripe's id) likewise."""

import asyncio
import base64
import hashlib
import hmac
import json
import threading
from datetime import datetime, timedelta, timezone

import pytest
from flask import Blueprint, Flask, Response, g, request
from psycopg_pool import AsyncConnectionPool
from standardwebhooks.webhooks import Webhook

from conftest import DATABASE_URL
from helpers import assert_problem, pay, value, wait_for
from pg_idempotency.flask import Idempotency, exempt
from pg_idempotency.webhooks import BodyKey, StandardWebhooks, WebhookReceiver, body_key, standard_webhook

SECRET = "whsec_" + base64.b64encode(b"a secret of the test sender").decode()


def delivery(event_id, payload, secret=SECRET, at=None):
    """The headers and body of a delivery signed as a Standard Webhooks sender does."""
    body = json.dumps(payload).encode()
    at = at or datetime.now(timezone.utc)
    return [("webhook-id", event_id), ("webhook-timestamp", str(int(at.timestamp()))),
            ("webhook-signature", Webhook(secret).sign(event_id, at, body))], body


def charge_handler(runs, gate=None):
    """Charges data.amount; counts its runs; waits for gate when given."""
    def handle(run, event):
        runs.append(event.key)
        charge = run.conn.execute("INSERT INTO charges (amount) VALUES (%s) RETURNING id",
                                  (event.payload["data"]["amount"],)).fetchone()[0]
        if gate is not None:
            gate.wait(30)
        if event.payload["data"].get("fail"):
            raise RuntimeError("the handler failed")
        return {"charge": charge}
    return handle


def receiver_of(pool, runs, gate=None, **options):
    """A Standard Webhooks receiver charging each event."""
    return WebhookReceiver(pool, StandardWebhooks(SECRET, sender="acme"), charge_handler(runs, gate),
                           **options)


def records(admin):
    """How many records there are."""
    return value(admin, "SELECT count(*) FROM idempotency.keys")


def test_an_event_runs_once_and_redeliveries_get_the_stored_answer(pool, admin):
    runs = []
    receiver = receiver_of(pool, runs)
    payload = {"type": "payment.created", "data": {"amount": 10}}
    first = receiver.receive(*delivery("msg_1", payload))
    assert first.status == 200 and json.loads(first.body)["charge"]
    # Redelivered later: a new timestamp and signature, the same id and body.
    again = receiver.receive(*delivery("msg_1", payload, at=datetime.now(timezone.utc) + timedelta(seconds=5)))
    assert (again.status, again.body) == (200, first.body)
    assert ("Idempotent-Replayed", "true") in again.headers
    assert runs == ["msg_1"] and value(admin, "SELECT count(*) FROM charges") == 1
    assert value(admin, "SELECT scope FROM idempotency.keys") == "webhook:acme"


@pytest.mark.parametrize("tamper", ["signature", "secret", "old timestamp", "future timestamp",
                                    "no headers", "body"])
def test_a_delivery_that_does_not_verify_is_refused_and_never_claimed(pool, admin, tamper):
    runs = []
    receiver = receiver_of(pool, runs)
    payload = {"data": {"amount": 10}}
    at = {"old timestamp": datetime.now(timezone.utc) - timedelta(minutes=10),
          "future timestamp": datetime.now(timezone.utc) + timedelta(minutes=10)}.get(tamper)
    other_secret = "whsec_" + base64.b64encode(b"not the secret").decode()
    headers, body = delivery("msg_2", payload, secret=other_secret if tamper == "secret" else SECRET, at=at)
    if tamper == "signature":
        headers[2] = ("webhook-signature", "v1," + base64.b64encode(b"x" * 32).decode())
    elif tamper == "no headers":
        headers = []
    elif tamper == "body":
        body = json.dumps({"data": {"amount": 1000}}).encode()
    answer = receiver.receive(headers, body)
    assert answer.status == 401 and json.loads(answer.body)["code"] == "webhook_unverified"
    assert runs == [] and records(admin) == 0 and value(admin, "SELECT count(*) FROM charges") == 0


def test_the_same_event_id_with_another_payload_charges_nothing(pool, admin):
    runs = []
    receiver = receiver_of(pool, runs)
    assert receiver.receive(*delivery("msg_3", {"data": {"amount": 10}})).status == 200
    answer = receiver.receive(*delivery("msg_3", {"data": {"amount": 99}}))
    assert answer.status == 422 and json.loads(answer.body)["code"] == "idempotency_key_mismatch"
    assert runs == ["msg_3"] and value(admin, "SELECT count(*) FROM charges") == 1


def test_a_handler_that_failed_is_run_again_by_the_next_delivery(pool, admin):
    runs = []
    receiver = receiver_of(pool, runs)
    payload = {"data": {"amount": 10, "fail": True}}
    assert receiver.receive(*delivery("msg_4", payload)).status == 500
    assert records(admin) == 0 and value(admin, "SELECT count(*) FROM charges") == 0
    assert receiver.receive(*delivery("msg_4", payload)).status == 500
    assert runs == ["msg_4", "msg_4"]


@pytest.mark.parametrize("one_transaction", [True, False])
def test_racing_deliveries_charge_once(pool, admin, one_transaction):
    runs, answers = [], []
    gate = threading.Event()
    receiver = receiver_of(pool, runs, gate, one_transaction=one_transaction,
                           wait="100 milliseconds" if one_transaction else None)
    payload = {"data": {"amount": 10}}

    def deliver():
        answers.append(receiver.receive(*delivery("msg_5", payload)))
    first = threading.Thread(target=deliver)
    first.start()
    wait_for(admin, "SELECT count(*) > 0 FROM pg_stat_activity WHERE query LIKE 'INSERT INTO charges%%'"
             if one_transaction else "SELECT count(*) > 0 FROM idempotency.keys")
    others = [threading.Thread(target=deliver) for _ in range(3)]
    for thread in others:
        thread.start()
    for thread in others:
        thread.join()
    gate.set()
    first.join()
    assert sorted(a.status for a in answers) == [200, 409, 409, 409]
    assert all(dict(a.headers)["Retry-After"] for a in answers if a.status == 409)
    assert runs == ["msg_5"] and value(admin, "SELECT count(*) FROM charges") == 1
    assert receiver.receive(*delivery("msg_5", payload)).status == 200


def stripe_verify(headers, body):
    """A sender's own check: an HMAC of the body in a header of its own."""
    expected = hmac.new(b"stripe secret", body, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(headers.get("stripe-signature", ""), expected):
        raise ValueError("bad signature")


def test_a_key_read_from_the_body(pool, admin):
    runs = []
    receiver = WebhookReceiver(pool, BodyKey(stripe_verify, sender="stripe"), charge_handler(runs))
    body = json.dumps({"id": "evt_1", "data": {"amount": 7}}).encode()
    signed = [("Stripe-Signature", hmac.new(b"stripe secret", body, hashlib.sha256).hexdigest())]
    first = receiver.receive(signed, body)
    assert first.status == 200 and receiver.receive(signed, body).body == first.body
    assert receiver.receive([("Stripe-Signature", "forged")], body).status == 401
    no_id = json.dumps({"data": {"amount": 7}}).encode()
    assert receiver.receive([("Stripe-Signature", hmac.new(b"stripe secret", no_id, hashlib.sha256)
                              .hexdigest())], no_id).status == 401
    assert runs == ["evt_1"] and value(admin, "SELECT key FROM idempotency.keys") == "evt_1"


def test_an_async_handler(admin):
    runs = []

    async def handle(run, event):
        runs.append(event.key)
        await run.conn.execute("INSERT INTO charges (amount) VALUES (%s)", (event.payload["data"]["amount"],))
        return {"ok": True}

    async def scenario():
        async with AsyncConnectionPool(DATABASE_URL, min_size=1, max_size=4) as pool:
            receiver = WebhookReceiver(pool, StandardWebhooks(SECRET, sender="acme"), handle)
            payload = {"data": {"amount": 3}}
            answers = await asyncio.gather(*(receiver.areceive(*delivery("msg_6", payload)) for _ in range(3)))
            assert {a.status for a in answers} <= {200, 409} and 200 in {a.status for a in answers}
            assert (await receiver.areceive(*delivery("msg_6", payload))).status == 200
    asyncio.run(scenario())
    assert runs == ["msg_6"] and value(admin, "SELECT count(*) FROM charges") == 1


def test_a_flask_view_exempt_from_the_extension_receives_webhooks(pool, admin):
    app = Flask("receiver")
    Idempotency(app, pool=pool)
    receiver = receiver_of(pool, [])

    @app.post("/webhooks")
    @exempt
    def webhooks():
        answer = receiver.receive(request.headers.items(), request.get_data())
        return Response(answer.body, answer.status, answer.headers)

    headers, body = delivery("msg_7", {"data": {"amount": 5}})
    client = app.test_client()
    first = client.post("/webhooks", headers=headers, data=body)
    again = client.post("/webhooks", headers=headers, data=body)
    assert (first.status_code, again.status_code) == (200, 200) and first.data == again.data
    assert again.headers["Idempotent-Replayed"] == "true"
    assert value(admin, "SELECT count(*) FROM charges") == 1


def stripe_signed(body):
    """The headers of a delivery signed as stripe_verify checks."""
    return [("Stripe-Signature", hmac.new(b"stripe secret", body, hashlib.sha256).hexdigest()),
            ("Content-Type", "application/json")]


def test_a_middleware_whose_key_source_is_standard_webhooks(serve, admin):
    client = serve(**standard_webhook(SECRET, sender="acme"))
    payload = {"type": "payment.requested", "amount": 3}
    first = client.post("/payments", headers=delivery("msg_m1", payload)[0], content=delivery("msg_m1", payload)[1])
    assert first.status_code == 201 and "idempotent-replayed" not in first.headers
    # A redelivery: signed again, a later timestamp.
    headers, body = delivery("msg_m1", payload, at=datetime.now(timezone.utc) + timedelta(seconds=5))
    again = client.post("/payments", headers=headers, content=body)
    assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert admin.execute("SELECT scope, key FROM idempotency.keys").fetchall() == [("webhook:acme", "msg_m1")]
    headers, body = delivery("msg_m1", {**payload, "amount": 4})
    assert_problem(client.post("/payments", headers=headers, content=body), 422, "idempotency_key_mismatch")
    assert value(admin, "SELECT count(*) FROM charges") == 1


@pytest.mark.parametrize("tamper", ["secret", "body", "old", "unsigned"])
def test_a_delivery_the_middleware_cannot_verify_is_401_and_never_claimed(serve, admin, tamper):
    client = serve(**standard_webhook(SECRET, sender="acme"))
    payload = {"amount": 3}
    headers, body = delivery("msg_m2", payload, **{
        "secret": {"secret": "whsec_" + base64.b64encode(b"another secret").decode()},
        "old": {"at": datetime.now(timezone.utc) - timedelta(minutes=10)}}.get(tamper, {}))
    if tamper == "body":
        body = json.dumps({"amount": 300}).encode()
    if tamper == "unsigned":
        headers = [("Idempotency-Key", "k-1")]
    assert_problem(client.post("/payments", headers=headers, content=body), 401, "webhook_unverified")
    assert records(admin) == 0 and value(admin, "SELECT count(*) FROM charges") == 0


def test_a_middleware_whose_key_is_read_from_the_body(serve, admin):
    client = serve(**body_key("id", verify=stripe_verify, sender="stripe"))
    body = json.dumps({"id": "evt_m1", "amount": 7}).encode()
    first = client.post("/payments", headers=stripe_signed(body), content=body)
    again = client.post("/payments", headers=stripe_signed(body), content=body)
    assert (first.status_code, again.status_code) == (201, 201) and again.headers["idempotent-replayed"] == "true"
    assert_problem(client.post("/payments", headers=[("Stripe-Signature", "forged")], content=body),
                   401, "webhook_unverified")
    no_id = json.dumps({"amount": 7}).encode()
    assert_problem(client.post("/payments", headers=stripe_signed(no_id), content=no_id), 401, "webhook_unverified")
    assert admin.execute("SELECT scope, key FROM idempotency.keys").fetchall() == [("webhook:stripe", "evt_m1")]
    assert value(admin, "SELECT count(*) FROM charges") == 1


def test_a_flask_blueprint_receives_webhooks_beside_the_apps_idempotency_keys(pool, admin):
    app = Flask("both")
    Idempotency(app, pool=pool)
    hooks = Blueprint("hooks", __name__)
    Idempotency(hooks, pool=pool, **standard_webhook(SECRET, sender="acme"))

    def charge(amount):
        """Charges amount on the request's transaction."""
        return g.db.execute("INSERT INTO charges (amount) VALUES (%s) RETURNING id", (amount,)).fetchone()[0]

    @hooks.post("/webhooks")
    def webhooks():
        return {"charge": charge(request.get_json(force=True)["data"]["amount"])}

    @app.post("/payments")
    def payments():
        return {"charge": charge(request.get_json()["amount"])}, 201

    app.register_blueprint(hooks)
    client = app.test_client()
    headers, body = delivery("msg_m3", {"data": {"amount": 5}})
    first = client.post("/webhooks", headers=headers, data=body)
    again = client.post("/webhooks", headers=headers, data=body)
    assert (first.status_code, again.status_code) == (200, 200) and first.data == again.data
    assert again.headers["Idempotent-Replayed"] == "true"
    assert client.post("/webhooks", headers=[("Idempotency-Key", "k-2")], data=body).status_code == 401
    paid = client.post("/payments", headers={"Idempotency-Key": "k-3"}, json={"amount": 2})
    assert paid.status_code == 201
    assert client.post("/payments", headers={"Idempotency-Key": "k-3"}, json={"amount": 2}) \
        .headers["Idempotent-Replayed"] == "true"
    assert client.post("/payments", headers=headers, data=body).status_code == 400, "no Idempotency-Key"
    assert sorted(admin.execute("SELECT scope, key FROM idempotency.keys").fetchall()) == \
        [("", "k-3"), ("webhook:acme", "msg_m3")]
    assert value(admin, "SELECT count(*) FROM charges") == 2
