//! What an operator's cron line meets, driven through the real binary on every coordinator whose
//! test URL is set (`DISTLOCK_TEST_{REDIS,ETCD,ZK,PG}_URL`; with `DISTLOCK_REQUIRE_BACKENDS=1` a
//! missing one fails) and on `memory://`: short waits that must still try once, job mode's
//! at-least on every backend, and credentials a coordinator refuses.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::{
    process::{Command, Output, Stdio},
    time::{Duration, Instant},
};

use distlock::Backend;
use support::{backends, fresh_key, output_within};

const BIN: &str = env!("CARGO_BIN_EXE_distlock");

fn distlock(url: &str) -> Command {
    let mut command = Command::new(BIN);
    command.env("DISTLOCK_URL", url).stdin(Stdio::null());
    command
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

/// `url` with its password replaced by `WRONG` (the user kept).
fn with_wrong_password(url: &str) -> String {
    let at = url.find('@').expect("a URL with credentials");
    let colon = url[..at].rfind(':').expect("user:password@");
    format!("{}:WRONG{}", &url[..colon], &url[at..])
}

/// ZooKeeper's digest scheme accepts any password at login, so a wrong one used to take a free
/// key and run the command. Now the lock root's ACL proves the identity at connect: 78 and the
/// command never starts, on a free key and on one the right credentials hold; `check` says 78
/// too. (The right credentials connect first, so the root is theirs.)
#[test]
fn a_wrong_zookeeper_password_is_78_before_the_command_runs() {
    if !Backend::ZooKeeper.is_enabled() {
        assert!(
            !conformance::backends_required(),
            "the ZooKeeper driver is not compiled in: build with --all-features"
        );
        return;
    }
    let Some(url) = conformance::backend_url("DISTLOCK_TEST_ZK_SECURE_URL") else {
        assert!(
            !conformance::backends_required(),
            "DISTLOCK_TEST_ZK_SECURE_URL is needed"
        );
        return;
    };
    let dir = support::temp_dir("zk-wrong");
    let url_file = |name: &str, url: &str| {
        let path = dir.join(name);
        std::fs::write(&path, url).unwrap();
        path
    };
    let right = url_file("right", &url);
    let wrong = url_file("wrong", &with_wrong_password(&url));
    let cli = |file: &std::path::Path| {
        let mut command = Command::new(BIN);
        command
            .env_remove("DISTLOCK_URL")
            .arg("--url-file")
            .arg(file)
            .stdin(Stdio::null());
        command
    };
    let mut first = cli(&right);
    first.args(["run", &fresh_key("zk-right"), "--", "true"]);
    let out = output_within(first, Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));

    let held = fresh_key("zk-held");
    let started = dir.join("started");
    let mut holder = cli(&right)
        .args(["run", "--ttl", "10s", &held, "--", "sh", "-c"])
        .arg(format!("touch {}; sleep 30", started.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    support::wait_for_file(&started, &mut holder, Duration::from_secs(30));
    for key in [fresh_key("zk-free"), held] {
        let ran = dir.join("ran");
        let mut run = cli(&wrong);
        run.args(["run", &key, "--", "sh", "-c"])
            .arg(format!("touch {}", ran.display()));
        let out = output_within(run, Duration::from_secs(30));
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(78), "{key}: {err}");
        assert!(err.starts_with("distlock: refused by zk"), "{err}");
        assert!(!err.contains("WRONG"), "the password leaked: {err}");
        assert!(
            !ran.exists(),
            "{key}: the command ran with a wrong password"
        );
    }
    let mut check = cli(&wrong);
    check.arg("check");
    let out = output_within(check, Duration::from_secs(60));
    assert_eq!(out.status.code(), Some(78), "{}", stderr(&out));
    let _ = holder.kill();
    let _ = holder.wait();
}

/// A certificate signed by a CA the client does not trust is a configuration error (78) on
/// etcd as on Redis, not an outage (69).
#[test]
fn a_certificate_from_the_wrong_ca_is_78() {
    let Some(wrong_ca) = conformance::backend_url("DISTLOCK_TEST_SECURE_WRONG_CA") else {
        assert!(
            !conformance::backends_required(),
            "DISTLOCK_TEST_SECURE_WRONG_CA is needed"
        );
        return;
    };
    let mut tried = 0;
    for (backend, var) in [
        (Backend::Etcd, "DISTLOCK_TEST_ETCD_SECURE_URL"),
        (Backend::Redis, "DISTLOCK_TEST_REDIS_SECURE_URL"),
    ] {
        if !backend.is_enabled() {
            assert!(
                !conformance::backends_required(),
                "{backend:?} is not compiled in: build with --all-features"
            );
            continue;
        }
        let Some(url) = conformance::backend_url(var) else {
            assert!(!conformance::backends_required(), "{var} is needed");
            continue;
        };
        let (head, query) = url.split_once('?').expect("a secure URL names its CA");
        let query: Vec<String> = query
            .split('&')
            .map(|kv| match kv.split_once('=') {
                Some(("ca" | "ca_file", _)) => format!("ca={wrong_ca}"),
                _ => kv.to_owned(),
            })
            .collect();
        let dir = support::temp_dir("wrong-ca");
        let file = dir.join("url");
        std::fs::write(&file, format!("{head}?{}", query.join("&"))).unwrap();
        let mut inspect = Command::new(BIN);
        inspect
            .env_remove("DISTLOCK_URL")
            .arg("--url-file")
            .arg(&file)
            .args(["inspect", "k"])
            .stdin(Stdio::null());
        let out = output_within(inspect, Duration::from_secs(30));
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(78), "{backend:?}: {err}");
        assert!(err.starts_with("distlock: refused by "), "{err}");
        tried += 1;
    }
    if conformance::backends_required() {
        assert_eq!(tried, 2);
    }
}

/// A Redis whose memory is full under `noeviction` refuses every write: `check` grades it FAIL
/// with a sentence saying so and exits 1 (audit FAIL), not 69 with the raw OOM line. `check
/// --url` is accepted as for every other command.
#[test]
fn check_on_a_full_redis_fails_with_1() {
    use conformance::servers::{PrivateServer, ServerKind, free_port, redis};
    if !Backend::Redis.is_enabled() {
        assert!(
            !conformance::backends_required(),
            "the Redis driver is not compiled in: build with --all-features"
        );
        return;
    }
    if std::process::Command::new("redis-server")
        .arg("--version")
        .output()
        .is_err()
    {
        assert!(!conformance::backends_required(), "redis-server is needed");
        return;
    }
    let server = PrivateServer::start_blocking_with(
        ServerKind::Redis,
        free_port(),
        &["--maxmemory", "64mb", "--maxmemory-policy", "noeviction"],
    );
    let port = server.port;
    let url = format!("redis://127.0.0.1:{port}");
    let check = || {
        let mut command = Command::new(BIN);
        command
            .env_remove("DISTLOCK_URL")
            .args(["check", "--url", &url])
            .stdin(Stdio::null());
        output_within(command, Duration::from_secs(60))
    };
    let out = check();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    // Fill it, then set the limit below what it uses: every write is refused from then on.
    assert_eq!(
        redis::cli(port, &["debug", "populate", "20000", "fill", "64"]),
        "OK"
    );
    assert_eq!(
        redis::cli(port, &["config", "set", "maxmemory", "1mb"]),
        "OK"
    );
    assert!(redis::cli(port, &["set", "x", "y"]).starts_with("OOM"));
    let out = check();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}{}", stderr(&out));
    let memory = text
        .lines()
        .find(|l| l.trim_start().starts_with("memory "))
        .unwrap_or_else(|| panic!("no memory finding: {text}"));
    assert!(memory.contains("FAIL"), "{memory}");
    assert!(
        memory.contains("refuses writes because it is out of memory"),
        "{memory}"
    );
}

/// Job mode's `--at-least 3s` with `--ttl 30s` and a command that ends at once: the next
/// `run` is granted no sooner than 3 s after the first grant and long before the TTL — on every
/// backend, etcd included (whose keepalive used to hold the key for the whole TTL). distlock
/// exits right after the job, so the coordinator alone frees the key.
#[test]
fn at_least_frees_the_key_at_at_least_not_at_the_ttl() {
    let all = backends();
    let mut checked = 0;
    for (backend, url) in &all {
        let key = fresh_key("at-least");
        let dir = support::temp_dir("at-least");
        let (first, second) = (dir.join("first"), dir.join("second"));
        let stamp = |path: &std::path::Path| format!("date +%s%N > {}", path.display());
        let mut run = distlock(url);
        run.args([
            "run",
            "--ttl",
            "30s",
            "--at-least",
            "3s",
            &key,
            "--",
            "sh",
            "-c",
        ])
        .arg(stamp(&first));
        let out = output_within(run, Duration::from_secs(30));
        assert_eq!(out.status.code(), Some(0), "{backend:?}: {}", stderr(&out));
        let mut next = distlock(url);
        next.args(["run", "--wait", "40s", &key, "--", "sh", "-c"])
            .arg(stamp(&second));
        let out = output_within(next, Duration::from_secs(60));
        assert_eq!(out.status.code(), Some(0), "{backend:?}: {}", stderr(&out));
        let read = |path: &std::path::Path| -> u128 {
            std::fs::read_to_string(path)
                .unwrap()
                .trim()
                .parse()
                .unwrap()
        };
        let apart = Duration::from_nanos(
            u64::try_from(read(&second).saturating_sub(read(&first))).unwrap(),
        );
        // The first stamp is taken after its grant and the second after its own: the gap is
        // at most a little shorter than grant to grant.
        assert!(
            apart >= Duration::from_millis(2900),
            "{backend:?}: granted again {apart:?} after an at-least of 3 s"
        );
        assert!(
            apart <= Duration::from_secs(6),
            "{backend:?}: free only {apart:?} after the grant (at-least 3 s, ttl 30 s)"
        );
        checked += 1;
    }
    assert_eq!(checked, all.len());
}
