//! `--election`: leader election's hand-over on `resign` and takeover after the leader dies, and
//! the cost of job mode (`run_exclusive` with `at_least`) against a plain `run_exclusive`.
//!
//! Per backend, in one process: a plain write round trip (uncontended `try_acquire` + `release`,
//! which is two writes), the hand-over (A resigns while B waits in `campaign`: from calling
//! `resign` to B's `campaign` returning; beside it the plain round trip once more, after the
//! same idle pause as the hand-over's), the takeover (A is a child process of this binary,
//! `--election-child`, SIGKILLed while it leads; from the kill to B's `campaign` returning) and
//! job mode on backends that claim `keep_until`.

use std::{
    convert::Infallible,
    process::Stdio,
    sync::Arc,
    time::{Duration, Instant},
};

use lock_core::{DistributedLockExt, DynLock, Election, InMemoryLock, LockOptions};
use serde::Serialize;
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::{
    backends::{self, Backend, Res},
    stats::{Summary, ratio},
};

/// client-go `leaderelection`'s documented defaults (not measured here).
const CLIENT_GO_LEASE: Duration = Duration::from_secs(15);
const CLIENT_GO_RENEW_DEADLINE: Duration = Duration::from_secs(10);
const CLIENT_GO_RETRY: Duration = Duration::from_secs(2);

/// The sizes of one `--election` run.
#[derive(Clone, Copy, Debug)]
pub struct ElectionPlan {
    /// Plain round trips measured (after `warmup` untimed ones).
    pub round_trips: usize,
    /// Untimed rounds before each measurement.
    pub warmup: usize,
    /// Hand-overs on `resign` measured.
    pub handovers: usize,
    /// Takeovers after the leader's death measured.
    pub takeovers: usize,
    /// The election TTL of the takeover measurement.
    pub ttl: Duration,
    /// Empty jobs per variant in the job-mode measurement.
    pub jobs: usize,
}

impl ElectionPlan {
    /// The quick (< 1 min) or the full plan.
    pub fn new(quick: bool) -> Self {
        Self {
            round_trips: if quick { 50 } else { 300 },
            warmup: if quick { 10 } else { 50 },
            handovers: if quick { 20 } else { 100 },
            takeovers: if quick { 2 } else { 3 },
            ttl: if quick {
                Duration::from_secs(2)
            } else {
                CLIENT_GO_LEASE
            },
            jobs: if quick { 100 } else { 500 },
        }
    }
}

/// One backend's numbers.
#[derive(Debug, Default, Serialize)]
pub struct ElectionReport {
    /// `memory`, `redis`, `etcd`, `zk` or `pg`.
    pub name: String,
    /// Uncontended `try_acquire` + `release`: two write round trips, back to back.
    pub round_trip: Option<Summary>,
    /// The same, each after the idle pause that precedes every hand-over ([`QUEUE_SETTLE`]):
    /// what two write round trips cost in the hand-over's conditions.
    pub idle_round_trip: Option<Summary>,
    /// From `resign` to the waiting campaigner's `campaign` returning.
    pub handover: Option<Summary>,
    /// The election TTL of the takeover measurement.
    pub ttl_ms: u128,
    /// From the SIGKILL of the leader's process to the waiting campaigner's `campaign`
    /// returning.
    pub takeover: Option<Summary>,
    /// Takeovers whose new term was greater than the killed leader's.
    pub terms_increased: usize,
    /// `run_exclusive` of an empty job.
    pub job_plain: Option<Summary>,
    /// The same with `at_least`.
    pub job_at_least: Option<Summary>,
    /// What went wrong or must be known.
    pub notes: Vec<String>,
}

/// The whole `--election` run.
#[derive(Debug, Serialize)]
pub struct Run {
    /// The command line.
    pub command: String,
    /// The plan's TTL for takeovers, in ms.
    pub ttl_ms: u128,
    /// Per backend.
    pub backends: Vec<ElectionReport>,
}

fn env_var(name: &str) -> Option<&'static str> {
    Some(match name {
        "redis" => "DISTLOCK_TEST_REDIS_URL",
        "etcd" => "DISTLOCK_TEST_ETCD_URL",
        "zk" => "DISTLOCK_TEST_ZK_URL",
        "pg" => "DISTLOCK_TEST_PG_URL",
        _ => return None,
    })
}

fn build(name: &str, url: &str, ttl: Duration) -> Res<Box<dyn Backend>> {
    Ok(match name {
        "redis" => Box::new(backends::redis::Redis::new(url)?),
        "etcd" => Box::new(backends::etcd::Etcd::new(url)?),
        "zk" => Box::new(backends::zk::Zk::new(url, ttl)?),
        "pg" => Box::new(backends::pg::Pg::new(url)?),
        other => return Err(format!("unknown backend {other:?} (redis, etcd, zk, pg)").into()),
    })
}

/// `a / b` for medians and for p99s.
pub fn ratios(a: &Summary, b: &Summary) -> (Option<f64>, Option<f64>) {
    (ratio(a.median_us, b.median_us), ratio(a.p99_us, b.p99_us))
}

/// One uncontended `try_acquire` + `release` of `key`: how long it took.
async fn round_trip(client: &DynLock, key: &str) -> Res<Duration> {
    let t = Instant::now();
    let guard = client
        .lock(key)
        .ttl(Duration::from_secs(30))
        .try_acquire()
        .await?
        .ok_or("the round-trip key was held")?;
    if !guard.release().await? {
        return Err("the round-trip lock was lost".into());
    }
    Ok(t.elapsed())
}

async fn round_trips(client: &DynLock, key: &str, plan: &ElectionPlan) -> Res<Summary> {
    let mut samples = Vec::with_capacity(plan.round_trips);
    for i in 0..plan.warmup + plan.round_trips {
        let took = round_trip(client, key).await?;
        if i >= plan.warmup {
            samples.push(took);
        }
    }
    Summary::of(&mut samples).ok_or_else(|| "no samples".into())
}

/// How long B's campaign may wait before it counts as a failure.
fn patience(ttl: Duration) -> Duration {
    ttl * 3 + Duration::from_secs(10)
}

/// Lets B's campaign reach the server and queue (there is no event to await for that).
const QUEUE_SETTLE: Duration = Duration::from_millis(50);

/// The hand-overs, and beside each (in the same conditions: after the same idle pause) one
/// plain round trip of `client` on `rt_key`.
async fn handovers(
    a: &Election,
    b: &Election,
    client: &DynLock,
    rt_key: &str,
    plan: &ElectionPlan,
) -> Res<(Summary, Summary)> {
    let mut samples = Vec::with_capacity(plan.handovers);
    let mut idle = Vec::with_capacity(plan.handovers);
    let wait = patience(Duration::from_secs(30));
    for i in 0..plan.warmup.min(5) + plan.handovers {
        tokio::time::sleep(QUEUE_SETTLE).await;
        let took = round_trip(client, rt_key).await?;
        if i >= plan.warmup.min(5) {
            idle.push(took);
        }
        let leader = a.campaign(wait).await?;
        let b = b.clone();
        let waiter = tokio::spawn(async move {
            let got = b.campaign(wait).await;
            (Instant::now(), got)
        });
        tokio::time::sleep(QUEUE_SETTLE).await;
        let t = Instant::now();
        if !leader.resign().await? {
            return Err("the leader had lost its leadership before resigning".into());
        }
        let (at, got) = waiter.await?;
        let next = got?;
        if i >= plan.warmup.min(5) {
            samples.push(at.saturating_duration_since(t));
        }
        next.resign().await?;
    }
    match (Summary::of(&mut samples), Summary::of(&mut idle)) {
        (Some(h), Some(r)) => Ok((h, r)),
        _ => Err("no samples".into()),
    }
}

/// The body of `--election-child`: campaigns in election `name` on `backend` (its URL from the
/// environment), prints `leading <term>` once it leads, and leads until the process is killed.
///
/// # Errors
/// When it cannot connect or campaign.
pub async fn child(backend: &str, name: &str, ttl: Duration) -> Res<Infallible> {
    let var = env_var(backend).ok_or("unknown backend")?;
    let url = std::env::var(var).map_err(|_| format!("{var} is not set"))?;
    let client = build(backend, &url, ttl)?.client().await?;
    let leader = Election::new(client, name)?
        .ttl(ttl)
        .campaign(patience(ttl))
        .await?;
    println!("leading {}", leader.term().get());
    leader.lost().await;
    Err("the leadership was lost while nobody killed us".into())
}

async fn takeovers(
    name: &str,
    b: &Election,
    election: &str,
    ttl: Duration,
    plan: &ElectionPlan,
    report: &mut ElectionReport,
) -> Res<Summary> {
    let mut samples = Vec::with_capacity(plan.takeovers);
    for _ in 0..plan.takeovers {
        let mut leader = tokio::process::Command::new(std::env::current_exe()?)
            .args(["--election-child", election, "--backends", name])
            .arg(format!("--election-ttl-ms={}", ttl.as_millis()))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()?;
        let stdout = leader.stdout.take().ok_or("the child has no stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let line = tokio::time::timeout(patience(ttl), lines.next_line())
            .await
            .map_err(|_| "the child never led")??
            .ok_or("the child exited before it led")?;
        let old_term: u64 = line
            .strip_prefix("leading ")
            .and_then(|t| t.parse().ok())
            .ok_or_else(|| format!("the child said {line:?}"))?;
        let b = b.clone();
        let wait = patience(ttl);
        let waiter = tokio::spawn(async move {
            let got = b.campaign(wait).await;
            (Instant::now(), got)
        });
        // Die at a random phase of the renewal period (every ttl/3).
        let phase = ttl.mul_f64(rand::random::<f64>() / 3.0);
        tokio::time::sleep(QUEUE_SETTLE + phase).await;
        leader.start_kill()?;
        let died = Instant::now();
        leader.wait().await?;
        let (at, got) = waiter.await?;
        let next = got?;
        samples.push(at.saturating_duration_since(died));
        if next.term().get() > old_term {
            report.terms_increased += 1;
        }
        next.resign().await?;
    }
    Summary::of(&mut samples).ok_or_else(|| "no samples".into())
}

async fn jobs(client: &DynLock, prefix: &str, plan: &ElectionPlan) -> Res<(Summary, Summary)> {
    // At least the backend's smallest TTL (ZooKeeper's is its session timeout).
    let ttl = Duration::from_secs(10).max(client.capabilities().min_ttl);
    let plain = LockOptions::with_ttl(ttl);
    let kept = plain.at_least(Duration::from_secs(2));
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for i in 0..plan.warmup + plan.jobs {
        // Alternate the two variants so that drift affects both alike; fresh keys, since an
        // `at_least` job keeps its key after it ends.
        for (variant, opts, samples) in [("plain", plain, &mut a), ("kept", kept, &mut b)] {
            let key = format!("{prefix}/{variant}/{i}");
            let t = Instant::now();
            client
                .run_exclusive(key.as_str(), opts, |_ctx| async {})
                .await?
                .ok_or("a fresh job key was held")?;
            if i >= plan.warmup {
                samples.push(t.elapsed());
            }
        }
    }
    match (Summary::of(&mut a), Summary::of(&mut b)) {
        (Some(a), Some(b)) => Ok((a, b)),
        _ => Err("no samples".into()),
    }
}

fn note<T>(report: &mut ElectionReport, what: &str, r: Res<T>) -> Option<T> {
    r.map_err(|e| report.notes.push(format!("{what} failed: {e}")))
        .ok()
}

async fn one(name: &str, plan: &ElectionPlan, run: &str) -> ElectionReport {
    let mut report = ElectionReport {
        name: name.to_owned(),
        ..ElectionReport::default()
    };
    let election = format!("bench-{run}-{name}");
    let (a, b, url): (DynLock, DynLock, Option<String>) = if name == "memory" {
        let coordinator = InMemoryLock::new();
        (
            Arc::new(coordinator.client()),
            Arc::new(coordinator.client()),
            None,
        )
    } else {
        let Some(url) = env_var(name).and_then(|v| std::env::var(v).ok()) else {
            report.notes.push(format!(
                "{} is not set (eval \"$(scripts/backends.sh env)\")",
                env_var(name).unwrap_or("its URL variable")
            ));
            return report;
        };
        let clients = match build(name, &url, plan.ttl) {
            Ok(backend) => futures::future::try_join(backend.client(), backend.client()).await,
            Err(e) => Err(e),
        };
        match note(&mut report, "connecting", clients) {
            Some((a, b)) => (a, b, Some(url)),
            None => return report,
        }
    };
    crate::progress(format!("election {name}: round trips"));
    report.round_trip = note(
        &mut report,
        "round trips",
        round_trips(&b, &format!("bench/{run}/{name}/rtt"), plan).await,
    );
    let ttl = plan.ttl.max(b.capabilities().min_ttl);
    report.ttl_ms = ttl.as_millis();
    let elections = Election::new(a, &election)
        .and_then(|a| Ok((a.ttl(ttl), Election::new(b.clone(), &election)?.ttl(ttl))));
    let Some((ea, eb)) = note(&mut report, "election setup", elections.map_err(Into::into)) else {
        return report;
    };
    crate::progress(format!("election {name}: {} hand-overs", plan.handovers));
    let rt_key = format!("bench/{run}/{name}/idle-rtt");
    if let Some((handover, idle)) = note(
        &mut report,
        "hand-over",
        handovers(&ea, &eb, &b, &rt_key, plan).await,
    ) {
        report.handover = Some(handover);
        report.idle_round_trip = Some(idle);
    }
    if url.is_some() {
        crate::progress(format!(
            "election {name}: {} takeovers at a {ttl:?} TTL",
            plan.takeovers
        ));
        let took = takeovers(name, &eb, &election, ttl, plan, &mut report).await;
        report.takeover = note(&mut report, "takeover", took);
    }
    if b.capabilities().keep_until {
        crate::progress(format!("election {name}: job mode"));
        if let Some((plain, kept)) = note(
            &mut report,
            "job mode",
            jobs(&b, &format!("bench/{run}/{name}/job"), plan).await,
        ) {
            report.job_plain = Some(plain);
            report.job_at_least = Some(kept);
        }
    } else {
        report
            .notes
            .push("job mode: the backend does not claim keep_until".to_owned());
    }
    report
}

/// Runs `--election` on `memory` and then each of `backends`.
pub async fn run(backends: &[String], plan: &ElectionPlan, run: &str, command: String) -> Run {
    let mut out = Vec::new();
    for name in std::iter::once("memory").chain(backends.iter().map(|s| s.trim())) {
        if name == "memory" && !out.is_empty() {
            continue;
        }
        out.push(one(name, plan, run).await);
    }
    Run {
        command,
        ttl_ms: plan.ttl.as_millis(),
        backends: out,
    }
}

fn ms(us: f64) -> String {
    format!("{:.2}", us / 1000.0)
}

fn pair(s: &Option<Summary>) -> String {
    s.as_ref().map_or("–".to_owned(), |s| {
        format!("{} / {}", ms(s.median_us), ms(s.p99_us))
    })
}

fn ratio_pair(a: &Option<Summary>, b: &Option<Summary>) -> String {
    match (a, b) {
        (Some(a), Some(b)) => {
            let (m, p) = ratios(a, b);
            let f = |r: Option<f64>| r.map_or("–".to_owned(), |r| format!("{r:.2}"));
            format!("{} / {}", f(m), f(p))
        }
        _ => "–".to_owned(),
    }
}

/// The run as a Markdown report.
pub fn markdown(run: &Run) -> String {
    let mut md = String::new();
    md.push_str("## Leader election and job mode\n\n");
    md.push_str(&format!("`{}`\n\n", run.command));
    md.push_str("Times in ms as median / p99. Round trip: an uncontended `try_acquire` + `release` (two write round trips), back to back, and once more after the same idle pause that precedes each hand-over (50 ms: on an idle machine the first request after a pause pays for waking threads and CPUs, which is not a round trip of the protocol). Hand-over ÷ the round trip after the same pause ≤ 1 meets the issue's goal of ≤ 2 write round trips.\n\n");
    md.push_str("| backend | round trip, back to back | round trip after the pause | hand-over on resign | hand-over / round trip after the pause | hand-over / back-to-back round trip |\n|---|---|---|---|---|---|\n");
    for b in &run.backends {
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} |\n",
            b.name,
            pair(&b.round_trip),
            pair(&b.idle_round_trip),
            pair(&b.handover),
            ratio_pair(&b.handover, &b.idle_round_trip),
            ratio_pair(&b.handover, &b.round_trip)
        ));
    }
    md.push_str("\nTakeover: the leader is a child process of the bench (`--election-child`) SIGKILLed while it leads, at a random phase of its renewal period (TTL / 3); from the kill to the waiting campaigner's `campaign` returning.\n\n");
    md.push_str(
        "| backend | TTL | takeover | takeover / TTL (median / p99) | new term > killed leader's |\n|---|---|---|---|---|\n",
    );
    for b in run.backends.iter().filter(|b| b.takeover.is_some()) {
        let ttl_us = b.ttl_ms as f64 * 1000.0;
        let (m, p) = b.takeover.as_ref().map_or((None, None), |t| {
            (ratio(t.median_us, ttl_us), ratio(t.p99_us, ttl_us))
        });
        let f = |r: Option<f64>| r.map_or("–".to_owned(), |r| format!("{r:.2}"));
        md.push_str(&format!(
            "| {} | {} ms | {} | {} / {} | {}/{} |\n",
            b.name,
            b.ttl_ms,
            pair(&b.takeover),
            f(m),
            f(p),
            b.terms_increased,
            b.takeover.as_ref().map_or(0, |t| t.n)
        ));
    }
    md.push_str(&format!(
        "\nclient-go `leaderelection` (its documented defaults, not measured): lease {} s, renew deadline {} s, retry period {} s; a candidate takes over once the record has not been renewed for a lease, checking every retry period: ≈ {}–{} s after the leader's last renewal.\n\n",
        CLIENT_GO_LEASE.as_secs(),
        CLIENT_GO_RENEW_DEADLINE.as_secs(),
        CLIENT_GO_RETRY.as_secs(),
        CLIENT_GO_LEASE.as_secs(),
        (CLIENT_GO_LEASE + CLIENT_GO_RETRY).as_secs()
    ));
    md.push_str("Job mode: `run_exclusive` of an empty job, plain and with `at_least(2 s)` (which keeps the lease to grant + 2 s instead of releasing), on fresh keys.\n\n");
    md.push_str("| backend | plain | at_least | at_least / plain |\n|---|---|---|---|\n");
    for b in run.backends.iter().filter(|b| b.job_plain.is_some()) {
        md.push_str(&format!(
            "| {} | {} | {} | {} |\n",
            b.name,
            pair(&b.job_plain),
            pair(&b.job_at_least),
            ratio_pair(&b.job_at_least, &b.job_plain)
        ));
    }
    let notes: Vec<String> = run
        .backends
        .iter()
        .flat_map(|b| b.notes.iter().map(move |n| format!("- {}: {n}", b.name)))
        .collect();
    if !notes.is_empty() {
        md.push_str("\nNotes:\n");
        md.push_str(&notes.join("\n"));
        md.push('\n');
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_of_medians_and_p99s() {
        let mut a = vec![Duration::from_millis(4); 3];
        let mut b = vec![Duration::from_millis(2); 3];
        let (m, p) = ratios(&Summary::of(&mut a).unwrap(), &Summary::of(&mut b).unwrap());
        assert_eq!((m, p), (Some(2.0), Some(2.0)));
    }
}
