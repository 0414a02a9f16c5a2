//! The idempotent function (`idempotent`, `Function`) against the database:
//! the work runs once and its writes commit with its stored result; a
//! duplicate gets the result back (deserialized) without running; other
//! arguments are a mismatch; an error frees the key, a final one is stored;
//! a duplicate of a running call waits, then is told it is in progress; two
//! transactions renew the lease, and a takeover resumes after a checkpoint.

mod common;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

use common::{connect, count_rows, create_table, unique};
use pg_idempotency::{Function, FunctionError, Work, idempotent, lookup};
use serde_json::json;
use tokio::sync::Semaphore;

/// A table of its own and a run counter.
async fn table_and_runs(name: &str) -> (String, Arc<AtomicUsize>) {
    let table = unique(name);
    create_table(&connect().await, &table).await;
    (table, Arc::new(AtomicUsize::new(0)))
}

/// The future of a charging run.
type Charged = std::pin::Pin<Box<dyn Future<Output = Result<(i64, String), String>> + Send>>;

/// Work that charges a row of `table` in its transaction and returns
/// `(id, note)`; counts its runs.
fn charging(table: &str, runs: &Arc<AtomicUsize>) -> impl FnMut(Work) -> Charged {
    let (table, runs) = (table.to_owned(), runs.clone());
    move |work: Work| {
        let (table, runs) = (table.clone(), runs.clone());
        Box::pin(async move {
            runs.fetch_add(1, SeqCst);
            let mut db = work.lock().await.map_err(|err| err.to_string())?;
            let sql = format!("INSERT INTO {table} (note) VALUES ('charged') RETURNING id");
            let id: i64 = sqlx::query_scalar(&sql).fetch_one(&mut *db).await.map_err(|err| err.to_string())?;
            Ok((id, "charged".to_owned()))
        })
    }
}

/// Writes a row of `table` in the work's transaction.
async fn write_row(work: &Work, table: &str) {
    let mut db = work.lock().await.unwrap();
    sqlx::raw_sql(&format!("INSERT INTO {table} (note) VALUES ('x')")).execute(&mut *db).await.unwrap();
}

#[tokio::test]
async fn runs_once_and_replays_the_result_to_its_type() {
    let pool = common::pool();
    let (table, runs) = table_and_runs("fn_once").await;
    let key = unique("fn");
    let args = json!({"amount": 10, "currency": "EUR"});
    let first = idempotent(&pool, &key, &args, charging(&table, &runs)).await.unwrap();
    // Same arguments in another key order: the same call.
    let again = json!({"currency": "EUR", "amount": 10});
    let second: (i64, String) = idempotent(&pool, &key, &again, charging(&table, &runs)).await.unwrap();
    assert_eq!(first, second);
    assert_eq!(runs.load(SeqCst), 1);
    assert_eq!(count_rows(&pool, &table).await, 1);
    let record = lookup(&pool, &key, None).await.unwrap().unwrap();
    assert_eq!(record.response.unwrap().body, serde_json::to_vec(&first).unwrap());
}

#[tokio::test]
async fn other_arguments_are_a_mismatch() {
    let pool = common::pool();
    let (table, runs) = table_and_runs("fn_mismatch").await;
    let key = unique("fn");
    idempotent(&pool, &key, &json!({"amount": 10}), charging(&table, &runs)).await.unwrap();
    let other = idempotent(&pool, &key, &json!({"amount": 11}), charging(&table, &runs)).await;
    assert!(matches!(other, Err(FunctionError::Mismatch)), "{other:?}");
    assert_eq!(runs.load(SeqCst), 1);
}

#[tokio::test]
async fn an_error_rolls_back_and_frees_the_key() {
    for one_transaction in [true, false] {
        let pool = common::pool();
        let (table, _) = table_and_runs("fn_error").await;
        let key = unique("fn");
        let function = Function::new(pool.clone()).one_transaction(one_transaction);
        let failed = function
            .run(&key, &1, |work: Work| {
                let table = table.clone();
                async move {
                    write_row(&work, &table).await;
                    Err::<i64, _>("declined by the bank".to_owned())
                }
            })
            .await;
        assert!(matches!(&failed, Err(FunctionError::Failed(message)) if message == "declined by the bank"), "{failed:?}");
        assert_eq!(count_rows(&pool, &table).await, 0, "one_transaction {one_transaction}");
        assert!(lookup(&pool, &key, None).await.unwrap().is_none(), "the key is free");
        let retried = function.run(&key, &1, |_| async { Ok::<_, String>(7) }).await.unwrap();
        assert_eq!(retried, 7);
    }
}

#[tokio::test]
async fn a_final_error_is_stored_and_given_back() {
    for one_transaction in [true, false] {
        let pool = common::pool();
        let (table, runs) = table_and_runs("fn_final").await;
        let key = unique("fn");
        let function = Function::new(pool.clone())
            .one_transaction(one_transaction)
            .final_errors(|err: &String| err.starts_with("declined"));
        let fail = |work: Work| {
            let (table, runs) = (table.clone(), runs.clone());
            async move {
                runs.fetch_add(1, SeqCst);
                write_row(&work, &table).await;
                Err::<i64, _>("declined: insufficient funds".to_owned())
            }
        };
        let first = function.run(&key, &1, fail).await;
        assert!(matches!(first, Err(FunctionError::Failed(_))), "{first:?}");
        let second = function.run(&key, &1, fail).await;
        assert!(
            matches!(&second, Err(FunctionError::Stored { message }) if message == "declined: insufficient funds"),
            "one_transaction {one_transaction}: {second:?}"
        );
        assert_eq!(runs.load(SeqCst), 1);
        assert_eq!(count_rows(&pool, &table).await, 0);
    }
}

/// Starts a call of `function` with `key` whose work waits for a permit of
/// `gate`; returns once the work runs.
async fn running(function: &Function, key: &str, gate: &Arc<Semaphore>) -> tokio::task::JoinHandle<Result<i64, FunctionError<String>>> {
    let started = Arc::new(Semaphore::new(0));
    let (function, key, gate, signal) = (function.clone(), key.to_owned(), gate.clone(), started.clone());
    let first = tokio::spawn(async move {
        function
            .run(&key, &1, move |_| {
                let (gate, signal) = (gate.clone(), signal.clone());
                async move {
                    signal.add_permits(1);
                    gate.acquire().await.unwrap().forget();
                    Ok::<_, String>(42)
                }
            })
            .await
    });
    started.acquire().await.unwrap().forget();
    first
}

#[tokio::test]
async fn a_duplicate_of_a_running_call_is_in_progress_or_waits_for_it() {
    let pool = common::pool();
    let key = unique("fn");
    // Two transactions: the claim is visible while the work runs.
    let function = Function::new(pool.clone()).one_transaction(false).wait(Duration::ZERO);
    let gate = Arc::new(Semaphore::new(0));
    let first = running(&function, &key, &gate).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = {
        let runs = runs.clone();
        move |_| {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, SeqCst);
                Ok::<_, String>(0)
            }
        }
    };
    let duplicate = function.run(&key, &1, counted.clone()).await;
    assert!(matches!(duplicate, Err(FunctionError::InProgress { retry_after }) if retry_after >= 1), "{duplicate:?}");
    // With a wait, the duplicate gets the first's result once it completes.
    let waiting = {
        let (function, key, counted) = (function.clone().wait(Duration::from_secs(30)), key.clone(), counted);
        tokio::spawn(async move { function.run(&key, &1, counted).await })
    };
    common::wait_for_backend(&key, "state = 'active' AND query LIKE '%idempotency.claim(%'").await;
    gate.add_permits(1);
    assert_eq!(first.await.unwrap().unwrap(), 42);
    assert_eq!(waiting.await.unwrap().unwrap(), 42);
    assert_eq!(runs.load(SeqCst), 0);
}

#[tokio::test]
async fn two_transactions_renew_the_lease_while_the_work_runs() {
    let pool = common::pool();
    let function = Function::new(pool.clone()).one_transaction(false).lease(Duration::from_secs(2)).extend_every(Duration::from_millis(100));
    renewed_while_running(&pool, &function).await;
    // By default every third of the database's lease (here 1.5 s: every 0.5 s).
    let short = common::pool_with_settings(&[("idempotency.lease", "1500ms")]);
    renewed_while_running(&pool, &Function::new(short).one_transaction(false)).await;
}

/// Asserts that a call of `function` renews its lease while its work runs.
async fn renewed_while_running(pool: &sqlx::PgPool, function: &Function) {
    let key = unique("fn");
    let gate = Arc::new(Semaphore::new(0));
    let first = running(function, &key, &gate).await;
    let claimed = lookup(pool, &key, None).await.unwrap().unwrap().lease_expires_at.unwrap();
    let mut renewed = claimed;
    for _ in 0..1000 {
        renewed = lookup(pool, &key, None).await.unwrap().unwrap().lease_expires_at.unwrap();
        if renewed > claimed {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(renewed > claimed, "the lease was not renewed");
    gate.add_permits(1);
    assert_eq!(first.await.unwrap().unwrap(), 42);
}

#[tokio::test]
async fn a_takeover_resumes_after_the_last_checkpoint() {
    let pool = common::pool();
    let key = unique("fn");
    // A run that checkpoints, then dies holding its lease (its future is
    // forgotten: no release, no renewal).
    let dying = Function::new(pool.clone()).one_transaction(false).lease(Duration::from_millis(300)).extend_every(Duration::from_secs(3600));
    let checkpointed = Arc::new(Semaphore::new(0));
    let signal = checkpointed.clone();
    let mut run = Box::pin(dying.run(&key, &1, move |work: Work| {
        let signal = signal.clone();
        async move {
            work.checkpoint("charged", Some(&json!({"charge": "ch_1"}))).await.unwrap();
            signal.add_permits(1);
            std::future::pending::<Result<String, String>>().await
        }
    }));
    tokio::select! {
        _ = &mut run => unreachable!(),
        permit = checkpointed.acquire() => permit.unwrap().forget(),
    }
    std::mem::forget(run);
    // The next call takes over once the lease ends, as attempt 2, with the checkpoint.
    let next = Function::new(pool.clone()).one_transaction(false).wait(Duration::from_secs(30));
    let resumed = next
        .run(&key, &1, |work: Work| async move {
            Ok::<_, String>(format!("{} {:?} {}", work.attempt(), work.recovery_point(), work.recovery_state().unwrap()["charge"]))
        })
        .await
        .unwrap();
    assert_eq!(resumed, "2 Some(\"charged\") \"ch_1\"");
}
