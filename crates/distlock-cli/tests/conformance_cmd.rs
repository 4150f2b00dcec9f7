//! `distlock conformance --url URL --junit FILE` against every shared server: every property
//! passes or skips for a declared capability, nothing is left under the run's namespace
//! (checked here with the servers' own tools, not only by the command), and the JUnit file
//! parses. Fault drills are refused.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    path::PathBuf,
    process::{Command, Output, Stdio},
    thread,
};

use distlock::Backend;
use quick_xml::{Reader, events::Event};

fn distlock(url: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_distlock"))
        .arg("--url")
        .arg(url)
        .args(args)
        .env_remove("DISTLOCK_URL")
        .env_remove("DISTLOCK_URL_FILE")
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn fault_drills_are_refused() {
    let out = distlock("memory://drills", &["conformance", "--drills"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("need control of the servers"),
        "{}",
        text(&out)
    );
}

#[test]
fn list_and_only_select_properties() {
    let out = distlock("memory://list", &["conformance", "--list"]);
    let all: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect();
    assert_eq!(all.len(), conformance::suite::properties().len());
    let out = distlock(
        "memory://list",
        &["conformance", "--list", "--only", "fencing_tokens"],
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "fencing_tokens_strictly_increase\n"
    );
    let out = distlock(
        "memory://list",
        &["conformance", "--only", "no_such_property"],
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
}

/// Counts of the JUnit file's test cases: (cases, failed, skipped), and the suite's
/// `failures` attribute.
fn junit_counts(xml: &str) -> (usize, usize, usize, String) {
    let mut reader = Reader::from_str(xml);
    let (mut cases, mut failed, mut skipped) = (0, 0, 0);
    let mut failures = String::new();
    loop {
        match reader.read_event().expect("well-formed JUnit XML") {
            Event::Start(e) | Event::Empty(e) => match e.name().as_ref() {
                b"testcase" => cases += 1,
                b"failure" => failed += 1,
                b"skipped" => skipped += 1,
                b"testsuite" => {
                    failures = e
                        .try_get_attribute("failures")
                        .unwrap()
                        .map(|a| a.unescape_value().unwrap().into_owned())
                        .unwrap_or_default();
                }
                _ => {}
            },
            Event::Eof => break,
            _ => {}
        }
    }
    (cases, failed, skipped, failures)
}

/// `distlock-conformance-<16 hex>`, the run's name, from the command's output.
fn run_name(out: &str) -> String {
    let at = out
        .find("distlock-conformance-")
        .unwrap_or_else(|| panic!("no run name in {out}"));
    out[at..at + "distlock-conformance-".len() + 16].to_owned()
}

fn tool(program: &str, args: &[&str]) -> String {
    let out = Command::new(program).args(args).output().unwrap();
    assert!(out.status.success(), "{program} {args:?}: {}", text(&out));
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Whether anything of run `run` is left on the coordinator of `url`, asked with the
/// servers' own tools where there is one.
fn leftover(backend: Backend, url: &str, run: &str) -> String {
    match backend {
        Backend::Redis => {
            let c = distlock::redis::RedisLockConfig::from_url(url).unwrap();
            tool(
                "redis-cli",
                &[
                    "-h",
                    &c.host,
                    "-p",
                    &c.port.to_string(),
                    "-n",
                    &c.db.to_string(),
                    "--scan",
                    "--pattern",
                    &format!("*{run}*"),
                ],
            )
        }
        Backend::Etcd => {
            let c = distlock::etcd::EtcdLockConfig::from_url(url).unwrap();
            tool(
                "etcdctl",
                &[
                    "--endpoints",
                    &c.endpoints.join(","),
                    "get",
                    &format!("{}{run}/", c.normalized_prefix()),
                    "--prefix",
                    "--keys-only",
                ],
            )
        }
        Backend::Postgres => {
            let (host_port, db) = url
                .trim_start_matches("postgres://")
                .split_once('/')
                .unwrap();
            let (user, host_port) = host_port.split_once('@').unwrap();
            let (host, port) = host_port.split_once(':').unwrap();
            let db = db.split('?').next().unwrap();
            tool(
                "psql",
                &[
                    "-h",
                    host,
                    "-p",
                    port,
                    "-U",
                    user,
                    "-d",
                    db,
                    "-XqtA",
                    "-c",
                    &format!("SELECT to_regclass('{}')", run.replace('-', "_")),
                ],
            )
        }
        Backend::ZooKeeper => {
            // No client tool on every machine: count the run's root through the library.
            let mut c = distlock::zk::ZkLockConfig::from_url(url).unwrap();
            c.root = format!("{}/{run}", c.root.trim_end_matches('/'));
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            match runtime.block_on(distlock::zk::namespace_size(&c)).unwrap() {
                0 => String::new(),
                n => format!("{n} nodes"),
            }
        }
        _ => String::new(),
    }
}

#[test]
fn the_suite_passes_on_every_shared_server_and_leaves_nothing_behind() {
    let servers: Vec<(Backend, String)> = [
        (Backend::Redis, "DISTLOCK_TEST_REDIS_URL", ""),
        (Backend::Etcd, "DISTLOCK_TEST_ETCD_URL", ""),
        // Short sessions: the shortest ZooKeeper lease is the session timeout. 2 s, not 1 s: the
        // four suites run at once here, and on a loaded 2-core machine a stall of the ZooKeeper
        // server or of this client longer than a 1 s session's vouched window (~0.7 s) made a
        // grant come after the window, which the driver rightly refuses ("the lock was ours only
        // after the session could no longer be vouched for"): one CI run failed that way.
        (
            Backend::ZooKeeper,
            "DISTLOCK_TEST_ZK_URL",
            "session_timeout=2s",
        ),
        (Backend::Postgres, "DISTLOCK_TEST_PG_URL", ""),
    ]
    .into_iter()
    .filter(|(backend, _, _)| backend.is_enabled())
    .filter_map(|(backend, var, query)| {
        let url = conformance::backend_url(var)?;
        Some(match query {
            "" => (backend, url),
            q if url.contains('?') => (backend, format!("{url}&{q}")),
            q => (backend, format!("{url}?{q}")),
        })
    })
    .collect();
    let properties = conformance::suite::properties().len();
    // One thread per server: the four runs take about as long as the slowest.
    let runs: Vec<_> = servers
        .into_iter()
        .map(|(backend, url)| {
            thread::spawn(move || {
                let junit: PathBuf = std::env::temp_dir().join(format!(
                    "distlock-conformance-{backend}-{}.xml",
                    std::process::id()
                ));
                let out = distlock(&url, &["conformance", "--junit", junit.to_str().unwrap()]);
                let xml = std::fs::read_to_string(&junit).unwrap_or_default();
                let _ = std::fs::remove_file(&junit);
                (backend, url, out, xml)
            })
        })
        .collect();
    for run in runs {
        let (backend, url, out, xml) = run.join().unwrap();
        let shown = text(&out);
        assert_eq!(out.status.code(), Some(0), "{backend}: {shown}");
        assert!(shown.contains(" 0 failed "), "{backend}: {shown}");
        assert!(shown.contains("nothing left"), "{backend}: {shown}");
        let name = run_name(&shown);
        let left = leftover(backend, &url, &name);
        let first: Vec<&str> = left.lines().take(5).collect();
        assert!(
            left.is_empty(),
            "{backend}: {name} left {} entries, e.g. {first:?}",
            left.lines().count()
        );
        let (cases, failed, skipped, failures) = junit_counts(&xml);
        assert_eq!(cases, properties + 1, "{backend}: {xml}");
        assert_eq!((failed, failures.as_str()), (0, "0"), "{backend}: {xml}");
        assert!(skipped <= 3, "{backend}: {skipped} skipped: {xml}");
    }
}
