//! Connecting and running statements: the client's own connection pool (TLS and credentials
//! come from the connect options), the lease table's check on first use, one statement run
//! under its time budget, and the classification of `sqlx`'s errors (nothing sent, refused, or
//! outcome unknown; one-line messages without credentials).
//!
//! # The connection pool
//!
//! `sqlx` 0.9's pool pings every connection when it is returned (`Floating::return_to_pool`),
//! whatever its options say: one extra round trip per statement, sent from a task spawned on
//! drop. `PoolOptions::test_before_acquire(false)` removes only the *other* ping, the one before
//! each acquire, and `after_release` runs before the return ping instead of replacing it.
//! Measured side by side (`distlock-bench --pools`, three runs, same statements, pool size 8):
//! sqlx's pool with `test_before_acquire(false)` is 1.11–1.26× slower per sequential operation
//! than this one, and under 8–32 concurrent tasks reaches 0.51–0.97× its throughput at
//! 1.1–1.6× the server CPU per operation; with sqlx's defaults 1.32–1.43× slower, 0.43–0.82× the
//! throughput, 1.2–1.9× the server CPU. So the pool stays hand-written (`ConnPool` /
//! `PooledConn`, about 80 lines) until sqlx can skip the return ping. Here a connection goes back to the idle list only after its statement completed; one that
//! failed or whose future was dropped mid-statement is closed, so its state never leaks into the
//! next operation. A connection the server killed while idle is detected on its next use
//! (see `Inner::fetch_idempotent`).
//!
//! # Error messages
//!
//! One-line messages for `sqlx` errors: PostgreSQL's own message and SQLSTATE without the
//! server's C source line that `sqlx` appends ("… does not exist at line 768"), and for a failed
//! connect the address (never the credentials) first.

use std::{
    error::Error as StdError,
    fmt,
    sync::{
        Arc, Mutex, OnceLock, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use lock_core::raw::{
    Batcher, BoxError, Effect, Error, HolderIdentity, LockKey, RequestFailure, Result,
};
use sqlx::{
    Connection, PgConnection, PgPool, Postgres,
    postgres::{PgConnectOptions, PgPoolOptions, PgRow},
};
use tokio::{
    sync::{OnceCell, Semaphore, SemaphorePermit},
    time::{Instant, timeout, timeout_at},
};

use crate::{
    PgLockConfig,
    lock::{BACKEND, Inner, PgLock, later},
    renew::MAX_RENEW_BATCH,
    sql::Statements,
    wake::Notifier,
};

impl PgLock {
    /// Connects the pool and makes sure the lease table exists (creating it when allowed).
    ///
    /// # Errors
    /// [`Error::Unavailable`] when the server cannot be reached (or does not offer the TLS the
    /// URL requires), [`Error::Backend`] when it refuses the credentials, its TLS certificate is
    /// not trusted, or the table cannot be created or checked.
    pub async fn connect(config: PgLockConfig) -> Result<Self> {
        let lock = Self::connect_lazy(config)?;
        lock.inner.ensure_table().await?;
        Ok(lock)
    }

    /// [`PgLock::connect`] with a URL (see [`PgLockConfig::from_url`]).
    ///
    /// # Errors
    /// [`Error::Config`] for a bad URL; as [`PgLock::connect`].
    pub async fn connect_url(url: &str) -> Result<Self> {
        Self::connect(PgLockConfig::from_url(url)?).await
    }

    /// A client that connects on first use; no I/O here. The table is checked on first use.
    ///
    /// # Errors
    /// [`Error::Config`] when an option is out of bounds ([`PgLockConfig::validate`]).
    pub fn connect_lazy(config: PgLockConfig) -> Result<Self> {
        config.validate()?;
        let conns = ConnPool::new(
            config.connect_options().clone(),
            config.pool_size,
            config.connect_timeout,
        );
        let identity = HolderIdentity::process(config.label.as_deref())?;
        let sql = Statements::new(&config.table, true);
        let sql_plain = Statements::new(&config.table, false);
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                conns,
                user_pool: OnceLock::new(),
                sql,
                sql_plain,
                identity,
                table_ready: OnceCell::new(),
                notifier: OnceLock::new(),
                renewals: Batcher::new(MAX_RENEW_BATCH),
                statements: AtomicU64::new(0),
            }),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &PgLockConfig {
        &self.inner.config
    }

    /// A `sqlx` pool to the same database for the caller's own statements, e.g. fenced writes
    /// ([`crate::FencedTable`]); created (without connecting) on first call, which must be
    /// inside a Tokio runtime. The lock's own statements use separate connections.
    pub fn pool(&self) -> &PgPool {
        self.inner.user_pool.get_or_init(|| {
            PgPoolOptions::new()
                .max_connections(self.inner.config.pool_size)
                .acquire_timeout(self.inner.config.connect_timeout)
                .connect_lazy_with(self.inner.config.connect_options().clone())
        })
    }

    /// How many statements this client has sent on its own connections so far (each one
    /// transaction, retries included; not the `LISTEN` connection, not [`PgLock::pool`]).
    /// Renewals that coincide share one statement.
    pub fn statements_sent(&self) -> u64 {
        self.inner.statements.load(Ordering::Relaxed)
    }

    pub(crate) fn notifier(&self) -> &Notifier {
        self.inner
            .notifier
            .get_or_init(|| Notifier::spawn(&self.inner.config))
    }
}

impl Inner {
    /// Creates the table on first use. Safe when several processes start at once:
    /// `CREATE TABLE IF NOT EXISTS` can still fail when two sessions race — with a unique
    /// violation on the catalog (23505), "relation exists" (42P07) or "type exists" (42710, the
    /// table's row type) — which all mean the other one created it.
    pub(crate) async fn ensure_table(&self) -> Result<()> {
        self.table_ready
            .get_or_try_init(|| async {
                let op = "create table";
                let exists = |e: &sqlx::Error| match e {
                    sqlx::Error::Database(db) => {
                        matches!(db.code().as_deref(), Some("23505" | "42P07" | "42710"))
                    }
                    _ => false,
                };
                let classify = |op, e: PgError| {
                    let e2 = e.sqlx();
                    if is_untrusted_server(e2) {
                        Error::backend(BACKEND, op, e)
                    } else if is_connection_error(e2) || matches!(e2, sqlx::Error::PoolTimedOut) {
                        Error::unavailable(BACKEND, op, e)
                    } else {
                        Error::backend(BACKEND, op, e)
                    }
                };
                let map = |e: sqlx::Error| classify(op, PgError::new(e));
                let mut pooled = self
                    .conns
                    .get()
                    .await
                    .map_err(|e| classify("connect", self.connect_error(e)))?;
                let Some(conn) = pooled.conn() else {
                    return Err(Error::unavailable(BACKEND, "connect", "no connection"));
                };
                // Whether the table exists, has the queue and the holder columns, and how it
                // persists.
                let look = "SELECT to_regclass($1)::text, \
                        EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) \
                            AND attname = 'waiters' AND NOT attisdropped), \
                        (SELECT count(*) = 2 FROM pg_attribute WHERE attrelid = to_regclass($1) \
                            AND attname IN ('holder', 'holder_fence') AND NOT attisdropped), \
                        (SELECT relpersistence::text FROM pg_class WHERE oid = to_regclass($1))";
                type Look = (Option<String>, bool, bool, Option<String>);
                // Looked at once; after creating the table, once more: whatever made it (this
                // statement, or a concurrent creator of any version) is what counts.
                let mut created = false;
                let found: Look = loop {
                    let found: Look = timeout(
                        self.config.timeout,
                        sqlx::query_as(look)
                            .bind(self.config.table.quoted())
                            .fetch_one(&mut *conn),
                    )
                    .await
                    .map_err(|_| Error::unavailable(BACKEND, op, "timed out"))?
                    .map_err(map)?;
                    check_persistence(&self.config.table, found.3.as_deref())?;
                    if found.0.is_some() || created {
                        break found;
                    }
                    if !self.config.create_table {
                        return Err(Error::Config(format!(
                            "the lease table {} does not exist and create_table=false",
                            self.config.table
                        )));
                    }
                    let outcome = timeout(
                        self.config.timeout,
                        sqlx::query(self.sql.create.clone()).execute(&mut *conn),
                    )
                    .await
                    .map_err(|_| Error::unavailable(BACKEND, op, "timed out"))?;
                    match outcome {
                        Ok(_) => {}
                        Err(e) if exists(&e) => {}
                        Err(e) => return Err(map(e)),
                    }
                    created = true;
                };
                let (_, queue, holder_columns, _) = found;
                if !queue {
                    // A table of an older version: add the wait queue and the holder columns
                    // (a catalog-only change).
                    if !self.config.create_table {
                        return Err(Error::Config(format!(
                            "the lease table {} has no waiters column and create_table=false: \
                             ALTER TABLE {} ADD COLUMN waiters text[] NOT NULL DEFAULT '{{}}'",
                            self.config.table,
                            self.config.table.quoted()
                        )));
                    }
                    timeout(
                        self.config.timeout,
                        sqlx::query(self.sql.add_waiters.clone()).execute(&mut *conn),
                    )
                    .await
                    .map_err(|_| Error::unavailable(BACKEND, op, "timed out"))?
                    .map_err(map)?;
                    pooled.put_back();
                    return Ok(true);
                }
                if holder_columns || !self.config.create_table {
                    pooled.put_back();
                    return Ok(holder_columns);
                }
                // A table of an older version with the queue: add the holder columns. A role
                // that may not alter the table (not its owner) keeps working without
                // identities: they are information, never needed for a grant.
                let added = timeout(
                    self.config.timeout,
                    sqlx::query(self.sql.add_holder.clone()).execute(&mut *conn),
                )
                .await
                .map_err(|_| Error::unavailable(BACKEND, op, "timed out"))?;
                let holders = match added {
                    Ok(_) => true,
                    Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some("42501") => {
                        tracing::warn!(
                            table = %self.config.table,
                            "the lease table has no holder columns and this role may not add \
                             them: inspect shows no holder identity"
                        );
                        false
                    }
                    Err(e) => return Err(map(e)),
                };
                pooled.put_back();
                Ok(holders)
            })
            .await
            .map(|_| ())
    }

    /// No connection could be had: the message names the server's address (no credentials).
    fn connect_error(&self, e: sqlx::Error) -> PgError {
        PgError::connecting(self.config.connect_options(), e)
    }

    /// Whether the table is known to have the holder columns.
    pub(crate) fn holders(&self) -> bool {
        self.table_ready.get() == Some(&true)
    }

    /// The statements for the table as checked (before the check, those without the holder
    /// columns, which work on every table).
    pub(crate) fn sql(&self) -> &Statements {
        if self.holders() {
            &self.sql
        } else {
            &self.sql_plain
        }
    }

    /// `timeout` from now (saturating: a huge timeout cannot overflow the clock).
    pub(crate) fn op_deadline(&self) -> Instant {
        later(Instant::now(), self.config.timeout)
    }

    /// Runs one statement on a pooled connection, bounded by `timeout` and by `limit` (the
    /// caller's deadline: waiting for a connection and the statement together never outlast
    /// it), and classifies the failure. A connection that failed mid-statement is closed,
    /// never reused.
    pub(crate) async fn fetch_all(
        &self,
        query: sqlx::query::Query<'_, Postgres, sqlx::postgres::PgArguments>,
        limit: Instant,
    ) -> std::result::Result<Vec<PgRow>, ExecError> {
        let not_sent = |e| ExecError::NotSent(self.connect_error(e));
        // No time left: never send a statement whose reply could not be awaited.
        let by_deadline = || {
            ExecError::NotSent(PgError::connecting_because(
                self.config.connect_options(),
                "no connection by the deadline",
                sqlx::Error::PoolTimedOut,
            ))
        };
        if Instant::now() >= limit {
            return Err(by_deadline());
        }
        let mut pooled = match timeout_at(limit, self.conns.get()).await {
            Ok(got) => got.map_err(not_sent)?,
            Err(_) => return Err(by_deadline()),
        };
        let Some(conn) = pooled.conn() else {
            return Err(not_sent(sqlx::Error::PoolClosed));
        };
        self.statements.fetch_add(1, Ordering::Relaxed);
        let until = self.op_deadline().min(limit);
        match timeout_at(until, query.fetch_all(&mut *conn)).await {
            Ok(Ok(rows)) => {
                pooled.put_back();
                Ok(rows)
            }
            Ok(Err(e)) if is_connection_error(&e) => Err(ExecError::Unknown {
                message: one_line(&e),
                retry: true,
            }),
            Ok(Err(e)) => {
                // The statement's implicit transaction rolled back; the connection is fine.
                pooled.put_back();
                Err(ExecError::Rejected(e))
            }
            Err(_) => Err(ExecError::Unknown {
                message: if until < limit {
                    format!("no reply within {:?}", self.config.timeout)
                } else {
                    "no reply by the deadline".to_owned()
                },
                retry: false,
            }),
        }
    }

    /// Runs an idempotent statement, retrying on another connection when the connection died
    /// under it (e.g. the pool's idle connections were terminated), or at once when the server
    /// rolled it back to break a deadlock or a serialization conflict (nothing was applied),
    /// up to once per pooled connection plus one, within `timeout` and `limit`. Also
    /// answers whether the statement was re-sent after a reply that was lost (the first one
    /// may have applied). Only for statements that are idempotent: running one twice must do
    /// what running it once does (never re-send one that could act on a later holder).
    pub(crate) async fn fetch_all_idempotent<'q>(
        &self,
        make: impl Fn() -> sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>,
        limit: Instant,
    ) -> std::result::Result<(Vec<PgRow>, bool), ExecError> {
        let give_up = self.op_deadline().min(limit);
        let mut attempts = self.config.pool_size.saturating_add(1);
        let mut resent = false;
        loop {
            match self.fetch_all(make(), limit).await {
                Ok(rows) => return Ok((rows, resent)),
                Err(ExecError::Unknown { retry: true, .. })
                    if attempts > 1 && Instant::now() < give_up =>
                {
                    attempts -= 1;
                    resent = true;
                }
                Err(ExecError::Rejected(e))
                    if is_transient_conflict(&e) && attempts > 1 && Instant::now() < give_up =>
                {
                    attempts -= 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// [`Inner::fetch_all_idempotent`] of a statement that returns at most one row.
    pub(crate) async fn fetch_idempotent<'q>(
        &self,
        make: impl Fn() -> sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>,
        limit: Instant,
    ) -> std::result::Result<Option<PgRow>, ExecError> {
        self.fetch_all_idempotent(make, limit)
            .await
            .map(|(rows, _)| rows.into_iter().next())
    }

    /// `connect_timeout` + `timeout` from now: the bound of one request outside `acquire`
    /// (a connection, then the statement).
    pub(crate) fn request_deadline(&self) -> Instant {
        later(
            Instant::now(),
            self.config
                .connect_timeout
                .saturating_add(self.config.timeout),
        )
    }
}

/// How a statement ended when it did not return a result.
#[derive(Debug)]
pub(crate) enum ExecError {
    /// No connection could be had: nothing was sent.
    NotSent(PgError),
    /// The server refused the statement: its transaction rolled back, nothing was applied.
    Rejected(sqlx::Error),
    /// The statement was sent and its reply was lost: it may have been applied. `retry` when
    /// the connection itself died (another connection may work right away); not after a
    /// timeout, when the statement may still be running.
    Unknown { message: String, retry: bool },
}

/// Errors that mean the connection (or the server) went away rather than the statement failing.
fn is_connection_error(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::WorkerCrashed => true,
        // 08: connection exception; 57P0x: admin/crash shutdown, cannot connect now, …
        sqlx::Error::Database(db) => db
            .code()
            .is_some_and(|c| c.starts_with("08") || c.starts_with("57P")),
        _ => false,
    }
}

/// A TLS handshake that rejected the server's certificate (unknown CA, wrong host name,
/// expired): retrying cannot help, so it is a permanent error rather than `Unavailable`.
fn is_untrusted_server(e: &sqlx::Error) -> bool {
    lock_core::raw::is_rejected_certificate(e)
}

/// Serialization failure (40001) or deadlock (40P01): the server rolled the statement back
/// to resolve a conflict with another transaction, so nothing was applied and an idempotent
/// statement may simply run again.
fn is_transient_conflict(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if matches!(db.code().as_deref(), Some("40001" | "40P01")))
}

/// A classified failure that can be handed to every lock of a failed batch: what the statement
/// may have applied ([`lock_core::raw::Failure`]), and why.
#[derive(Clone, Debug)]
pub(crate) struct Failure {
    class: lock_core::raw::Failure,
    source: Arc<dyn StdError + Send + Sync>,
}

impl From<ExecError> for Failure {
    /// PostgreSQL's pre-classification onto lock_core's: an untrusted server certificate is
    /// refused (nothing was sent, but retrying cannot help); a statement error that is a lost
    /// connection rolled back, so nothing applied, as if not sent.
    fn from(e: ExecError) -> Self {
        use lock_core::raw::Failure::{NotSent, Refused, Unknown};
        match e {
            ExecError::NotSent(e) if is_untrusted_server(e.sqlx()) => Self::new(Refused, e),
            ExecError::NotSent(e) => Self::new(NotSent, e),
            ExecError::Rejected(e) if is_connection_error(&e) => {
                Self::new(NotSent, PgError::new(e))
            }
            ExecError::Rejected(e) => Self::refused(PgError::new(e)),
            ExecError::Unknown { message, .. } => Self {
                class: Unknown,
                source: Arc::from(BoxError::from(message)),
            },
        }
    }
}

impl Failure {
    fn new(class: lock_core::raw::Failure, e: PgError) -> Self {
        Self {
            class,
            source: Arc::new(e),
        }
    }

    /// The server refused it (or its answer cannot be used): nothing applied, and trying again
    /// will not help.
    pub(crate) fn refused(e: PgError) -> Self {
        Self::new(lock_core::raw::Failure::Refused, e)
    }

    /// See [`Failure::refused`].
    pub(crate) fn is_refused(&self) -> bool {
        self.class == lock_core::raw::Failure::Refused
    }

    /// The caller's error for `op`, a write of the lock's state ([`Effect::Write`]: an unknown
    /// outcome is `Indeterminate`).
    pub(crate) fn into_error(self, op: &'static str, key: &LockKey) -> Error {
        RequestFailure {
            failure: self.class,
            source: Box::new(self.source),
        }
        .into_error(BACKEND, op, key, Effect::Write)
    }
}

pub(crate) fn exec_error(op: &'static str, key: &LockKey, e: ExecError) -> Error {
    Failure::from(e).into_error(op, key)
}

/// Refuses a lease table that does not keep its rows: an `UNLOGGED` table is emptied by a
/// crash (every fence restarts at 1), a temporary one is private to one session (no exclusion
/// between clients at all). `persistence`: `pg_class.relpersistence`, `None` when absent.
fn check_persistence(table: &crate::TableName, persistence: Option<&str>) -> Result<()> {
    match persistence {
        Some("u") => Err(Error::Config(format!(
            "the lease table {table} is UNLOGGED: a crash would empty it and fencing tokens \
             would repeat; use a logged table (ALTER TABLE {} SET LOGGED)",
            table.quoted()
        ))),
        Some("t") => Err(Error::Config(format!(
            "the lease table {table} is a temporary table, private to one session: it cannot \
             exclude anyone; use a regular table"
        ))),
        _ => Ok(()),
    }
}

pub(crate) struct ConnPool {
    options: PgConnectOptions,
    idle: Mutex<Vec<PgConnection>>,
    permits: Semaphore,
    connect_timeout: Duration,
}

impl std::fmt::Debug for ConnPool {
    // Not derived: the connect options hold the password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnPool")
            .field("available", &self.permits.available_permits())
            .finish_non_exhaustive()
    }
}

/// A connection checked out of [`ConnPool`]. Dropped without [`PooledConn::put_back`], it is
/// closed.
pub(crate) struct PooledConn<'a> {
    pool: &'a ConnPool,
    conn: Option<PgConnection>,
    _permit: SemaphorePermit<'a>,
}

impl ConnPool {
    pub(crate) fn new(options: PgConnectOptions, size: u32, connect_timeout: Duration) -> Self {
        Self {
            options,
            idle: Mutex::new(Vec::new()),
            permits: Semaphore::new(usize::try_from(size).unwrap_or(1).max(1)),
            connect_timeout,
        }
    }

    /// An idle connection, or a new one; waits for a free slot up to the connect timeout.
    pub(crate) async fn get(&self) -> Result<PooledConn<'_>, sqlx::Error> {
        let permit = timeout(self.connect_timeout, self.permits.acquire())
            .await
            .map_err(|_| sqlx::Error::PoolTimedOut)?
            .map_err(|_| sqlx::Error::PoolClosed)?;
        let idle = self
            .idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop();
        let conn = match idle {
            Some(conn) => conn,
            None => timeout(
                self.connect_timeout,
                PgConnection::connect_with(&self.options),
            )
            .await
            .map_err(|_| sqlx::Error::PoolTimedOut)??,
        };
        Ok(PooledConn {
            pool: self,
            conn: Some(conn),
            _permit: permit,
        })
    }
}

impl PooledConn<'_> {
    pub(crate) fn conn(&mut self) -> Option<&mut PgConnection> {
        self.conn.as_mut()
    }

    /// Returns the connection to the idle list (call only after a completed statement).
    pub(crate) fn put_back(mut self) {
        if let Some(conn) = self.conn.take() {
            self.pool
                .idle
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(conn);
        }
    }
}

/// A `sqlx` error with a one-line message; the `sqlx` error stays its source.
#[derive(Debug)]
pub(crate) struct PgError {
    message: String,
    source: sqlx::Error,
}

impl PgError {
    /// A statement's (or the session's) error.
    pub(crate) fn new(source: sqlx::Error) -> Self {
        Self {
            message: one_line(&source),
            source,
        }
    }

    /// No connection to `options`' server could be had.
    pub(crate) fn connecting(options: &PgConnectOptions, source: sqlx::Error) -> Self {
        Self {
            message: format!(
                "cannot connect to {}: {}",
                address(options),
                one_line(&source)
            ),
            source,
        }
    }

    /// No connection to `options`' server could be had, for the reason `cause`.
    pub(crate) fn connecting_because(
        options: &PgConnectOptions,
        cause: &str,
        source: sqlx::Error,
    ) -> Self {
        Self {
            message: format!("cannot connect to {}: {cause}", address(options)),
            source,
        }
    }

    /// The `sqlx` error, to classify.
    pub(crate) fn sqlx(&self) -> &sqlx::Error {
        &self.source
    }
}

impl fmt::Display for PgError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl StdError for PgError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(&self.source)
    }
}

/// `host:port/database`: where the client connects, without user or password.
pub(crate) fn address(options: &PgConnectOptions) -> String {
    let host = options.get_host();
    let host = if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_owned()
    };
    format!(
        "{host}:{}/{}",
        options.get_port(),
        options.get_database().unwrap_or_default()
    )
}

/// The error on one line: a server error as its message and SQLSTATE, an I/O error as itself
/// (not "error communicating with database: …"), anything else as `sqlx` says it; never the
/// server's source line, never a line break.
pub(crate) fn one_line(e: &sqlx::Error) -> String {
    let text = match e {
        sqlx::Error::Database(db) => match db.code() {
            Some(code) => format!("{} (SQLSTATE {code})", db.message()),
            None => db.message().to_owned(),
        },
        sqlx::Error::Io(io) => io.to_string(),
        sqlx::Error::PoolTimedOut => "no connection within connect_timeout".to_owned(),
        other => other.to_string(),
    };
    strip_source_line(&text.split_whitespace().collect::<Vec<_>>().join(" ")).to_owned()
}

/// `text` without a trailing " at line <digits>" (where in PostgreSQL's C sources the error
/// was raised, which `sqlx` appends to the server's message).
pub(crate) fn strip_source_line(text: &str) -> &str {
    match text.rsplit_once(" at line ") {
        Some((head, line)) if !line.is_empty() && line.bytes().all(|b| b.is_ascii_digit()) => head,
        _ => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_shows_the_password() {
        let config =
            PgLockConfig::from_url("postgres://app:hunter2@127.0.0.1:1/db?table=t").unwrap();
        let lock = PgLock::connect_lazy(config).unwrap();
        let shown = format!("{lock:?} {:?}", lock.inner.conns);
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("127.0.0.1"), "{shown}");
    }

    #[test]
    fn connection_errors_are_told_apart_from_statement_errors() {
        assert!(is_connection_error(&sqlx::Error::Io(std::io::Error::from(
            std::io::ErrorKind::UnexpectedEof
        ))));
        assert!(!is_connection_error(&sqlx::Error::RowNotFound));
        assert!(!is_connection_error(&sqlx::Error::PoolTimedOut));
    }

    /// The classes of lock_core's `Failure` give each statement failure the error it had
    /// before they were used: variant, message and source.
    #[test]
    fn each_statement_failure_keeps_its_error() {
        let key = LockKey::new("k").unwrap();
        let options: PgConnectOptions = "postgres://app:hunter2@db.example:6432/jobs"
            .parse()
            .unwrap();
        let not_sent = ExecError::NotSent(PgError::connecting(&options, sqlx::Error::PoolTimedOut));
        match exec_error("release", &key, not_sent) {
            Error::Unavailable {
                backend,
                op,
                message,
                source: Some(source),
            } => {
                assert_eq!((backend, op), (BACKEND, "release"));
                assert_eq!(
                    message,
                    "cannot connect to db.example:6432/jobs: no connection within connect_timeout"
                );
                assert_eq!(source.to_string(), message);
                assert!(source.source().is_some_and(|s| s.is::<sqlx::Error>()));
            }
            other => panic!("{other:?}"),
        }
        match exec_error("renew", &key, ExecError::Rejected(sqlx::Error::RowNotFound)) {
            Error::Backend {
                message,
                source: Some(_),
                ..
            } => assert_eq!(message, one_line(&sqlx::Error::RowNotFound)),
            other => panic!("{other:?}"),
        }
        let lost = ExecError::Unknown {
            message: "no reply within 5s".to_owned(),
            retry: false,
        };
        match exec_error("try_acquire", &key, lost) {
            Error::Indeterminate {
                backend,
                op,
                key,
                message,
            } => {
                assert_eq!((backend, op, key.as_str()), (BACKEND, "try_acquire", "k"));
                assert_eq!(message, "no reply within 5s");
            }
            other => panic!("{other:?}"),
        }
        let refused = Failure::from(ExecError::Rejected(sqlx::Error::RowNotFound));
        assert!(refused.is_refused());
        assert!(
            !Failure::from(ExecError::NotSent(PgError::new(sqlx::Error::PoolClosed))).is_refused()
        );
    }

    #[test]
    fn the_server_source_line_is_stripped() {
        assert_eq!(
            strip_source_line("role \"nouser\" does not exist at line 768"),
            "role \"nouser\" does not exist"
        );
        assert_eq!(
            strip_source_line("seen at line 7 of the file"),
            "seen at line 7 of the file"
        );
        assert_eq!(strip_source_line("ends at line "), "ends at line ");
        assert_eq!(strip_source_line("plain"), "plain");
    }

    #[test]
    fn io_errors_are_one_line_without_sqlx_prefix() {
        let e = sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "Connection refused\n(os error 111)",
        ));
        assert_eq!(one_line(&e), "Connection refused (os error 111)");
    }

    #[test]
    fn the_address_has_no_credentials() {
        let options: PgConnectOptions = "postgres://app:hunter2@db.example:6432/jobs"
            .parse()
            .unwrap();
        let e = PgError::connecting(&options, sqlx::Error::PoolTimedOut);
        assert_eq!(
            e.to_string(),
            "cannot connect to db.example:6432/jobs: no connection within connect_timeout"
        );
        let v6 = PgConnectOptions::new().host("::1").port(5).database("d");
        assert_eq!(address(&v6), "[::1]:5/d");
    }
}
