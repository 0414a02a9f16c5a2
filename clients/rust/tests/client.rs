//! The client API against the extension: every outcome, IK001, the
//! validation errors, and the fingerprint computed here against the database's.

mod common;

use std::time::{Duration, SystemTime};

use common::{connect, connect_one, count_rows, create_table, pool_with_settings, unique};
use sqlx::PgPool;
use pg_idempotency::{claim, fingerprint, lookup, ClaimOptions, Completion, Error, Outcome, Owner, State};
use serde_json::json;

/// Options with a scope of the test's own.
fn scoped(scope: &str) -> ClaimOptions {
    ClaimOptions { scope: Some(scope.to_owned()), ..ClaimOptions::default() }
}

/// Claims and expects `new`.
async fn claim_new(db: &PgPool, key: &str, fp: &[u8], options: &ClaimOptions) -> Owner {
    match claim(db, key, fp, options).await.unwrap() {
        Outcome::New(owner) => owner,
        other => panic!("expected new, got {:?}", other),
    }
}

#[tokio::test]
async fn a_completed_claim_replays_its_response() {
    let db = connect().await;
    let (key, options) = (unique("done"), scoped("tenant-a"));
    let fp = fingerprint("POST", "/payments", Some(b"{}"), None);
    let owner = claim_new(&db, &key, &fp, &options).await;
    assert_eq!(owner.attempt, 1);
    assert!(owner.fence > 0);
    assert_eq!(owner.recovery_point, None);

    let headers = [("content-type", "application/octet-stream"), ("link", "<a>"), ("link", "<b>")];
    let body = b"\x00\xffbinary\r\n";
    assert_eq!(owner.complete(&db, 201, &headers, body).await.unwrap(), Completion::Stored);

    match claim(&db, &key, &fp, &options).await.unwrap() {
        Outcome::Replay { response, created_at } => {
            assert_eq!(response.status_code, 201);
            assert_eq!(response.body, body);
            let mut got = response.headers.clone();
            got.sort();
            assert_eq!(
                got,
                [("content-type", "application/octet-stream"), ("link", "<a>"), ("link", "<b>")]
                    .map(|(n, v)| (n.to_owned(), v.to_owned()))
            );
            assert!(created_at <= SystemTime::now() + Duration::from_secs(60));
        }
        other => panic!("expected replay, got {:?}", other),
    }
    // Another scope is another key.
    claim_new(&db, &key, &fp, &scoped("tenant-b")).await;
}

#[tokio::test]
async fn bytes_come_back_whatever_bytea_output_the_database_sets() {
    // A DBA's `bytea_output = escape` (per database or role) changes how
    // bytea travels as text; the replayed body and the looked-up
    // fingerprint must not change with it.
    let db = pool_with_settings(&[("bytea_output", "escape")]);
    let (key, options) = (unique("escape"), scoped("tenant-e"));
    let fp = fingerprint("POST", "/payments", Some(b"\\x41"), None);
    let body = b"\x00\\\x7f\xff'\x41";
    claim_new(&db, &key, &fp, &options).await.complete(&db, 201, &[], body).await.unwrap();
    match claim(&db, &key, &fp, &options).await.unwrap() {
        Outcome::Replay { response, .. } => assert_eq!(response.body, body),
        other => panic!("expected replay, got {:?}", other),
    }
    let record = lookup(&db, &key, Some("tenant-e")).await.unwrap().unwrap();
    assert_eq!((record.fingerprint, record.response.unwrap().body), (fp.to_vec(), body.to_vec()));
}

#[tokio::test]
async fn a_live_claim_is_in_progress_and_another_request_a_mismatch() {
    let db = connect().await;
    let (key, options) = (unique("busy"), scoped("s"));
    let fp = fingerprint("POST", "/a", None, None);
    let owner = claim_new(&db, &key, &fp, &ClaimOptions { lease: Some(Duration::from_secs(30)), ..options.clone() }).await;
    match claim(&db, &key, &fp, &options).await.unwrap() {
        Outcome::InProgress { retry_after } => assert!((1..=30).contains(&retry_after), "{}", retry_after),
        other => panic!("expected in_progress, got {:?}", other),
    }
    let other = fingerprint("POST", "/a", Some(b"x"), None);
    assert!(matches!(claim(&db, &key, &other, &options).await.unwrap(), Outcome::Mismatch { .. }));
    owner.complete(&db, 200, &[], b"").await.unwrap();
    assert!(matches!(claim(&db, &key, &other, &options).await.unwrap(), Outcome::Mismatch { .. }));
}

#[tokio::test]
async fn a_server_error_is_released_and_runs_again() {
    let db = connect().await;
    let (key, options) = (unique("5xx"), scoped("s"));
    let fp = fingerprint("POST", "/a", None, None);
    let owner = claim_new(&db, &key, &fp, &options).await;
    assert_eq!(owner.complete(&db, 503, &[], b"down").await.unwrap(), Completion::Released);
    assert!(lookup(&db, &key, Some("s")).await.unwrap().is_none());
    claim_new(&db, &key, &fp, &options).await;
}

#[tokio::test]
async fn release_frees_the_key_once() {
    let db = connect().await;
    let (key, options) = (unique("release"), scoped("s"));
    let fp = fingerprint("POST", "/a", None, None);
    let owner = claim_new(&db, &key, &fp, &options).await;
    assert!(owner.release(&db).await.unwrap());
    assert!(!owner.release(&db).await.unwrap());
    let again = claim_new(&db, &key, &fp, &options).await;
    assert!(again.fence > owner.fence);
    assert!(matches!(owner.complete(&db, 200, &[], b"").await, Err(Error::ClaimLost(_))));
}

#[tokio::test]
async fn a_takeover_gets_the_checkpoint_and_fences_out_the_first_owner() {
    let db = connect().await;
    let key = unique("takeover");
    let options = ClaimOptions { lease: Some(Duration::from_millis(300)), ..scoped("s") };
    let fp = fingerprint("POST", "/a", None, None);
    let first = claim_new(&db, &key, &fp, &options).await;

    let until = first.extend(&db, Some(Duration::from_millis(400))).await.unwrap();
    assert!(until > SystemTime::now() + Duration::from_millis(200), "the lease was renewed");
    first.checkpoint(&db, "charged", Some(&json!({"charge": 7}))).await.unwrap();
    let record = lookup(&db, &key, Some("s")).await.unwrap().unwrap();
    assert_eq!(record.recovery_point.as_deref(), Some("charged"));
    assert_eq!(record.lease, Some(Duration::from_millis(300)));

    tokio::time::sleep(Duration::from_millis(450)).await; // the 300 ms lease ends
    let second = claim_new(&db, &key, &fp, &options).await;
    assert_eq!(second.attempt, 2);
    assert!(second.fence > first.fence);
    assert_eq!(second.recovery_point.as_deref(), Some("charged"));
    assert_eq!(second.recovery_state, Some(json!({"charge": 7})));

    let lost = [
        first.complete(&db, 200, &[], b"").await.map(|_| ()),
        first.extend(&db, None).await.map(|_| ()),
        first.checkpoint(&db, "x", None).await,
    ];
    for result in lost {
        let err = result.unwrap_err();
        assert!(matches!(err, Error::ClaimLost(_)), "{:?}", err);
        assert_eq!(err.sqlstate().as_deref(), Some("IK001"));
    }
    assert_eq!(second.complete(&db, 200, &[], b"ok").await.unwrap(), Completion::Stored);
}

#[tokio::test]
async fn a_lost_claim_rolls_back_the_business_writes_of_its_transaction() {
    let db = connect().await;
    let table = unique("lost_writes");
    create_table(&db, &table).await;
    let (key, options) = (unique("lost"), scoped("s"));
    let fp = fingerprint("POST", "/a", None, None);
    let owner = claim_new(&db, &key, &fp, &options).await;
    assert!(owner.release(&db).await.unwrap()); // as a reaper or takeover would

    let mut tx = db.begin().await.unwrap();
    sqlx::query(&format!("INSERT INTO {table} (note) VALUES ('charged')")).execute(&mut *tx).await.unwrap();
    let err = owner.complete(&mut *tx, 201, &[], b"{}").await.unwrap_err();
    assert!(matches!(err, Error::ClaimLost(_)), "{:?}", err);
    tx.rollback().await.unwrap();
    assert_eq!(count_rows(&db, &table).await, 0);
}

#[tokio::test]
async fn lookup_shows_a_record_as_claim_sees_it() {
    let db = connect().await;
    let (key, scope) = (unique("lookup"), "s");
    assert!(lookup(&db, &key, Some(scope)).await.unwrap().is_none());
    let options = ClaimOptions { retention: Some(Duration::from_secs(3600)), ..scoped(scope) };
    let fp = fingerprint("PATCH", "/a", Some(b"1"), Some("q=1"));
    let owner = claim_new(&db, &key, &fp, &options).await;

    let running = lookup(&db, &key, Some(scope)).await.unwrap().unwrap();
    assert_eq!(running.state, State::InProgress);
    assert!(running.response.is_none());
    assert!(running.lease_expires_at.is_some());
    assert!(running.lease.is_some());
    assert_eq!(running.fingerprint, fp);
    assert_eq!(running.attempt, 1);

    owner.complete(&db, 202, &[("location", "/jobs/1")], b"queued").await.unwrap();
    let done = lookup(&db, &key, Some(scope)).await.unwrap().unwrap();
    assert_eq!(done.state, State::Completed);
    assert_eq!((done.scope.as_str(), done.key.as_str()), (scope, key.as_str()));
    let response = done.response.unwrap();
    assert_eq!((response.status_code, response.body.as_slice()), (202, &b"queued"[..]));
    assert_eq!(response.headers, [("location".to_owned(), "/jobs/1".to_owned())]);
    assert!(done.completed_at.is_some());
    assert!(done.lease.is_none() && done.lease_expires_at.is_none(), "a completed record has no lease");
    assert_eq!(done.expires_at.duration_since(done.created_at).unwrap(), Duration::from_secs(3600));
}

#[tokio::test]
async fn a_claim_may_wait_for_the_owner_to_finish() {
    let db = connect().await;
    let (key, options) = (unique("wait"), scoped("s"));
    let fp = fingerprint("POST", "/a", None, None);
    let owner = claim_new(&db, &key, &fp, &options).await;
    let finisher = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        owner.complete(&connect().await, 201, &[], b"done").await.unwrap();
    });
    let waiting = ClaimOptions { wait: Some(Duration::from_secs(10)), ..options };
    match claim(&db, &key, &fp, &waiting).await.unwrap() {
        Outcome::Replay { response, .. } => assert_eq!(response.body, b"done"),
        other => panic!("expected replay after waiting, got {:?}", other),
    }
    finisher.await.unwrap();
}

#[tokio::test]
async fn bad_arguments_are_invalid_argument_errors() {
    let db = connect().await;
    let fp = fingerprint("POST", "/a", None, None);
    let options = scoped("s");
    let long = "k".repeat(256);
    for (key, fp) in [("", &fp[..]), (&long, &fp[..]), ("a\nb", &fp[..]), ("ok", &[][..]), ("ok", &[0u8; 65][..])] {
        let err = claim(&db, key, fp, &options).await.unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{:?}: {:?}", key, err);
        assert_eq!(err.sqlstate().as_deref(), Some("22023"));
    }
    let zero_lease = ClaimOptions { lease: Some(Duration::ZERO), ..options.clone() };
    assert!(matches!(claim(&db, "ok", &fp, &zero_lease).await, Err(Error::InvalidArgument(_))));

    let key = unique("status");
    let owner = claim_new(&db, &key, &fp, &options).await;
    for status in [99, 600] {
        assert!(matches!(owner.complete(&db, status, &[], b"").await, Err(Error::InvalidArgument(_))));
    }
    assert_eq!(lookup(&db, &key, Some("s")).await.unwrap().unwrap().state, State::InProgress, "bad input writes nothing");
}

#[tokio::test]
async fn a_response_over_the_limit_is_too_large_and_changes_nothing() {
    let mut db = connect_one().await;
    sqlx::raw_sql("SET idempotency.max_response_bytes = '1kB'").execute(&mut db).await.unwrap();
    let (key, options) = (unique("large"), scoped("s"));
    let fp = fingerprint("POST", "/a", None, None);
    let owner = match claim(&mut db, &key, &fp, &options).await.unwrap() {
        Outcome::New(owner) => owner,
        other => panic!("expected new, got {other:?}"),
    };
    let err = owner.complete(&mut db, 200, &[], &[b'x'; 2048]).await.unwrap_err();
    assert!(matches!(err, Error::TooLarge(_)), "{:?}", err);
    assert_eq!(err.sqlstate().as_deref(), Some("54000"));
    assert!(err.to_string().contains("too large"), "{}", err);
    assert_eq!(lookup(&mut db, &key, Some("s")).await.unwrap().unwrap().state, State::InProgress);
    assert_eq!(owner.complete(&mut db, 200, &[], &[b'x'; 1000]).await.unwrap(), Completion::Stored);
}

#[tokio::test]
async fn errors_say_what_failed_and_keep_the_server_message() {
    let db = connect().await;
    let err = claim(&db, "", &[1], &ClaimOptions::default()).await.unwrap_err();
    let text = err.to_string();
    assert!(text.starts_with("invalid argument: "), "{}", text);
    assert!(std::error::Error::source(&err).is_some());
}

#[tokio::test]
async fn the_fingerprint_computed_here_is_the_databases() {
    let db = connect().await;
    let binary: Vec<u8> = (0..=255).collect();
    // Method, path, body, query.
    type Case<'a> = (&'a str, &'a str, Option<&'a [u8]>, Option<&'a str>);
    let cases: [Case; 9] = [
        ("POST", "/payments", Some(br#"{"amount":10}"#), None),
        ("post", "/payments", Some(br#"{"amount":10}"#), None),
        ("PaTcH", "/a/b", None, None),
        ("POST", "/a", Some(b""), None),
        ("POST", "/a", None, Some("")),
        ("POST", "/a", Some(&binary), Some("x=1&y=%20")),
        ("POST", "", None, None),
        ("POST", "/é/ü", Some("naïve".as_bytes()), Some("q=ü")),
        ("M-SEARCH", "*", Some(&[0, 0, 0]), Some("a")),
    ];
    for (method, path, body, query) in cases {
        let theirs: Vec<u8> = sqlx::query_scalar("SELECT idempotency.fingerprint($1, $2, $3, $4)")
            .bind(method)
            .bind(path)
            .bind(body)
            .bind(query)
            .fetch_one(&db)
            .await
            .unwrap();
        assert_eq!(fingerprint(method, path, body, query).to_vec(), theirs, "{:?}", (method, path, body, query));
    }
}
