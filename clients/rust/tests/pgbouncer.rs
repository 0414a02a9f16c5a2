//! The layer through PgBouncer in transaction mode (Debian's
//! /usr/sbin/pgbouncer, 1.18 on Debian 12, started here on 127.0.0.1) with
//! SQLx's default pool settings: each transaction, and each statement
//! outside one, may run on another server connection, which fewer server
//! connections than the app's pool holds make certain. Fresh keys, replays
//! and concurrent duplicates, in both modes. Skipped, saying why, without
//! pgbouncer.

mod common;

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, Response};
use common::{connect, count_rows, create_table, options, post, serve, unique};
use pg_idempotency::{IdempotencyLayer, State, Tx, lookup};
use sqlx::PgPool;

/// PgBouncer, stopped (and its directory removed) when dropped.
struct Bouncer {
    child: Child,
    dir: PathBuf,
    port: u16,
}

impl Drop for Bouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The PgBouncer to run, if there is one.
fn pgbouncer() -> Option<PathBuf> {
    let path = PathBuf::from(std::env::var("PGBOUNCER").unwrap_or_else(|_| "/usr/sbin/pgbouncer".into()));
    path.exists().then_some(path)
}

/// Starts PgBouncer in transaction mode in front of DATABASE_URL's server,
/// with two server connections for the app's pool of ten.
fn start(program: &Path) -> Bouncer {
    let target = options();
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let dir = std::env::temp_dir().join(unique("pg-idempotency-pgbouncer"));
    std::fs::create_dir(&dir).unwrap();
    let user = target.get_username();
    let db = target.get_database().unwrap_or(user);
    std::fs::write(dir.join("users.txt"), format!("\"{user}\" \"\"\n")).unwrap();
    let ini = format!(
        "[databases]\n{db} = host={host} port={server_port} dbname={db}\n\
         [pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n\
         auth_type = trust\nauth_file = {users}\npool_mode = transaction\ndefault_pool_size = 2\n\
         ignore_startup_parameters = extra_float_digits\n",
        host = target.get_host(),
        server_port = target.get_port(),
        users = dir.join("users.txt").display(),
    );
    std::fs::write(dir.join("pgbouncer.ini"), ini).unwrap();
    let mut command = Command::new(program);
    // It refuses to run as root.
    if std::env::var("USER").as_deref() == Ok("root") || Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout == b"0\n") {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        command.args(["-u", "nobody"]);
    }
    let child = command.arg(dir.join("pgbouncer.ini")).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    let bouncer = Bouncer { child, dir, port };
    for _ in 0..200 {
        if TcpStream::connect(SocketAddr::from(([127, 0, 0, 1], port))).is_ok() {
            return bouncer;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("pgbouncer did not listen on 127.0.0.1:{port}");
}

/// A pool through PgBouncer with SQLx's default pool settings (ten connections).
fn pool_through(bouncer: &Bouncer) -> PgPool {
    PgPool::connect_lazy_with(options().host("127.0.0.1").port(bouncer.port))
}

/// Serves a handler that charges through its `Tx` (its own statement
/// unprepared: `persistent(false)`, as every statement of an app behind
/// PgBouncer before 1.21 must be) and answers 201 `{"charge": id}`.
async fn serve_charges(layer: IdempotencyLayer, table: &str) -> SocketAddr {
    let table = table.to_owned();
    serve(layer, move |request: Request<Body>| {
        let (tx, table) = (request.extensions().get::<Tx>().unwrap().clone(), table.clone());
        async move {
            let mut db = tx.lock().await.unwrap();
            let sql = format!("INSERT INTO {table} (note) VALUES ('charged') RETURNING id");
            let id: i64 = sqlx::query_scalar(&sql).persistent(false).fetch_one(&mut *db).await.unwrap();
            Response::builder().status(201).body(Body::from(format!("{{\"charge\":{id}}}"))).unwrap()
        }
    })
    .await
}

/// Fresh keys, their replays, and eight concurrent duplicates of one key:
/// one charge per key.
async fn charges_once_through(bouncer: &Bouncer, one_transaction: bool) {
    let db = connect().await;
    let table = unique("pooled_charges");
    create_table(&db, &table).await;
    let pool = pool_through(bouncer);
    let layer = IdempotencyLayer::new(pool.clone()).one_transaction(one_transaction);
    let address = serve_charges(layer, &table).await;
    for _ in 0..6 {
        let key = unique("pooled");
        let first = post(address, &key, b"{\"amount\":10}", &[]).await;
        assert_eq!(first.status, 201, "{first:?}");
        let again = post(address, &key, b"{\"amount\":10}", &[]).await;
        assert_eq!(again.header("idempotent-replayed"), Some("true"), "{again:?}");
        assert_eq!(again.body, first.body);
        let record = lookup(&pool, &key, Some("")).await.unwrap().expect("a record");
        assert_eq!(record.state, State::Completed);
    }
    let key = unique("pooled_duplicate");
    let answers = futures_join(address, &key).await;
    assert!(answers.iter().all(|status| [201, 409].contains(status)), "{answers:?}");
    assert_eq!(count_rows(&db, &table).await, 7, "one charge per key");
}

/// A handler that never locks its `Tx` (its work is elsewhere: the case of
/// two transactions), answering `status`: its `complete` runs apart from
/// the request's transaction. Sixteen keys at once, then each again: a 2xx
/// is stored and replayed, a 5xx released (no record).
async fn complete_apart_through(bouncer: &Bouncer, status: u16) {
    let pool = pool_through(bouncer);
    let layer = IdempotencyLayer::new(pool.clone());
    let address = serve(layer, move |_request: Request<Body>| async move {
        Response::builder().status(status).body(Body::from("{\"done\":true}")).unwrap()
    })
    .await;
    let keys: Vec<String> = (0..16).map(|n| unique(&format!("apart_{status}_{n}"))).collect();
    let sends: Vec<_> = keys
        .iter()
        .map(|key| {
            let key = key.clone();
            tokio::spawn(async move { post(address, &key, b"{\"amount\":10}", &[]).await })
        })
        .collect();
    for send in sends {
        let reply = send.await.unwrap();
        assert_eq!(reply.status, status, "{reply:?}");
    }
    for key in &keys {
        let record = lookup(&pool, key, Some("")).await.unwrap();
        if status < 500 {
            assert_eq!(record.expect("a record").state, State::Completed);
            let again = post(address, key, b"{\"amount\":10}", &[]).await;
            assert_eq!(again.header("idempotent-replayed"), Some("true"), "{again:?}");
        } else {
            assert!(record.is_none(), "a 5xx is released");
        }
    }
}

/// Sends eight requests with one key at once; their statuses.
async fn futures_join(address: SocketAddr, key: &str) -> Vec<u16> {
    let sends: Vec<_> = (0..8)
        .map(|_| {
            let key = key.to_owned();
            tokio::spawn(async move { post(address, &key, b"{\"amount\":10}", &[]).await.status })
        })
        .collect();
    let mut statuses = Vec::new();
    for send in sends {
        statuses.push(send.await.unwrap());
    }
    statuses
}

#[tokio::test]
async fn through_pgbouncer_in_transaction_mode() {
    let Some(program) = pgbouncer() else {
        eprintln!("skipped: no pgbouncer at /usr/sbin/pgbouncer (set PGBOUNCER)");
        return;
    };
    let bouncer = start(&program);
    charges_once_through(&bouncer, false).await;
    charges_once_through(&bouncer, true).await;
    complete_apart_through(&bouncer, 201).await;
    complete_apart_through(&bouncer, 503).await;
}
