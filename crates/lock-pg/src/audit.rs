//! `audit`: read the PostgreSQL settings the fence and the lease depend on and grade each
//! (see the README's "Durability").

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lock_core::raw::{AuditReport, Error, Result};
use sqlx::{
    Connection, PgConnection,
    postgres::{PgListener, PgPoolOptions},
};
use tokio::time::{Instant, timeout};

use crate::{PgLockConfig, lock::BACKEND};

/// Reads the server's settings that the fence and the lease depend on and grades each PASS /
/// WARN / FAIL with why and what to change. Read-only except for one `pg_notify` on a channel
/// of its own (to see whether notifications reach a listener); it takes no lock and creates no
/// table.
///
/// Checks: `version`, `synchronous_commit` (of this role and database; the driver raises it to
/// `on` for every grant, so `off` is a WARN), `fsync` and `full_page_writes` (off: a crash can
/// lose or tear committed grants), `table-persistence` (an `UNLOGGED` or temporary lease table:
/// fences restart or no exclusion), `standby` (connected to a standby: writes refused) and
/// `replication` (asynchronous standbys: a failover loses grants), `listen` (a transaction
/// pooler in between drops `LISTEN`: waiters would wait for their fallback poll), `clock`
/// (informational).
///
/// # Errors
/// [`Error::Config`] for an invalid configuration; [`Error::Unavailable`] / [`Error::Backend`]
/// when the server cannot be reached or refuses the connection or a read.
pub async fn audit(config: &PgLockConfig) -> Result<AuditReport> {
    config.validate()?;
    let budget = config.timeout;
    let mut conn = match timeout(
        config.connect_timeout,
        PgConnection::connect_with(config.connect_options()),
    )
    .await
    {
        Ok(Ok(conn)) => conn,
        Ok(Err(e)) => return Err(connect_error(e)),
        Err(_) => {
            return Err(Error::Unavailable {
                backend: BACKEND,
                op: "connect",
                message: format!("no connection within {:?}", config.connect_timeout),
                source: None,
            });
        }
    };
    let mut report = AuditReport::new(BACKEND);

    let mut best: Option<Duration> = None;
    for _ in 0..5 {
        let sent = Instant::now();
        scalar::<i32>(&mut conn, "SELECT 1", budget).await?;
        let rtt = sent.elapsed();
        best = Some(best.map_or(rtt, |b| b.min(rtt)));
    }
    report.round_trip = best;

    let version_num = scalar::<String>(&mut conn, "SHOW server_version_num", budget).await?;
    let version = scalar::<String>(&mut conn, "SHOW server_version", budget).await?;
    grade_version(&mut report, &version, &version_num);

    let sync = scalar::<String>(&mut conn, "SHOW synchronous_commit", budget).await?;
    grade_synchronous_commit(&mut report, &sync);
    let fsync = scalar::<String>(&mut conn, "SHOW fsync", budget).await?;
    let fpw = scalar::<String>(&mut conn, "SHOW full_page_writes", budget).await?;
    grade_crash_safety(&mut report, &fsync, &fpw);

    let persistence: Option<String> = timeout(
        budget,
        sqlx::query_scalar("SELECT relpersistence::text FROM pg_class WHERE oid = to_regclass($1)")
            .bind(config.table.quoted())
            .fetch_optional(&mut conn),
    )
    .await
    .map_err(|_| timed_out("read the table's persistence", budget))?
    .map_err(|e| Error::backend(BACKEND, "audit", e))?
    .flatten();
    grade_table(&mut report, config, persistence.as_deref());

    let in_recovery = scalar::<bool>(&mut conn, "SELECT pg_is_in_recovery()", budget).await?;
    let standby_names =
        scalar::<String>(&mut conn, "SHOW synchronous_standby_names", budget).await?;
    let (standbys, sync_standbys): (i64, i64) = timeout(
        budget,
        sqlx::query_as(
            "SELECT count(*), count(*) FILTER (WHERE sync_state IN ('sync', 'quorum')) \
             FROM pg_stat_replication",
        )
        .fetch_one(&mut conn),
    )
    .await
    .map_err(|_| timed_out("read pg_stat_replication", budget))?
    .map_err(|e| Error::backend(BACKEND, "audit", e))?;
    grade_replication(
        &mut report,
        in_recovery,
        &standby_names,
        &sync,
        standbys,
        sync_standbys,
    );

    if config.listen {
        listen(&mut report, config, &mut conn).await;
    } else {
        report.pass(
            "listen",
            "listen=false",
            "waiters poll (poll_interval) instead of LISTEN: works through any pooler",
        );
    }

    let before = SystemTime::now();
    let sent = Instant::now();
    let server: f64 = scalar(
        &mut conn,
        "SELECT extract(epoch FROM clock_timestamp())::float8",
        budget,
    )
    .await?;
    let rtt = sent.elapsed();
    if let Ok(local) = before.duration_since(UNIX_EPOCH) {
        let local = (local + rtt / 2).as_secs_f64();
        let diff_ms = (server - local) * 1000.0;
        report.pass(
            "clock",
            format!(
                "server {diff_ms:+.1} ms from ours (± {:.1} ms)",
                rtt.as_secs_f64() * 500.0
            ),
            "informational: expiry is decided by the server's clock alone, trust by this client's monotonic clock",
        );
    }
    let _ = conn.close().await;
    Ok(report)
}

fn connect_error(e: sqlx::Error) -> Error {
    match &e {
        sqlx::Error::Database(_) | sqlx::Error::Tls(_) => Error::backend(BACKEND, "connect", e),
        sqlx::Error::Configuration(_) => Error::Config(e.to_string()),
        _ => Error::unavailable(BACKEND, "connect", e),
    }
}

fn timed_out(what: &str, budget: Duration) -> Error {
    Error::Unavailable {
        backend: BACKEND,
        op: "audit",
        message: format!("{what}: no answer within {budget:?}"),
        source: None,
    }
}

async fn scalar<T>(conn: &mut PgConnection, sql: &'static str, budget: Duration) -> Result<T>
where
    T: for<'r> sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres> + Send + Unpin,
{
    timeout(
        budget,
        sqlx::query_scalar::<_, T>(sql).fetch_one(&mut *conn),
    )
    .await
    .map_err(|_| timed_out(sql, budget))?
    .map_err(|e| Error::backend(BACKEND, "audit", e))
}

fn grade_version(report: &mut AuditReport, version: &str, num: &str) {
    match num.trim().parse::<u32>() {
        Ok(n) if n >= 130_000 => {
            report.pass(
                "version",
                version,
                "a supported PostgreSQL (the tests run 15)",
            );
        }
        Ok(_) => {
            report.warn(
                "version",
                version,
                "older than PostgreSQL 13 (out of upstream support; not tested here)",
                "upgrade to a supported PostgreSQL (13 or newer)",
            );
        }
        Err(_) => {
            report.warn(
                "version",
                version,
                "server_version_num not understood (not PostgreSQL?)",
                "connect to PostgreSQL 13 or newer",
            );
        }
    }
}

fn grade_synchronous_commit(report: &mut AuditReport, value: &str) {
    match value {
        "on" | "remote_apply" | "remote_write" => {
            report.pass(
                "synchronous_commit",
                value,
                "grants, renewals and durable releases wait for the WAL flush",
            );
        }
        "local" => {
            report.pass(
                "synchronous_commit",
                value,
                "grants wait for the local WAL flush (not for synchronous standbys, see replication)",
            );
        }
        _ => {
            report.warn(
                "synchronous_commit",
                value,
                "the driver raises it to on for every grant and renewal, but other writes of this role (your fenced writes through PgLock::pool) commit asynchronously",
                "ALTER ROLE … SET synchronous_commit = on (or in postgresql.conf)",
            );
        }
    }
}

fn grade_crash_safety(report: &mut AuditReport, fsync: &str, fpw: &str) {
    if fsync == "on" {
        report.pass(
            "fsync",
            fsync,
            "commits reach the disk before they are acknowledged",
        );
    } else {
        report.fail(
            "fsync",
            fsync,
            "a crash of the server's machine loses acknowledged grants: fences repeat, two holders",
            "fsync = on in postgresql.conf",
        );
    }
    if fpw == "on" {
        report.pass(
            "full_page_writes",
            fpw,
            "a crash cannot leave torn lease-table pages",
        );
    } else {
        report.warn(
            "full_page_writes",
            fpw,
            "unless the file system never tears pages (e.g. ZFS), a crash can corrupt the lease table",
            "full_page_writes = on in postgresql.conf",
        );
    }
}

fn grade_table(report: &mut AuditReport, config: &PgLockConfig, persistence: Option<&str>) {
    let name = config.table.quoted();
    match persistence {
        Some("p") => {
            report.pass(
                "table-persistence",
                format!("{name}: logged"),
                "the lease table survives a crash",
            );
        }
        Some("u") => {
            report.fail(
                "table-persistence",
                format!("{name}: UNLOGGED"),
                "an unlogged table is emptied by a crash: every fence restarts at 1 (the driver refuses it)",
                format!("ALTER TABLE {name} SET LOGGED"),
            );
        }
        Some("t") => {
            report.fail(
                "table-persistence",
                format!("{name}: temporary"),
                "a temporary table is private to one session: no exclusion between clients (the driver refuses it)",
                "use an ordinary table (table=schema.name)",
            );
        }
        Some(other) => {
            report.warn(
                "table-persistence",
                format!("{name}: relpersistence {other}"),
                "unknown persistence",
                "use an ordinary logged table",
            );
        }
        None if config.create_table => {
            report.pass(
                "table-persistence",
                format!("{name}: not created yet"),
                "the driver creates it as an ordinary (logged) table on first use",
            );
        }
        None => {
            report.fail(
                "table-persistence",
                format!("{name}: missing"),
                "the table does not exist and create_table=false: every operation fails",
                "create the table (see the README) or set create_table=true",
            );
        }
    }
}

fn grade_replication(
    report: &mut AuditReport,
    in_recovery: bool,
    standby_names: &str,
    sync: &str,
    standbys: i64,
    sync_standbys: i64,
) {
    if in_recovery {
        report.fail(
            "standby",
            "in recovery (a standby)",
            "a standby refuses the lock's writes",
            "point the URL at the primary",
        );
    } else {
        report.pass("standby", "primary", "writes go to the primary");
    }
    let observed = format!(
        "{standbys} standby(s), {sync_standbys} synchronous; synchronous_standby_names '{standby_names}'"
    );
    if standbys == 0 {
        report.pass(
            "replication",
            observed,
            "no standby that a failover could promote with grants missing",
        );
    } else if sync_standbys > 0 && sync != "local" && sync != "off" {
        report.pass(
            "replication",
            observed,
            "grants wait for a synchronous standby: a failover to it keeps them",
        );
    } else {
        report.warn(
            "replication",
            observed,
            "asynchronous standbys: a failover to one can lose acknowledged grants (two holders, repeated fences)",
            "set synchronous_standby_names (and synchronous_commit on) or never fail over automatically",
        );
    }
}

/// Whether a notification sent on a fresh channel reaches a listener on another connection
/// (a transaction pooler, e.g. PgBouncer in transaction mode, drops `LISTEN`).
async fn listen(report: &mut AuditReport, config: &PgLockConfig, conn: &mut PgConnection) {
    let wait = Duration::from_secs(2);
    let channel = format!("distlock_audit_{:016x}", rand::random::<u64>());
    let outcome = async {
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(config.connect_timeout)
            .connect_with(config.connect_options().clone())
            .await
            .map_err(|e| e.to_string())?;
        let mut listener = PgListener::connect_with(&pool)
            .await
            .map_err(|e| e.to_string())?;
        listener.listen(&channel).await.map_err(|e| e.to_string())?;
        sqlx::query("SELECT pg_notify($1, 'audit')")
            .bind(&channel)
            .execute(&mut *conn)
            .await
            .map_err(|e| e.to_string())?;
        let got = timeout(wait, listener.recv()).await;
        let _ = listener.unlisten(&channel).await;
        // The listener holds the pool's connection: closing the pool waits for it.
        drop(listener);
        pool.close().await;
        match got {
            Ok(Ok(n)) if n.channel() == channel => Ok(true),
            Ok(Ok(_)) | Err(_) => Ok(false),
            Ok(Err(e)) => Err(e.to_string()),
        }
    };
    match timeout(wait + config.connect_timeout + config.timeout, outcome).await {
        Ok(Ok(true)) => {
            report.pass(
                "listen",
                "notification received",
                "LISTEN/NOTIFY work: waiters are woken at once",
            );
        }
        Ok(Ok(false)) => {
            report.warn(
                "listen",
                format!("no notification within {wait:?}"),
                "LISTEN does not receive (a transaction pooler in between?): waiters only notice a release at their fallback poll",
                "connect directly or through a session pooler, or set listen=false (waiters poll)",
            );
        }
        Ok(Err(e)) => {
            report.warn(
                "listen",
                "LISTEN failed",
                format!("waiters cannot be notified: {e}"),
                "connect directly or through a session pooler, or set listen=false",
            );
        }
        Err(_) => {
            report.warn(
                "listen",
                "timed out",
                "the LISTEN check did not finish",
                "connect directly or through a session pooler, or set listen=false",
            );
        }
    }
}

async fn connect(config: &PgLockConfig) -> Result<PgConnection> {
    config.validate()?;
    match timeout(
        config.connect_timeout,
        PgConnection::connect_with(config.connect_options()),
    )
    .await
    {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(e)) => Err(connect_error(e)),
        Err(_) => Err(Error::Unavailable {
            backend: BACKEND,
            op: "connect",
            message: format!("no connection within {:?}", config.connect_timeout),
            source: None,
        }),
    }
}

/// How many rows the lease table holds (0 when it does not exist). For checking that a test
/// run left nothing behind.
///
/// # Errors
/// [`Error::Unavailable`] / [`Error::Backend`] when the server cannot be reached or refuses.
pub async fn namespace_size(config: &PgLockConfig) -> Result<usize> {
    let mut conn = connect(config).await?;
    let name = config.table.quoted();
    let exists: Option<String> = timeout(
        config.timeout,
        sqlx::query_scalar("SELECT to_regclass($1)::text")
            .bind(&name)
            .fetch_one(&mut conn),
    )
    .await
    .map_err(|_| timed_out("find the table", config.timeout))?
    .map_err(|e| Error::backend(BACKEND, "count", e))?;
    if exists.is_none() {
        return Ok(0);
    }
    // The name is a validated, quoted identifier (`TableName`), not user text.
    let count = format!("SELECT count(*) FROM {name}");
    let rows: i64 = timeout(
        config.timeout,
        sqlx::query_scalar(sqlx::AssertSqlSafe(count)).fetch_one(&mut conn),
    )
    .await
    .map_err(|_| timed_out("count", config.timeout))?
    .map_err(|e| Error::backend(BACKEND, "count", e))?;
    let _ = conn.close().await;
    Ok(usize::try_from(rows).unwrap_or(0))
}

/// Drops the lease table — **only for a table of your own**, such as a test run's: every lock
/// and fence in it is gone. Returns how many rows it held.
///
/// # Errors
/// [`Error::Config`] for the default table; [`Error::Unavailable`] / [`Error::Backend`]
/// otherwise.
pub async fn purge_namespace(config: &PgLockConfig) -> Result<usize> {
    if config.table.table() == crate::TableName::DEFAULT && config.table.schema().is_none() {
        return Err(Error::Config(
            "refusing to drop the default lease table".to_owned(),
        ));
    }
    let rows = namespace_size(config).await?;
    let mut conn = connect(config).await?;
    let drop = format!("DROP TABLE IF EXISTS {}", config.table.quoted());
    timeout(
        config.timeout,
        sqlx::query(sqlx::AssertSqlSafe(drop)).execute(&mut conn),
    )
    .await
    .map_err(|_| timed_out("drop the table", config.timeout))?
    .map_err(|e| Error::backend(BACKEND, "drop", e))?;
    let _ = conn.close().await;
    Ok(rows)
}
