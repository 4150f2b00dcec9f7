//! `distlock conformance [--junit FILE] [--only NAME]..`: the conformance properties that need
//! no server control, against the coordinator of `--url`, on fresh keys under a namespace of
//! this run's own, removed (and checked empty) afterwards.

use std::{
    path::Path,
    sync::Arc,
    time::{Duration, Instant},
};

use conformance::{
    Harness, TestBackend,
    suite::{self, Report, Verdict},
};
use distlock::{Backend, DynLock, Lease, raw::async_trait};

use crate::{ConformanceArgs, exit};

/// The coordinator, with this run's namespace in its configuration (built once per run: the
/// variants' sizes do not matter).
#[derive(Clone, Debug)]
#[allow(clippy::large_enum_variant)]
enum Target {
    Memory(String),
    #[cfg(feature = "redis")]
    Redis(distlock::redis::RedisLockConfig),
    #[cfg(feature = "etcd")]
    Etcd(distlock::etcd::EtcdLockConfig),
    #[cfg(feature = "zk")]
    Zk(distlock::zk::ZkLockConfig),
    #[cfg(feature = "pg")]
    Pg(distlock::pg::PgLockConfig),
}

impl Target {
    /// `url`'s configuration with everything moved under `run` (a fresh, unique name).
    fn new(url: &str, run: &str) -> distlock::Result<Self> {
        Ok(match Backend::for_url(url)? {
            Backend::Memory => Target::Memory(format!("memory://{run}")),
            #[cfg(feature = "redis")]
            Backend::Redis => {
                let mut config = distlock::redis::RedisLockConfig::from_url(url)?;
                config.namespace = format!("{}{run}:", config.namespace);
                Target::Redis(config)
            }
            #[cfg(feature = "etcd")]
            Backend::Etcd => {
                let mut config = distlock::etcd::EtcdLockConfig::from_url(url)?;
                config.prefix = format!("{}{run}/", config.normalized_prefix());
                Target::Etcd(config)
            }
            #[cfg(feature = "zk")]
            Backend::ZooKeeper => {
                let mut config = distlock::zk::ZkLockConfig::from_url(url)?;
                config.root = format!("{}/{run}", config.root.trim_end_matches('/'));
                Target::Zk(config)
            }
            #[cfg(feature = "pg")]
            Backend::Postgres => {
                let mut config = distlock::pg::PgLockConfig::from_url(url)?;
                let table = run.replace('-', "_");
                let name = match config.table.schema() {
                    Some(schema) => format!("{schema}.{table}"),
                    None => table,
                };
                config.table = distlock::pg::TableName::new(&name)?;
                Target::Pg(config)
            }
            #[allow(unreachable_patterns)]
            other => {
                return Err(distlock::Error::Config(format!(
                    "the {other} backend is not compiled in"
                )));
            }
        })
    }

    /// Where this run's locks live, for messages.
    fn namespace(&self) -> String {
        match self {
            Target::Memory(url) => url.clone(),
            #[cfg(feature = "redis")]
            Target::Redis(c) => format!("redis keys {}*", c.namespace),
            #[cfg(feature = "etcd")]
            Target::Etcd(c) => format!("etcd prefix {}", c.prefix),
            #[cfg(feature = "zk")]
            Target::Zk(c) => format!("zookeeper root {}", c.root),
            #[cfg(feature = "pg")]
            Target::Pg(c) => format!("postgres table {}", c.table.quoted()),
        }
    }

    async fn connect(&self) -> distlock::Result<DynLock> {
        Ok(match self {
            Target::Memory(url) => distlock::connect(url).await?,
            #[cfg(feature = "redis")]
            Target::Redis(c) => Arc::new(distlock::RedisLock::connect(c.clone()).await?),
            #[cfg(feature = "etcd")]
            Target::Etcd(c) => Arc::new(distlock::EtcdLock::connect(c.clone()).await?),
            #[cfg(feature = "zk")]
            Target::Zk(c) => Arc::new(distlock::ZkLock::connect(c.clone()).await?),
            #[cfg(feature = "pg")]
            Target::Pg(c) => Arc::new(distlock::PgLock::connect(c.clone()).await?),
        })
    }

    /// How many keys / nodes / rows this run's namespace holds.
    async fn size(&self) -> distlock::Result<usize> {
        match self {
            Target::Memory(_) => Ok(0),
            #[cfg(feature = "redis")]
            Target::Redis(c) => distlock::redis::namespace_size(c).await,
            #[cfg(feature = "etcd")]
            Target::Etcd(c) => distlock::etcd::namespace_size(c).await,
            #[cfg(feature = "zk")]
            Target::Zk(c) => distlock::zk::namespace_size(c).await,
            #[cfg(feature = "pg")]
            Target::Pg(c) => distlock::pg::namespace_size(c).await,
        }
    }

    /// Removes this run's namespace.
    async fn purge(&self) -> distlock::Result<usize> {
        match self {
            Target::Memory(_) => Ok(0),
            #[cfg(feature = "redis")]
            Target::Redis(c) => distlock::redis::purge_namespace(c).await,
            #[cfg(feature = "etcd")]
            Target::Etcd(c) => distlock::etcd::purge_namespace(c).await,
            #[cfg(feature = "zk")]
            Target::Zk(c) => distlock::zk::purge_namespace(c).await,
            #[cfg(feature = "pg")]
            Target::Pg(c) => distlock::pg::purge_namespace(c).await,
        }
    }
}

/// The suite's view of the user's coordinator: fresh clients, and an operator client whose
/// `force_release` stands in for "the coordinator dropped the lease" (no server control).
struct UserBackend {
    target: Target,
    operator: DynLock,
    short_ttl: Duration,
}

#[async_trait]
impl TestBackend for UserBackend {
    async fn client(&self) -> distlock::Result<DynLock> {
        self.target.connect().await
    }

    fn short_ttl(&self) -> Duration {
        self.short_ttl
    }

    async fn force_expire(&self, lease: &Lease) -> distlock::Result<()> {
        self.operator.force_release(lease.key()).await.map(|_| ())
    }
}

/// The longest one property may run before it counts as failed.
const PROPERTY_LIMIT: Duration = Duration::from_secs(180);

/// Fault drills the repository runs, which need control of the servers.
const DRILLS: &str = "kill and restart (drill_restart), frozen servers (drill_frozen), \
    partitions (drill_partition_*), lost replies through a proxy (drill_proxy, \
    drill_lost_replies), cluster fail-overs (drill_cluster)";

/// `distlock conformance`.
pub async fn conformance(url: &str, args: &ConformanceArgs) -> u8 {
    if args.drills {
        say!(
            "distlock: conformance --drills: fault drills need control of the servers ({DRILLS}); \
             they are not run against your coordinator. Run them in the distlock repository with \
             its private servers: scripts/test.sh"
        );
        return exit::USAGE;
    }
    let all = suite::properties();
    let selected: Vec<_> = all
        .iter()
        .copied()
        .filter(|p| args.only.is_empty() || args.only.iter().any(|o| p.name.contains(o.as_str())))
        .collect();
    if selected.is_empty() {
        say!("distlock: --only matches no property (see --list)");
        return exit::USAGE;
    }
    if args.list {
        for p in &selected {
            println!("{}", p.name);
        }
        return exit::OK;
    }
    // The audit first: a green suite on a deployment whose settings can drop or double a held
    // lock (an evicting Redis, fsync off, ...) would be a false assurance.
    let accepted = match audit_first(url, args).await {
        Ok(accepted) => accepted,
        Err(code) => return code,
    };
    let run = format!("distlock-conformance-{:016x}", rand::random::<u64>());
    let target = match Target::new(url, &run) {
        Ok(target) => target,
        Err(e) => {
            say!("distlock: {e}");
            return exit::code_for(&e);
        }
    };
    let operator = match target.connect().await {
        Ok(lock) => lock,
        Err(e) => {
            say!("distlock: cannot connect: {e}");
            return exit::connect_code(&e);
        }
    };
    let caps = operator.capabilities();
    // Long enough that a scheduling stall of a loaded machine does not outlast it.
    let short_ttl = args
        .short_ttl
        .unwrap_or(Duration::from_millis(500))
        .max(caps.min_ttl);
    let backend = operator.backend_name().to_owned();
    println!(
        "conformance: {} properties against {backend} under {} (short ttl {:?}); fault drills \
         need server control and are not run",
        selected.len(),
        target.namespace(),
        short_ttl
    );
    let harness = Harness::new(UserBackend {
        target: target.clone(),
        operator,
        short_ttl,
    });
    let started = Instant::now();
    let mut reports = Vec::with_capacity(selected.len());
    let width = selected.len().to_string().len();
    let mut outage: Option<(&'static str, String)> = None;
    // A failed assertion is reported below as what was expected and what happened, not as
    // the panic hook's message with a backtrace.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|info| {
        if let Ok(mut last) = LAST_PANIC.lock() {
            *last = info
                .location()
                .map(|l| format!("{}:{}", l.file(), l.line()));
        }
    }));
    for (i, property) in selected.iter().enumerate() {
        if let Ok(mut last) = LAST_PANIC.lock() {
            *last = None;
        }
        let mut report = suite::run(*property, harness.clone(), PROPERTY_LIMIT).await;
        if let Verdict::Failed(message) = &report.verdict {
            let at = LAST_PANIC.lock().ok().and_then(|mut l| l.take());
            report.verdict = Verdict::Failed(describe_failure(property.name, message, at));
        }
        if matches!(report.verdict, Verdict::Failed(_))
            && let Err(why) = reachable(&target).await
        {
            // The server went away: that is an outage, not a property failure.
            println!(
                "[{:>width$}/{}] {} ... interrupted: the coordinator became unreachable ({why})",
                i + 1,
                selected.len(),
                property.name
            );
            outage = Some((property.name, why));
            break;
        }
        // One line per property once it ended (what a property prints comes before it).
        print!(
            "[{:>width$}/{}] {} ... ",
            i + 1,
            selected.len(),
            property.name
        );
        match &report.verdict {
            Verdict::Passed => println!("ok ({:.1}s)", report.took.as_secs_f64()),
            Verdict::Skipped(why) => println!("skipped: {why}"),
            Verdict::Failed(why) => {
                println!("FAILED ({:.1}s)", report.took.as_secs_f64());
                for line in why.lines() {
                    println!("      {line}");
                }
            }
        }
        reports.push(report);
    }
    std::panic::set_hook(hook);
    drop(harness);
    if let Some((property, why)) = outage {
        say!(
            "distlock: conformance: the coordinator became unreachable during {property} ({why}): \
             {} of {} properties ran; this is an outage, not a property failure (nothing was \
             cleaned up: {} may be left behind)",
            reports.len(),
            selected.len(),
            target.namespace()
        );
        distlock::finish_background_releases(Duration::from_secs(1)).await;
        return exit::UNAVAILABLE;
    }
    // Clean-ups the properties left to the background finish before the namespace goes.
    distlock::finish_background_releases(Duration::from_secs(10)).await;
    let leftover = clean_up(&target).await;
    let passed = count(&reports, |v| matches!(v, Verdict::Passed));
    let skipped = count(&reports, |v| matches!(v, Verdict::Skipped(_)));
    let failed = count(&reports, |v| matches!(v, Verdict::Failed(_)));
    println!(
        "summary: {} properties: {passed} passed, {skipped} skipped, {failed} failed in {:.1}s \
         against {backend}",
        reports.len(),
        started.elapsed().as_secs_f64()
    );
    if accepted > 0 {
        println!(
            "audit: {accepted} FAIL accepted (--accept-audit-failures): passing properties do not \
             make this deployment safe"
        );
    }
    let mut code = if failed == 0 { exit::OK } else { exit::FAILED };
    match &leftover {
        Ok(()) => println!("clean-up: {} removed, nothing left", target.namespace()),
        Err(why) => {
            println!("clean-up: FAILED: {why}");
            code = exit::FAILED;
        }
    }
    if let Some(path) = &args.junit {
        let xml = junit(
            &backend,
            &reports,
            started.elapsed(),
            leftover.as_ref().err(),
        );
        if let Err(e) = std::fs::write(path, xml) {
            say!("distlock: cannot write {}: {e}", path.display());
            return exit::CONFIG;
        }
        println!("junit: {}", Path::new(path).display());
    }
    code
}

/// Where the last panic (a property's failed assertion) happened.
static LAST_PANIC: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

/// A failed property's panic message as three lines: the property (and where it failed), what
/// was expected, what happened — with the driver errors' `Debug` made readable.
fn describe_failure(name: &str, message: &str, at: Option<String>) -> String {
    let (expected, happened) = expected_and_happened(message.trim());
    let at = at.map_or(String::new(), |at| format!(" (failed at {at})"));
    // A property's own message names the check that failed, which may be worded as what it
    // wanted or as what went wrong: labelled as the check, not as what was expected.
    let label = if expected.1 { "expected" } else { "check" };
    format!(
        "property: {name}{at}\n{label}: {}\nhappened: {}",
        readable(&expected.0),
        readable(&happened)
    )
}

/// (what was expected or checked, whether it is an expectation), what happened.
fn expected_and_happened(message: &str) -> ((String, bool), String) {
    let owned = |s: &str| s.trim().to_owned();
    if let Some(rest) = message.strip_prefix("called `Result::unwrap()` on an `Err` value: ") {
        return (
            ("the operation succeeds".to_owned(), true),
            format!("it failed: {rest}"),
        );
    }
    if let Some(rest) = message.strip_prefix("called `Result::unwrap_err()` on an `Ok` value: ") {
        return (
            ("the operation fails".to_owned(), true),
            format!("it succeeded: {rest}"),
        );
    }
    if message.starts_with("called `Option::unwrap()` on a `None` value") {
        return (("a value".to_owned(), true), "none".to_owned());
    }
    if let Some(rest) = message.strip_prefix("assertion failed: ") {
        return ((owned(rest), true), "it is false".to_owned());
    }
    if let Some(rest) = message.strip_prefix("assertion `") {
        // assertion `left == right` failed[: MESSAGE]\n  left: L\n right: R
        let (head, values) = rest.split_once('\n').unwrap_or((rest, ""));
        let (op, context) = head.split_once('`').unwrap_or((head, ""));
        let context = context
            .trim_start_matches(" failed")
            .trim_start_matches(':')
            .trim();
        let mut left = String::new();
        let mut right = String::new();
        for line in values.lines() {
            let line = line.trim();
            if let Some(v) = line.strip_prefix("left:") {
                left = v.trim().to_owned();
            } else if let Some(v) = line.strip_prefix("right:") {
                right = v.trim().to_owned();
            }
        }
        let expected = if context.is_empty() {
            op.to_owned()
        } else {
            format!("{context} ({op})")
        };
        return (
            (expected, true),
            format!("left is {left}, right is {right}"),
        );
    }
    if message.starts_with("did not finish within") {
        return (
            ("the property finishes in time".to_owned(), true),
            message.to_owned(),
        );
    }
    // An `expect` / `assert!` message: "WHAT IT NEEDED: WHAT CAME".
    match message.split_once(": ") {
        Some((what, came)) if !what.contains('{') => ((owned(what), false), owned(came)),
        _ => (
            ("the property's assertions hold".to_owned(), true),
            owned(message),
        ),
    }
}

/// `text` with the `Debug` of driver errors (`Kind { backend: "b", op: "o", message: "m", .. }`)
/// and of a panicked task (`JoinError::Panic(Id(n), "text", ..)`) written as sentences.
fn readable(text: &str) -> String {
    let mut out = text.to_owned();
    if let Some(at) = out.find("JoinError::Panic(Id(")
        && let Some(open) = out[at..].find(", \"").map(|i| at + i + 3)
        && let Some((inner, end)) = debug_string(&out[open..])
    {
        let close = out[open + end..]
            .find(')')
            .map_or(out.len(), |i| open + end + i + 1);
        out = format!(
            "{}a task panicked: {}{}",
            &out[..at],
            readable(&inner),
            &out[close..]
        );
    }
    let mut guard = 0;
    while let Some(fields) = out.find(" { backend: \"") {
        guard += 1;
        if guard > 16 {
            break;
        }
        let kind_start = out[..fields]
            .rfind(|c: char| !c.is_ascii_alphanumeric())
            .map_or(0, |i| i + 1);
        let kind = &out[kind_start..fields];
        let body = &out[fields + 3..];
        let field = |name: &str| -> Option<String> {
            let at = body.find(&format!("{name}: \""))? + name.len() + 3;
            debug_string(&body[at..]).map(|(s, _)| s)
        };
        let Some(end) = matching_brace(&out[fields + 1..]).map(|e| fields + 1 + e + 1) else {
            break;
        };
        let backend = field("backend").unwrap_or_default();
        let op = field("op").unwrap_or_default();
        let message = field("message").unwrap_or_default();
        let sentence = format!(
            "{backend} {} during {op}: {message}",
            kind.to_ascii_lowercase()
        );
        out = format!("{}{sentence}{}", &out[..kind_start], &out[end..]);
    }
    out
}

/// The Rust string literal at the start of `text` (just after its opening quote), unescaped,
/// and the index just past its closing quote.
fn debug_string(text: &str) -> Option<(String, usize)> {
    let mut out = String::new();
    let mut chars = text.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Some((out, i + 1)),
            '\\' => match chars.next()?.1 {
                'n' => out.push('\n'),
                't' => out.push('\t'),
                other => out.push(other),
            },
            c => out.push(c),
        }
    }
    None
}

/// The index of the `}` closing the `{` that `text` starts with (quoted text skipped).
fn matching_brace(text: &str) -> Option<usize> {
    let (mut depth, mut quoted, mut escaped) = (0usize, false, false);
    for (i, c) in text.char_indices() {
        if quoted {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => quoted = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => quoted = true,
            '{' => depth += 1,
            '}' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => {}
        }
    }
    None
}

/// How long the audit before the run may take.
const AUDIT_LIMIT: Duration = Duration::from_secs(60);

/// Runs the audit of `url` before the properties: `Ok(n)` to go on (with `n` FAIL findings the
/// user accepted), `Err(code)` to stop — 1 when a setting FAILs and the risk was not accepted,
/// 69 / 78 when the audit cannot reach the coordinator or is refused.
async fn audit_first(url: &str, args: &ConformanceArgs) -> Result<usize, u8> {
    let report = match tokio::time::timeout(AUDIT_LIMIT, crate::check::audit(url)).await {
        Ok(Ok(report)) => report,
        Ok(Err(e)) => {
            say!("distlock: conformance: the audit could not run: {e}");
            return Err(exit::connect_code(&e));
        }
        Err(_) => {
            say!(
                "distlock: conformance: the coordinator did not answer the audit within {}",
                crate::duration::format_duration(AUDIT_LIMIT)
            );
            return Err(exit::UNAVAILABLE);
        }
    };
    let failing: Vec<_> = report
        .findings
        .iter()
        .filter(|f| f.verdict == distlock::Verdict::Fail)
        .collect();
    if failing.is_empty() {
        return Ok(0);
    }
    let names: Vec<&str> = failing.iter().map(|f| f.check.as_str()).collect();
    if args.accept_audit_failures {
        println!(
            "audit: {} FAIL on {} ({}), accepted with --accept-audit-failures:",
            failing.len(),
            report.backend,
            names.join(", ")
        );
    } else {
        say!(
            "distlock: conformance refused: the audit grades this {} deployment FAIL ({}): a held \
             lock can be lost or granted twice there whatever the properties show. Fix it (see \
             below, or `distlock check`), or pass --accept-audit-failures to run the suite anyway",
            report.backend,
            names.join(", ")
        );
    }
    for f in &failing {
        let line = format!("  {}  FAIL  {}: {}", f.check, f.observed, f.why);
        let fix = f
            .fix
            .as_ref()
            .map(|fix| format!("  {}        fix: {fix}", " ".repeat(f.check.len())));
        if args.accept_audit_failures {
            println!("{line}");
            if let Some(fix) = fix {
                println!("{fix}");
            }
        } else {
            say!("{line}");
            if let Some(fix) = fix {
                say!("{fix}");
            }
        }
    }
    if args.accept_audit_failures {
        Ok(failing.len())
    } else {
        if let Some(path) = &args.junit {
            let why = format!(
                "the audit grades the deployment FAIL ({})",
                names.join(", ")
            );
            let refused = Report {
                name: "audit",
                verdict: Verdict::Failed(why),
                took: Duration::ZERO,
            };
            let xml = junit(&report.backend, &[refused], Duration::ZERO, None);
            if let Err(e) = std::fs::write(path, xml) {
                say!("distlock: cannot write {}: {e}", path.display());
            }
        }
        Err(exit::FAILED)
    }
}

/// After a failed property: whether the coordinator still answers (a fresh client, one
/// lookup), so that an outage is told apart from a property failure.
async fn reachable(target: &Target) -> Result<(), String> {
    let probe = async {
        let lock = target.connect().await?;
        let key = distlock::LockKey::new("distlock-conformance/probe")?;
        lock.inspect(&key).await.map(|_| ())
    };
    match tokio::time::timeout(PROBE_LIMIT, probe).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) if exit::code_for(&e) == exit::UNAVAILABLE => Err(e.to_string()),
        // It answered, if only to refuse: not an outage.
        Ok(Err(_)) => Ok(()),
        Err(_) => Err(format!(
            "no answer within {}",
            crate::duration::format_duration(PROBE_LIMIT)
        )),
    }
}

/// How long the reachability probe after a failed property waits.
const PROBE_LIMIT: Duration = Duration::from_secs(10);

fn count(reports: &[Report], f: impl Fn(&Verdict) -> bool) -> usize {
    reports.iter().filter(|r| f(&r.verdict)).count()
}

/// Removes the run's namespace and checks that nothing is left (a clean-up still running in
/// the background may re-create an entry for a moment: retried a few times).
async fn clean_up(target: &Target) -> Result<(), String> {
    let mut last = String::new();
    for attempt in 0..5 {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        if let Err(e) = target.purge().await {
            last = format!("removing {}: {e}", target.namespace());
            continue;
        }
        match target.size().await {
            Ok(0) => return Ok(()),
            Ok(n) => last = format!("{n} left under {} after removing it", target.namespace()),
            Err(e) => last = format!("checking {}: {e}", target.namespace()),
        }
    }
    Err(last)
}

fn xml_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            // XML 1.0 allows no other control characters.
            c if c.is_control() && !matches!(c, '\n' | '\r' | '\t') => {
                out.push_str(&format!("\\u{{{:x}}}", c as u32));
            }
            c => out.push(c),
        }
    }
    out
}

/// The reports as JUnit XML (one `testsuite`; the clean-up is a test case of its own).
fn junit(backend: &str, reports: &[Report], took: Duration, leftover: Option<&String>) -> String {
    let failures =
        count(reports, |v| matches!(v, Verdict::Failed(_))) + usize::from(leftover.is_some());
    let skipped = count(reports, |v| matches!(v, Verdict::Skipped(_)));
    let class = format!("distlock.conformance.{}", xml_escape(backend));
    let mut xml = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    xml.push_str(&format!(
        "<testsuites name=\"distlock conformance\" tests=\"{}\" failures=\"{failures}\" \
         skipped=\"{skipped}\" time=\"{:.3}\">\n",
        reports.len() + 1,
        took.as_secs_f64()
    ));
    xml.push_str(&format!(
        "  <testsuite name=\"{class}\" tests=\"{}\" failures=\"{failures}\" errors=\"0\" \
         skipped=\"{skipped}\" time=\"{:.3}\">\n",
        reports.len() + 1,
        took.as_secs_f64()
    ));
    for r in reports {
        let head = format!(
            "    <testcase classname=\"{class}\" name=\"{}\" time=\"{:.3}\"",
            xml_escape(r.name),
            r.took.as_secs_f64()
        );
        match &r.verdict {
            Verdict::Passed => xml.push_str(&format!("{head}/>\n")),
            Verdict::Skipped(why) => xml.push_str(&format!(
                "{head}>\n      <skipped message=\"{}\"/>\n    </testcase>\n",
                xml_escape(why)
            )),
            Verdict::Failed(why) => {
                let first = why.lines().next().unwrap_or_default();
                xml.push_str(&format!(
                    "{head}>\n      <failure message=\"{}\">{}</failure>\n    </testcase>\n",
                    xml_escape(first),
                    xml_escape(why)
                ));
            }
        }
    }
    let head =
        format!("    <testcase classname=\"{class}\" name=\"nothing_is_left_behind\" time=\"0\"");
    match leftover {
        None => xml.push_str(&format!("{head}/>\n")),
        Some(why) => xml.push_str(&format!(
            "{head}>\n      <failure message=\"{}\"/>\n    </testcase>\n",
            xml_escape(why)
        )),
    }
    xml.push_str("  </testsuite>\n</testsuites>\n");
    xml
}

#[cfg(test)]
mod tests {
    use quick_xml::{Reader, events::Event};

    use super::*;

    /// Each `testcase`'s name and its `skipped` / `failure` child's message, read back with a
    /// real XML parser.
    fn parse(xml: &str) -> Vec<(String, Option<(String, String)>)> {
        let mut reader = Reader::from_str(xml);
        let mut cases: Vec<(String, Option<(String, String)>)> = Vec::new();
        loop {
            match reader.read_event().expect("well-formed XML") {
                Event::Start(e) | Event::Empty(e) => {
                    let attr = |name: &str| {
                        e.try_get_attribute(name)
                            .expect("attribute")
                            .map(|a| a.unescape_value().expect("escaped").into_owned())
                    };
                    match e.name().as_ref() {
                        b"testcase" => cases.push((attr("name").unwrap_or_default(), None)),
                        kind @ (b"skipped" | b"failure") => {
                            let kind = String::from_utf8_lossy(kind).into_owned();
                            let message = attr("message").unwrap_or_default();
                            cases.last_mut().expect("inside a testcase").1 = Some((kind, message));
                        }
                        _ => {}
                    }
                }
                Event::Eof => break,
                _ => {}
            }
        }
        cases
    }

    #[test]
    fn junit_parses_with_every_verdict_and_awkward_text() {
        let reports = vec![
            Report {
                name: "a_passes",
                verdict: Verdict::Passed,
                took: Duration::from_millis(5),
            },
            Report {
                name: "b_skips",
                verdict: Verdict::Skipped("fair_queue <not> claimed".to_owned()),
                took: Duration::ZERO,
            },
            Report {
                name: "c_fails",
                verdict: Verdict::Failed("left & right \"differ\"\nsecond line\u{1}".to_owned()),
                took: Duration::from_secs(1),
            },
        ];
        let xml = junit("redis", &reports, Duration::from_secs(2), None);
        let cases = parse(&xml);
        assert_eq!(cases.len(), 4, "{xml}");
        assert_eq!(cases[0], ("a_passes".to_owned(), None));
        assert_eq!(
            cases[1].1,
            Some(("skipped".to_owned(), "fair_queue <not> claimed".to_owned()))
        );
        assert_eq!(
            cases[2].1,
            Some(("failure".to_owned(), "left & right \"differ\"".to_owned()))
        );
        assert_eq!(cases[3], ("nothing_is_left_behind".to_owned(), None));
        assert!(xml.contains("failures=\"1\""), "{xml}");

        let left = "3 left under redis keys x*".to_owned();
        let cases = parse(&junit("redis", &reports[..1], Duration::ZERO, Some(&left)));
        assert_eq!(
            cases.last().and_then(|c| c.1.clone()),
            Some(("failure".to_owned(), left))
        );
    }

    #[test]
    fn failures_say_what_was_expected_and_what_happened() {
        let text = describe_failure(
            "renew_extends_the_lease",
            "renewing a held lease: Backend { backend: \"redis\", op: \"renew\", message: \"ResponseError: x {y}\", source: Some(ResponseError: x) }",
            Some("conformance/src/properties.rs:335".to_owned()),
        );
        assert_eq!(
            text,
            "property: renew_extends_the_lease (failed at conformance/src/properties.rs:335)\n\
             check: renewing a held lease\n\
             happened: redis backend during renew: ResponseError: x {y}"
        );
        let real = "renewing a held lease: Backend { backend: \"redis\", op: \"renew\", message: \"ResponseError: Unknown Redis command called from script script: a3649a993df171df51bf65df948a22f3e285748d, on @user_script:8.\", source: Some(ResponseError: Unknown Redis command called from script script: a3649a993df171df51bf65df948a22f3e285748d, on @user_script:8.) }";
        assert_eq!(
            readable(expected_and_happened(real).1.as_str()),
            "redis backend during renew: ResponseError: Unknown Redis command called from script script: a3649a993df171df51bf65df948a22f3e285748d, on @user_script:8."
        );
        let text = describe_failure(
            "p",
            "assertion `left == right` failed: tokens\n  left: 1\n right: 2",
            None,
        );
        assert_eq!(
            text,
            "property: p\nexpected: tokens (left == right)\nhappened: left is 1, right is 2"
        );
        let text = describe_failure(
            "p",
            "called `Result::unwrap()` on an `Err` value: JoinError::Panic(Id(104), \"acquire: Unavailable { backend: \\\"etcd\\\", op: \\\"try_acquire\\\", message: \\\"gone\\\", source: None }\", ...)",
            None,
        );
        assert_eq!(
            text,
            "property: p\nexpected: the operation succeeds\nhappened: it failed: a task panicked: acquire: etcd unavailable during try_acquire: gone"
        );
    }

    #[test]
    fn escapes_what_xml_needs() {
        assert_eq!(
            xml_escape("a<b & \"c\"\u{1}"),
            "a&lt;b &amp; &quot;c&quot;\\u{1}"
        );
    }
}
