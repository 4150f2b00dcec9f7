//! What an operator's cron line meets, driven through the real binary on every coordinator whose
//! test URL is set (`DISTLOCK_TEST_{REDIS,ETCD,ZK,PG}_URL`; with `DISTLOCK_REQUIRE_BACKENDS=1` a
//! missing one fails) and on `memory://`: short waits that must still try once, job mode's
//! at-least on every backend, and credentials a coordinator refuses.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::{
    process::{Command, Output, Stdio},
    thread,
    time::{Duration, Instant},
};

use distlock::Backend;
use support::fresh_key;

const BIN: &str = env!("CARGO_BIN_EXE_distlock");

fn distlock(url: &str) -> Command {
    let mut command = Command::new(BIN);
    command.env("DISTLOCK_URL", url).stdin(Stdio::null());
    command
}

/// Every real coordinator's URL, each asserted present when the run requires backends.
fn backends() -> Vec<(Backend, String)> {
    let named = [
        (Backend::Redis, "DISTLOCK_TEST_REDIS_URL"),
        (Backend::Etcd, "DISTLOCK_TEST_ETCD_URL"),
        (Backend::ZooKeeper, "DISTLOCK_TEST_ZK_URL"),
        (Backend::Postgres, "DISTLOCK_TEST_PG_URL"),
    ];
    let found: Vec<_> = named
        .into_iter()
        .filter(|(backend, _)| backend.is_enabled())
        .filter_map(|(backend, var)| {
            conformance::backend_url(var).map(|url| (backend, with_short_session(backend, url)))
        })
        .collect();
    if conformance::backends_required() {
        assert_eq!(
            found.len(),
            4,
            "DISTLOCK_REQUIRE_BACKENDS=1 needs all four URLs"
        );
    }
    found
}

/// Short sessions for ZooKeeper, whose smallest TTL is its session timeout (10 s by default).
fn with_short_session(backend: Backend, url: String) -> String {
    if backend != Backend::ZooKeeper {
        return url;
    }
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}session_timeout=2s")
}

/// Runs to the end, killed (and the test failed) after `within`.
fn output_within(mut command: Command, within: Duration) -> Output {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + within;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "distlock did not exit within {within:?}; stderr: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        thread::sleep(Duration::from_millis(10));
    }
    child.wait_with_output().unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// `run --wait 0` (and `--wait 1ms`) on a key nobody holds takes it and runs the command, like
/// `flock -w 0`: a wait decides whether to wait, never whether to try — on memory and every
/// real coordinator.
#[test]
fn a_zero_wait_takes_a_free_key() {
    let mut urls = vec![("memory".to_owned(), "memory://ops".to_owned())];
    urls.extend(backends().into_iter().map(|(b, u)| (format!("{b:?}"), u)));
    let mut ran = 0;
    for (name, url) in &urls {
        for wait in ["0", "1ms"] {
            let key = fresh_key("wait0");
            let mut run = distlock(url);
            run.args(["run", "--wait", wait, &key, "--", "sh", "-c", "echo ran"]);
            let out = output_within(run, Duration::from_secs(20));
            assert_eq!(
                out.status.code(),
                Some(0),
                "{name}: run --wait {wait} on a free key: {}",
                stderr(&out)
            );
            assert_eq!(String::from_utf8_lossy(&out.stdout), "ran\n", "{name}");
        }
        ran += 1;
    }
    assert_eq!(ran, urls.len());
}

/// `run --wait 0` on a key another process holds gives 75 at once, saying who holds it.
#[test]
fn a_zero_wait_on_a_held_key_is_75_at_once() {
    let all = backends();
    for (backend, url) in &all {
        let key = fresh_key("wait0-held");
        let dir = support::temp_dir("wait0-held");
        let started = dir.join("started");
        let mut holder = distlock(url)
            .args(["run", "--ttl", "10s", &key, "--", "sh", "-c"])
            .arg(format!("touch {}; sleep 30", started.display()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        support::wait_for_file(&started, &mut holder, Duration::from_secs(20));
        let mut run = distlock(url);
        run.args(["run", "--wait", "0", &key, "--", "true"]);
        let began = Instant::now();
        let out = output_within(run, Duration::from_secs(20));
        let took = began.elapsed();
        let _ = holder.kill();
        let _ = holder.wait();
        assert_eq!(out.status.code(), Some(75), "{backend:?}: {}", stderr(&out));
        let first = stderr(&out).lines().next().unwrap_or_default().to_owned();
        assert!(
            first.contains("not acquired") && first.contains("held by"),
            "{backend:?}: {first}"
        );
        assert!(took < Duration::from_secs(10), "{backend:?}: took {took:?}");
    }
}
