//! Shared by the CLI's server tests (`backends.rs`, `elect.rs`, `exits.rs`, `lifetime.rs`):
//! the coordinators to run on, a tally that each loop over them ran on every one, fresh names,
//! scratch directories, and waiting for a command's marker file.
#![allow(dead_code, clippy::unwrap_used)]

use std::{
    path::{Path, PathBuf},
    process::Child,
    sync::Mutex,
    thread,
    time::{Duration, Instant},
};

use distlock::Backend;

/// The four real coordinators and the variable naming each one's test server.
pub const COORDINATORS: [(Backend, &str); 4] = [
    (Backend::Redis, "DISTLOCK_TEST_REDIS_URL"),
    (Backend::Etcd, "DISTLOCK_TEST_ETCD_URL"),
    (Backend::ZooKeeper, "DISTLOCK_TEST_ZK_URL"),
    (Backend::Postgres, "DISTLOCK_TEST_PG_URL"),
];

/// Every real coordinator compiled into this build whose test URL is set (ZooKeeper's with a
/// 2 s session, its smallest TTL). With `DISTLOCK_REQUIRE_BACKENDS=1` all four must be there —
/// compiled in and with a URL — or this panics: a missing server fails the test instead of
/// shrinking the loop over the backends.
pub fn backends() -> Vec<(Backend, String)> {
    let required = conformance::backends_required();
    let mut out = Vec::new();
    for (backend, var) in COORDINATORS {
        if !backend.is_enabled() {
            assert!(
                !required,
                "{backend} is not compiled in but DISTLOCK_REQUIRE_BACKENDS=1: build with --all-features"
            );
            eprintln!("skipping {backend}: not compiled in");
            continue;
        }
        // Panics when the URL is unset under DISTLOCK_REQUIRE_BACKENDS=1.
        let Some(url) = conformance::backend_url(var) else {
            continue;
        };
        out.push((backend, with_short_session(backend, url)));
    }
    if required {
        assert_eq!(out.len(), COORDINATORS.len(), "every coordinator is tested");
    }
    if out.is_empty() {
        eprintln!("SKIP: no coordinator's test URL is set (DISTLOCK_TEST_*_URL)");
    }
    out
}

/// Short sessions for ZooKeeper, whose smallest TTL is its session timeout (10 s by default).
pub fn with_short_session(backend: Backend, url: String) -> String {
    if backend != Backend::ZooKeeper {
        return url;
    }
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}session_timeout=2s")
}

/// Which backends a loop over [`backends`] finished its body for: the loop calls
/// [`Tally::ran`] at the end of each iteration and [`Tally::assert_each_ran_once`] after it,
/// so a loop that skips a backend it names (an early `continue`, a thread that returned, no
/// backend at all under `DISTLOCK_REQUIRE_BACKENDS=1`) fails instead of printing ok.
pub struct Tally {
    what: &'static str,
    named: Vec<Backend>,
    ran: Mutex<Vec<Backend>>,
}

impl Tally {
    pub fn new(what: &'static str, backends: &[(Backend, String)]) -> Self {
        Self {
            what,
            named: backends.iter().map(|(b, _)| *b).collect(),
            ran: Mutex::default(),
        }
    }

    /// `backend`'s iteration got to its end.
    pub fn ran(&self, backend: Backend) {
        self.ran.lock().unwrap().push(backend);
    }

    /// Each named backend's iteration ended exactly once (and, under
    /// `DISTLOCK_REQUIRE_BACKENDS=1`, all four were named).
    pub fn assert_each_ran_once(&self) {
        let ran = self.ran.lock().unwrap();
        for backend in &self.named {
            let times = ran.iter().filter(|b| *b == backend).count();
            assert_eq!(
                times, 1,
                "{}: the loop ran {times} time(s) on {backend}, named once; ran on {ran:?}",
                self.what
            );
        }
        assert_eq!(
            ran.len(),
            self.named.len(),
            "{}: ran on {ran:?}, named {:?}",
            self.what,
            self.named
        );
        if conformance::backends_required() {
            for (backend, _) in COORDINATORS {
                assert!(
                    self.named.contains(&backend),
                    "{}: DISTLOCK_REQUIRE_BACKENDS=1 but {backend} is not among {:?}",
                    self.what,
                    self.named
                );
            }
        }
        eprintln!("{}: ran on {:?}", self.what, *ran);
    }
}

/// Runs `test` for every backend of [`backends`] at once, each in its own thread, and asserts
/// each ran to its end.
pub fn on_every_backend(
    what: &'static str,
    test: impl Fn(Backend, String) + Send + Sync + 'static,
) {
    let backends = backends();
    let tally = std::sync::Arc::new(Tally::new(what, &backends));
    let test = std::sync::Arc::new(test);
    let workers: Vec<_> = backends
        .into_iter()
        .map(|(backend, url)| {
            let (tally, test) = (tally.clone(), test.clone());
            thread::spawn(move || {
                test(backend, url);
                tally.ran(backend);
            })
        })
        .collect();
    for worker in workers {
        worker.join().unwrap();
    }
    tally.assert_each_ran_once();
}

/// A lock key (or election name) no other test or run uses.
pub fn fresh_key(label: &str) -> String {
    format!("distlock-cli-test/{label}/{:016x}", rand::random::<u64>())
}

/// A new scratch directory under the system's temp dir.
pub fn temp_dir(label: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "distlock-cli-{label}-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Waits until `path` exists, failing if `child` (distlock) exits first or it takes longer
/// than `within`.
pub fn wait_for_file(path: &Path, child: &mut Child, within: Duration) {
    let deadline = Instant::now() + within;
    while !path.exists() {
        if let Some(status) = child.try_wait().unwrap() {
            panic!(
                "distlock exited with {status} before {} appeared",
                path.display()
            );
        }
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        thread::sleep(Duration::from_millis(20));
    }
}

/// Runs `command` to the end with its output captured; kills it (and fails the test, showing
/// what it said) after `within`.
pub fn output_within(mut command: std::process::Command, within: Duration) -> std::process::Output {
    let child = command
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_output(child, within)
}

/// Waits for `child` (its output piped) to exit; kills it and fails the test after `within`.
pub fn wait_output(mut child: Child, within: Duration) -> std::process::Output {
    let deadline = Instant::now() + within;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "distlock did not exit within {within:?}; stdout: {}; stderr: {}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        thread::sleep(Duration::from_millis(10));
    }
    child.wait_with_output().unwrap()
}
