"""What the Flask and ASGI middlewares cost per request: database round
trips and latency, fresh and replayed, against the same route without them
and under the hand-written recipe (recipe.py), in both of their modes.

    DATABASE_URL=... clients/python/bench/overhead [REQUESTS] [flask|asgi]...

(overhead runs this file in a virtualenv with the built wheel and the
pinned requirements/test.txt.)

Flask: the example app (examples/python/app.py) is served as it is
("guarded"), and its payment view again without the middleware ("plain": a
pooled connection per request, committed after the view), each by werkzeug
in a process of its own on 127.0.0.1. ASGI: a FastAPI payment route behind
IdempotencyMiddleware, and the same route without it (a pooled connection
per request, committed when the route returns), each by uvicorn in a
process of its own. Each framework's route also runs behind the middleware
in its one-transaction mode ("one": IDEMPOTENCY_ONE_TRANSACTION=on, which
the example app reads too), in both modes with the prepare option
("+prepare": IDEMPOTENCY_PREPARE=on), and under the hand-written recipe
("recipe").
One client sends REQUESTS (default 2000) sequential requests of each kind
(plain; fresh and replayed behind each mode and under the recipe) of each
framework named (default both) and prints the median and 90th percentile,
and the speed of each mode against the recipe (the recipe's median over
the mode's: above 1.0x, the middleware is faster). The kinds take turns,
100 requests at a time after 20 untimed, so that other load on the machine
weighs on each alike. Round trips are counted apart, in process, from the
libpq trace of a one-connection pool (the trace slows requests, so it is
off while timing), and then the CPU per request of CPU_REQUESTS more: this
process's (the app's, with the test client's) and the database session's
(/proc), which load on the machine does not inflate as it does latencies.
REQUESTS 0: in process only.
"""

import asyncio
import contextlib
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
# The example app; pg_idempotency comes from the virtualenv's wheel.
sys.path[:0] = [os.path.join(HERE, "..", "..", "..", "examples", "python")]

from flask import Flask, g  # noqa: E402
from psycopg.rows import namedtuple_row  # noqa: E402
from psycopg_pool import AsyncConnectionPool, ConnectionPool  # noqa: E402

import recipe  # noqa: E402  (beside this file)

BODY = json.dumps({"amount": 10}).encode()
# The server kinds: what stands before the route.
GUARDS = {"guarded": "two transactions", "one": "one transaction",
          "guarded+prepare": "two tx, prepare", "one+prepare": "one tx, prepare",
          "recipe": "hand-written recipe"}
MODES = [guard for guard in GUARDS if guard != "recipe"]   # the middleware's
WARMUP = 20     # requests before each batch that are not timed
CPU_REQUESTS = 1000   # in process, of each kind, for the CPU per request
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


def recipe_app(pool):
    """The example's payment view under the hand-written recipe."""
    import app as example
    app = Flask("recipe")
    app.add_url_rule("/payments", view_func=recipe.flask_view(pool, example.create_payment), methods=["POST"])
    app.add_url_rule("/", view_func=example.health)
    return app


def asgi_app(pool, guard):
    """A FastAPI payment route like the example's view: behind the ASGI
    middleware (guard one of MODES: "one" its one-transaction mode,
    "+prepare" its prepare option), under
    the hand-written recipe ("recipe"), or on a pooled connection committed
    when it returns ("plain")."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from pg_idempotency.asgi import IdempotencyMiddleware

    app = FastAPI()
    guarded = guard in MODES
    if guarded:
        app.add_middleware(IdempotencyMiddleware, pool=pool, one_transaction=guard.startswith("one"),
                           prepare=guard.endswith("+prepare"))

    async def charge(db, request):
        """Inserts the charge; returns the 201 answer."""
        amount = (await request.json())["amount"]
        cur = await db.execute("INSERT INTO charges (amount) VALUES (%s) RETURNING id", (amount,))
        return JSONResponse({"charge": (await cur.fetchone())[0]}, status_code=201)

    async def pay(request: Request):
        """Charges in the middleware's transaction, or in one of its own."""
        if guarded:
            return await charge(request.state.db, request)
        async with pool.connection() as conn:  # BEGIN ... COMMIT on leaving
            return await charge(conn, request)
    app.add_api_route("/payments", recipe.asgi_route(pool, charge) if guard == "recipe" else pay,
                      methods=["POST"])

    @app.get("/")
    async def health():
        """Answers without the database."""
        return {"status": "ok"}
    return app


def serve(mode, port):
    """Serves one app (flask-KIND or asgi-KIND, KIND plain or one of GUARDS)
    on 127.0.0.1:port until killed."""
    framework, kind = mode.split("-")
    # The example app reads them when imported, whatever the caller's environment says.
    os.environ["IDEMPOTENCY_ONE_TRANSACTION"] = "on" if kind.startswith("one") else "off"
    os.environ["IDEMPOTENCY_PREPARE"] = "on" if kind.endswith("+prepare") else "off"
    if framework == "asgi":
        import uvicorn
        pool = AsyncConnectionPool(os.environ["DATABASE_URL"], min_size=2, max_size=10, open=False)
        app = asgi_app(pool, kind)

        @contextlib.asynccontextmanager
        async def lifespan(_app):
            """Opens the pool in uvicorn's event loop."""
            async with pool:
                yield
        app.router.lifespan_context = lifespan
        uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                      access_log=False)).run()
        return
    from werkzeug.serving import make_server
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
    import app as example
    example.pool.open(wait=True)
    app = {"plain": plain_app, "recipe": recipe_app}.get(kind, lambda _pool: example.app)(example.pool)
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


def timings(kind, port, count, keys):
    """Sends count payments of kind with keys from keys() (None: no key); returns the latencies in µs."""
    conn = http.client.HTTPConnection("127.0.0.1", port)
    latencies = []
    for i in range(count + WARMUP):
        headers = {"Content-Type": "application/json", "Authorization": "Bearer bench"}
        key = keys() if keys else None
        if key:
            headers["Idempotency-Key"] = key
        began = time.perf_counter()
        conn.request("POST", "/payments", BODY, headers)
        response = conn.getresponse()
        body = response.read()
        elapsed = time.perf_counter() - began
        assert response.status == 201, f"{kind}: {response.status} {body!r}"
        if i >= WARMUP:
            latencies.append(elapsed * 1e6)
    return latencies


def backend_cpu(pool_conn):
    """CPU seconds used so far by the server process of a connection (its
    /proc entry: the server runs on this machine); None where it cannot be read."""
    try:
        with open(f"/proc/{pool_conn.info.backend_pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def per_request(app_cpu, db_cpu, app_before, db_before, count):
    """(this process's, the server process's) CPU µs per request since the befores."""
    db = None if db_before is None else (db_cpu - db_before) / count * 1e6
    return (app_cpu - app_before) / count * 1e6, db


def round_trips(pool, send, count=50):
    """Returns the round trips per request of send(): ReadyForQuery messages
    in the libpq trace of the pool's one connection, after 10 untraced (a
    replayed key is then stored, and the statements prepared); and the CPU
    per request of CPU_REQUESTS more (per_request)."""
    for _ in range(10):
        response = send()
        assert response.status_code == 201, f"flask: {response.status_code} {response.text}"
    with tempfile.TemporaryFile("w+") as trace:
        with pool.connection() as conn:
            conn.pgconn.trace(trace.fileno())
        for _ in range(count):
            assert send().status_code == 201
        with pool.connection() as conn:
            conn.pgconn.untrace()
        trace.seek(0)
        trips = sum("\tReadyForQuery\t" in line for line in trace) / count
    with pool.connection() as conn:
        app_before, db_before = time.process_time(), backend_cpu(conn)
    for _ in range(CPU_REQUESTS):
        send()
    with pool.connection() as conn:
        return (trips, *per_request(time.process_time(), backend_cpu(conn), app_before, db_before, CPU_REQUESTS))


def count_round_trips():
    """Round trips of a plain request, and of a fresh and a replayed one behind
    each mode and under the recipe, Flask and ASGI."""
    import app as example
    from pg_idempotency.flask import Idempotency
    url = os.environ["DATABASE_URL"]
    headers = {"Content-Type": "application/json", "Authorization": "Bearer bench"}
    counts = {}
    with ConnectionPool(url, min_size=1, max_size=1, kwargs={"row_factory": namedtuple_row}) as pool:
        apps = {"plain": plain_app(pool), "recipe": recipe_app(pool)}
        for guard in MODES:
            apps[guard] = Flask(guard)
            apps[guard].add_url_rule("/payments", view_func=example.create_payment, methods=["POST"])
            Idempotency(apps[guard], pool=pool, one_transaction=guard.startswith("one"),
                        prepare=guard.endswith("+prepare"))
        for guard, app in apps.items():
            client = app.test_client()
            for work, key in kinds_of(guard, "traced"):
                counts[f"flask {work}"] = round_trips(pool, lambda key=key: client.post(
                    "/payments", data=BODY, headers={**headers, **({"Idempotency-Key": key()} if key else {})}))
    counts.update(asyncio.run(asgi_round_trips(url, headers)))
    return counts


def kinds_of(guard, run):
    """The kinds of request (their names, their key makers) of a server
    with guard (plain or one of GUARDS); replayed keys are of run only."""
    if guard == "plain":
        return [("plain", None)]
    return [(f"{guard} fresh", lambda: uuid.uuid4().hex), (f"{guard} replay", lambda: f"{run}-{guard}")]


async def asgi_round_trips(url, headers):
    """Round trips of the ASGI route: plain, behind each mode and under the recipe."""
    import httpx

    async with AsyncConnectionPool(url, min_size=1, max_size=1) as pool:
        async def count(app, key):
            """Round trips per request of 50 requests with key() (async trace as above)."""
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://bench") as client:
                async def send():
                    """Sends one payment."""
                    key_header = {"Idempotency-Key": key()} if key else {}
                    response = await client.post("/payments", content=BODY,
                                                 headers={**headers, **key_header})
                    assert response.status_code == 201, f"asgi: {response.status_code} {response.text}"
                for _ in range(10):
                    await send()
                with tempfile.TemporaryFile("w+") as trace:
                    async with pool.connection() as conn:
                        conn.pgconn.trace(trace.fileno())
                    for _ in range(50):
                        await send()
                    async with pool.connection() as conn:
                        conn.pgconn.untrace()
                    trace.seek(0)
                    trips = sum("\tReadyForQuery\t" in line for line in trace) / 50
                async with pool.connection() as conn:
                    app_before, db_before = time.process_time(), backend_cpu(conn)
                for _ in range(CPU_REQUESTS):
                    await send()
                async with pool.connection() as conn:
                    return (trips, *per_request(time.process_time(), backend_cpu(conn), app_before, db_before,
                                                CPU_REQUESTS))
        counts = {}
        for guard in ("plain", *GUARDS):
            app = asgi_app(pool, guard)
            for work, key in kinds_of(guard, "traced"):
                counts[f"asgi {work}"] = await count(app, key)
        return counts


def main():
    """Measures and prints the tables."""
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    frameworks = sys.argv[2:] or ["flask", "asgi"]
    import psycopg
    with psycopg.connect(os.environ["DATABASE_URL"], autocommit=True) as conn:
        conn.execute("""CREATE TABLE IF NOT EXISTS charges (
                            id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                            amount numeric NOT NULL,
                            created_at timestamptz NOT NULL DEFAULT now())""")
        conn.execute(recipe.TABLE)
    trips = count_round_trips()
    results = over_http(count, frameworks) if count else {}
    print(f"{count // BATCH * BATCH} sequential requests of each kind over HTTP, latency in µs; in process,"
          f" round trips and the CPU µs per request of {CPU_REQUESTS} more, of the app (this process,"
          " the test client included) and of its database session (guarded: two transactions;"
          " one: one transaction; recipe: hand-written):")
    print(f"{'request':<30}{'median':>8}{'p90':>8}{'round trips':>13}{'app CPU':>9}{'db CPU':>8}")
    medians = {}
    for kind in trips:
        if kind.split()[0] not in frameworks:
            continue
        lat = results.get(kind)
        medians[kind] = statistics.median(lat) if lat else None
        p90 = f"{statistics.quantiles(lat, n=10)[-1]:8.0f}" if lat else f"{'':8}"
        trip, app_cpu, db_cpu = trips[kind]
        db = "n/a" if db_cpu is None else f"{db_cpu:.0f}"
        median = f"{medians[kind]:8.0f}" if lat else f"{'':8}"
        print(f"{kind:<30}{median}{p90}{trip:13.1f}{app_cpu:9.0f}{db:>8}")
    print("\nours ÷ hand-written (the recipe's over ours; above 1.0x ours is faster): median latency"
          " over HTTP; CPU per request in process, app and database together:")
    print(f"{'mode':<24}{'fresh':>8}{'replay':>8}{'CPU fresh':>11}{'CPU replay':>11}")
    for framework in frameworks:
        for guard in MODES:
            kinds = [(f"{framework} recipe {work}", f"{framework} {guard} {work}") for work in ("fresh", "replay")]
            latency = "".join(f"{medians[r] / medians[o]:7.2f}x" if results else f"{'':8}" for r, o in kinds)
            cpu = "".join(f"{cpu_of(trips[r]) / cpu_of(trips[o]):10.2f}x" for r, o in kinds)
            print(f"{framework + ', ' + GUARDS[guard]:<24}{latency}{cpu}")


def cpu_of(counted):
    """The app's and the database's CPU per request together (the app's alone where the other is unknown)."""
    _trips, app_cpu, db_cpu = counted
    return app_cpu + (db_cpu or 0)


def over_http(count, frameworks):
    """Latencies in µs of count requests of each kind, each framework's
    servers in processes of their own, the kinds taking turns."""
    servers, kinds = [], {}
    run = uuid.uuid4().hex  # replayed keys of this run only
    try:
        for framework in frameworks:
            for guard in ("plain", *GUARDS):
                process, port = start(f"{framework}-{guard}")
                servers.append(process)
                for work, keys in kinds_of(guard, f"{run}-{framework}"):
                    kinds[f"{framework} {work}"] = (port, keys)
        results = {kind: [] for kind in kinds}
        # Rounds of 100 of each kind in turn, so that the load of the machine
        # weighs on every kind alike.
        for _ in range(max(1, count // BATCH)):
            for kind, (port, keys) in kinds.items():
                results[kind] += timings(kind, port, BATCH, keys)
    finally:
        for process in servers:
            process.kill()
            process.wait()
    return results


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2], int(sys.argv[3]))
    else:
        main()
