"""What the Flask middleware costs per request: database round trips and
latency, fresh and replayed, against the example app without it.

    DATABASE_URL=... /usr/bin/python3 clients/python/bench/overhead.py [REQUESTS]

The example app (examples/python/app.py) is served as it is ("guarded"), and
its payment view again without the middleware ("plain": a pooled connection
per request, committed after the view), each by werkzeug in a process of its
own on 127.0.0.1. One client sends REQUESTS (default 2000) sequential
requests of each kind (plain; guarded fresh; guarded replayed) and prints
the median and 90th percentile. The kinds take turns, 100 requests at a
time after 20 untimed, so that other load on the machine weighs on each
alike. Round trips are counted apart, in process, from the libpq trace of a
one-connection pool (the trace slows requests, so it is off while timing),
for the ASGI middleware too.
"""

import asyncio
import http.client
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "src"), os.path.join(HERE, "..", "..", "..", "examples", "python")]

from flask import Flask, g  # noqa: E402
from psycopg.rows import namedtuple_row  # noqa: E402
from psycopg_pool import AsyncConnectionPool, ConnectionPool  # noqa: E402

BODY = json.dumps({"amount": 10}).encode()
WARMUP = 20     # requests before each batch that are not timed
BATCH = 100


def plain_app(pool):
    """The example's payment view without the middleware: g.db is a pooled
    connection whose transaction commits after the view (rolls back on 5xx)."""
    import app as example
    plain = Flask("plain")
    plain.add_url_rule("/payments", view_func=example.create_payment, methods=["POST"])
    plain.add_url_rule("/", view_func=example.health)

    @plain.before_request
    def take():
        """Gives the view a connection."""
        g.db = pool.getconn()

    @plain.after_request
    def commit(response):
        """Commits the view's writes, or rolls them back on a 5xx."""
        g.db.commit() if response.status_code < 500 else g.db.rollback()
        return response

    @plain.teardown_request
    def give_back(_exc):
        """Returns the connection."""
        g.db.rollback()
        pool.putconn(g.pop("db"))
    return plain


def serve(mode, port):
    """Serves one app on 127.0.0.1:port until killed."""
    from werkzeug.serving import make_server
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
    import app as example
    example.pool.open(wait=True)
    app = example.app if mode == "guarded" else plain_app(example.pool)
    make_server("127.0.0.1", port, app, threaded=True).serve_forever()


def start(mode):
    """Starts a server process; returns it and its port once it answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen([sys.executable, __file__, "serve", mode, str(port)])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            http.client.HTTPConnection("127.0.0.1", port, timeout=1).request("GET", "/")
            return process, port
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"the {mode} server did not start")


def timings(port, count, keys):
    """Sends count payments with keys from keys(); returns the latencies in µs."""
    conn = http.client.HTTPConnection("127.0.0.1", port)
    latencies = []
    for i in range(count + WARMUP):
        headers = {"Content-Type": "application/json", "Authorization": "Bearer bench"}
        key = keys()
        if key:
            headers["Idempotency-Key"] = key
        began = time.perf_counter()
        conn.request("POST", "/payments", BODY, headers)
        response = conn.getresponse()
        response.read()
        elapsed = time.perf_counter() - began
        assert response.status == 201, response.status
        if i >= WARMUP:
            latencies.append(elapsed * 1e6)
    return latencies


def round_trips(pool, send, count=50):
    """Returns the round trips per request of send(): ReadyForQuery messages
    in the libpq trace of the pool's one connection."""
    with tempfile.TemporaryFile("w+") as trace:
        with pool.connection() as conn:
            conn.pgconn.trace(trace.fileno())
        for _ in range(count):
            assert send().status_code == 201
        with pool.connection() as conn:
            conn.pgconn.untrace()
        trace.seek(0)
        return sum("\tReadyForQuery\t" in line for line in trace) / count


def count_round_trips():
    """Round trips of a fresh and a replayed request, guarded and plain, Flask and ASGI."""
    import app as example
    url = os.environ["DATABASE_URL"]
    headers = {"Content-Type": "application/json", "Authorization": "Bearer bench"}
    counts = {}
    with ConnectionPool(url, min_size=1, max_size=1, kwargs={"row_factory": namedtuple_row}) as pool:
        guarded = Flask("guarded")
        guarded.add_url_rule("/payments", view_func=example.create_payment, methods=["POST"])
        from pg_idempotency.flask import Idempotency
        Idempotency(guarded, pool=pool)
        client = guarded.test_client()
        counts["flask fresh"] = round_trips(pool, lambda: client.post(
            "/payments", data=BODY, headers={**headers, "Idempotency-Key": uuid.uuid4().hex}))
        counts["flask replay"] = round_trips(pool, lambda: client.post(
            "/payments", data=BODY, headers={**headers, "Idempotency-Key": "replayed"}))
        plain = plain_app(pool).test_client()
        counts["plain"] = round_trips(pool, lambda: plain.post("/payments", data=BODY, headers=headers))
    counts.update(asyncio.run(asgi_round_trips(url, headers)))
    return counts


async def asgi_round_trips(url, headers):
    """Round trips of the ASGI middleware on a FastAPI app, fresh and replayed."""
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from pg_idempotency.asgi import IdempotencyMiddleware

    async with AsyncConnectionPool(url, min_size=1, max_size=1) as pool:
        app = FastAPI()
        app.add_middleware(IdempotencyMiddleware, pool=pool)

        @app.post("/payments")
        async def pay(request: Request):
            """Charges, like the example's view."""
            amount = (await request.json())["amount"]
            cur = await request.state.db.execute(
                "INSERT INTO charges (amount) VALUES (%s) RETURNING id", (amount,))
            return JSONResponse({"charge": (await cur.fetchone())[0]}, status_code=201)

        async def count(key):
            """Round trips per request of 50 requests with key() (async trace as above)."""
            with tempfile.TemporaryFile("w+") as trace:
                async with pool.connection() as conn:
                    conn.pgconn.trace(trace.fileno())
                async with httpx.AsyncClient(app=app, base_url="http://bench") as client:
                    for _ in range(50):
                        response = await client.post("/payments", content=BODY,
                                          headers={**headers, "Idempotency-Key": key()})
                        assert response.status_code == 201
                async with pool.connection() as conn:
                    conn.pgconn.untrace()
                trace.seek(0)
                return sum("\tReadyForQuery\t" in line for line in trace) / 50
        return {"asgi fresh": await count(lambda: uuid.uuid4().hex),
                "asgi replay": await count(lambda: "replayed")}


def main():
    """Measures and prints the table."""
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    import psycopg
    with psycopg.connect(os.environ["DATABASE_URL"], autocommit=True) as conn:
        conn.execute("""CREATE TABLE IF NOT EXISTS charges (
                            id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                            amount numeric NOT NULL,
                            created_at timestamptz NOT NULL DEFAULT now())""")
    trips = count_round_trips()
    plain, plain_port = start("plain")
    guarded, guarded_port = start("guarded")
    kinds = {"plain": (plain_port, lambda: None),
             "flask fresh": (guarded_port, lambda: uuid.uuid4().hex),
             "flask replay": (guarded_port, lambda: "replayed")}
    results = {kind: [] for kind in kinds}
    try:
        # Rounds of 100 of each kind in turn, so that the load of the machine
        # weighs on every kind alike.
        for _ in range(max(1, count // BATCH)):
            for kind, (port, keys) in kinds.items():
                results[kind] += timings(port, BATCH, keys)
    finally:
        for process in (plain, guarded):
            process.kill()
            process.wait()
    print(f"{len(results['plain'])} sequential requests of each kind, latency in µs:")
    print(f"{'request':<14}{'median':>8}{'p90':>8}{'round trips':>13}")
    for kind in ("plain", "flask fresh", "flask replay", "asgi fresh", "asgi replay"):
        lat = results.get(kind)
        median = f"{statistics.median(lat):8.0f}" if lat else f"{'':>8}"
        p90 = f"{statistics.quantiles(lat, n=10)[-1]:8.0f}" if lat else f"{'':>8}"
        print(f"{kind:<14}{median}{p90}{trips[kind]:13.1f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2], int(sys.argv[3]))
    else:
        main()
