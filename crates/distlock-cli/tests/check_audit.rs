//! `distlock check URL --json` grades real servers: the shared, well-configured ones PASS (no
//! FAIL), and servers this test starts itself with a deliberately bad setting get the FAIL or
//! WARN their driver's README says they deserve: Redis evicting keys, PostgreSQL with
//! `synchronous_commit=off`, `fsync=off` and an unlogged table, a ZooKeeper whose
//! `maxSessionTimeout` is below what the URL asks, a 3-member etcd cluster with one member down.
//! Each private server is started once per test, on free ports, and stopped when the test ends.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    thread,
    time::{Duration, Instant},
};

use conformance::servers::{
    ClusterKind, PrivateCluster, PrivateServer, ServerKind, free_port, redis,
};
use distlock::Backend;
use serde_json::Value;

fn check(url: &str, extra: &[&str]) -> (Option<i32>, Value, Output) {
    let out = Command::new(env!("CARGO_BIN_EXE_distlock"))
        .arg("check")
        .arg(url)
        .arg("--json")
        .args(extra)
        .env_remove("DISTLOCK_URL")
        .env_remove("DISTLOCK_URL_FILE")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let value: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "check {url}: not JSON ({e}): {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code(), value, out)
}

/// The verdict of `name` in a `check --json` object (panics, showing the report, if absent).
fn verdict(report: &Value, name: &str) -> String {
    finding(report, name)["verdict"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

fn finding<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["audit"]["findings"]
        .as_array()
        .and_then(|f| f.iter().find(|f| f["check"] == name))
        .unwrap_or_else(|| panic!("no finding {name} in {report:#}"))
}

/// Waits (up to `within`) until `ready` holds, polling.
fn wait_until(what: &str, within: Duration, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !ready() {
        assert!(
            Instant::now() < deadline,
            "{what}: not ready within {within:?}"
        );
        thread::sleep(Duration::from_millis(100));
    }
}

/// The server in `var` when `backend` is compiled in; `None` (skip) when either is missing —
/// unless `DISTLOCK_REQUIRE_BACKENDS=1` (scripts/test.sh starts every server these tests name:
/// the single ones, the clusters of `up3`, the secured ones of `up-secure`), where a missing
/// server or driver fails the test.
fn shared(var: &str, backend: Backend) -> Option<String> {
    if !backend.is_enabled() {
        assert!(
            !conformance::backends_required(),
            "{var}: {backend} is not compiled in but DISTLOCK_REQUIRE_BACKENDS=1"
        );
        return None;
    }
    conformance::backend_url(var)
}

#[test]
fn the_shared_servers_pass_what_their_setup_gets_right() {
    let expectations: &[(&str, Backend, &[&str])] = &[
        (
            "DISTLOCK_TEST_REDIS_URL",
            Backend::Redis,
            &["version", "scripts", "maxmemory-policy", "role", "clock"],
        ),
        (
            "DISTLOCK_TEST_PG_URL",
            Backend::Postgres,
            &[
                "version",
                "synchronous_commit",
                "fsync",
                "full_page_writes",
                "table-persistence",
                "standby",
                "replication",
                "listen",
            ],
        ),
        (
            "DISTLOCK_TEST_ETCD_URL",
            Backend::Etcd,
            &["version", "health", "leader", "endpoints"],
        ),
        (
            "DISTLOCK_TEST_ZK_URL",
            Backend::ZooKeeper,
            &["version", "quorum", "session-timeout"],
        ),
    ];
    let mut checked = 0;
    for (var, backend, passes) in expectations {
        let Some(url) = shared(var, *backend) else {
            continue;
        };
        let (code, report, out) = check(&url, &[]);
        assert_eq!(
            code,
            Some(0),
            "{url}: {report:#}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_ne!(report["audit"]["worst"], "FAIL", "{url}: {report:#}");
        for name in *passes {
            assert_eq!(verdict(&report, name), "PASS", "{url} {name}: {report:#}");
        }
        assert!(
            report["audit"]["round_trip_ms"].as_f64().is_some(),
            "{report:#}"
        );
        assert_eq!(report["self_test"]["error"], Value::Null, "{report:#}");
        // --strict fails exactly when something warns.
        let warns = report["audit"]["warn"].as_u64().unwrap();
        let (strict, _, _) = check(&url, &["--strict"]);
        assert_eq!(strict, Some(if warns > 0 { 1 } else { 0 }), "{url}");
        checked += 1;
    }
    // The clustered and secured servers (required with DISTLOCK_REQUIRE_BACKENDS=1, as the
    // others): a 3-member cluster tolerates a failure; auth refuses anonymous clients.
    let clustered_and_secured = [
        ("DISTLOCK_TEST_ETCD3_URL", Backend::Etcd, "members"),
        ("DISTLOCK_TEST_ETCD3_URL", Backend::Etcd, "health"),
        ("DISTLOCK_TEST_ZK3_URL", Backend::ZooKeeper, "members"),
        ("DISTLOCK_TEST_ZK3_URL", Backend::ZooKeeper, "quorum"),
        ("DISTLOCK_TEST_ETCD_SECURE_URL", Backend::Etcd, "auth"),
        ("DISTLOCK_TEST_ZK_SECURE_URL", Backend::ZooKeeper, "auth"),
    ];
    let mut graded = 0;
    for (var, backend, name) in clustered_and_secured {
        let Some(url) = shared(var, backend) else {
            continue;
        };
        let (code, report, _) = check(&url, &[]);
        assert_eq!(code, Some(0), "{var}: {report:#}");
        assert_eq!(verdict(&report, name), "PASS", "{var} {name}: {report:#}");
        graded += 1;
    }
    if conformance::backends_required() {
        assert_eq!(checked, 4, "every shared server is checked");
        assert_eq!(
            graded,
            clustered_and_secured.len(),
            "every clustered and secured server is checked"
        );
    }
}

#[test]
fn redis_that_evicts_keys_fails() {
    if !Backend::Redis.is_enabled() || which("redis-server").is_none() {
        assert!(!conformance::backends_required(), "redis-server is needed");
        return;
    }
    let server = PrivateServer::start_blocking_with(
        ServerKind::Redis,
        free_port(),
        &["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"],
    );
    let port = server.port;
    let cli = |args: &[&str]| redis::cli(port, args);
    let url = format!("redis://127.0.0.1:{port}");

    let (code, report, _) = check(&url, &[]);
    assert_eq!(verdict(&report, "maxmemory-policy"), "FAIL", "{report:#}");
    assert!(
        finding(&report, "maxmemory-policy")["fix"]
            .as_str()
            .unwrap()
            .contains("noeviction"),
        "{report:#}"
    );
    assert_eq!(code, Some(1), "a FAIL fails the check: {report:#}");
    // The self-test itself still passes: the setting is what fails.
    assert_eq!(report["self_test"]["error"], Value::Null, "{report:#}");

    // A volatile policy with a memory limit can evict a held lock (it has a TTL).
    assert_eq!(
        cli(&["config", "set", "maxmemory-policy", "volatile-lru"]),
        "OK"
    );
    let (code, report, _) = check(&url, &[]);
    assert_eq!(verdict(&report, "maxmemory-policy"), "FAIL", "{report:#}");
    assert_eq!(code, Some(1));

    // Read live: fixed, it passes; the AOF with fsync always passes persistence too.
    assert_eq!(
        cli(&["config", "set", "maxmemory-policy", "noeviction"]),
        "OK"
    );
    assert_eq!(cli(&["config", "set", "appendonly", "yes"]), "OK");
    assert_eq!(cli(&["config", "set", "appendfsync", "always"]), "OK");
    let (code, report, _) = check(&url, &["--strict"]);
    assert_eq!(verdict(&report, "maxmemory-policy"), "PASS", "{report:#}");
    assert_eq!(verdict(&report, "persistence"), "PASS", "{report:#}");
    assert_eq!(code, Some(0), "nothing left to warn about: {report:#}");

    // replicas=1 with no replica connected: every grant would end Indeterminate.
    let (code, report, _) = check(&format!("{url}?replicas=1"), &[]);
    assert_eq!(verdict(&report, "replicas"), "FAIL", "{report:#}");
    assert_ne!(code, Some(0), "{report:#}");

    // Through a Sentinel: the master it names is what gets audited.
    let sentinel = PrivateServer::start_sentinel_blocking(
        free_port(),
        "audited",
        port,
        1,
        &["--sentinel", "down-after-milliseconds", "audited", "600000"],
    );
    let sentinel_port = sentinel.port;
    wait_until("sentinel", Duration::from_secs(20), || {
        redis::cli(
            sentinel_port,
            &["sentinel", "get-master-addr-by-name", "audited"],
        )
        .contains(&port.to_string())
    });
    let (code, report, out) = check(
        &format!("redis+sentinel://127.0.0.1:{sentinel_port}/audited"),
        &[],
    );
    assert_eq!(verdict(&report, "topology"), "PASS", "{report:#}");
    assert!(
        finding(&report, "topology")["observed"]
            .as_str()
            .unwrap()
            .contains(&format!("127.0.0.1:{port}")),
        "{report:#}"
    );
    assert_eq!(verdict(&report, "maxmemory-policy"), "PASS", "{report:#}");
    assert_eq!(verdict(&report, "scripts"), "PASS", "{report:#}");
    assert_eq!(
        code,
        Some(0),
        "{report:#}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join(program))
            .find(|p| p.is_file())
    })
}

/// `psql` as the superuser on a private PostgreSQL.
fn psql(pg: &PrivateServer, sql: &str) -> String {
    let out = Command::new("psql")
        .args(["-h", "127.0.0.1", "-p", &pg.port.to_string()])
        .args([
            "-U",
            "postgres",
            "-d",
            "distlock",
            "-XqtA",
            "-v",
            "ON_ERROR_STOP=1",
        ])
        .args(["-c", sql])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{sql}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

#[test]
fn postgres_with_async_commit_fsync_off_and_an_unlogged_table_is_flagged() {
    if !Backend::Postgres.is_enabled() || which("psql").is_none() {
        assert!(!conformance::backends_required(), "psql is needed");
        return;
    }
    // A PostgreSQL of our own, through `backends.sh` like every test server.
    let pg = PrivateServer::start_blocking(ServerKind::Pg, free_port());
    psql(&pg, "ALTER DATABASE distlock SET synchronous_commit = off");
    psql(&pg, "ALTER SYSTEM SET fsync = off");
    psql(&pg, "SELECT pg_reload_conf()");
    psql(
        &pg,
        "CREATE UNLOGGED TABLE audit_unlogged (name text PRIMARY KEY)",
    );
    // The reload reaches every backend soon, not at once.
    wait_until("fsync = off", Duration::from_secs(10), || {
        psql(&pg, "SHOW fsync") == "off"
    });
    let base = pg.url();

    let url = format!("{base}?table=audit_unlogged");
    let (code, report, out) = check(&url, &[]);
    assert_eq!(verdict(&report, "table-persistence"), "FAIL", "{report:#}");
    assert_eq!(verdict(&report, "synchronous_commit"), "WARN", "{report:#}");
    assert_eq!(verdict(&report, "fsync"), "FAIL", "{report:#}");
    assert_eq!(code, Some(1), "{report:#}");
    // The driver refuses the unlogged table when connecting; the audit says why anyway.
    assert!(
        report["self_test"]["error"]
            .as_str()
            .is_some_and(|e| e.contains("not connected")),
        "{report:#}{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Fixed: the settings pass (the default table does not exist yet: created logged).
    psql(&pg, "ALTER DATABASE distlock SET synchronous_commit = on");
    psql(&pg, "ALTER SYSTEM SET fsync = on");
    psql(&pg, "SELECT pg_reload_conf()");
    wait_until("fsync = on", Duration::from_secs(10), || {
        psql(&pg, "SHOW fsync") == "on"
    });
    let (code, report, _) = check(&base, &[]);
    for name in ["table-persistence", "synchronous_commit", "fsync"] {
        assert_eq!(verdict(&report, name), "PASS", "{name}: {report:#}");
    }
    assert_eq!(code, Some(0), "{report:#}");
}

#[test]
fn zookeeper_that_lowers_or_raises_the_session_timeout_is_flagged() {
    let jar = Path::new("/usr/share/java/zookeeper.jar");
    if !Backend::ZooKeeper.is_enabled() || !jar.exists() || which("java").is_none() {
        assert!(!conformance::backends_required(), "ZooKeeper is needed");
        return;
    }
    let server = PrivateServer::start_blocking_with(
        ServerKind::Zk,
        free_port(),
        &["minSessionTimeout=500", "maxSessionTimeout=2000"],
    );
    let port = server.port;

    // Asked 10 s, the server's maxSessionTimeout is 2 s: every lease is capped at 2 s.
    let url = format!("zk://127.0.0.1:{port}?session_timeout=10s");
    let (code, report, out) = check(&url, &[]);
    assert_eq!(verdict(&report, "session-timeout"), "WARN", "{report:#}");
    let observed = finding(&report, "session-timeout")["observed"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        observed.contains("asked 10000 ms, negotiated 2000 ms"),
        "{observed}"
    );
    assert_eq!(
        code,
        Some(0),
        "a WARN alone passes: {report:#}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(check(&url, &["--strict"]).0, Some(1));

    // Asked 300 ms, the server raises it to its minimum of 500 ms: the driver refuses.
    let url = format!("zk://127.0.0.1:{port}?session_timeout=300ms");
    let (code, report, _) = check(&url, &[]);
    assert_eq!(verdict(&report, "session-timeout"), "FAIL", "{report:#}");
    assert_eq!(code, Some(1), "{report:#}");

    // What the server allows: PASS.
    let url = format!("zk://127.0.0.1:{port}?session_timeout=2s");
    let (_, report, _) = check(&url, &[]);
    assert_eq!(verdict(&report, "session-timeout"), "PASS", "{report:#}");
}

#[test]
fn etcd_cluster_with_a_member_down_warns() {
    if !Backend::Etcd.is_enabled() || which("etcd").is_none() {
        assert!(!conformance::backends_required(), "etcd is needed");
        return;
    }
    let cluster = PrivateCluster::start_blocking(ClusterKind::Etcd);
    let url = cluster.url();
    let mut last = Value::Null;
    wait_until("etcd cluster healthy", Duration::from_secs(30), || {
        let (_, report, _) = check(&url, &[]);
        let healthy = report["audit"]["findings"].as_array().is_some_and(|f| {
            f.iter()
                .any(|f| f["check"] == "health" && f["verdict"] == "PASS")
        });
        last = report;
        healthy
    });
    assert_eq!(verdict(&last, "members"), "PASS", "{last:#}");

    cluster.ctl_blocking("kill", 2);
    // Once the two left agree on a leader (at once, or after an election of ~1 s) and serve
    // linearizable reads again, the cluster serves with one member fewer: WARN, not FAIL, and
    // not PASS. A leader alone is not enough: right after an election its first linearizable
    // read can outlast the audit's health probe (862 ms once under CI load), which then counted
    // the live leader as not serving (a flake of the wait, not of the audit). An audit that
    // never reaches WARN still fails the wait.
    let mut report = Value::Null;
    let mut code = None;
    wait_until(
        "etcd cluster serving on two",
        Duration::from_secs(30),
        || {
            let (c, r, _) = check(&url, &[]);
            let settled = r["audit"]["findings"].as_array().is_some_and(|f| {
                f.iter()
                    .any(|f| f["check"] == "leader" && f["verdict"] == "PASS")
                    && f.iter()
                        .any(|f| f["check"] == "health" && f["verdict"] != "FAIL")
            });
            report = r;
            code = c;
            settled
        },
    );
    assert_eq!(verdict(&report, "health"), "WARN", "{report:#}");
    assert!(
        finding(&report, "health")["observed"]
            .as_str()
            .unwrap()
            .contains(&format!("2/3 healthy; not serving: {}", cluster.member(2))),
        "{report:#}"
    );
    assert_eq!(verdict(&report, "endpoints"), "WARN", "{report:#}");
    assert_eq!(verdict(&report, "members"), "PASS", "{report:#}");
    assert_eq!(report["audit"]["worst"], "WARN", "{report:#}");
    let _ = code; // the self-test may hit the dead endpoint (see the endpoints finding)

    // The URL naming only the live members: the dead one is still found (through the member
    // list) and the cluster is WARN, while the endpoints pass and so does the self-test.
    let live = cluster.url_of(0..2);
    let (code, report, _) = check(&live, &[]);
    assert_eq!(verdict(&report, "health"), "WARN", "{report:#}");
    assert_eq!(verdict(&report, "endpoints"), "PASS", "{report:#}");
    assert_eq!(code, Some(0), "a member down is a WARN: {report:#}");
    assert_eq!(check(&live, &["--strict"]).0, Some(1));

    // A second member down: no quorum.
    cluster.ctl_blocking("kill", 1);
    let (code, report, _) = check(&url, &[]);
    assert_ne!(code, Some(0), "{report:#}");
    if report["audit"]["findings"].is_array() {
        assert_eq!(verdict(&report, "health"), "FAIL", "{report:#}");
    }
}

#[test]
fn an_unreachable_coordinator_is_unavailable_without_leaking_the_password() {
    for (backend, url) in [
        (Backend::Redis, "redis://u:s3cretpw@127.0.0.1:1"),
        (Backend::Etcd, "etcd://u:s3cretpw@127.0.0.1:1"),
        (Backend::ZooKeeper, "zk://u:s3cretpw@127.0.0.1:1"),
        (Backend::Postgres, "postgres://u:s3cretpw@127.0.0.1:1/db"),
    ] {
        if !backend.is_enabled() {
            continue;
        }
        let (code, report, out) = check(url, &[]);
        assert_eq!(code, Some(69), "{url}: {report:#}");
        assert!(report["audit"]["error"].is_string(), "{url}: {report:#}");
        assert_eq!(report["ok"], false, "{url}: {report:#}");
        assert_ne!(report["backend"], "unknown", "{url}: {report:#}");
        let all = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!all.contains("s3cretpw"), "{url}: {all}");
    }
}
