//! PostgreSQL: `PgLock` vs one upsert + one update vs sqlx's `PgAdvisoryLock`.
//!
//! Everything runs in a database of its own (`distlock_bench`, created on the shared server when
//! missing) so that `pg_stat_database.xact_commit` counts only this bench's transactions.

use std::{sync::Arc, time::Duration};

use lock_core::raw::async_trait;
use lock_core::{DynLock, LockKey, OwnershipToken};
use lock_pg::{
    PgLock, PgLockConfig,
    sqlx::{self, Connection, Either, PgConnection, postgres::PgAdvisoryLock},
};

use super::{AfterIdle, Backend, Counts, Cycle, DistlockCycle, RequestCounter, Res};
use crate::report::Kind;

/// The database the bench works in.
pub const BENCH_DB: &str = "distlock_bench";

/// The PostgreSQL backend at a URL.
pub struct Pg {
    /// The URL as given (its database is used to create [`BENCH_DB`] and read statistics).
    admin_url: String,
    /// The same server, database [`BENCH_DB`].
    url: String,
}

impl Pg {
    /// Parses the URL and derives the bench database's URL (no I/O).
    ///
    /// # Errors
    /// When the URL is not a valid distlock PostgreSQL URL.
    pub fn new(url: &str) -> Res<Self> {
        PgLockConfig::from_url(url)?;
        let mut bench = url::Url::parse(url)?;
        bench.set_path(&format!("/{BENCH_DB}"));
        Ok(Self {
            admin_url: url.to_owned(),
            url: bench.to_string(),
        })
    }

    /// The URL without the driver's own query options, for plain sqlx connections.
    fn plain(url: &str) -> Res<String> {
        let mut u = url::Url::parse(url)?;
        let keep: Vec<(String, String)> = u
            .query_pairs()
            .filter(|(k, _)| {
                matches!(
                    k.as_ref(),
                    "sslmode"
                        | "sslrootcert"
                        | "sslcert"
                        | "sslkey"
                        | "application_name"
                        | "options"
                )
            })
            .map(|(k, v)| (k.into_owned(), v.into_owned()))
            .collect();
        u.set_query(None);
        if !keep.is_empty() {
            u.query_pairs_mut().extend_pairs(keep);
        }
        Ok(u.to_string())
    }

    /// Creates the bench database when it does not exist yet.
    ///
    /// # Errors
    /// When the server cannot be reached or refuses.
    pub async fn create_database(&self) -> Res<()> {
        let mut admin = PgConnection::connect(&Self::plain(&self.admin_url)?).await?;
        let exists: Option<i32> =
            sqlx::query_scalar("SELECT 1 FROM pg_database WHERE datname = $1")
                .bind(BENCH_DB)
                .fetch_optional(&mut admin)
                .await?;
        if exists.is_none() {
            match sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {BENCH_DB}")))
                .execute(&mut admin)
                .await
            {
                Ok(_) => {}
                // Created concurrently by another run.
                Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P04") => {}
                Err(e) => return Err(e.into()),
            }
        }
        admin.close().await?;
        Ok(())
    }

    /// The URL of the bench database.
    pub fn bench_url(&self) -> &str {
        &self.url
    }

    async fn connection(&self) -> Res<PgConnection> {
        Ok(PgConnection::connect(&Self::plain(&self.url)?).await?)
    }
}

const UPSERT: &str = "INSERT INTO distlock_leases AS l (name, owner, fence, expires_at) \
     VALUES ($1, $2, 1, clock_timestamp() + $3::bigint * interval '1 microsecond') \
     ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, fence = l.fence + 1, \
     expires_at = clock_timestamp() + $3::bigint * interval '1 microsecond' \
     WHERE l.owner IS NULL OR l.expires_at <= clock_timestamp() RETURNING l.fence";
const RELEASE: &str = "UPDATE distlock_leases SET owner = NULL, expires_at = clock_timestamp() \
     WHERE name = $1 AND owner = $2";

/// The lease-table protocol made bare: the same upsert, a guarded update; both commit durably.
struct Bare {
    conn: PgConnection,
    name: String,
    ttl_us: i64,
}

#[async_trait]
impl Cycle for Bare {
    fn kind(&self) -> Kind {
        Kind::Bare
    }

    fn label(&self) -> String {
        "upsert + guarded update, both durable commits (sqlx)".into()
    }

    async fn run(&mut self) -> Res<()> {
        let token = OwnershipToken::generate().expose_hex();
        let fence: Option<i64> = sqlx::query_scalar(UPSERT)
            .bind(&self.name)
            .bind(&token)
            .bind(self.ttl_us)
            .fetch_optional(&mut self.conn)
            .await?;
        fence.ok_or("the bare row was held")?;
        sqlx::query(RELEASE)
            .bind(&self.name)
            .bind(&token)
            .execute(&mut self.conn)
            .await?;
        Ok(())
    }
}

struct Peer {
    conn: PgConnection,
    lock: PgAdvisoryLock,
}

#[async_trait]
impl Cycle for Peer {
    fn kind(&self) -> Kind {
        Kind::Peer
    }

    fn label(&self) -> String {
        "sqlx PgAdvisoryLock try_acquire + release_now (session lock, no TTL, no fence)".into()
    }

    async fn run(&mut self) -> Res<()> {
        match self.lock.try_acquire(&mut self.conn).await? {
            Either::Left(guard) => {
                guard.release_now().await?;
                Ok(())
            }
            Either::Right(_) => Err("the advisory lock was held".into()),
        }
    }
}

struct Select1 {
    conn: PgConnection,
}

#[async_trait]
impl Cycle for Select1 {
    fn kind(&self) -> Kind {
        Kind::Rtt
    }

    fn label(&self) -> String {
        "SELECT 1".into()
    }

    async fn run(&mut self) -> Res<()> {
        let _: i32 = sqlx::query_scalar("SELECT 1")
            .fetch_one(&mut self.conn)
            .await?;
        Ok(())
    }
}

/// One durable write: a one-row `UPDATE` of the lease table, committed.
struct Update {
    conn: PgConnection,
    name: String,
}

#[async_trait]
impl Cycle for Update {
    fn kind(&self) -> Kind {
        Kind::Write
    }

    fn label(&self) -> String {
        "one-row UPDATE, durable commit".into()
    }

    async fn run(&mut self) -> Res<()> {
        let updated =
            sqlx::query("UPDATE distlock_leases SET expires_at = expires_at WHERE name = $1")
                .bind(&self.name)
                .execute(&mut self.conn)
                .await?;
        if updated.rows_affected() != 1 {
            return Err("the bench row is missing".into());
        }
        Ok(())
    }
}

/// Committed + rolled back transactions of the bench database.
struct Transactions {
    admin_url: String,
    conn: tokio::sync::Mutex<Option<PgConnection>>,
}

#[async_trait]
impl RequestCounter for Transactions {
    fn source(&self) -> String {
        format!("pg_stat_database xact_commit + xact_rollback of {BENCH_DB} (flushed ≤ 1 s late)")
    }

    fn exclusive(&self) -> bool {
        true
    }

    async fn read(&self) -> Res<Counts> {
        let mut slot = self.conn.lock().await;
        if slot.is_none() {
            *slot = Some(PgConnection::connect(&Pg::plain(&self.admin_url)?).await?);
        }
        let conn = slot.as_mut().ok_or("no statistics connection")?;
        let (commits, rollbacks): (i64, i64) = sqlx::query_as(
            "SELECT xact_commit, xact_rollback FROM pg_stat_database WHERE datname = $1",
        )
        .bind(BENCH_DB)
        .fetch_one(conn)
        .await?;
        let (commits, rollbacks) = (u64::try_from(commits)?, u64::try_from(rollbacks)?);
        Ok(Counts {
            total: commits + rollbacks,
            parts: vec![("commit".into(), commits), ("rollback".into(), rollbacks)],
        })
    }
}

#[async_trait]
impl Backend for Pg {
    fn name(&self) -> &'static str {
        "pg"
    }

    fn server(&self) -> String {
        url::Url::parse(&self.url)
            .map(|u| {
                format!(
                    "{}:{}/{BENCH_DB}",
                    u.host_str().unwrap_or_default(),
                    u.port().unwrap_or(5432)
                )
            })
            .unwrap_or_default()
    }

    async fn prepare(&self) -> Res<()> {
        self.create_database().await
    }

    async fn client(&self) -> Res<DynLock> {
        Ok(Arc::new(PgLock::connect_url(&self.url).await?))
    }

    async fn cycles(&self, run: &str, ttl: Duration) -> Res<Vec<Box<dyn Cycle>>> {
        let lock = self.client().await?;
        // The first acquisition creates the lease table the bare variant writes to.
        let warm = LockKey::new(format!("bench/{run}/create-table"))?;
        if let Some(lease) = lock.try_acquire(&warm, ttl).await? {
            lock.release(&lease).await?;
        }
        Ok(vec![
            Box::new(DistlockCycle {
                lock,
                key: LockKey::new(format!("bench/{run}/cycle"))?,
                ttl,
                label: "PgLock try_acquire + release (release commits asynchronously)".into(),
            }),
            Box::new(Bare {
                conn: self.connection().await?,
                name: format!("bench/{run}/bare"),
                ttl_us: i64::try_from(ttl.as_micros())?,
            }),
            Box::new(Peer {
                conn: self.connection().await?,
                lock: PgAdvisoryLock::new(format!("distlock-bench/{run}")),
            }),
            Box::new(Select1 {
                conn: self.connection().await?,
            }),
            Box::new(AfterIdle(Box::new(Select1 {
                conn: self.connection().await?,
            }))),
            Box::new(Update {
                conn: self.connection().await?,
                name: warm.as_str().to_owned(),
            }),
        ])
    }

    async fn watchdog_client(&self) -> Res<(DynLock, Box<dyn RequestCounter>)> {
        Ok((
            self.client().await?,
            Box::new(Transactions {
                admin_url: self.admin_url.clone(),
                conn: tokio::sync::Mutex::new(None),
            }),
        ))
    }

    fn notes(&self) -> Vec<String> {
        vec![format!(
            "runs in its own database `{BENCH_DB}` on the shared server; the advisory-lock peer is session-bound (no TTL, no fencing token, nothing committed), so it is a floor rather than equal work."
        )]
    }
}
