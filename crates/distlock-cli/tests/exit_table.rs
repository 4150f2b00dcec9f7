//! The exit-status table (`distlock --help`, the README), one test per row, each driven through
//! the real binary on memory:// and every real coordinator (with `DISTLOCK_REQUIRE_BACKENDS=1`
//! a missing one fails), asserting the status and the first line of what distlock says. Rows
//! with a test of their own elsewhere say where: 75 (`ops.rs`: held key, `--wait 0`), 78 for
//! refused credentials and certificates (`exits.rs`, `ops.rs`), 1 for an audit FAIL
//! (`ops.rs`, `check_audit.rs`), 76 with a background child (`lifetime.rs`), 128+N
//! (`exits.rs`). 70 (the guard process failed) and 79 (a loss noticed after the command
//! exited) cannot be caused from outside on demand; they are covered by the guard's own tests.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::{
    process::{Command, Output, Stdio},
    thread,
    time::{Duration, Instant},
};

use support::fresh_key;

fn distlock(url: &str) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_distlock"));
    command
        .env_remove("DISTLOCK_URL_FILE")
        .env("DISTLOCK_URL", url)
        .stdin(Stdio::null());
    command
}

/// memory:// and every real coordinator (`support::backends`: all four under
/// `DISTLOCK_REQUIRE_BACKENDS=1`), named.
fn every_backend() -> Vec<(String, String)> {
    let mut all = vec![("memory".to_owned(), "memory://exit-table".to_owned())];
    all.extend(
        support::backends()
            .into_iter()
            .map(|(backend, url)| (backend.to_string(), url)),
    );
    all
}

/// Runs to the end; killed (and the test failed) after `within`.
fn run(command: Command, within: Duration) -> Output {
    support::output_within(command, within)
}

fn first_line(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr)
        .lines()
        .next()
        .unwrap_or_default()
        .to_owned()
}

/// Runs `args` on every backend and checks the status and the first line of stderr (`None`:
/// nothing said); returns how many backends it ran on.
fn row(args: impl Fn(&str) -> Vec<String>, code: i32, says: Option<&str>) -> usize {
    let mut ran = 0;
    for (name, url) in every_backend() {
        let mut command = distlock(&url);
        command.args(args(&url));
        let out = run(command, Duration::from_secs(30));
        let first = first_line(&out);
        assert_eq!(out.status.code(), Some(code), "{name}: {first}");
        match says {
            Some(text) => assert!(first.contains(text), "{name}: {first:?} lacks {text:?}"),
            None => assert!(first.is_empty(), "{name}: said {first:?}"),
        }
        ran += 1;
    }
    ran
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|&a| a.to_owned()).collect()
}

#[test]
fn row_0_success_and_the_commands_own_status() {
    let n = row(
        |_| strings(&["run", &fresh_key("t0"), "--", "true"]),
        0,
        None,
    );
    let m = row(
        |_| strings(&["run", &fresh_key("t3"), "--", "sh", "-c", "exit 3"]),
        3,
        None,
    );
    assert_eq!(n, m);
}

#[test]
fn row_1_inspect_of_a_free_lock() {
    row(|_| strings(&["inspect", &fresh_key("t1")]), 1, None);
}

#[test]
fn row_2_usage_errors_before_any_io() {
    row(
        |_| strings(&["run", "", "--", "true"]),
        2,
        Some("distlock: invalid lock key"),
    );
    row(
        |_| strings(&["run", "--ttl", "soon", "k", "--", "true"]),
        2,
        Some("soon"),
    );
}

/// An address nobody listens on, per backend.
fn unreachable(url: &str) -> Option<String> {
    let scheme = url.split("://").next()?;
    Some(match scheme {
        "redis" => "redis://127.0.0.1:1".to_owned(),
        "etcd" => "etcd://127.0.0.1:1?dial_timeout=500ms".to_owned(),
        "zk" => "zk://127.0.0.1:1".to_owned(),
        "postgres" | "postgresql" => "postgres://postgres@127.0.0.1:1/distlock".to_owned(),
        _ => return None,
    })
}

#[test]
fn row_69_an_unreachable_coordinator() {
    let mut ran = 0;
    for (name, url) in every_backend() {
        let Some(down) = unreachable(&url) else {
            continue; // memory:// is always reachable
        };
        let mut command = distlock(&down);
        command.args(["run", &fresh_key("t69"), "--", "true"]);
        let out = run(command, Duration::from_secs(30));
        let first = first_line(&out);
        assert_eq!(out.status.code(), Some(69), "{name}: {first}");
        assert!(
            first.starts_with("distlock: cannot reach "),
            "{name}: {first}"
        );
        ran += 1;
    }
    if conformance::backends_required() {
        assert_eq!(ran, 4);
    }
}

#[test]
fn row_78_an_invalid_url_option() {
    row(
        |url| {
            let sep = if url.contains('?') { '&' } else { '?' };
            vec![
                "--url".to_owned(),
                format!("{url}{sep}nosuch=1"),
                "run".to_owned(),
                fresh_key("t78"),
                "--".to_owned(),
                "true".to_owned(),
            ]
        },
        78,
        Some("distlock: invalid configuration"),
    );
}

#[test]
fn row_127_a_command_that_does_not_exist() {
    row(
        |_| strings(&["run", &fresh_key("t127"), "--", "/nonexistent/command"]),
        127,
        Some("/nonexistent/command"),
    );
}

/// 76: the lease is taken away while the command runs (another process force-releases it); the
/// command is terminated and distlock exits 76 — on every coordinator (memory:// locks live in
/// one process, so nobody else can take it away). The force-release is pushed to the holder on
/// every coordinator: with a 30 s TTL (a renewal every 7.5 s) distlock still exits within 3 s.
#[test]
fn row_76_a_lease_lost_while_the_command_runs() {
    let mut ran = 0;
    for (name, url) in every_backend().into_iter().skip(1) {
        let key = fresh_key("t76");
        let dir = support::temp_dir("t76");
        let started = dir.join("started");
        let mut holder = distlock(&url)
            .args(["run", "--ttl", "30s", &key, "--", "sh", "-c"])
            .arg(format!("touch {}; exec sleep 60", started.display()))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        support::wait_for_file(&started, &mut holder, Duration::from_secs(20));
        let mut release = distlock(&url);
        release.args(["release", "--force", "--yes", &key]);
        let out = run(release, Duration::from_secs(20));
        assert_eq!(out.status.code(), Some(0), "{name}: {}", first_line(&out));
        let released = Instant::now();
        let deadline = released + Duration::from_secs(40);
        while holder.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "{name}: distlock did not exit");
            thread::sleep(Duration::from_millis(20));
        }
        let took = released.elapsed();
        assert!(
            took < Duration::from_secs(3),
            "{name}: the force-release reached the holder only after {took:?}"
        );
        let out = holder.wait_with_output().unwrap();
        let said = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(76), "{name}: {said}");
        assert!(
            said.lines().any(|l| l.contains("lost")),
            "{name}: nothing said of the loss: {said}"
        );
        ran += 1;
    }
    if conformance::backends_required() {
        assert_eq!(ran, 4);
    }
}
