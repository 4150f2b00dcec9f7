//! `--redis-topologies`: the cost of the Redis topologies side by side in one run — the
//! uncontended acquire+release cycle and the hand-off between waiting clients on a single
//! server, a Sentinel-managed master (as plain `redis://`, through the sentinels, and with
//! `replicas=1`), a 3+3 Cluster, and (cycle only: it polls) Redlock over three masters, each as
//! a median and p99 and as a ratio to the single server.
//!
//! The servers are private, started here on free loopback ports by the same code lock-redis's
//! tests use (`conformance::servers::redis`: each process a `scripts/backends.sh` instance), and
//! stopped when the run ends (or, should it be killed, by that module's reaper once this process
//! is gone). The
//! cycles of all topologies are interleaved round by round ([`scenario::uncontended`]), so a
//! burst of load on the machine hits every row alike; the hand-offs run one topology after the
//! other with the main run's scenario ([`scenario::handoff`]).

use std::{sync::Arc, time::Duration};

use lock_core::{DynLock, LockKey};
use lock_redis::{RedisLock, RedlockLock};
use serde::Serialize;

use crate::{
    backends::{Cycle, DistlockCycle},
    progress,
    report::{Handoff, Variant},
    scenario::{self, HandoffFloors},
    stats::{Summary, ratio},
};

// The topologies lock-redis's tests use, every process started through scripts/backends.sh.
use conformance::servers::redis as servers;

/// The sizes of one run.
#[derive(Clone, Copy, Debug)]
pub struct TopologyPlan {
    /// Unmeasured rounds first (connections, script caches, slot maps).
    pub warmup: usize,
    /// Measured uncontended rounds per topology.
    pub cycles: usize,
    /// Measured hand-offs per topology.
    pub handoffs: usize,
    /// Clients taking turns in the hand-off.
    pub waiters: usize,
}

/// One topology's numbers.
#[derive(Clone, Debug, Serialize)]
pub struct TopologyRow {
    /// What was measured.
    pub topology: String,
    /// The URL form (servers on loopback; no credentials).
    pub url: String,
    /// Uncontended `try_acquire` + `release`.
    pub cycle: Option<Summary>,
    /// Release to the next holder's `acquire` returning.
    pub handoff: Option<Summary>,
    /// Why a measurement is missing.
    pub notes: Vec<String>,
}

/// The whole run.
#[derive(Clone, Debug, Serialize)]
pub struct TopologyReport {
    /// How to reproduce it.
    pub command: String,
    /// The runtime flavour.
    pub runtime: String,
    /// The plan's sizes.
    pub cycles: usize,
    /// Hand-offs per topology.
    pub handoffs: usize,
    /// Clients in the hand-off.
    pub waiters: usize,
    /// `redis-server --version`.
    pub server: String,
    /// Single server first (the base of the ratios).
    pub rows: Vec<TopologyRow>,
}

/// The private servers (stopped when dropped), and the topologies on them.
struct Servers {
    /// Its first node is the single server (a set of its own: Redlock's releases to the other
    /// set's masters may still be in flight when the next cycle starts).
    single: servers::Masters,
    masters: servers::Masters,
    sentinel: servers::SentinelSet,
    cluster: servers::Cluster,
}

impl Servers {
    fn start() -> Self {
        Self {
            single: servers::Masters::start(),
            masters: servers::Masters::start(),
            sentinel: servers::SentinelSet::start(false),
            cluster: servers::Cluster::start(),
        }
    }

    /// `(name, url, measure the hand-off)`, the single server first.
    fn topologies(&self) -> Vec<(String, String, bool)> {
        let mut rows = vec![(
            "single server (no replicas)".to_owned(),
            format!("redis://{}", self.single.nodes[0].addr()),
            true,
        )];
        if let Some(port) = self.sentinel.master_port() {
            rows.push((
                "the Sentinel set's master as `redis://` (2 replicas attached)".to_owned(),
                format!("redis://127.0.0.1:{port}"),
                true,
            ));
        }
        rows.extend([
            (
                "Sentinel (`redis+sentinel://`, 3 sentinels)".to_owned(),
                self.sentinel.url(""),
                true,
            ),
            (
                "Sentinel, `replicas=1`".to_owned(),
                self.sentinel.url("replicas=1&replica_timeout=1s"),
                true,
            ),
            (
                "Cluster 3+3 (`redis+cluster://`)".to_owned(),
                self.cluster.url(""),
                true,
            ),
            (
                "Redlock, 3 masters (`redlock://`; waiters poll)".to_owned(),
                self.masters.url(""),
                false,
            ),
        ]);
        rows
    }
}

async fn connect(url: &str) -> Result<DynLock, String> {
    let lock: DynLock = if url.starts_with("redlock://") {
        Arc::new(
            RedlockLock::connect_url(url)
                .await
                .map_err(|e| e.to_string())?,
        )
    } else {
        Arc::new(
            RedisLock::connect_url(url)
                .await
                .map_err(|e| e.to_string())?,
        )
    };
    Ok(lock)
}

fn server_version() -> String {
    std::process::Command::new("redis-server")
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|e| format!("unknown ({e})"))
}

impl TopologyReport {
    /// A report of a run that measured nothing: one row saying why.
    fn not_measured(plan: &TopologyPlan, command: String, runtime: String, why: String) -> Self {
        Self {
            command,
            runtime,
            cycles: plan.cycles,
            handoffs: plan.handoffs,
            waiters: plan.waiters,
            server: server_version(),
            rows: vec![TopologyRow {
                topology: "(none)".to_owned(),
                url: String::new(),
                cycle: None,
                handoff: None,
                notes: vec![why],
            }],
        }
    }
}

/// Starts the servers, measures every topology and stops them.
pub async fn run(
    plan: &TopologyPlan,
    run: &str,
    command: String,
    runtime: String,
) -> TopologyReport {
    progress(
        "starting a single server + 2 more masters, a Sentinel set (1+2, 3 sentinels) and a 3+3 Cluster on loopback",
    );
    let servers = match tokio::task::spawn_blocking(Servers::start).await {
        Ok(s) => s,
        Err(e) => {
            // The start panicked (a missing redis-server, a cluster that did not form).
            let why = format!("the servers could not be started: {e}");
            return TopologyReport::not_measured(plan, command, runtime, why);
        }
    };
    let topologies = servers.topologies();
    let ttl = crate::TTL;
    let mut rows: Vec<TopologyRow> = topologies
        .iter()
        .map(|(name, url, _)| TopologyRow {
            topology: name.clone(),
            url: url.clone(),
            cycle: None,
            handoff: None,
            notes: Vec::new(),
        })
        .collect();

    // The uncontended cycles of every topology, interleaved round by round.
    let mut variants: Vec<Box<dyn Cycle>> = Vec::new();
    let mut cycled = Vec::new();
    for (i, (name, url, _)) in topologies.iter().enumerate() {
        let key = LockKey::new(format!("bench/{run}/topology-cycle/{i}"));
        match (connect(url).await, key) {
            (Ok(lock), Ok(key)) => {
                variants.push(Box::new(DistlockCycle {
                    lock,
                    key,
                    ttl,
                    label: name.clone(),
                }));
                cycled.push(i);
            }
            (Err(e), _) => rows[i].notes.push(format!("cannot connect: {e}")),
            (_, Err(e)) => rows[i].notes.push(format!("bad key: {e}")),
        }
    }
    progress(format!(
        "uncontended cycles on {} topologies ({} + {} warm-up rounds, interleaved)",
        variants.len(),
        plan.cycles,
        plan.warmup
    ));
    let measured: Vec<Variant> =
        scenario::uncontended(&mut variants, plan.warmup, plan.cycles).await;
    drop(variants);
    for (i, v) in cycled.into_iter().zip(measured) {
        rows[i].cycle = v.latency;
        if let Some(e) = v.error {
            rows[i].notes.push(format!("cycle failed: {e}"));
        }
    }

    // The hand-offs, one topology after the other.
    for (i, (name, url, handoff)) in topologies.iter().enumerate() {
        if !handoff {
            continue;
        }
        progress(format!("{name}: hand-off, {} clients", plan.waiters));
        let clients = futures::future::try_join_all((0..plan.waiters).map(|_| connect(url))).await;
        let key = LockKey::new(format!("bench/{run}/topology-handoff/{i}"));
        match (clients, key) {
            (Ok(clients), Ok(key)) => {
                match scenario::handoff(
                    &clients,
                    &key,
                    ttl,
                    plan.handoffs,
                    HandoffFloors::default(),
                )
                .await
                {
                    Ok(Handoff { latency, .. }) => rows[i].handoff = Some(latency),
                    Err(e) => rows[i].notes.push(format!("hand-off failed: {e}")),
                }
            }
            (Err(e), _) => rows[i].notes.push(format!("cannot connect: {e}")),
            (_, Err(e)) => rows[i].notes.push(format!("bad key: {e}")),
        }
    }
    // Stop the servers (blocking: they are waited for).
    let _ = tokio::task::spawn_blocking(move || drop(servers)).await;
    TopologyReport {
        command,
        runtime,
        cycles: plan.cycles,
        handoffs: plan.handoffs,
        waiters: plan.waiters,
        server: server_version(),
        rows,
    }
}

fn us(s: &Summary, pick: fn(&Summary) -> f64) -> String {
    format!("{:.0} µs", pick(s))
}

fn cell_ratio(s: Option<&Summary>, base: Option<&Summary>, pick: fn(&Summary) -> f64) -> String {
    match (s, base) {
        (Some(s), Some(b)) => {
            ratio(pick(s), pick(b)).map_or("—".to_owned(), |r| format!("{r:.2}"))
        }
        _ => "—".to_owned(),
    }
}

/// The report as a Markdown section: one row per topology, medians and p99s, ratios to the
/// single server (first row).
pub fn markdown(report: &TopologyReport) -> String {
    let median = |s: &Summary| s.median_us;
    let p99 = |s: &Summary| s.p99_us;
    let base = report.rows.first();
    let (base_cycle, base_handoff) = (
        base.and_then(|r| r.cycle.as_ref()),
        base.and_then(|r| r.handoff.as_ref()),
    );
    let mut md = String::new();
    md.push_str("## Redis topologies (distlock-bench --redis-topologies)\n\n");
    md.push_str(&format!(
        "`{}`; {}; {}; {} uncontended cycles per topology (interleaved), {} hand-offs among {} clients per topology; private servers on loopback. Ratios: to the single server, median to median and p99 to p99.\n\n",
        report.command, report.server, report.runtime, report.cycles, report.handoffs, report.waiters
    ));
    md.push_str("| topology | acquire+release p50 | p99 | ratio p50 | ratio p99 | hand-off p50 | p99 | ratio p50 | ratio p99 |\n");
    md.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for row in &report.rows {
        let (c, h) = (row.cycle.as_ref(), row.handoff.as_ref());
        let dash = || "—".to_owned();
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            row.topology,
            c.map_or_else(dash, |s| us(s, median)),
            c.map_or_else(dash, |s| us(s, p99)),
            cell_ratio(c, base_cycle, median),
            cell_ratio(c, base_cycle, p99),
            h.map_or_else(dash, |s| us(s, median)),
            h.map_or_else(dash, |s| us(s, p99)),
            cell_ratio(h, base_handoff, median),
            cell_ratio(h, base_handoff, p99),
        ));
    }
    let notes: Vec<String> = report
        .rows
        .iter()
        .flat_map(|r| {
            r.notes
                .iter()
                .map(move |n| format!("* {}: {n}", r.topology))
        })
        .collect();
    if !notes.is_empty() {
        md.push('\n');
        md.push_str(&notes.join("\n"));
        md.push('\n');
    }
    md
}

/// `--redis-topologies`: runs, prints and writes `topologies.md` and `topologies.json`.
pub fn main(
    quick: bool,
    cycles: Option<usize>,
    waiters: usize,
    out: std::path::PathBuf,
    runtime: &tokio::runtime::Runtime,
    flavour: String,
) -> std::process::ExitCode {
    let plan = TopologyPlan {
        warmup: if quick { 50 } else { 200 },
        cycles: cycles.unwrap_or(if quick { 150 } else { 1000 }),
        handoffs: if quick { 40 } else { 200 },
        waiters,
    };
    let run = format!("{:08x}", rand::random::<u32>());
    let report = runtime.block_on(run_with_timeout(&plan, &run, flavour));
    let md = markdown(&report);
    println!("{md}");
    let failed = report.rows.iter().any(|r| r.cycle.is_none());
    let written = std::fs::create_dir_all(&out)
        .and_then(|()| std::fs::write(out.join("topologies.md"), &md))
        .and_then(|()| {
            let json = serde_json::to_string_pretty(&report).map_err(std::io::Error::other)?;
            std::fs::write(out.join("topologies.json"), json)
        });
    match written {
        Ok(()) => {
            progress(format!(
                "wrote topologies.md and topologies.json to {}",
                out.display()
            ));
        }
        Err(e) => {
            eprintln!("cannot write the results to {}: {e}", out.display());
            return std::process::ExitCode::FAILURE;
        }
    }
    if failed {
        std::process::ExitCode::FAILURE
    } else {
        std::process::ExitCode::SUCCESS
    }
}

async fn run_with_timeout(plan: &TopologyPlan, run_id: &str, flavour: String) -> TopologyReport {
    // A hand-off that never completes (a lost wake-up and no poll) must not hang the run.
    let limit = Duration::from_secs(1800);
    let command = crate::command_line();
    match tokio::time::timeout(limit, run(plan, run_id, command.clone(), flavour.clone())).await {
        Ok(report) => report,
        Err(_) => TopologyReport::not_measured(
            plan,
            command,
            flavour,
            format!("the run did not finish within {limit:?}"),
        ),
    }
}
