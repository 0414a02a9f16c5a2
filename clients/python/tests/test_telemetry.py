"""OpenTelemetry spans of every middleware and of the client, read back
from the SDK's in-memory exporter, against the database: names, kind,
attributes, the outcome of a fresh request, a replay and a mismatch, an
error's SQLSTATE, and never the key, the scope, a body or a header value."""

import asyncio
import hashlib
import json
import time
import uuid

import httpx
import pytest
from aws_lambda_powertools.utilities.idempotency import IdempotencyConfig, idempotent
from django.test import Client as DjangoClient
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from psycopg.conninfo import make_conninfo
from psycopg_pool import AsyncConnectionPool

import test_django
from conftest import DATABASE_URL
from helpers import ALICE, pay, scope_of
from pg_idempotency import AsyncClient, ClaimLost, Client
from pg_idempotency.powertools import PostgresPersistenceLayer
from test_django_asgi import django_asgi  # noqa: F401 (a fixture)
from test_powertools import LambdaContext

KEY = "order-7f3a-secret-key"
AMOUNT = 4321987


def key_hash(key):
    """What the spans must show of a key."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


@pytest.fixture
def exporter():
    """An in-memory exporter behind a tracer provider of the test's own (exporter.provider)."""
    exporter = InMemorySpanExporter()
    exporter.provider = TracerProvider()
    exporter.provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    exporter.provider.shutdown()


@pytest.fixture(scope="module")
def global_exporter_once():
    """An in-memory exporter on the global tracer provider (set once per process)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


@pytest.fixture
def global_exporter(global_exporter_once):
    """The global provider's exporter, emptied for this test."""
    global_exporter_once.clear()
    return global_exporter_once


def spans(exporter, count):
    """The spans exported, once there are count of them (bounded wait:
    a server thread may end a span just after its answer went out)."""
    deadline = time.monotonic() + 10
    while len(exporter.get_finished_spans()) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return [span for span in exporter.get_finished_spans() if span.name.startswith("idempotency.")]


def summary(found):
    """[(name, outcome)] of the spans, in the order they ended."""
    return [(span.name, span.attributes.get("idempotency.outcome")) for span in found]


def check_attributes(found, key=KEY, secrets=()):
    """Every span is INTERNAL, shows the key's hash, and no attribute holds
    the key, a body, the credential or the scope."""
    secrets = [key, str(AMOUNT), ALICE["Authorization"], ALICE["Authorization"].split()[1], *secrets]
    for span in found:
        assert span.kind == SpanKind.INTERNAL
        assert span.attributes["idempotency.key_hash"] == key_hash(key)
        assert set(span.attributes) <= {"idempotency.key_hash", "idempotency.outcome",
                                        "idempotency.attempt", "db.response.status_code", "error.type"}
        texts = [str(v) for v in span.attributes.values()]
        texts += [str(v) for event in span.events for v in event.attributes.values()]
        texts.append(span.status.description or "")
        for text in texts:
            for secret in secrets:
                assert secret not in text, (span.name, text)


def exchange(send):
    """A fresh request, its replay and a mismatch through send(key, body): the answers."""
    body = {"amount": AMOUNT}
    return [send(KEY, body), send(KEY, body), send(KEY, {"amount": AMOUNT + 1})]


EXPECTED = [("idempotency.claim", "new"), ("idempotency.complete", "stored"),
            ("idempotency.claim", "replay"), ("idempotency.claim", "mismatch")]


def check_exchange(answers, exporter, secrets=()):
    """The answers and spans of exchange()."""
    assert [answer.status_code for answer in answers] == [201, 201, 422]
    found = spans(exporter, len(EXPECTED))
    assert summary(found) == EXPECTED
    assert found[0].attributes["idempotency.attempt"] == 1
    assert "idempotency.attempt" not in found[2].attributes
    assert all(span.status.status_code == StatusCode.UNSET for span in found)
    check_attributes(found, secrets=secrets)


def test_the_http_middlewares_trace_claim_and_complete(serve, exporter, admin):
    client = serve(tracer_provider=exporter.provider)
    answers = exchange(lambda key, body: pay(client, key, body))
    check_exchange(answers, exporter, secrets=[scope_of(ALICE)])


def test_a_5xx_is_traced_as_the_complete_that_released_it(serve, exporter):
    client = serve(tracer_provider=exporter.provider)
    assert pay(client, KEY, {"amount": AMOUNT, "fail": True}).status_code == 500
    found = spans(exporter, 2)
    assert summary(found) == [("idempotency.claim", "new"), ("idempotency.complete", "released")]
    check_attributes(found)


def test_a_5xx_kept_by_store_server_errors_is_traced_as_stored(serve, exporter):
    client = serve(tracer_provider=exporter.provider,
                   conninfo=make_conninfo(DATABASE_URL, options="-c idempotency.store_server_errors=on"))
    assert pay(client, KEY, {"amount": AMOUNT, "fail": True}).status_code == 500
    found = spans(exporter, 2)
    assert summary(found) == [("idempotency.claim", "new"), ("idempotency.complete", "stored")]
    check_attributes(found)


def test_the_http_middlewares_use_the_global_tracer_provider_by_default(serve, global_exporter):
    client = serve()
    assert pay(client, KEY, {"amount": AMOUNT}).status_code == 201
    assert summary(spans(global_exporter, 2)) == EXPECTED[:2]


def test_the_django_middleware_traces_claim_and_complete(global_exporter, admin):
    client = DjangoClient(raise_request_exception=False)
    try:
        answers = exchange(lambda key, body: test_django.pay(client, key, body))
    finally:
        test_django.connection.close()
    check_exchange(answers, global_exporter)


def test_the_django_middleware_under_asgi_traces_its_async_views(django_asgi, global_exporter):  # noqa: F811
    with httpx.Client(base_url=django_asgi.url, timeout=30) as client:
        answers = exchange(lambda key, body: pay(client, key, body, path="/async/payments"))
    check_exchange(answers, global_exporter)


def test_the_django_middleware_traces_the_release_of_a_view_that_raised(global_exporter):
    client = DjangoClient(raise_request_exception=False)
    try:
        assert test_django.pay(client, KEY, {"amount": AMOUNT, "raise": True}).status_code == 500
    finally:
        test_django.connection.close()
    found = spans(global_exporter, 2)
    assert summary(found) == [("idempotency.claim", "new"), ("idempotency.release", "released")]
    check_attributes(found)


def test_the_powertools_layer_traces_claim_and_complete(pool, exporter):
    calls = []
    store = PostgresPersistenceLayer(pool, tracer_provider=exporter.provider)

    @idempotent(persistence_store=store, config=IdempotencyConfig(event_key_jmespath="body"))
    def handler(event, context):
        """Counts the call."""
        calls.append(event)
        return {"statusCode": 201}

    event = {"body": json.dumps({"key": KEY, "amount": AMOUNT})}
    assert handler(event, LambdaContext()) == handler(event, LambdaContext())
    assert len(calls) == 1
    found = spans(exporter, 3)
    assert summary(found) == EXPECTED[:3]
    for span in found:   # Powertools' key is a hash of the event already
        assert span.kind == SpanKind.INTERNAL and KEY not in str(span.attributes)
        assert str(AMOUNT) not in str(span.attributes)


def test_an_error_sets_the_status_and_the_sqlstate_but_not_the_message(pool, exporter):
    client = Client(pool, tracer_provider=exporter.provider)
    claim = client.claim(KEY, b"\x01")
    with pytest.raises(ClaimLost):
        client.complete(KEY, claim.fence + 1, 201, str(AMOUNT).encode())
    assert client.release(KEY, claim.fence + 1) is False
    found = spans(exporter, 3)
    assert summary(found) == [("idempotency.claim", "new"), ("idempotency.complete", None),
                              ("idempotency.release", "not_owned")]
    failed = found[1]
    assert failed.status.status_code == StatusCode.ERROR
    assert failed.attributes["db.response.status_code"] == "IK001"
    assert not failed.events
    check_attributes(found)


def test_the_async_client_traces_too(exporter):
    async def run():
        """Claims, completes, releases nothing: a fresh key then its replay."""
        async with AsyncConnectionPool(DATABASE_URL, min_size=1, max_size=1) as pool:
            client = AsyncClient(pool, tracer_provider=exporter.provider)
            claim = await client.claim(KEY, b"\x01", token=uuid.uuid4())
            assert await client.complete(KEY, claim.fence, 201, b"{}") == "stored"
            assert (await client.claim(KEY, b"\x01")).outcome == "replay"
    asyncio.run(run())
    found = spans(exporter, 3)
    assert summary(found) == EXPECTED[:3]
    check_attributes(found)
