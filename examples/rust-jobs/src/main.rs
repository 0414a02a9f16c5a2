//! Jobs that run once however often the queue delivers them: an apalis
//! queue "charges" (apalis-postgres, its tables in the application's
//! database), whose job charges `amount` into the same charges table as the
//! example apps' POST /payments. The job is an idempotent function of
//! pg-idempotency keyed by the job's id: a job delivered again (its worker
//! died after its work committed, before apalis acknowledged it) gets the
//! stored result, and nothing is charged again.
//!
//!   ./run worker            works on the queue until SIGTERM
//!   ./run enqueue AMOUNT    sends a job; prints its id
//!   ./run status ID         prints the job's state and output (JSON)
//!   ./run storm once|bare   the redelivery storm: jobs per second, effects
//!
//! Environment: DATABASE_URL; JOBS_EXPIRE_SECONDS (default 60: how long a
//! worker may go unheard before apalis delivers its jobs again);
//! JOBS_ACK=transaction (the job's acknowledgment commits with its work);
//! for the tests, JOBS_CRASH=mid-job (the worker dies after writing the
//! charge, before its transaction commits) or after-commit (after the
//! function committed, before apalis's acknowledgment).

use std::env;
use std::error::Error;
use std::str::FromStr;
use std::time::{Duration, Instant};

use apalis::prelude::{BoxDynError, Data, TaskBuilder, TaskId, TaskSink, WorkerBuilder, WorkerContext};
use apalis::prelude::WorkerBuilderExt;
use apalis_postgres::{Config, PostgresStorage};
use pg_idempotency::{Function, Work};
use serde::{Deserialize, Serialize};
use serde_json::{Number, Value, json};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgConnection, PgPool};

const QUEUE: &str = "charges";

const CREATE_CHARGES: &str = "CREATE TABLE IF NOT EXISTS charges (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    amount numeric NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now())";

/// A job: charge this amount.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Charge {
    amount: Number,
}

/// What every job gets: the idempotent function on the application's pool
/// (SQLx 0.8, as pg-idempotency), and how this worker was started.
#[derive(Clone)]
struct Worker {
    function: Function,
    ack_in_transaction: bool,
    crash: Option<String>,
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let done = match args[..] {
        ["worker"] => work().await,
        ["enqueue", amount] => enqueue(amount).await,
        ["status", id] => status(id).await,
        ["storm", mode] => storm(mode).await,
        _ => Err("usage: run worker | enqueue AMOUNT | status ID | storm once|bare".into()),
    };
    if let Err(err) = done {
        eprintln!("charge-jobs: {err}");
        std::process::exit(1);
    }
}

/// The application's pool (pg-idempotency's SQLx) and the queue's (apalis-postgres's SQLx).
async fn pools() -> Result<(PgPool, apalis_postgres::PgPool), Box<dyn Error>> {
    let url = env::var("DATABASE_URL").map_err(|_| "DATABASE_URL is not set")?;
    let app = PgPoolOptions::new().max_connections(10).connect_with(PgConnectOptions::from_str(&url)?).await?;
    let queue = apalis_postgres::PgPool::connect(&url).await?;
    Ok((app, queue))
}

/// The queue's storage, its tables made when missing.
async fn storage(queue_pool: &apalis_postgres::PgPool, queue: &str) -> Result<PostgresStorage<Charge>, Box<dyn Error>> {
    PostgresStorage::setup(queue_pool).await?;
    // A worker unheard for JOBS_EXPIRE_SECONDS is dead: its jobs are delivered again.
    let expire: u64 = env::var("JOBS_EXPIRE_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(60);
    let config = Config::default().queue(queue).heartbeat_interval(Duration::from_secs(1)).missed_heartbeats(expire.max(1) as usize);
    Ok(PostgresStorage::new(queue_pool).with_config(config))
}

/// Works on the queue until SIGTERM or SIGINT.
async fn work() -> Result<(), Box<dyn Error>> {
    let (pool, queue_pool) = pools().await?;
    sqlx::raw_sql(CREATE_CHARGES).execute(&pool).await?;
    let worker = Worker {
        function: Function::new(pool).scope(format!("apalis:{QUEUE}")),
        ack_in_transaction: env::var("JOBS_ACK").as_deref() == Ok("transaction"),
        crash: env::var("JOBS_CRASH").ok(),
    };
    // A name of its own: a dead worker's jobs go to others once it is unheard.
    let name = format!("charge-worker-{}", std::process::id());
    WorkerBuilder::new(name.as_str())
        .backend(storage(&queue_pool, QUEUE).await?)
        .data(worker)
        .concurrency(8)
        .build(charge)
        .run_until(shutdown())
        .await?;
    Ok(())
}

/// Resolves on SIGTERM or SIGINT.
async fn shutdown() -> Result<(), std::io::Error> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => Ok(()),
        interrupted = tokio::signal::ctrl_c() => interrupted,
    }
}

/// The job: charges the amount once per job id. Its writes and its result
/// commit together (one transaction); a delivery of a job that already ran
/// gets that result back without running. With JOBS_ACK=transaction, the
/// job's acknowledgment commits with them too.
async fn charge(job: Charge, id: TaskId, context: WorkerContext, worker: Data<Worker>) -> Result<Value, BoxDynError> {
    let key = id.to_string();
    let result = worker
        .function
        .run(&key, &job, |work: Work| {
            let (amount, key, worker, name) = (job.amount.to_string(), key.clone(), worker.clone(), context.name().to_owned());
            async move {
                let mut db = work.lock().await.map_err(|err| err.to_string())?;
                let charge: i64 = sqlx::query_scalar("INSERT INTO charges (amount) VALUES ($1::text::numeric) RETURNING id")
                    .bind(&amount)
                    .fetch_one(&mut *db)
                    .await
                    .map_err(|err| err.to_string())?;
                if worker.crash.as_deref() == Some("mid-job") {
                    crash("mid-job: the charge is written, not committed");
                }
                let result = json!({ "charge": charge });
                if worker.ack_in_transaction {
                    acknowledge(&mut db, &key, &name, &result).await.map_err(|err| err.to_string())?;
                }
                Ok::<_, String>(result)
            }
        })
        .await?;
    if worker.crash.as_deref() == Some("after-commit") {
        crash("after-commit: the job's work committed, apalis has not acknowledged it");
    }
    Ok(result)
}

/// Marks the job done with its result, as apalis's acknowledgment does, in
/// the job's transaction: apalis's tables are in this database, so the
/// acknowledgment commits with the work (apalis's own, after the job
/// returns, then finds the job done and writes the same again).
async fn acknowledge(db: &mut PgConnection, id: &str, worker: &str, result: &Value) -> Result<(), sqlx::Error> {
    let acknowledged = sqlx::query(
        "UPDATE apalis.jobs SET status = 'Done', done_at = now(), last_result = jsonb_build_object('Ok', $3::jsonb)
         WHERE id = $1 AND lock_by = $2",
    )
    .bind(id)
    .bind(worker)
    .bind(result)
    .execute(db)
    .await?;
    if acknowledged.rows_affected() != 1 {
        return Err(sqlx::Error::Protocol(format!("job {id} is not held by worker {worker}")));
    }
    Ok(())
}

/// Ends the process at once, as a kill would (no destructor runs: the
/// connections drop with it, and an open transaction rolls back).
fn crash(where_: &str) -> ! {
    eprintln!("crashing ({where_})");
    std::process::abort();
}

/// Sends a job charging `amount`; prints its id.
async fn enqueue(amount: &str) -> Result<(), Box<dyn Error>> {
    let (_, queue_pool) = pools().await?;
    let amount = Number::from_str(amount).map_err(|_| format!("not an amount: {amount}"))?;
    let id = ulid::Ulid::generate().to_string();
    let task = TaskBuilder::new(Charge { amount }).task_id(TaskId::from_string(&id)).build();
    storage(&queue_pool, QUEUE).await?.push_task(task).await?;
    println!("{id}");
    Ok(())
}

/// Prints the state and output of job `id`: `completed {"charge": N}` once done.
async fn status(id: &str) -> Result<(), Box<dyn Error>> {
    let (pool, _) = pools().await?;
    let job: Option<(String, Option<Value>)> = sqlx::query_as("SELECT status, last_result FROM apalis.jobs WHERE id = $1")
        .bind(id)
        .fetch_optional(&pool)
        .await?;
    match job {
        None => println!("none"),
        Some((state, result)) if state == "Done" => {
            println!("completed {}", result.as_ref().and_then(|r| r.get("Ok")).unwrap_or(&Value::Null));
        }
        Some((state, result)) => println!("{} {}", state.to_lowercase(), result.unwrap_or(Value::Null)),
    }
    Ok(())
}

/// The redelivery storm: ORDERS units of work, each sent as DELIVERIES
/// jobs (what a queue redelivering every job that often hands its workers),
/// worked on WORKERS at once; the job wrapped in the function keyed by the
/// order (`once`), or the bare handler (`bare`).
const ORDERS: u32 = 100;
const DELIVERIES: u32 = 20;
const WORKERS: usize = 8;

/// Runs the storm; prints jobs per second and the effects the orders got.
async fn storm(mode: &str) -> Result<(), Box<dyn Error>> {
    let once = match mode {
        "once" => true,
        "bare" => false,
        _ => return Err("storm once | bare".into()),
    };
    let (pool, queue_pool) = pools().await?;
    let queue = format!("storm-{mode}-{}", std::process::id());
    sqlx::raw_sql("CREATE TABLE IF NOT EXISTS storm_effects (order_id int NOT NULL, mode text NOT NULL, queue text NOT NULL)")
        .execute(&pool)
        .await?;
    let mut storage = storage(&queue_pool, &queue).await?;
    let mut tasks = Vec::new();
    for _ in 0..DELIVERIES {
        for order in 0..ORDERS {
            tasks.push(TaskBuilder::new(Charge { amount: Number::from(order) }).build());
        }
    }
    storage.push_all(&mut futures_util::stream::iter(tasks)).await?;
    let total = ORDERS * DELIVERIES;
    let started = Instant::now();
    let function = Function::new(pool.clone()).scope("storm").wait(Duration::from_secs(30));
    let run = Storm { pool: pool.clone(), function, queue: queue.clone(), once };
    let worker = WorkerBuilder::new(format!("storm-{}", std::process::id()).as_str())
        .backend(storage)
        .data(run)
        .concurrency(WORKERS)
        .build(storm_job)
        .run_until(all_done(pool.clone(), queue.clone(), total));
    worker.await?;
    let seconds = started.elapsed().as_secs_f64();
    let (effects, orders, most): (i64, i64, i32) = sqlx::query_as(
        "SELECT coalesce(sum(n), 0)::int8, count(*), coalesce(max(n), 0)::int4
         FROM (SELECT order_id, count(*) AS n FROM storm_effects WHERE queue = $1 GROUP BY order_id) AS o",
    )
    .bind(&queue)
    .fetch_one(&pool)
    .await?;
    println!(
        "{mode}: {total} jobs ({ORDERS} orders x {DELIVERIES}) over {WORKERS} workers: {:.0} jobs/s; \
         {effects} effects on {orders} orders, at most {most} per order",
        f64::from(total) / seconds
    );
    Ok(())
}

/// What a storm job gets.
#[derive(Clone)]
struct Storm {
    pool: PgPool,
    function: Function,
    queue: String,
    once: bool,
}

/// A storm job: the effect for its order, in the function keyed by the order, or bare.
async fn storm_job(job: Charge, storm: Data<Storm>) -> Result<Value, BoxDynError> {
    let order = job.amount.as_i64().ok_or("an order number")? as i32;
    let insert = "INSERT INTO storm_effects VALUES ($1, $2, $3)";
    let mode = if storm.once { "once" } else { "bare" };
    if !storm.once {
        let mut tx = storm.pool.begin().await?;
        sqlx::query(insert).bind(order).bind(mode).bind(&storm.queue).execute(&mut *tx).await?;
        tx.commit().await?;
        return Ok(json!({ "order": order }));
    }
    let key = format!("{}:{order}", storm.queue);
    let result = storm
        .function
        .run(&key, &order, |work: Work| {
            let queue = storm.queue.clone();
            async move {
                let mut db = work.lock().await.map_err(|err| err.to_string())?;
                sqlx::query(insert).bind(order).bind(mode).bind(&queue).execute(&mut *db).await.map_err(|err| err.to_string())?;
                Ok::<_, String>(json!({ "order": order }))
            }
        })
        .await?;
    Ok(result)
}

/// Resolves once every job of the storm's queue is done (polled).
async fn all_done(pool: PgPool, queue: String, total: u32) -> Result<(), std::io::Error> {
    loop {
        let done: Result<i64, _> = sqlx::query_scalar("SELECT count(*) FROM apalis.jobs WHERE job_type = $1 AND status = 'Done'")
            .bind(&queue)
            .fetch_one(&pool)
            .await;
        if done.is_ok_and(|done| done >= i64::from(total)) {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
