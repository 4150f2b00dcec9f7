//! `distlock check [URL] [--json] [--strict]`: audit the coordinator's settings (each driver's
//! `audit()`), then the acquire/renew/release self-test with its measured round trips.

use std::time::Duration;

use distlock::{AuditReport, Backend, Capabilities, DistributedLockExt, DynLock, LockKey, Verdict};
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::{
    CheckArgs,
    commands::{describe_capabilities, describe_holder},
    duration::format_duration,
    exit::{self, code_for},
};

/// The self-test's key.
pub const SELF_TEST_KEY: &str = "distlock-check/self-test";

/// Runs the driver's audit for `url`.
///
/// # Errors
/// As the driver's `audit` (connecting, reading).
pub async fn audit(url: &str) -> distlock::Result<AuditReport> {
    match Backend::for_url(url)? {
        Backend::Memory => {
            let mut report = AuditReport::new("memory");
            report.warn(
                "scope",
                "in-process",
                "memory:// locks exclude only within this process",
                "use a real coordinator (redis://, etcd://, zk://, postgres://) between processes",
            );
            Ok(report)
        }
        #[cfg(feature = "redis")]
        Backend::Redis => {
            distlock::redis::audit(&distlock::redis::RedisLockConfig::from_url(url)?).await
        }
        #[cfg(feature = "etcd")]
        Backend::Etcd => {
            distlock::etcd::audit(&distlock::etcd::EtcdLockConfig::from_url(url)?).await
        }
        #[cfg(feature = "zk")]
        Backend::ZooKeeper => {
            distlock::zk::audit(&distlock::zk::ZkLockConfig::from_url(url)?).await
        }
        #[cfg(feature = "pg")]
        Backend::Postgres => distlock::pg::audit(&distlock::pg::PgLockConfig::from_url(url)?).await,
        #[allow(unreachable_patterns)]
        other => Err(distlock::Error::Config(format!(
            "the {other} backend is not compiled in"
        ))),
    }
}

/// One step of the self-test.
struct Step {
    name: &'static str,
    took: Option<Duration>,
    detail: String,
}

/// The self-test's outcome.
struct SelfTest {
    steps: Vec<Step>,
    error: Option<(String, u8)>,
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1_000_000.0).round() / 1000.0
}

/// `distlock check` once connected.
pub async fn check(lock: DynLock, url: &str, args: &CheckArgs) -> u8 {
    let caps = lock.capabilities();
    let report = audit(url).await;
    let ttl = args
        .ttl
        .unwrap_or_else(|| caps.effective_ttl(Duration::from_secs(5).max(caps.min_ttl)));
    let test = match LockKey::new(SELF_TEST_KEY) {
        Ok(key) => self_test(&lock, &key, ttl, caps).await,
        Err(e) => SelfTest {
            steps: Vec::new(),
            error: Some((e.to_string(), exit::FAILED)),
        },
    };
    finish(url, Some(&lock), &report, &test, ttl, args)
}

/// `distlock check` when connecting failed (`code`): the audit still says why, e.g. a
/// PostgreSQL lease table the driver refuses.
pub async fn check_unconnected(url: &str, args: &CheckArgs, why: &str, code: u8) -> u8 {
    let report = audit(url).await;
    let test = SelfTest {
        steps: Vec::new(),
        error: Some((format!("not connected: {why}"), code)),
    };
    finish(
        url,
        None,
        &report,
        &test,
        args.ttl.unwrap_or_default(),
        args,
    )
}

fn finish(
    url: &str,
    lock: Option<&DynLock>,
    report: &distlock::Result<AuditReport>,
    test: &SelfTest,
    ttl: Duration,
    args: &CheckArgs,
) -> u8 {
    let audit_code = match report {
        Ok(report) if report.is_ok(args.strict) => exit::OK,
        Ok(_) => exit::FAILED,
        Err(e) => code_for(e),
    };
    // The table: the audit ran and found a FAIL → 1, whatever the self-test met (a FAIL says
    // why it failed, e.g. a full Redis refusing writes); else the self-test's code (69 could
    // not reach, 78 refused credentials), else the audit's.
    let code = match (&test.error, audit_code) {
        (_, exit::FAILED) => exit::FAILED,
        (Some((_, code)), _) => *code,
        (None, code) => code,
    };
    let backend = match (lock, report) {
        (Some(l), _) => l.backend_name().to_owned(),
        (None, Ok(r)) => r.backend.clone(),
        (None, Err(_)) => {
            Backend::for_url(url).map_or_else(|_| "unknown".to_owned(), |b| b.to_string())
        }
    };
    let caps = lock.map(|l| l.capabilities());
    if args.json {
        print_json(&backend, report, test, ttl, args.strict, code);
    } else {
        print_text(&backend, caps, report, test, ttl, args.strict);
    }
    code
}

fn verdict_counts(report: &AuditReport) -> (usize, usize, usize) {
    let count = |v| report.findings.iter().filter(|f| f.verdict == v).count();
    (
        count(Verdict::Pass),
        count(Verdict::Warn),
        count(Verdict::Fail),
    )
}

fn print_text(
    backend: &str,
    caps: Option<Capabilities>,
    report: &distlock::Result<AuditReport>,
    test: &SelfTest,
    ttl: Duration,
    strict: bool,
) {
    println!("backend: {backend}");
    if let Some(caps) = caps {
        for line in describe_capabilities(backend, &caps) {
            println!("{line}");
        }
    }
    println!("audit:");
    match report {
        Ok(report) => {
            let width = report
                .findings
                .iter()
                .map(|f| f.check.len())
                .max()
                .unwrap_or(0);
            for f in &report.findings {
                println!(
                    "  {:<width$}  {}  {}: {}",
                    f.check, f.verdict, f.observed, f.why
                );
                if let Some(fix) = &f.fix {
                    println!("  {:<width$}        fix: {fix}", "");
                }
            }
            if let Some(rtt) = report.round_trip {
                println!("  round trip: {:.3} ms (best of 5)", ms(rtt));
            }
            let (pass, warn, fail) = verdict_counts(report);
            let verdict = if report.is_ok(strict) { "ok" } else { "FAILED" };
            println!(
                "  audit verdict: {verdict} ({fail} FAIL, {warn} WARN, {pass} PASS{})",
                if strict {
                    "; --strict: a WARN fails"
                } else {
                    ""
                }
            );
        }
        Err(e) => println!("  could not run: {e}"),
    }
    println!(
        "self-test on {SELF_TEST_KEY} (ttl {}):",
        format_duration(ttl)
    );
    for step in &test.steps {
        match step.took {
            Some(took) => println!(
                "  {:<13} ok  {:>9}  {}",
                step.name,
                format!("{:.1}ms", ms(took)),
                step.detail
            ),
            None => println!("  {:<13} {}", step.name, step.detail),
        }
    }
    let took: Vec<Duration> = test.steps.iter().filter_map(|s| s.took).collect();
    if let (Some(min), Some(max)) = (took.iter().min(), took.iter().max()) {
        println!(
            "  round trips:  {:.1}ms to {:.1}ms per operation",
            ms(*min),
            ms(*max)
        );
    }
    match &test.error {
        Some((why, _)) => println!("  self-test verdict: FAILED: {why}"),
        None => println!("  self-test verdict: ok"),
    }
    let audit_line = match report {
        Ok(report) => {
            let (pass, warn, fail) = verdict_counts(report);
            if fail > 0 || (strict && warn > 0) {
                Some(format!(
                    "audit: {fail} FAIL, {warn} WARN{}",
                    if strict { " (--strict)" } else { "" }
                ))
            } else {
                let _ = pass;
                None
            }
        }
        Err(e) => Some(format!("audit could not run: {e}")),
    };
    match (&test.error, audit_line) {
        (Some((why, _)), _) => println!("result: FAILED: {why}"),
        (None, Some(line)) => println!("result: FAILED: {line}"),
        (None, None) => println!("result: OK"),
    }
}

fn print_json(
    backend: &str,
    report: &distlock::Result<AuditReport>,
    test: &SelfTest,
    ttl: Duration,
    strict: bool,
    code: u8,
) {
    let audit = match report {
        Ok(report) => {
            let (pass, warn, fail) = verdict_counts(report);
            json!({
                "findings": report.findings.iter().map(|f| json!({
                    "check": f.check,
                    "verdict": f.verdict.as_str(),
                    "observed": f.observed,
                    "why": f.why,
                    "fix": f.fix,
                })).collect::<Vec<Value>>(),
                "worst": report.worst().as_str(),
                "pass": pass,
                "warn": warn,
                "fail": fail,
                "round_trip_ms": report.round_trip.map(ms),
            })
        }
        Err(e) => json!({ "error": e.to_string() }),
    };
    let value = json!({
        "backend": backend,
        "audit": audit,
        "self_test": {
            "key": SELF_TEST_KEY,
            "ttl_ms": ms(ttl),
            "steps": test.steps.iter().map(|s| json!({
                "step": s.name,
                "ok": s.took.is_some(),
                "ms": s.took.map(ms),
                "detail": s.detail,
            })).collect::<Vec<Value>>(),
            "error": test.error.as_ref().map(|e| e.0.clone()),
        },
        "strict": strict,
        "ok": code == exit::OK,
    });
    println!("{value}");
}

async fn self_test(lock: &DynLock, key: &LockKey, ttl: Duration, caps: Capabilities) -> SelfTest {
    let mut steps = Vec::new();
    let error = match run_steps(lock, key, ttl, caps, &mut steps).await {
        Ok(()) => None,
        Err(StepError::Lock(e)) => Some((e.to_string(), code_for(&e))),
        Err(StepError::Wrong(why)) => Some((why, exit::FAILED)),
    };
    SelfTest { steps, error }
}

enum StepError {
    Lock(distlock::Error),
    Wrong(String),
}

impl From<distlock::Error> for StepError {
    fn from(e: distlock::Error) -> Self {
        StepError::Lock(e)
    }
}

fn done(steps: &mut Vec<Step>, name: &'static str, started: Instant, detail: String) {
    steps.push(Step {
        name,
        took: Some(started.elapsed()),
        detail,
    });
}

async fn run_steps(
    lock: &DynLock,
    key: &LockKey,
    ttl: Duration,
    caps: Capabilities,
    steps: &mut Vec<Step>,
) -> Result<(), StepError> {
    let wrong = |s: &str| Err(StepError::Wrong(s.to_owned()));

    let t = Instant::now();
    // Another `check` may be running: wait for it (its lease ends within a ttl).
    let give_up = Instant::now() + ttl + Duration::from_secs(1);
    let mut lease = loop {
        if let Some(lease) = lock.try_acquire(key, ttl).await? {
            break lease;
        }
        if Instant::now() >= give_up {
            return wrong("the self-test key stayed held (another `distlock check` running?)");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let first = lease.fencing_token();
    done(
        steps,
        "try_acquire",
        t,
        first.map_or("no fencing token".to_owned(), |f| {
            format!("fencing token {f}")
        }),
    );

    let t = Instant::now();
    match lock.inspect(key).await? {
        Some(h) if h.token_digest.is_none_or(|d| d == lease.token().digest()) => {
            done(
                steps,
                "inspect",
                t,
                format!("held by us ({})", describe_holder(&h)),
            );
        }
        Some(_) => return wrong("inspect shows another holder than us"),
        None => return wrong("inspect shows the key free while we hold it"),
    }

    let t = Instant::now();
    if lock.try_acquire(key, ttl).await?.is_some() {
        return wrong("a second acquisition succeeded while the lock was held");
    }
    done(
        steps,
        "exclusion",
        t,
        "a second try_acquire is refused".to_owned(),
    );

    if caps.renew {
        let t = Instant::now();
        lock.renew(&mut lease, ttl).await?;
        done(steps, "renew", t, String::new());
    } else {
        steps.push(Step {
            name: "renew",
            took: None,
            detail: "skipped (not supported)".to_owned(),
        });
    }

    let t = Instant::now();
    if !lock.release(&lease).await? {
        return wrong("release reported the lease already lost");
    }
    done(steps, "release", t, String::new());

    let t = Instant::now();
    if lock.inspect(key).await?.is_some() {
        return wrong("inspect shows a holder after release");
    }
    done(steps, "inspect", t, "free".to_owned());

    let t = Instant::now();
    let guard = lock.lock(key).ttl(ttl).try_acquire().await?;
    let Some(guard) = guard else {
        return wrong("the released key could not be acquired again");
    };
    let second = guard.fencing_token();
    if !guard.release().await? {
        return wrong("the second lease was lost before its release");
    }
    match (first, second) {
        (Some(a), Some(b)) if b <= a => {
            return Err(StepError::Wrong(format!(
                "fencing tokens did not increase ({a} then {b})"
            )));
        }
        (Some(a), Some(b)) => done(
            steps,
            "reacquire",
            t,
            format!("fencing token {b} > {a}, released"),
        ),
        _ => done(steps, "reacquire", t, "released".to_owned()),
    }
    Ok(())
}
