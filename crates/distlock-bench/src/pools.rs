//! `--pools`: lock-pg's own connection pool against `sqlx`'s `PgPool` (issue 20, "kept crates
//! over hand-written code").
//!
//! lock-pg runs every statement on a connection of its own small pool (`lock-pg/src/client.rs`,
//! `ConnPool`) instead of a `sqlx::PgPool`. The question is whether `sqlx`'s pool, with
//! `PoolOptions::test_before_acquire(false)`, would cost the same. Three pools, each with
//! lock-pg's `pool_size` (8) and connect options, run the same statements side by side in one
//! process:
//!
//! - **lock-pg**: a `PgLock` driven through its public API (`inspect`; `try_acquire` +
//!   `release`), i.e. its own pool and the driver's work around the statement;
//! - **sqlx, no test**: a `PgPool` with `test_before_acquire(false)` running the statements
//!   lock-pg sent for those calls;
//! - **sqlx default**: a `PgPool` with `sqlx`'s defaults (`test_before_acquire(true)`), the
//!   pool `PgLock::pool` hands out, running the same statements;
//!
//! plus one `PgConnection` without any pool (the floor; sequential only).
//!
//! The statements are not copies: each is read back from `pg_stat_activity.query` of the
//! `PgLock`'s own connection right after the `PgLock` sent it, so both sides run the same text
//! with the same parameters. Two workloads: `inspect` of a held key (one read) and
//! `try_acquire` + `release` of a free key (two writes: a durable grant and a release that
//! commits asynchronously, lock-pg's hot path). Sequential: every round runs each variant once,
//! in rotating order. Concurrent: `M` tasks share one client (pool), in bursts of a fixed number
//! of operations, variants in rotating order for several rounds; per-operation latency includes
//! the wait for a pooled connection. Per burst also: the server CPU time of the variant's
//! backends (from `/proc/<pid>/stat` of the PostgreSQL backend processes, when the server is on
//! this machine) and the connections each pool had open at the end.

use std::{
    collections::HashMap,
    fmt::Write as _,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use lock_core::raw::async_trait;
use lock_core::{DistributedLock, DynLock, Lease, LockKey, OwnershipToken};
use lock_pg::{
    PgLock, PgLockConfig,
    sqlx::{
        self, Connection, PgConnection, PgPool, Row, SqlSafeStr, SqlStr,
        postgres::{PgConnectOptions, PgPoolOptions},
    },
};
use serde::Serialize;
use tokio::time::Instant;

use crate::{
    backends::{Cycle, Res, pg::Pg},
    report::{Kind, Variant, fmt_us},
    scenario,
    stats::{Summary, ratio},
    system::{self, Machine},
};

/// The TTL of the held key and of every grant (nothing expires during a run).
const TTL: Duration = Duration::from_secs(600);

/// The application names that tell the variants' backends apart in `pg_stat_activity`.
const APP_LOCK_PG: &str = "dlb-pool-lockpg";
const APP_NO_TEST: &str = "dlb-pool-sqlx-notest";
const APP_DEFAULT: &str = "dlb-pool-sqlx-default";
const APP_CONN: &str = "dlb-pool-conn";

/// The sizes of one `--pools` run.
#[derive(Clone, Debug)]
pub struct PoolPlan {
    /// Untimed sequential rounds first.
    pub warmup: usize,
    /// Measured sequential rounds.
    pub rounds: usize,
    /// Concurrent tasks per burst (one burst size per entry).
    pub tasks: Vec<usize>,
    /// Operations per concurrent burst.
    pub burst_ops: usize,
    /// Measured bursts per variant (rotating order) per task count.
    pub bursts: usize,
}

/// What one workload does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Work {
    /// `inspect` of a held key: one read statement.
    Inspect,
    /// `try_acquire` + `release` of a free key: two statements (a durable grant, a release
    /// committed asynchronously).
    AcquireRelease,
}

impl Work {
    fn title(self) -> &'static str {
        match self {
            Work::Inspect => "inspect of a held key (1 statement, read)",
            Work::AcquireRelease => {
                "try_acquire + release (2 statements: durable grant, asynchronous release)"
            }
        }
    }
}

/// The statements lock-pg sent, read back from the server.
#[derive(Clone, Debug)]
struct Statements {
    inspect: SqlStr,
    acquire: SqlStr,
    release: SqlStr,
    /// The holder identity lock-pg binds as the acquire's last parameter.
    identity: String,
}

/// How a variant reaches the server.
enum Exec {
    /// A `PgLock` through its public API (its own pool).
    LockPg(DynLock),
    /// A `sqlx` pool running lock-pg's statements.
    Pool(PgPool),
    /// One connection, no pool (sequential only).
    Conn(tokio::sync::Mutex<PgConnection>),
}

/// One variant of one workload: the client and the keys each task works on.
struct Op {
    label: String,
    kind: Kind,
    app: &'static str,
    exec: Exec,
    work: Work,
    sql: Arc<Statements>,
    /// Per task: the key (`inspect`: every task looks at the one held key).
    keys: Vec<LockKey>,
}

impl Op {
    async fn run(&self, task: usize) -> Res<()> {
        let key = self
            .keys
            .get(task % self.keys.len().max(1))
            .ok_or("no key")?;
        match (&self.exec, self.work) {
            (Exec::LockPg(lock), Work::Inspect) => {
                lock.inspect(key)
                    .await?
                    .ok_or("the inspected key is not held")?;
            }
            (Exec::LockPg(lock), Work::AcquireRelease) => {
                let lease = lock
                    .try_acquire(key, TTL)
                    .await?
                    .ok_or("the key was held")?;
                if !lock.release(&lease).await? {
                    return Err("release reported the lease already lost".into());
                }
            }
            (Exec::Pool(pool), Work::Inspect) => {
                inspect_on(pool, &self.sql, key).await?;
            }
            (Exec::Pool(pool), Work::AcquireRelease) => {
                let fence = acquire_on(pool, &self.sql, key).await?;
                release_on(pool, &self.sql, key, &fence).await?;
            }
            (Exec::Conn(conn), Work::Inspect) => {
                let mut conn = conn.lock().await;
                inspect_on(&mut *conn, &self.sql, key).await?;
            }
            (Exec::Conn(conn), Work::AcquireRelease) => {
                let mut conn = conn.lock().await;
                let fence = acquire_on(&mut *conn, &self.sql, key).await?;
                release_on(&mut *conn, &self.sql, key, &fence).await?;
            }
        }
        Ok(())
    }
}

async fn inspect_on<'e, E>(exec: E, sql: &Statements, key: &LockKey) -> Res<()>
where
    E: sqlx::Executor<'e, Database = sqlx::Postgres>,
{
    let row = sqlx::query(sql.inspect.clone())
        .bind(key.as_str())
        .fetch_optional(exec)
        .await?
        .ok_or("the inspected key is not held")?;
    // Read the row as the driver does (owner, fence, remaining, waiters, holder).
    let _: (String, i64, i64, i64, Option<String>) = (
        row.try_get(0)?,
        row.try_get(1)?,
        row.try_get(2)?,
        row.try_get(3)?,
        row.try_get(4)?,
    );
    Ok(())
}

/// A grant: the owner token and fence to release it with.
struct Grant {
    owner: String,
    fence: i64,
}

async fn acquire_on<'e, E>(exec: E, sql: &Statements, key: &LockKey) -> Res<Grant>
where
    E: sqlx::Executor<'e, Database = sqlx::Postgres>,
{
    let owner = OwnershipToken::generate().expose_hex();
    let ttl_us = i64::try_from(TTL.as_micros())?;
    let row = sqlx::query(sql.acquire.clone())
        .bind(key.as_str())
        .bind(owner.clone())
        .bind(ttl_us)
        .bind(sql.identity.clone())
        .fetch_optional(exec)
        .await?
        .ok_or("the key was held")?;
    let fence: i64 = row.try_get(0)?;
    Ok(Grant { owner, fence })
}

async fn release_on<'e, E>(exec: E, sql: &Statements, key: &LockKey, grant: &Grant) -> Res<()>
where
    E: sqlx::Executor<'e, Database = sqlx::Postgres>,
{
    let rows = sqlx::query(sql.release.clone())
        .bind(key.as_str())
        .bind(grant.owner.clone())
        .bind(grant.fence)
        .fetch_all(exec)
        .await?;
    if rows.is_empty() {
        return Err("the release found the grant gone".into());
    }
    Ok(())
}

/// Adapts an [`Op`] (task 0) to the sequential runner of [`scenario::uncontended`].
struct Seq(Arc<Op>);

#[async_trait]
impl Cycle for Seq {
    fn kind(&self) -> Kind {
        self.0.kind
    }

    fn label(&self) -> String {
        self.0.label.clone()
    }

    async fn run(&mut self) -> Res<()> {
        self.0.run(0).await
    }
}

/// One variant's sequential latency and its ratio to lock-pg's.
#[derive(Clone, Debug, Serialize)]
pub struct SeqRow {
    /// The variant.
    pub variant: Variant,
    /// This median ÷ lock-pg's median.
    pub median_vs_lock_pg: Option<f64>,
    /// This p99 ÷ lock-pg's p99.
    pub p99_vs_lock_pg: Option<f64>,
}

/// One variant's concurrent bursts.
#[derive(Clone, Debug, Serialize)]
pub struct ConcRow {
    /// What it is.
    pub label: String,
    /// Per-operation latency over every measured burst (`None` when it failed).
    pub latency: Option<Summary>,
    /// Operations per second over the measured bursts' wall time.
    pub ops_per_s: Option<f64>,
    /// This median ÷ lock-pg's.
    pub median_vs_lock_pg: Option<f64>,
    /// This p99 ÷ lock-pg's.
    pub p99_vs_lock_pg: Option<f64>,
    /// This throughput ÷ lock-pg's.
    pub ops_vs_lock_pg: Option<f64>,
    /// Server CPU time of this variant's backends per 1,000 operations (ms), when readable.
    pub server_cpu_ms_per_1000: Option<f64>,
    /// This process's CPU time per 1,000 operations (ms; all variants share the process, so
    /// this is measured per burst).
    pub client_cpu_ms_per_1000: Option<f64>,
    /// Connections of this variant open at the end.
    pub connections: Option<i64>,
    /// Why it has no numbers.
    pub error: Option<String>,
}

/// One workload at one concurrency.
#[derive(Clone, Debug, Serialize)]
pub struct ConcTable {
    /// The workload.
    pub work: Work,
    /// Tasks sharing one client.
    pub tasks: usize,
    /// The variants.
    pub rows: Vec<ConcRow>,
}

/// One workload's sequential table.
#[derive(Clone, Debug, Serialize)]
pub struct SeqTable {
    /// The workload.
    pub work: Work,
    /// The variants.
    pub rows: Vec<SeqRow>,
}

/// The whole `--pools` run.
#[derive(Clone, Debug, Serialize)]
pub struct PoolReport {
    /// The command line.
    pub command: String,
    /// Build profile.
    pub profile: &'static str,
    /// The tokio runtime.
    pub runtime: String,
    /// The machine.
    pub machine: Machine,
    /// The sizes.
    pub warmup: usize,
    /// Measured sequential rounds.
    pub rounds: usize,
    /// Operations per concurrent burst.
    pub burst_ops: usize,
    /// Measured bursts per variant and task count.
    pub bursts: usize,
    /// lock-pg's `pool_size`, also every `sqlx` pool's `max_connections`.
    pub pool_size: u32,
    /// Sequential tables.
    pub sequential: Vec<SeqTable>,
    /// Concurrent tables.
    pub concurrent: Vec<ConcTable>,
    /// Anything the reader must know.
    pub notes: Vec<String>,
    /// The whole run, seconds.
    pub duration_s: f64,
}

/// The connect options of the bench database with `application_name` set.
fn options(url: &str, app: &str) -> Res<PgConnectOptions> {
    Ok(PgLockConfig::from_url(url)?
        .connect_options()
        .clone()
        .application_name(app))
}

fn sqlx_pool(config: &PgLockConfig, opts: PgConnectOptions, test: bool) -> PgPool {
    // What `PgLock::pool` builds, with `test_before_acquire` chosen.
    PgPoolOptions::new()
        .max_connections(config.pool_size)
        .acquire_timeout(config.connect_timeout)
        .test_before_acquire(test)
        .connect_lazy_with(opts)
}

/// The last statement of `app`'s backend that has been idle since (exactly one backend).
async fn last_statement(admin: &mut PgConnection, app: &str) -> Res<String> {
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT state, query FROM pg_stat_activity WHERE application_name = $1 \
         AND backend_type = 'client backend'",
    )
    .bind(app)
    .fetch_all(&mut *admin)
    .await?;
    match rows.as_slice() {
        [(state, query)] if state == "idle" => Ok(query.clone()),
        [(state, _)] => Err(format!("{app}'s backend is {state}, not idle").into()),
        other => Err(format!("{app} has {} backends, expected one", other.len()).into()),
    }
}

/// Reads back the statements a fresh `PgLock` sends for `inspect`, `try_acquire` and `release`.
async fn capture(
    admin: &mut PgConnection,
    lock: &PgLock,
    run: &str,
    truncated_at: usize,
) -> Res<Statements> {
    let key = LockKey::new(format!("bench/{run}/pool/capture"))?;
    let lease = lock
        .try_acquire(&key, TTL)
        .await?
        .ok_or("the capture key was held")?;
    let acquire = last_statement(admin, APP_LOCK_PG).await?;
    // The identity lock-pg records is the holder column of the capture row's grant.
    let (identity,): (Option<String>,) =
        sqlx::query_as("SELECT holder FROM distlock_leases WHERE name = $1")
            .bind(key.as_str())
            .fetch_one(&mut *admin)
            .await?;
    lock.inspect(&key)
        .await?
        .ok_or("the capture key is not held")?;
    let inspect = last_statement(admin, APP_LOCK_PG).await?;
    if !lock.release(&lease).await? {
        return Err("the capture lease was lost".into());
    }
    let release = last_statement(admin, APP_LOCK_PG).await?;
    let acquire = pick_statement("acquire", acquire, truncated_at, None)?;
    let inspect = pick_statement("inspect", inspect, truncated_at, None)?;
    let release = pick_statement("release", release, truncated_at, Some(RELEASE_ASYNC))?;
    // A table without the holder columns would have failed the statement above.
    let identity = identity.unwrap_or_else(|| "distlock-bench".to_owned());
    let safe = |s: String| sqlx::AssertSqlSafe(s).into_sql_str();
    Ok(Statements {
        inspect: safe(inspect),
        acquire: safe(acquire),
        release: safe(release),
        identity,
    })
}

/// lock-pg's release statement (`release_async` of `lock-pg/src/sql.rs` for the default table
/// with the holder columns), copied: at 2,252 bytes it is longer than `pg_stat_activity` shows
/// with the default `track_activity_query_size` (1024). Used only when the text read back is
/// cut off and is a prefix of this copy; otherwise the run stops (the copy is stale).
const RELEASE_ASYNC: &str = "UPDATE \"distlock_leases\" AS l SET (owner, fence, expires_at, waiters, holder, \
    holder_fence) = (SELECT CASE WHEN h.granting THEN split_part(h.head, ' ', 5) WHEN \
    h.frees THEN NULL ELSE l.owner END, CASE WHEN h.granting THEN l.fence + 1 ELSE l.fence \
    END, CASE WHEN h.granting THEN clock_timestamp() + split_part(h.head, ' ', 4)::bigint * \
    interval '1 microsecond' WHEN h.frees THEN clock_timestamp() ELSE l.expires_at END, CASE \
    WHEN h.granting THEN ARRAY[split_part(h.head, ' ', 1) || ' 0 ' || split_part(h.head, ' \
    ', 3)] || h.live[2:] ELSE h.live END, CASE WHEN h.granting THEN CASE WHEN \
    split_part(h.head, ' ', 6) ~ '^([2-7][0-9a-f]){1,200}$' THEN \
    convert_from(decode(split_part(h.head, ' ', 6), 'hex'), 'UTF8') END WHEN h.frees THEN \
    NULL ELSE l.holder END, CASE WHEN h.granting THEN l.fence + 1 WHEN h.frees THEN NULL \
    ELSE l.holder_fence END FROM (SELECT x.frees, x.live, x.live[1] AS head, x.frees AND \
    COALESCE(x.live[1] ~ '^[A-Za-z0-9_]{1,63}:[0-9]{1,20} [0-9]{1,18} [0-9]{1,19} \
    [0-9]{1,14} [0-9a-f]{32}( ([2-7][0-9a-f]){1,200})?$', false) AS granting FROM (SELECT \
    true AS frees, ARRAY(SELECT q.w FROM unnest(l.waiters) WITH ORDINALITY AS q(w, o) WHERE \
    CASE WHEN q.w ~ '^[A-Za-z0-9_]{1,63}:[0-9]{1,20} [0-9]{1,18}( [0-9]{1,19} [0-9]{1,14} \
    [0-9a-f]{32}( ([2-7][0-9a-f]){1,200})?)?$' THEN split_part(q.w, ' ', 2)::bigint ELSE 0 \
    END > (extract(epoch FROM clock_timestamp()) * 1000)::bigint AND true ORDER BY q.o) AS \
    live) AS x) AS h) WHERE l.name = $1 AND l.owner = $2 AND l.fence = $3 AND l.expires_at > \
    clock_timestamp() RETURNING l.fence, CASE WHEN COALESCE(l.owner IS NOT NULL AND \
    split_part(l.waiters[1], ' ', 2) = '0', false) THEN \
    pg_notify(split_part(split_part(l.waiters[1], ' ', 1), ':', 1), \
    split_part(split_part(l.waiters[1], ' ', 1), ':', 2) || ':' || split_part(l.waiters[1], \
    ' ', 3) || ':' || l.fence) WHEN l.owner IS NULL AND l.waiters[1] IS NOT NULL THEN \
    pg_notify(split_part(split_part(l.waiters[1], ' ', 1), ':', 1), \
    split_part(split_part(l.waiters[1], ' ', 1), ':', 2)) END, \
    set_config('synchronous_commit', CASE WHEN COALESCE(l.owner IS NOT NULL AND \
    split_part(l.waiters[1], ' ', 2) = '0', false) THEN CASE \
    current_setting('synchronous_commit') WHEN 'off' THEN 'on' ELSE \
    current_setting('synchronous_commit') END ELSE 'off' END, true)";

/// The statement to run for `what`: the text read back from `pg_stat_activity` when it is whole
/// (shorter than `truncated_at - 1` bytes), else `copy` when the text read back is a prefix of
/// it.
fn pick_statement(
    what: &str,
    seen: String,
    truncated_at: usize,
    copy: Option<&str>,
) -> Result<String, String> {
    if seen.len() + 1 < truncated_at {
        return Ok(seen);
    }
    match copy {
        Some(copy) if copy.starts_with(&seen) => Ok(copy.to_owned()),
        Some(_) => Err(format!(
            "lock-pg's {what} statement, cut off at {} bytes in pg_stat_activity, differs from \
             the bench's copy: update the copy in distlock-bench/src/pools.rs",
            seen.len()
        )),
        None => Err(format!(
            "lock-pg's {what} statement ({} bytes) is cut off in pg_stat_activity \
             (track_activity_query_size = {truncated_at}) and the bench has no copy of it",
            seen.len()
        )),
    }
}

/// CPU ticks of each client backend of `app`, by pid (empty when `/proc` does not show them:
/// a server on another machine).
async fn backend_ticks(admin: &mut PgConnection, app: &str) -> Res<HashMap<i32, u64>> {
    let pids: Vec<(i32,)> = sqlx::query_as(
        "SELECT pid FROM pg_stat_activity WHERE application_name = $1 \
         AND backend_type = 'client backend'",
    )
    .bind(app)
    .fetch_all(&mut *admin)
    .await?;
    Ok(pids
        .into_iter()
        .filter_map(|(pid,)| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            Some((pid, system::parse_cpu_ticks(&stat)?))
        })
        .collect())
}

async fn connections(admin: &mut PgConnection, app: &str) -> Res<i64> {
    let (n,): (i64,) = sqlx::query_as(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 \
         AND backend_type = 'client backend'",
    )
    .bind(app)
    .fetch_one(&mut *admin)
    .await?;
    Ok(n)
}

/// One burst: `tasks` tasks run `ops` operations of `op` between them. Per-operation latencies
/// and the burst's wall time.
async fn burst(op: &Arc<Op>, tasks: usize, ops: usize) -> Res<(Vec<Duration>, Duration)> {
    let next = Arc::new(AtomicUsize::new(0));
    let samples: Arc<Mutex<Vec<Duration>>> = Arc::new(Mutex::new(Vec::with_capacity(ops)));
    let start = Instant::now();
    let mut handles = Vec::with_capacity(tasks);
    for task in 0..tasks {
        let (op, next, samples) = (op.clone(), next.clone(), samples.clone());
        handles.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            while next.fetch_add(1, Ordering::Relaxed) < ops {
                let t = Instant::now();
                op.run(task).await?;
                mine.push(t.elapsed());
            }
            samples
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .extend(mine);
            Ok::<(), lock_core::BoxError>(())
        }));
    }
    let mut failed = None;
    for h in handles {
        match h.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => failed = Some(e.to_string()),
            Err(e) => failed = Some(format!("a task panicked or was cancelled: {e}")),
        }
    }
    let wall = start.elapsed();
    if let Some(e) = failed {
        return Err(e.into());
    }
    let samples = std::mem::take(&mut *samples.lock().unwrap_or_else(PoisonError::into_inner));
    Ok((samples, wall))
}

#[derive(Default)]
struct Acc {
    samples: Vec<Duration>,
    wall: Duration,
    server_ticks: Option<u64>,
    client: Duration,
    error: Option<String>,
}

/// Concurrent bursts of every variant, in rotating order, after one untimed burst each.
async fn concurrent(
    admin: &mut PgConnection,
    ops: &[Arc<Op>],
    tasks: usize,
    plan: &PoolPlan,
) -> Vec<ConcRow> {
    let k = ops.len();
    let mut acc: Vec<Acc> = (0..k).map(|_| Acc::default()).collect();
    for op in ops {
        let _ = burst(op, tasks, plan.burst_ops / 4).await;
    }
    for round in 0..plan.bursts {
        for step in 0..k {
            let i = (round + step) % k;
            if acc[i].error.is_some() {
                continue;
            }
            let before = backend_ticks(admin, ops[i].app).await.unwrap_or_default();
            let cpu0 = system::cpu_time();
            match burst(&ops[i], tasks, plan.burst_ops).await {
                Ok((samples, wall)) => {
                    let client = system::cpu_time()
                        .zip(cpu0)
                        .map(|(a, b)| a.saturating_sub(b))
                        .unwrap_or_default();
                    let after = backend_ticks(admin, ops[i].app).await.unwrap_or_default();
                    let a = &mut acc[i];
                    a.samples.extend(samples);
                    a.wall += wall;
                    a.client += client;
                    if !after.is_empty() {
                        let d: u64 = after
                            .iter()
                            .map(|(pid, t)| t.saturating_sub(before.get(pid).copied().unwrap_or(0)))
                            .sum();
                        a.server_ticks = Some(a.server_ticks.unwrap_or(0) + d);
                    }
                }
                Err(e) => acc[i].error = Some(e.to_string()),
            }
        }
    }
    let mut rows = Vec::with_capacity(k);
    for (op, mut a) in ops.iter().zip(acc) {
        let n = a.samples.len();
        let per_1000 = |d: Duration| (n > 0).then(|| d.as_secs_f64() * 1e3 * 1000.0 / n as f64);
        let latency = if a.error.is_some() {
            None
        } else {
            Summary::of(&mut a.samples)
        };
        rows.push(ConcRow {
            label: op.label.clone(),
            ops_per_s: latency
                .as_ref()
                .and_then(|_| ratio(n as f64, a.wall.as_secs_f64())),
            latency,
            median_vs_lock_pg: None,
            p99_vs_lock_pg: None,
            ops_vs_lock_pg: None,
            server_cpu_ms_per_1000: a
                .server_ticks
                .and_then(|t| per_1000(Duration::from_secs_f64(t as f64 / 100.0))),
            client_cpu_ms_per_1000: per_1000(a.client),
            connections: connections(admin, op.app).await.ok(),
            error: a.error,
        });
    }
    if let Some(base) = rows.first().cloned() {
        for r in &mut rows {
            if let (Some(l), Some(b)) = (&r.latency, &base.latency) {
                r.median_vs_lock_pg = ratio(l.median_us, b.median_us);
                r.p99_vs_lock_pg = ratio(l.p99_us, b.p99_us);
            }
            r.ops_vs_lock_pg = r
                .ops_per_s
                .zip(base.ops_per_s)
                .and_then(|(a, b)| ratio(a, b));
        }
    }
    rows
}

/// The variants of one workload, lock-pg first.
async fn variants(
    url: &str,
    config: &PgLockConfig,
    sql: &Arc<Statements>,
    work: Work,
    run: &str,
    tasks: usize,
    held: &LockKey,
) -> Res<(Vec<Arc<Op>>, Arc<PgLock>)> {
    let w = match work {
        Work::Inspect => "inspect",
        Work::AcquireRelease => "cycle",
    };
    let keys = |v: &str| -> Res<Vec<LockKey>> {
        match work {
            Work::Inspect => Ok(vec![held.clone()]),
            Work::AcquireRelease => (0..tasks)
                .map(|t| Ok(LockKey::new(format!("bench/{run}/pool/{w}/{v}/{t}"))?))
                .collect(),
        }
    };
    let lock = Arc::new(PgLock::connect(PgLockConfig::new(options(url, APP_LOCK_PG)?)).await?);
    let dyn_lock: DynLock = lock.clone();
    let op = |label: &str, kind, app, exec, keys| {
        Arc::new(Op {
            label: label.to_owned(),
            kind,
            app,
            exec,
            work,
            sql: sql.clone(),
            keys,
        })
    };
    let what = match work {
        Work::Inspect => "PgLock::inspect",
        Work::AcquireRelease => "PgLock try_acquire + release",
    };
    let conn = PgConnection::connect_with(&options(url, APP_CONN)?).await?;
    Ok((
        vec![
            op(
                &format!("lock-pg's own pool ({what})"),
                Kind::Distlock,
                APP_LOCK_PG,
                Exec::LockPg(dyn_lock),
                keys("lockpg")?,
            ),
            op(
                "sqlx PgPool, test_before_acquire(false), the same statements",
                Kind::Peer,
                APP_NO_TEST,
                Exec::Pool(sqlx_pool(config, options(url, APP_NO_TEST)?, false)),
                keys("notest")?,
            ),
            op(
                "sqlx PgPool, defaults (test_before_acquire(true), = PgLock::pool), the same statements",
                Kind::Peer,
                APP_DEFAULT,
                Exec::Pool(sqlx_pool(config, options(url, APP_DEFAULT)?, true)),
                keys("default")?,
            ),
            op(
                "one PgConnection, no pool, the same statements",
                Kind::Rtt,
                APP_CONN,
                Exec::Conn(tokio::sync::Mutex::new(conn)),
                keys("conn")?,
            ),
        ],
        lock,
    ))
}

async fn close(ops: Vec<Arc<Op>>) {
    for op in ops {
        if let Ok(op) = Arc::try_unwrap(op) {
            match op.exec {
                Exec::Pool(pool) => pool.close().await,
                Exec::Conn(conn) => {
                    let _ = conn.into_inner().close().await;
                }
                Exec::LockPg(_) => {}
            }
        }
    }
}

/// Runs the comparison against the PostgreSQL server at `url` (the bench database is used).
///
/// # Errors
/// When the server cannot be reached or lock-pg's statements cannot be read back.
pub async fn run(url: &str, plan: &PoolPlan, run: &str, meta: (String, String)) -> Res<PoolReport> {
    let t0 = std::time::Instant::now();
    let pg = Pg::new(url)?;
    pg.create_database().await?;
    let url = pg.bench_url();
    let config = PgLockConfig::from_url(url)?;
    let mut admin = PgConnection::connect_with(&options(url, "dlb-pool-admin")?).await?;
    let (size,): (String,) = sqlx::query_as("SELECT current_setting('track_activity_query_size')")
        .fetch_one(&mut admin)
        .await?;
    let truncated_at: usize = size.trim().parse().unwrap_or(1024);
    let mut notes = Vec::new();

    // Read lock-pg's statements back from a PgLock of its own (one connection: nothing else
    // can have been that backend's last statement).
    let probe = PgLock::connect(PgLockConfig::new(options(url, APP_LOCK_PG)?)).await?;
    let sql = Arc::new(capture(&mut admin, &probe, run, truncated_at).await?);
    drop(probe);
    // The probe's connection closes when its pool is dropped; wait for it to leave.
    for _ in 0..50 {
        if connections(&mut admin, APP_LOCK_PG).await? == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let mut sequential = Vec::new();
    let mut conc = Vec::new();
    let max_tasks = plan.tasks.iter().copied().max().unwrap_or(1).max(1);
    for work in [Work::Inspect, Work::AcquireRelease] {
        crate::progress(format!("pools: {}", work.title()));
        let held_key = LockKey::new(format!("bench/{run}/pool/held"))?;
        let (ops, lock) = variants(url, &config, &sql, work, run, max_tasks, &held_key).await?;
        let held: Option<Lease> = match work {
            Work::Inspect => Some({
                lock.try_acquire(&held_key, TTL)
                    .await?
                    .ok_or("the held key was held by someone else")?
            }),
            Work::AcquireRelease => None,
        };
        let mut cycles: Vec<Box<dyn Cycle>> = ops
            .iter()
            .map(|op| Box::new(Seq(op.clone())) as Box<dyn Cycle>)
            .collect();
        let variants = scenario::uncontended(&mut cycles, plan.warmup, plan.rounds).await;
        drop(cycles);
        let base = variants.first().and_then(|v| v.latency);
        sequential.push(SeqTable {
            work,
            rows: variants
                .into_iter()
                .map(|v| SeqRow {
                    median_vs_lock_pg: v
                        .latency
                        .zip(base)
                        .and_then(|(l, b)| ratio(l.median_us, b.median_us)),
                    p99_vs_lock_pg: v
                        .latency
                        .zip(base)
                        .and_then(|(l, b)| ratio(l.p99_us, b.p99_us)),
                    variant: v,
                })
                .collect(),
        });
        // The single connection serializes every task: no concurrent variant.
        let pooled: Vec<Arc<Op>> = ops
            .iter()
            .filter(|op| !matches!(op.exec, Exec::Conn(_)))
            .cloned()
            .collect();
        for &tasks in &plan.tasks {
            crate::progress(format!("pools: {tasks} concurrent tasks, {}", work.title()));
            let rows = concurrent(&mut admin, &pooled, tasks, plan).await;
            conc.push(ConcTable { work, tasks, rows });
        }
        drop(pooled);
        if let Some(lease) = held {
            lock.release(&lease).await?;
        }
        drop(lock);
        close(ops).await;
    }
    if conc
        .iter()
        .flat_map(|t| &t.rows)
        .all(|r| r.server_cpu_ms_per_1000.is_none())
    {
        notes.push(
            "server CPU not measured: the PostgreSQL backends' /proc entries are not readable here"
                .to_owned(),
        );
    }
    notes.push(format!(
        "every pool has lock-pg's pool_size ({}) as its size and the bench database's connect options; each variant has an application_name of its own ({APP_LOCK_PG}, {APP_NO_TEST}, {APP_DEFAULT}, {APP_CONN}) so its backends are counted apart",
        config.pool_size
    ));
    notes.push(
        "the sqlx variants run the statement texts read back from pg_stat_activity after the PgLock sent them (acquire with lock-pg's holder identity, release with synchronous_commit off), with the same parameters"
            .to_owned(),
    );
    notes.push(
        "why sqlx costs more even with test_before_acquire(false): sqlx 0.9 pings every connection when it is returned to the pool, whatever the options (sqlx-core 0.9.0 src/pool/connection.rs, Floating::return_to_pool: `self.raw.ping()`, one Sync/ReadyForQuery round trip, in a task spawned by PoolConnection's Drop); test_before_acquire(false) removes only the second ping, the one before each acquire. lock-pg's pool puts a connection back only after its statement completed (rows or a server error) and closes one whose statement was cut off or whose future was dropped, so it needs neither ping"
            .to_owned(),
    );
    let _ = admin.close().await;
    let (command, runtime) = meta;
    Ok(PoolReport {
        command,
        profile: if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        runtime,
        machine: Machine::detect(),
        warmup: plan.warmup,
        rounds: plan.rounds,
        burst_ops: plan.burst_ops,
        bursts: plan.bursts,
        pool_size: config.pool_size,
        sequential,
        concurrent: conc,
        notes,
        duration_s: t0.elapsed().as_secs_f64(),
    })
}

fn fmt_ratio(v: Option<f64>) -> String {
    v.map_or_else(|| "–".to_owned(), |v| format!("{v:.2}"))
}

fn fmt_opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "–".to_owned(), |v| format!("{v:.digits$}"))
}

/// The report as markdown.
pub fn markdown(r: &PoolReport) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "## lock-pg's pool against sqlx's PgPool\n");
    let _ = writeln!(out, "`{}`\n", r.command);
    let m = &r.machine;
    let _ = writeln!(
        out,
        "- machine: {} × {}, Linux {}; load average at start {}",
        m.nproc, m.cpu_model, m.kernel, m.loadavg_at_start
    );
    let _ = writeln!(
        out,
        "- build: {} profile; runtime: {}; the run took {:.0} s",
        r.profile, r.runtime, r.duration_s
    );
    let _ = writeln!(
        out,
        "- sequential: {} measured rounds after {} warm-up rounds, each variant once per round in rotating order; concurrent: {} bursts of {} operations per variant and task count, rotating, after one untimed burst each. Latencies in µs, nearest-rank percentiles; ratios are this ÷ lock-pg's pool.\n",
        r.rounds, r.warmup, r.bursts, r.burst_ops
    );
    for t in &r.sequential {
        let _ = writeln!(out, "### Sequential: {}\n", t.work.title());
        let _ = writeln!(
            out,
            "| variant | median µs | p99 µs | ÷ lock-pg (median) | ÷ lock-pg (p99) |"
        );
        let _ = writeln!(out, "|---|---:|---:|---:|---:|");
        for row in &t.rows {
            let v = &row.variant;
            match (&v.latency, &v.error) {
                (Some(l), _) => {
                    let _ = writeln!(
                        out,
                        "| {} | {} | {} | {} | {} |",
                        v.label,
                        fmt_us(l.median_us),
                        fmt_us(l.p99_us),
                        fmt_ratio(row.median_vs_lock_pg),
                        fmt_ratio(row.p99_vs_lock_pg)
                    );
                }
                (None, e) => {
                    let _ = writeln!(
                        out,
                        "| {} | failed: {} | | | |",
                        v.label,
                        e.as_deref().unwrap_or("no samples")
                    );
                }
            }
        }
        let _ = writeln!(out);
    }
    for t in &r.concurrent {
        let _ = writeln!(
            out,
            "### Concurrent, {} tasks on one client: {}\n",
            t.tasks,
            t.work.title()
        );
        let _ = writeln!(
            out,
            "| variant | median µs | p99 µs | ops/s | ÷ lock-pg (median) | ÷ lock-pg (p99) | ÷ lock-pg (ops/s) | server CPU ms / 1000 ops | client CPU ms / 1000 ops | connections |"
        );
        let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        for row in &t.rows {
            match (&row.latency, &row.error) {
                (Some(l), _) => {
                    let _ = writeln!(
                        out,
                        "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                        row.label,
                        fmt_us(l.median_us),
                        fmt_us(l.p99_us),
                        fmt_opt(row.ops_per_s, 0),
                        fmt_ratio(row.median_vs_lock_pg),
                        fmt_ratio(row.p99_vs_lock_pg),
                        fmt_ratio(row.ops_vs_lock_pg),
                        fmt_opt(row.server_cpu_ms_per_1000, 0),
                        fmt_opt(row.client_cpu_ms_per_1000, 0),
                        row.connections
                            .map_or_else(|| "–".to_owned(), |c| c.to_string())
                    );
                }
                (None, e) => {
                    let _ = writeln!(
                        out,
                        "| {} | failed: {} | | | | | | | | |",
                        row.label,
                        e.as_deref().unwrap_or("no samples")
                    );
                }
            }
        }
        let _ = writeln!(out);
    }
    if !r.notes.is_empty() {
        let _ = writeln!(out, "### Notes\n");
        for n in &r.notes {
            let _ = writeln!(out, "- {n}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_whole_statement_is_taken_as_read_back() {
        assert_eq!(
            pick_statement("inspect", "SELECT 1".into(), 1024, None),
            Ok("SELECT 1".to_owned())
        );
    }

    #[test]
    fn a_cut_off_statement_needs_a_matching_copy() {
        let cut = RELEASE_ASYNC[..1023].to_owned();
        assert_eq!(
            pick_statement("release", cut.clone(), 1024, Some(RELEASE_ASYNC)),
            Ok(RELEASE_ASYNC.to_owned())
        );
        let err = pick_statement(
            "release",
            cut.replace("UPDATE", "DELETE"),
            1024,
            Some(RELEASE_ASYNC),
        )
        .unwrap_err();
        assert!(err.contains("differs from the bench's copy"), "{err}");
        let err = pick_statement("acquire", cut, 1024, None).unwrap_err();
        assert!(err.contains("no copy"), "{err}");
    }

    #[test]
    fn the_copy_is_one_statement_on_the_default_table() {
        assert!(RELEASE_ASYNC.starts_with("UPDATE \"distlock_leases\" AS l SET"));
        assert!(
            !RELEASE_ASYNC.contains("  "),
            "a line break lost or added a space"
        );
        assert_eq!(RELEASE_ASYNC.len(), 2252);
    }
}
