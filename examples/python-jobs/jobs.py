"""Payment jobs on procrastinate, charged once however often they are delivered.

procrastinate delivers a job at least once: a worker that dies after the
job's work committed and before procrastinate marked it done leaves it
"doing", and the job is delivered again (here: retried by the stalled-job
watch of a live worker). The job's work is an idempotent function keyed by
the order: its charge commits with its stored result, so a redelivery gets
that result back and charges nothing.

    ./run schema                       creates procrastinate's tables and charges (once)
    ./run defer ORDER AMOUNT [OPTIONS] defers a charge job; OPTIONS (JSON) adds
                                       "stall": true (the first delivery hangs
                                       after its charge, uncommitted) or
                                       "die_after_commit": true (the worker dies
                                       after the work committed, before the acknowledgment)
    ./run worker                       runs a worker (stops on SIGINT/SIGTERM)
    ./run storm [ORDERS DELIVERIES WORKERS]
                                       a redelivery storm (default: 100 orders, each
                                       delivered 20 times, over 8 worker processes),
                                       wrapped then bare: jobs/s and charges of each

Environment: DATABASE_URL; JOBS_STALLED_AFTER, seconds without a heartbeat
after which a worker's jobs are delivered again (default 30);
JOBS_CONCURRENCY (default 4); JOBS_QUEUE (default payments); JOBS_WAIT=off
stops a worker when its queue is empty. Each job run prints one JSON line:
{"job": id, "order": ..., "result": ..., "replayed": true|false}.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys

import procrastinate
import psycopg
from psycopg_pool import AsyncConnectionPool

from pg_idempotency import InProgress, idempotent_function
from pg_idempotency.function import arguments_fingerprint

DATABASE_URL = os.environ.get("DATABASE_URL", "")
STALLED_AFTER = float(os.environ.get("JOBS_STALLED_AFTER", "30"))

app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=DATABASE_URL))
pool = AsyncConnectionPool(DATABASE_URL, min_size=1, max_size=10, open=False)


def order_fingerprint(arguments):
    """The job's payload is the order and its amount: the test knobs are not part of it."""
    return arguments_fingerprint({"order": arguments["order"], "amount": arguments["amount"]})


@idempotent_function(pool, key="order", scope="jobs:charge", fingerprint=order_fingerprint)
async def charge(run, order, amount, stall=False):
    """Charges amount for order, once: the charge commits with the stored result."""
    cur = await run.conn.execute("INSERT INTO charges (amount) VALUES (%s) RETURNING id", (amount,))
    charge_id = (await cur.fetchone())[0]
    if stall:
        await asyncio.sleep(3600)   # the test kills the worker here: nothing commits
    return {"charge": charge_id}


# InProgress: another delivery of the order runs now; try again shortly.
@app.task(name="charge", queue="payments", pass_context=True,
          retry=procrastinate.RetryStrategy(max_attempts=20, wait=1, retry_exceptions={InProgress}))
async def charge_job(context, order, amount, stall=False, die_after_commit=False):
    """The job: the idempotent charge, then procrastinate's acknowledgment."""
    job = context.job
    first_delivery = job.attempts == 0
    outcome = await charge.outcome(order=order, amount=amount, stall=stall and first_delivery)
    print(json.dumps({"job": job.id, "order": order, "result": outcome.result,
                      "replayed": outcome.replayed}), flush=True)
    if die_after_commit and not outcome.replayed:
        os.kill(os.getpid(), signal.SIGKILL)   # after the commit, before the acknowledgment
    return outcome.result


@app.task(name="charge_bare", queue="payments")
async def charge_bare(order, amount):
    """The same charge without the record (the storm's baseline): every delivery charges."""
    async with pool.connection() as conn:
        cur = await conn.execute("INSERT INTO charges (amount) VALUES (%s) RETURNING id", (amount,))
        return {"charge": (await cur.fetchone())[0]}


async def deliver_stalled_jobs_again():
    """Delivers again the jobs of workers whose heartbeat stopped (they died)."""
    while True:
        await asyncio.sleep(STALLED_AFTER / 4)
        for job in await app.job_manager.get_stalled_jobs(seconds_since_heartbeat=STALLED_AFTER):
            try:
                await app.job_manager.retry_job(job)
            except procrastinate.exceptions.ConnectorException as err:
                print(f"job {job.id} was delivered again by another worker: {err}", file=sys.stderr)


async def work():
    """Runs a worker and the stalled-job watch until SIGINT or SIGTERM."""
    await pool.open()
    async with app.open_async():
        watch = asyncio.ensure_future(deliver_stalled_jobs_again())
        try:
            await app.run_worker_async(
                queues=[os.environ.get("JOBS_QUEUE", "payments")], wait=os.environ.get("JOBS_WAIT") != "off",
                concurrency=int(os.environ.get("JOBS_CONCURRENCY", "4")),
                update_heartbeat_interval=STALLED_AFTER / 4, stalled_worker_timeout=STALLED_AFTER)
        finally:
            watch.cancel()
    await pool.close()


async def create_schema():
    """Creates procrastinate's tables and the charges table, when missing."""
    async with await psycopg.AsyncConnection.connect(DATABASE_URL, autocommit=True) as conn:
        await conn.execute("""CREATE TABLE IF NOT EXISTS charges (
                                  id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                                  amount numeric NOT NULL,
                                  created_at timestamptz NOT NULL DEFAULT now())""")
        exists = (await (await conn.execute(
            "SELECT to_regclass('procrastinate_jobs') IS NOT NULL")).fetchone())[0]
    if not exists:
        async with app.open_async():
            await app.schema_manager.apply_schema_async()


async def defer(order, amount, options):
    """Defers one charge job."""
    async with app.open_async():
        job_id = await charge_job.defer_async(order=order, amount=amount, **options)
    print(job_id)


async def defer_storm(task, queue, orders, deliveries, amount):
    """Defers each of orders charges deliveries times, in rounds (duplicates race)."""
    async with app.open_async():
        await task.configure(queue=queue).batch_defer_async(
            *[{"order": f"{queue}-{i}", "amount": amount} for _ in range(deliveries) for i in range(orders)])


async def storm_figures(queue, amount):
    """Jobs per second (first start to last success) and the charges made, of queue's jobs."""
    async with await psycopg.AsyncConnection.connect(DATABASE_URL) as conn:
        cur = await conn.execute(
            """SELECT count(*) FILTER (WHERE e.type = 'succeeded'),
                      extract(epoch FROM max(e.at) FILTER (WHERE e.type = 'succeeded')
                                         - min(e.at) FILTER (WHERE e.type = 'started')),
                      (SELECT count(*) FROM charges WHERE amount = %s)
                 FROM procrastinate_events e JOIN procrastinate_jobs j ON j.id = e.job_id
                WHERE j.queue_name = %s""", (amount, queue))
        return await cur.fetchone()


def storm(orders=100, deliveries=20, workers=8):
    """The redelivery storm, wrapped then bare, each over workers processes."""
    for name, task, amount in (("wrapped", charge_job, 1001), ("bare", charge_bare, 1002)):
        queue = "storm-" + name
        asyncio.run(defer_storm(task, queue, orders, deliveries, amount))
        env = {**os.environ, "JOBS_QUEUE": queue, "JOBS_WAIT": "off", "JOBS_CONCURRENCY": "1"}
        processes = [subprocess.Popen([sys.executable, "-c", "import sys, jobs; jobs.main(['', 'worker'])"],
                                      env=env, stdout=subprocess.DEVNULL,
                                      cwd=os.path.dirname(os.path.abspath(__file__)))
                     for _ in range(workers)]
        for process in processes:
            process.wait()
        done, seconds, charges = asyncio.run(storm_figures(queue, amount))
        print(f"{name}: {done} jobs ({orders} orders x {deliveries}) over {workers} workers in "
              f"{float(seconds):.2f} s: {done / float(seconds):.0f} jobs/s; {charges} charges")


def main(argv):
    """Runs the command argv names."""
    command = argv[1] if len(argv) > 1 else "worker"
    if command == "worker":
        asyncio.run(work())
    elif command == "schema":
        asyncio.run(create_schema())
    elif command == "storm":
        storm(*(int(arg) for arg in argv[2:5]))
    elif command == "defer":
        options = json.loads(argv[4]) if len(argv) > 4 else {}
        asyncio.run(defer(argv[2], json.loads(argv[3]), options))
    else:
        sys.exit("usage: ./run worker | schema | defer ORDER AMOUNT [OPTIONS] | storm [ORDERS DELIVERIES WORKERS]")


if __name__ == "__main__":
    main(sys.argv)
