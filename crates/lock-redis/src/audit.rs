//! `audit`: read the Redis settings the fence and the lease depend on and grade each
//! (see the README's "Fencing: `SingleNode`, and what breaks it").

use std::{
    collections::HashMap,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use lock_core::raw::{AuditReport, Error, Result, no_answer};
use redis::{AsyncConnectionConfig, ConnectionAddr, InfoDict, aio::MultiplexedConnection};
use tokio::time::{Instant, timeout};

use crate::{RedisLockConfig, RedisTopology};

const BACKEND: &str = "redis";

/// Reads the server's settings that the fence and the lease depend on and grades each PASS /
/// WARN / FAIL with why and what to change. Read-only: it takes no lock and writes no key (it
/// runs `PING`, `INFO`, `CONFIG GET`, `TIME`, `EVAL "return 1" 0`, `SCRIPT LOAD`/`EVALSHA` of
/// that same one-line script).
///
/// Checks: `version` (RESP3 needs 6+), `scripts` (the lock is Lua scripts), `maxmemory-policy`
/// (eviction of a fence counter repeats fences; of a held lock key, two holders), `persistence`
/// (`appendonly yes` + `appendfsync always`, else a restart loses fence increments), `role` and
/// `replicas` (a failover to an asynchronous replica loses acknowledged grants), `clock` (the
/// server's clock next to ours; informational, the lease never uses it).
///
/// A setting that cannot be read (`CONFIG` disabled or renamed, as on some managed services)
/// is a WARN saying so.
///
/// # Errors
/// [`Error::Config`] for an invalid configuration; [`Error::Unavailable`] / [`Error::Backend`]
/// when the server cannot be reached or refuses the connection.
pub async fn audit(config: &RedisLockConfig) -> Result<AuditReport> {
    config.validate()?;
    match &config.topology {
        RedisTopology::Cluster { .. } => {
            let masters = servers(config).await?;
            let mut reports = Vec::new();
            for (host, port) in &masters {
                reports.push((
                    format!("{host}:{port}"),
                    audit_server(config, host, *port).await?,
                ));
            }
            let mut report = merge(reports);
            report.findings.insert(
                0,
                lock_core::raw::Finding {
                    check: "topology".to_owned(),
                    verdict: lock_core::raw::Verdict::Pass,
                    observed: format!("cluster, {} masters", masters.len()),
                    why: "every master audited; a check shows the worst of them".to_owned(),
                    fix: None,
                },
            );
            Ok(report)
        }
        RedisTopology::Sentinel { master_name, .. } => {
            let (host, port) =
                servers(config)
                    .await?
                    .into_iter()
                    .next()
                    .ok_or_else(|| Error::Unavailable {
                        backend: BACKEND,
                        op: "audit",
                        message: "no master".to_owned(),
                        source: None,
                    })?;
            let mut report = audit_server(config, &host, port).await?;
            report.findings.insert(
                0,
                lock_core::raw::Finding {
                    check: "topology".to_owned(),
                    verdict: lock_core::raw::Verdict::Pass,
                    observed: format!("sentinel master {master_name:?} at {host}:{port}"),
                    why: "the master the sentinels name is audited (a failover promotes a replica: see replicas)".to_owned(),
                    fix: None,
                },
            );
            Ok(report)
        }
        _ => audit_server(config, &config.host, config.port).await,
    }
}

/// The servers that hold locks: the one server, the master the sentinels name, or every
/// master of the cluster.
async fn servers(config: &RedisLockConfig) -> Result<Vec<(String, u16)>> {
    let budget = config.connect_timeout.saturating_add(config.timeout);
    match &config.topology {
        RedisTopology::Sentinel {
            sentinels,
            master_name,
        } => {
            let mut last = String::from("no sentinel given");
            for (host, port) in sentinels {
                let asked = async {
                    let client = redis::Client::open(ConnectionAddr::Tcp(host.clone(), *port))
                        .map_err(|e| e.to_string())?;
                    let mut c = timeout(budget, client.get_multiplexed_async_connection())
                        .await
                        .map_err(|_| "connect timed out".to_owned())?
                        .map_err(|e| e.to_string())?;
                    let reply: Option<(String, String)> = timeout(
                        budget,
                        redis::cmd("SENTINEL")
                            .arg("get-master-addr-by-name")
                            .arg(master_name)
                            .query_async(&mut c),
                    )
                    .await
                    .map_err(|_| "no answer".to_owned())?
                    .map_err(|e| e.to_string())?;
                    reply
                        .and_then(|(h, p)| Some((h, p.parse::<u16>().ok()?)))
                        .ok_or_else(|| format!("knows no master named {master_name:?}"))
                };
                match asked.await {
                    Ok(addr) => return Ok(vec![addr]),
                    Err(e) => last = format!("sentinel {host}:{port}: {e}"),
                }
            }
            Err(Error::Unavailable {
                backend: BACKEND,
                op: "audit",
                message: last,
                source: None,
            })
        }
        RedisTopology::Cluster { nodes } => {
            let mut last = String::from("no seed node given");
            for (host, port) in nodes {
                let listed = async {
                    let mut conn = open_at(config, host, *port).await?;
                    let mut cmd = redis::cmd("CLUSTER");
                    cmd.arg("NODES");
                    query::<String>(&mut conn, cmd, budget, "cluster nodes").await
                };
                match listed.await {
                    Ok(text) => {
                        let masters = cluster_masters(&text);
                        if !masters.is_empty() {
                            return Ok(masters);
                        }
                        last = format!("{host}:{port} lists no master");
                    }
                    Err(e) => last = format!("{host}:{port}: {e}"),
                }
            }
            Err(Error::Unavailable {
                backend: BACKEND,
                op: "audit",
                message: last,
                source: None,
            })
        }
        _ => Ok(vec![(config.host.clone(), config.port)]),
    }
}

/// The masters of a `CLUSTER NODES` reply (`id ip:port@cport flags master …`), failed ones
/// left out.
fn cluster_masters(text: &str) -> Vec<(String, u16)> {
    text.lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let addr = fields.nth(1)?;
            let flags = fields.next()?;
            let flags: Vec<&str> = flags.split(',').collect();
            if !flags.contains(&"master") || flags.iter().any(|f| f.starts_with("fail")) {
                return None;
            }
            let addr = addr.split('@').next()?;
            let (host, port) = addr.rsplit_once(':')?;
            Some((host.to_owned(), port.parse().ok()?))
        })
        .collect()
}

/// One report of several servers' reports: each check once, with the worst verdict; its
/// observation per server when they differ.
fn merge(reports: Vec<(String, AuditReport)>) -> AuditReport {
    let mut merged = AuditReport::new(BACKEND);
    merged.round_trip = reports.iter().filter_map(|(_, r)| r.round_trip).max();
    let Some((_, first)) = reports.first() else {
        return merged;
    };
    for check in first.findings.iter().map(|f| f.check.clone()) {
        let all: Vec<(&String, &lock_core::raw::Finding)> = reports
            .iter()
            .filter_map(|(addr, r)| r.finding(&check).map(|f| (addr, f)))
            .collect();
        let Some(worst) = all.iter().map(|(_, f)| *f).max_by_key(|f| f.verdict) else {
            continue;
        };
        let same = all.iter().all(|(_, f)| f.observed == worst.observed);
        let observed = if same {
            worst.observed.clone()
        } else {
            all.iter()
                .map(|(addr, f)| format!("{addr}: {}", f.observed))
                .collect::<Vec<_>>()
                .join("; ")
        };
        merged.push(
            check,
            worst.verdict,
            observed,
            worst.why.clone(),
            worst.fix.clone(),
        );
    }
    merged
}

/// The audit of one server.
async fn audit_server(config: &RedisLockConfig, host: &str, port: u16) -> Result<AuditReport> {
    let mut conn = open_at(config, host, port).await?;
    let budget = config.connect_timeout.saturating_add(config.timeout);
    let mut report = AuditReport::new(BACKEND);

    // Round trip: the best of a few PINGs (the first one may include a lazy setup).
    let mut best: Option<Duration> = None;
    for _ in 0..5 {
        let sent = Instant::now();
        query::<String>(&mut conn, redis::cmd("PING"), budget, "ping").await?;
        let rtt = sent.elapsed();
        best = Some(best.map_or(rtt, |b| b.min(rtt)));
    }
    report.round_trip = best;

    let info = query::<InfoDict>(&mut conn, redis::cmd("INFO"), budget, "info").await?;
    version(&mut report, info.get::<String>("redis_version"));
    scripts(&mut report, &mut conn, budget).await;
    let settings = config_get(
        &mut conn,
        budget,
        &[
            "maxmemory-policy",
            "maxmemory",
            "appendonly",
            "appendfsync",
            "min-replicas-to-write",
        ],
    )
    .await;
    eviction(&mut report, settings.as_ref());
    writes(&mut report, &mut conn, budget, config, &info).await;
    persistence(&mut report, settings.as_ref());
    replication(&mut report, &info, settings.as_ref(), config);
    clock(&mut report, &mut conn, budget).await;
    Ok(report)
}

async fn open_at(config: &RedisLockConfig, host: &str, port: u16) -> Result<MultiplexedConnection> {
    config.validate()?;
    let client = crate::client::client_at(config, host, port)?;
    let settings = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(config.connect_timeout))
        .set_response_timeout(Some(config.timeout));
    let budget = config.connect_timeout.saturating_add(config.timeout);
    match timeout(
        budget,
        client.get_multiplexed_async_connection_with_config(&settings),
    )
    .await
    {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(e))
            if e.kind() == redis::ErrorKind::AuthenticationFailed
                || matches!(e.code(), Some("WRONGPASS" | "NOAUTH" | "NOPERM")) =>
        {
            Err(Error::backend(BACKEND, "connect", e))
        }
        Ok(Err(e)) => Err(Error::unavailable(BACKEND, "connect", e)),
        Err(_) => Err(no_answer(BACKEND, "connect", budget)),
    }
}

async fn query<T: redis::FromRedisValue>(
    conn: &mut MultiplexedConnection,
    cmd: redis::Cmd,
    budget: Duration,
    op: &'static str,
) -> Result<T> {
    match timeout(budget, cmd.query_async::<T>(conn)).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(Error::backend(BACKEND, op, e)),
        Err(_) => Err(no_answer(BACKEND, op, budget)),
    }
}

/// `CONFIG GET` of each name; `Err(message)` when the server refuses `CONFIG`.
async fn config_get(
    conn: &mut MultiplexedConnection,
    budget: Duration,
    names: &[&str],
) -> std::result::Result<HashMap<String, String>, String> {
    let mut cmd = redis::cmd("CONFIG");
    cmd.arg("GET");
    for name in names {
        cmd.arg(*name);
    }
    query::<HashMap<String, String>>(conn, cmd, budget, "config get")
        .await
        .map_err(|e| e.to_string())
}

/// `major.minor.patch` → numbers (missing parts 0; `None` when unparsable).
fn parse_version(v: &str) -> Option<(u32, u32, u32)> {
    let mut parts = v.trim().split('.').map(|p| p.parse::<u32>().ok());
    let major = parts.next().flatten()?;
    let minor = parts.next().flatten().unwrap_or(0);
    let patch = parts.next().flatten().unwrap_or(0);
    Some((major, minor, patch))
}

fn version(report: &mut AuditReport, version: Option<String>) {
    let Some(v) = version else {
        report.warn(
            "version",
            "unknown",
            "INFO has no redis_version (a proxy or another server speaking RESP?)",
            "connect to Redis 6 or newer directly",
        );
        return;
    };
    match parse_version(&v) {
        Some((major, ..)) if major >= 6 => {
            report.pass(
                "version",
                v,
                "Redis 6+ (RESP3, ACLs); 7.0 is what the tests run",
            );
        }
        Some(_) => {
            report.fail(
                "version",
                v,
                "the driver speaks RESP3, which needs Redis 6 or newer",
                "upgrade to Redis 6 or newer (7.x recommended)",
            );
        }
        None => {
            report.warn(
                "version",
                v,
                "unrecognised version string",
                "connect to Redis 6 or newer",
            );
        }
    }
}

async fn scripts(report: &mut AuditReport, conn: &mut MultiplexedConnection, budget: Duration) {
    let mut eval = redis::cmd("EVAL");
    eval.arg("return 1").arg(0);
    if let Err(e) = query::<i64>(conn, eval, budget, "eval").await {
        report.fail(
            "scripts",
            "EVAL refused",
            format!("every lock operation is a Lua script: {e}"),
            "allow EVAL/EVALSHA/SCRIPT for this user (ACL +@scripting) and do not put a proxy that drops scripts in between",
        );
        return;
    }
    let mut load = redis::cmd("SCRIPT");
    load.arg("LOAD").arg("return 1");
    let sha = match query::<String>(conn, load, budget, "script load").await {
        Ok(sha) => sha,
        Err(e) => {
            report.fail(
                "scripts",
                "SCRIPT LOAD refused",
                format!("the driver loads its scripts and runs them by SHA: {e}"),
                "allow SCRIPT LOAD and EVALSHA for this user (ACL +@scripting)",
            );
            return;
        }
    };
    let mut evalsha = redis::cmd("EVALSHA");
    evalsha.arg(&sha).arg(0);
    match query::<i64>(conn, evalsha, budget, "evalsha").await {
        Ok(1) => {
            report.pass(
                "scripts",
                "EVAL, SCRIPT LOAD, EVALSHA",
                "Lua scripts run (every lock operation is one atomic script)",
            );
        }
        Ok(other) => {
            report.fail(
                "scripts",
                format!("EVALSHA returned {other}"),
                "a script did not return what it should (a proxy in between?)",
                "connect to Redis directly",
            );
        }
        Err(e) => {
            report.fail(
                "scripts",
                "EVALSHA failed after SCRIPT LOAD",
                format!("loaded scripts are not found again (a proxy spreading requests over servers?): {e}"),
                "connect to one Redis primary directly, not through a proxy that drops SCRIPT LOAD",
            );
        }
    }
}

/// Whether the server takes a script's write now: a `SET` of a probe key that no lock can have
/// (a NUL after the namespace; lock keys have no control characters), gone after 1 ms. A full
/// Redis under `noeviction` refuses it with `OOM command not allowed`, and then so is every
/// acquire: graded FAIL with what to change, not left to the self-test's raw error.
async fn writes(
    report: &mut AuditReport,
    conn: &mut MultiplexedConnection,
    budget: Duration,
    config: &RedisLockConfig,
    info: &InfoDict,
) {
    let mut eval = redis::cmd("EVAL");
    eval.arg("return redis.call('SET', KEYS[1], '1', 'PX', 1)")
        .arg(1)
        .arg(format!("{}\0audit-probe", config.namespace));
    let used = info.get::<u64>("used_memory");
    let limit = info.get::<u64>("maxmemory").filter(|m| *m > 0);
    let observed = match (used, limit) {
        (Some(used), Some(limit)) => format!("used_memory {used} of maxmemory {limit}"),
        (Some(used), None) => format!("used_memory {used}, no maxmemory"),
        _ => "memory use unknown".to_owned(),
    };
    match query::<redis::Value>(conn, eval, budget, "eval").await {
        Ok(_) => {
            report.pass("memory", observed, "the server accepts writes");
        }
        Err(e) if e.to_string().contains("OOM") => {
            report.fail(
                "memory",
                observed,
                "the server refuses writes because it is out of memory (maxmemory reached): every acquire fails",
                "raise maxmemory, free memory, or give the locks a Redis of their own",
            );
        }
        Err(e) => {
            report.warn(
                "memory",
                observed,
                format!(
                    "a probe write was refused, so whether the server takes writes is unknown: {e}"
                ),
                "allow the audit's user to write keys under the namespace",
            );
        }
    }
}

fn unreadable(report: &mut AuditReport, check: &str, why: &str) {
    report.warn(
        check,
        "unreadable",
        format!("CONFIG GET refused ({why}), so this cannot be checked"),
        "allow CONFIG GET for the audit's user, or check this setting by hand",
    );
}

fn eviction(
    report: &mut AuditReport,
    settings: std::result::Result<&HashMap<String, String>, &String>,
) {
    let settings = match settings {
        Ok(s) => s,
        Err(why) => return unreadable(report, "maxmemory-policy", why),
    };
    let Some(policy) = settings.get("maxmemory-policy") else {
        return unreadable(
            report,
            "maxmemory-policy",
            "no maxmemory-policy in the reply",
        );
    };
    let maxmemory = settings
        .get("maxmemory")
        .and_then(|m| m.parse::<u64>().ok())
        .unwrap_or(0);
    let observed = format!("{policy} (maxmemory {maxmemory})");
    if policy == "noeviction" {
        report.pass(
            "maxmemory-policy",
            observed,
            "no key is ever evicted: fence counters and held locks stay",
        );
    } else if policy.starts_with("allkeys-") {
        report.fail(
            "maxmemory-policy",
            observed,
            "an allkeys-* policy can evict a fence counter (fences repeat) or a held lock (two holders)",
            "CONFIG SET maxmemory-policy noeviction (and in redis.conf), or use a Redis of its own for locks",
        );
    } else if maxmemory > 0 {
        report.fail(
            "maxmemory-policy",
            observed,
            "a volatile-* policy with a memory limit can evict a held lock key (it has a TTL): two holders",
            "CONFIG SET maxmemory-policy noeviction (and in redis.conf)",
        );
    } else {
        report.warn(
            "maxmemory-policy",
            observed,
            "no memory limit now, but once maxmemory is set this policy evicts held lock keys",
            "CONFIG SET maxmemory-policy noeviction (and in redis.conf)",
        );
    }
}

fn persistence(
    report: &mut AuditReport,
    settings: std::result::Result<&HashMap<String, String>, &String>,
) {
    let settings = match settings {
        Ok(s) => s,
        Err(why) => return unreadable(report, "persistence", why),
    };
    let aof = settings.get("appendonly").map(String::as_str);
    let fsync = settings.get("appendfsync").map(String::as_str);
    let observed = format!(
        "appendonly {}, appendfsync {}",
        aof.unwrap_or("?"),
        fsync.unwrap_or("?")
    );
    match (aof, fsync) {
        (Some("yes"), Some("always")) => {
            report.pass(
                "persistence",
                observed,
                "every acknowledged fence increment is on disk before the reply",
            );
        }
        (Some("yes"), _) => {
            report.warn(
                "persistence",
                observed,
                "a crash loses up to the last second of writes: fences can repeat after a restart",
                "CONFIG SET appendfsync always (and in redis.conf) if fences must survive a crash",
            );
        }
        _ => {
            report.warn(
                "persistence",
                observed,
                "without the AOF a restart loses fence counters (back to the last snapshot, or to nothing): fences repeat",
                "CONFIG SET appendonly yes + appendfsync always (and in redis.conf) if fences must survive a restart",
            );
        }
    }
}

fn replication(
    report: &mut AuditReport,
    info: &InfoDict,
    settings: std::result::Result<&HashMap<String, String>, &String>,
    config: &RedisLockConfig,
) {
    let role = info.get::<String>("role").unwrap_or_default();
    match role.as_str() {
        "master" => {
            report.pass("role", "master", "writes go to the primary");
        }
        "slave" | "replica" => {
            report.fail(
                "role",
                "replica",
                "this server is a replica: it refuses the lock's writes, or (replica-read-only no) keeps them to itself",
                "point the URL at the primary",
            );
        }
        other => {
            report.warn(
                "role",
                if other.is_empty() { "unknown" } else { other },
                "INFO replication does not say this server is a primary",
                "point the URL at the Redis primary",
            );
        }
    }
    let replicas = info.get::<u64>("connected_slaves").unwrap_or(0);
    let wanted = u64::from(config.replicas);
    if wanted > replicas {
        report.fail(
            "replicas",
            format!("{replicas} connected, replicas={wanted} asked"),
            "fewer replicas than the URL's replicas= can acknowledge: every grant and renewal ends Indeterminate",
            "connect the replicas, or lower replicas= in the URL",
        );
        return;
    }
    if wanted > 0 {
        report.pass(
            "replicas",
            format!("{replicas} connected, replicas={wanted} acknowledge each grant (WAIT)"),
            "a grant counts only once replicas have it, so a failover to one of them keeps it",
        );
        return;
    }
    if replicas == 0 {
        report.pass(
            "replicas",
            "0 connected",
            "no replica that a failover could promote with writes missing",
        );
        return;
    }
    let min = settings
        .ok()
        .and_then(|s| s.get("min-replicas-to-write"))
        .and_then(|m| m.parse::<u64>().ok())
        .unwrap_or(0);
    report.warn(
        "replicas",
        format!("{replicas} connected, min-replicas-to-write {min}"),
        "replication is asynchronous: a promoted replica can miss acknowledged grants (two holders, repeated fences)",
        if min == 0 {
            "add replicas=N to the URL (each grant waits for N replicas), do not fail over automatically, or set min-replicas-to-write (bounds, does not prevent, the loss); protect resources with fencing tokens"
        } else {
            "min-replicas-to-write bounds the loss but does not prevent it: do not fail over automatically; protect resources with fencing tokens"
        },
    );
}

async fn clock(report: &mut AuditReport, conn: &mut MultiplexedConnection, budget: Duration) {
    let before = SystemTime::now();
    let sent = Instant::now();
    let Ok((secs, micros)) =
        query::<(String, String)>(conn, redis::cmd("TIME"), budget, "time").await
    else {
        report.warn(
            "clock",
            "unreadable",
            "TIME refused (informational: leases are timed by this client's monotonic clock)",
            "nothing to change for the lock",
        );
        return;
    };
    let rtt = sent.elapsed();
    let server = secs.parse::<u64>().ok().zip(micros.parse::<u64>().ok());
    let local = before.duration_since(UNIX_EPOCH).ok().map(|d| d + rtt / 2);
    let (Some((s, us)), Some(local)) = (server, local) else {
        report.warn(
            "clock",
            "unreadable",
            "TIME reply not understood",
            "nothing to change for the lock",
        );
        return;
    };
    let server = Duration::from_secs(s) + Duration::from_micros(us);
    // Always PASS: no lease depends on the two clocks agreeing.
    report.pass(
        "clock",
        clock_observed(server, local, rtt),
        "informational: leases are timed by this client's monotonic clock, never by the server's",
    );
}

/// `server +1.2 ms from ours (± 0.1 ms)`.
pub(crate) fn clock_observed(server: Duration, local: Duration, rtt: Duration) -> String {
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let sign = if server >= local { "+" } else { "-" };
    format!(
        "server {sign}{:.1} ms from ours (± {:.1} ms)",
        ms(server.abs_diff(local)),
        ms(rtt) / 2.0
    )
}

/// The glob patterns (for `SCAN MATCH`) of every key the driver writes for locks under
/// `namespace`: `<ns>…` (a lock and its hash-tagged keys), `{<ns>…` (the derived keys of a
/// lock without braces) and `{<tag>}\x1f<ns>…` (those of a lock with braces).
fn namespace_patterns(namespace: &str) -> Vec<String> {
    let escaped: String = namespace
        .chars()
        .flat_map(|c| {
            let special = matches!(c, '*' | '?' | '[' | ']' | '\\');
            special
                .then_some('\\')
                .into_iter()
                .chain(std::iter::once(c))
        })
        .collect();
    vec![
        format!("{escaped}*"),
        format!("{{{escaped}*"),
        format!("{{*}}\x1f{escaped}*"),
    ]
}

async fn namespace_keys(
    conn: &mut MultiplexedConnection,
    namespace: &str,
    budget: Duration,
) -> Result<Vec<Vec<u8>>> {
    let mut keys = Vec::new();
    for pattern in namespace_patterns(namespace) {
        let mut cursor: u64 = 0;
        loop {
            let mut scan = redis::cmd("SCAN");
            scan.arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(1000);
            let (next, batch): (u64, Vec<Vec<u8>>) = query(conn, scan, budget, "scan").await?;
            keys.extend(batch);
            if next == 0 {
                break;
            }
            cursor = next;
        }
    }
    keys.sort_unstable();
    keys.dedup();
    Ok(keys)
}

fn own_namespace(config: &RedisLockConfig) -> Result<()> {
    if config.namespace.is_empty() {
        return Err(Error::Config(
            "refusing to touch every key of the database: the namespace is empty".to_owned(),
        ));
    }
    Ok(())
}

/// How many keys the driver's locks under `config.namespace` occupy (lock, fence counter,
/// queue, holder and clean-up keys), on every server that holds locks (each master of a
/// cluster). For checking that a test run left nothing behind.
///
/// # Errors
/// [`Error::Config`] for an empty namespace; as [`audit`] otherwise.
pub async fn namespace_size(config: &RedisLockConfig) -> Result<usize> {
    own_namespace(config)?;
    let budget = config.connect_timeout.saturating_add(config.timeout);
    let mut total = 0;
    for (host, port) in servers(config).await? {
        let mut conn = open_at(config, &host, port).await?;
        total += namespace_keys(&mut conn, &config.namespace, budget)
            .await?
            .len();
    }
    Ok(total)
}

/// Deletes every key of the driver's locks under `config.namespace`, fence counters included,
/// on every server that holds locks — **only for a namespace of your own**, such as a test
/// run's: a lock deleted under its holder is given to the next caller, and a deleted fence
/// counter restarts at 1. Returns how many keys were deleted.
///
/// # Errors
/// [`Error::Config`] for an empty namespace; as [`audit`] otherwise.
pub async fn purge_namespace(config: &RedisLockConfig) -> Result<usize> {
    own_namespace(config)?;
    let budget = config.connect_timeout.saturating_add(config.timeout);
    // A cluster refuses a DEL of keys in different slots: one key per DEL there.
    let chunk = match config.topology {
        RedisTopology::Cluster { .. } => 1,
        _ => 500,
    };
    let mut deleted = 0;
    for (host, port) in servers(config).await? {
        let mut conn = open_at(config, &host, port).await?;
        let keys = namespace_keys(&mut conn, &config.namespace, budget).await?;
        for keys in keys.chunks(chunk) {
            let mut del = redis::cmd("DEL");
            for key in keys {
                del.arg(key.as_slice());
            }
            query::<u64>(&mut conn, del, budget, "del").await?;
        }
        deleted += keys.len();
    }
    Ok(deleted)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions() {
        assert_eq!(parse_version("7.0.15"), Some((7, 0, 15)));
        assert_eq!(parse_version("6"), Some((6, 0, 0)));
        assert_eq!(parse_version("x"), None);
    }

    #[test]
    fn cluster_masters_are_read_from_cluster_nodes() {
        let text = "a1 127.0.0.1:7000@17000 myself,master - 0 0 1 connected 0-5460\n\
                    b2 127.0.0.1:7003@17003 slave a1 0 0 1 connected\n\
                    c3 127.0.0.1:7001@17001 master,fail - 0 0 2 connected\n\
                    d4 ::1:7002@17002 master - 0 0 3 connected 5461-10922\n";
        assert_eq!(
            cluster_masters(text),
            vec![("127.0.0.1".to_owned(), 7000), ("::1".to_owned(), 7002)]
        );
    }

    #[test]
    fn patterns_escape_the_namespace() {
        assert_eq!(
            namespace_patterns("a*b:"),
            vec!["a\\*b:*", "{a\\*b:*", "{*}\x1fa\\*b:*"]
        );
    }
}
