//! A small pool of tokio-postgres connections (Debian packages neither
//! deadpool nor bb8), and [`Tx`], the request's transaction that the layer
//! lends the handler.

use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use tokio::sync::{MappedMutexGuard, OwnedSemaphorePermit, Semaphore};
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::{Client, Config, Socket};

use crate::Error;

type Connecting = Pin<Box<dyn Future<Output = Result<Client, tokio_postgres::Error>> + Send>>;

/// At most `size` connections to one database, opened when needed and kept
/// for the next request. Cloning is cheap: clones share the connections.
#[derive(Clone)]
pub struct Pool {
    shared: Arc<Shared>,
}

struct Shared {
    connect: Box<dyn Fn() -> Connecting + Send + Sync>,
    idle: Mutex<Vec<Client>>,
    permits: Arc<Semaphore>,
}

impl Pool {
    /// A pool on `config` (e.g. `DATABASE_URL.parse()?`) with `tls`
    /// (`tokio_postgres::NoTls`, or a TLS connector) of at most `size` connections.
    pub fn new<T>(config: Config, tls: T, size: usize) -> Pool
    where
        T: MakeTlsConnect<Socket> + Clone + Send + Sync + 'static,
        T::Stream: Send + 'static,
        T::TlsConnect: Send,
        <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
    {
        let connect = move || -> Connecting {
            let (config, tls) = (config.clone(), tls.clone());
            Box::pin(async move {
                let (client, connection) = config.connect(tls).await?;
                tokio::spawn(async move {
                    if let Err(err) = connection.await {
                        log::debug!("idempotency: a pooled connection ended: {}", err);
                    }
                });
                Ok(client)
            })
        };
        Pool {
            shared: Arc::new(Shared {
                connect: Box::new(connect),
                idle: Mutex::new(Vec::new()),
                permits: Arc::new(Semaphore::new(size.max(1))),
            }),
        }
    }

    /// Lends a connection: an idle one that is still open, or a new one.
    /// Waits while `size` connections are lent.
    pub async fn get(&self) -> Result<PooledClient, Error> {
        let permit = self.shared.permits.clone().acquire_owned().await.expect("the pool's semaphore is never closed");
        let idle = self.take_idle();
        let client = match idle {
            Some(client) => client,
            None => (self.shared.connect)().await?,
        };
        Ok(PooledClient { client: Some(client), in_transaction: false, pool: self.shared.clone(), _permit: permit })
    }

    /// Takes an open idle connection, dropping the ones the server closed.
    fn take_idle(&self) -> Option<Client> {
        let mut idle = self.shared.idle.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        while let Some(client) = idle.pop() {
            if !client.is_closed() {
                return Some(client);
            }
        }
        None
    }
}

/// A connection lent by the [`Pool`]; it derefs to `tokio_postgres::Client`
/// and goes back to the pool when dropped, unless it is closed or was left
/// inside a transaction the layer opened (then it is closed, and the server
/// rolls that transaction back).
pub struct PooledClient {
    client: Option<Client>,
    in_transaction: bool,
    pool: Arc<Shared>,
    _permit: OwnedSemaphorePermit,
}

impl PooledClient {
    /// Starts a transaction with BEGIN; until `end` the connection is not reused.
    pub(crate) async fn begin(&mut self) -> Result<(), Error> {
        self.in_transaction = true;
        self.batch_execute("BEGIN").await?;
        Ok(())
    }

    /// Ends the transaction with `COMMIT` or `ROLLBACK`.
    pub(crate) async fn end(&mut self, command: &str) -> Result<(), Error> {
        self.batch_execute(command).await?;
        self.in_transaction = false;
        Ok(())
    }
}

impl Deref for PooledClient {
    type Target = Client;

    /// The connection.
    fn deref(&self) -> &Client {
        self.client.as_ref().expect("a pooled client is present until dropped")
    }
}

impl DerefMut for PooledClient {
    /// The connection, mutably (for `Client::transaction`).
    fn deref_mut(&mut self) -> &mut Client {
        self.client.as_mut().expect("a pooled client is present until dropped")
    }
}

impl Drop for PooledClient {
    /// Returns an open connection outside any transaction to the pool.
    fn drop(&mut self) {
        if let Some(client) = self.client.take() {
            if !self.in_transaction && !client.is_closed() {
                self.pool.idle.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push(client);
            }
        }
    }
}

/// The request's transaction, which the layer opens before the handler runs
/// and commits (with the stored response) or rolls back after it answers.
/// The layer puts it in the request's extensions; it is cheap to clone.
///
/// A handler takes it from the request (`req.extensions().get::<Tx>()`,
/// or axum's `Extension<Tx>`) and calls [`Tx::client`] for the connection:
/// the guard that returns derefs to `tokio_postgres::Client`, and keeps the
/// connection to this handler until it is dropped. Do not `COMMIT` or
/// `ROLLBACK` in it (use savepoints): the layer ends the transaction.
#[derive(Clone)]
pub struct Tx {
    conn: Arc<tokio::sync::Mutex<Option<PooledClient>>>,
}

impl Tx {
    /// Hands the connection over to the layer's transaction.
    pub(crate) fn new(conn: PooledClient) -> Tx {
        Tx { conn: Arc::new(tokio::sync::Mutex::new(Some(conn))) }
    }

    /// Locks the transaction's connection for queries, for as long as the
    /// guard lives. `Err(Error::TransactionEnded)` once the response is sent.
    pub async fn client(&self) -> Result<TxClient<'_>, Error> {
        let guard = self.conn.lock().await;
        tokio::sync::MutexGuard::try_map(guard, |conn| conn.as_mut().map(|conn| &mut **conn))
            .map(|guard| TxClient { guard })
            .map_err(|_| Error::TransactionEnded)
    }

    /// Takes the connection back from the handler (waiting for its guard to drop).
    pub(crate) async fn take(&self) -> Option<PooledClient> {
        self.conn.lock().await.take()
    }
}

/// The connection of the request's transaction, locked for its handler. It
/// derefs to `tokio_postgres::Client` for queries, and only shared: a
/// `Client::transaction()` of its own would commit the layer's transaction.
pub struct TxClient<'a> {
    guard: MappedMutexGuard<'a, Client>,
}

impl Deref for TxClient<'_> {
    type Target = Client;

    /// The connection.
    fn deref(&self) -> &Client {
        &self.guard
    }
}
