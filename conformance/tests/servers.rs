//! `conformance::servers` itself: a Sentinel is a `backends.sh` instance like the others (its
//! config file written by `backends.sh`, settings passed as flags, kept across a restart), and
//! an instance that is never dropped (a `static`, a test process that is killed) is killed by
//! the reaper once the process has exited.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed expectation is a failed test

use std::{
    path::PathBuf,
    process::Command,
    time::{Duration, Instant},
};

use conformance::servers::{PrivateServer, ServerKind, free_port, redis::cli};

/// `SENTINEL MASTER name` as field -> value.
fn sentinel_master(port: u16, name: &str) -> std::collections::HashMap<String, String> {
    let out = cli(port, &["SENTINEL", "MASTER", name]);
    let lines: Vec<&str> = out.lines().collect();
    lines
        .chunks(2)
        .filter(|kv| kv.len() == 2)
        .map(|kv| (kv[0].to_owned(), kv[1].to_owned()))
        .collect()
}

#[test]
fn a_sentinel_monitors_the_master_it_is_given_with_its_settings_across_a_restart() {
    if conformance::backend_url("DISTLOCK_TEST_REDIS_URL").is_none() {
        return;
    }
    let master = PrivateServer::start_blocking(ServerKind::Redis, free_port());
    let sentinel = PrivateServer::start_sentinel_blocking(
        free_port(),
        "monitored",
        master.port,
        1,
        &[
            "--sentinel",
            "down-after-milliseconds",
            "monitored",
            "600000",
        ],
    );
    let seen = sentinel_master(sentinel.port, "monitored");
    assert_eq!(seen.get("port"), Some(&master.port.to_string()), "{seen:?}");
    assert_eq!(
        seen.get("quorum").map(String::as_str),
        Some("1"),
        "{seen:?}"
    );
    assert_eq!(
        seen.get("down-after-milliseconds").map(String::as_str),
        Some("600000"),
        "{seen:?}"
    );
    let id = cli(sentinel.port, &["SENTINEL", "MYID"]);
    assert_eq!(id.len(), 40, "{id}");

    // A crash and a restart: the config file it rewrote is kept (same id, same master), and
    // the settings are passed again.
    sentinel.ctl_blocking("kill");
    assert_eq!(cli(sentinel.port, &["PING"]), "", "killed");
    sentinel.ctl_blocking("start");
    assert_eq!(cli(sentinel.port, &["SENTINEL", "MYID"]), id);
    let seen = sentinel_master(sentinel.port, "monitored");
    assert_eq!(seen.get("port"), Some(&master.port.to_string()), "{seen:?}");
    assert_eq!(
        seen.get("down-after-milliseconds").map(String::as_str),
        Some("600000"),
        "{seen:?}"
    );

    // Paused, it does not answer; resumed, it does.
    sentinel.ctl_blocking("pause");
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &sentinel.port.to_string()])
        .args(["-t", "1", "PING"]) // redis-cli's own timeout: the process is stopped
        .output()
        .unwrap();
    assert_ne!(String::from_utf8_lossy(&out.stdout).trim(), "PONG");
    sentinel.ctl_blocking("resume");
    assert_eq!(cli(sentinel.port, &["PING"]), "PONG");
}

#[test]
fn a_leaked_instance_is_killed_once_its_process_has_exited() {
    if conformance::backend_url("DISTLOCK_TEST_REDIS_URL").is_none() {
        return;
    }
    let report = std::env::temp_dir().join(format!(
        "distlock-servers-test-leak-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    // A process of its own (`src/bin/distlock-leak-server.rs`) that starts a Redis and exits
    // without dropping it, as a killed test process would.
    let status = Command::new(env!("CARGO_BIN_EXE_distlock-leak-server"))
        .arg(&report)
        .status()
        .unwrap();
    assert!(status.success(), "the child: {status}");
    let written = std::fs::read_to_string(&report).unwrap();
    let _ = std::fs::remove_file(&report);
    let mut lines = written.lines();
    let pid: u32 = lines.next().unwrap().parse().unwrap();
    let port: u16 = lines.next().unwrap().parse().unwrap();
    let dir = PathBuf::from(lines.next().unwrap());
    let alive = || {
        std::fs::read(format!("/proc/{pid}/cmdline"))
            .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&format!("127.0.0.1:{port}")))
    };
    // The reaper polls its parent every 0.5 s, then kills and deletes.
    let until = Instant::now() + Duration::from_secs(20);
    while alive() || dir.exists() {
        if Instant::now() > until {
            let what = format!(
                "20 s after its process exited, the leaked redis (pid {pid}) is {} and its \
                 directory {}",
                if alive() { "alive" } else { "gone" },
                if dir.exists() { "exists" } else { "is gone" }
            );
            // Leave nothing behind even when red.
            if alive() {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap()),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            let _ = std::fs::remove_dir_all(&dir);
            panic!("{what}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
