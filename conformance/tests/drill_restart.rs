//! Drill 5: the server is killed (SIGKILL; PostgreSQL: a crash of the whole server) and
//! restarted while a lock is held — on a private instance per backend (`backends.sh` with its
//! own data directory and a port from the drills' ranges; the shared servers are never touched).
//!
//! PostgreSQL, etcd and ZooKeeper claim durable fencing: the checker must find the history
//! clean (fencing tokens keep increasing across the crash). The test Redis has no persistence, so
//! its fence counter restarts — the limit lock-redis's README documents ("the server restarts
//! without `appendonly yes`…"). The drill measures it: the only violation allowed is
//! `FencingNotIncreasing`, the README must say so, the new holder's writes are rejected by the
//! fenced resource (which remembers the higher token), and the old holder must be told it lost —
//! a lock silently trusted after the restart fails the drill.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed expectation is a failed test

mod drill_support;

use conformance::drill::{History, Rule};
use drill_support::{Backend, Client, FencedLog, PrivateServer, TTL, finish, write};
use lock_core::FencingToken;
use std::time::Duration;
use tokio::time::Instant;

const WAIT: Duration = Duration::from_secs(20);

async fn restart_while_held(backend: Backend, port: u16) {
    let server = PrivateServer::start(backend, port).await;
    let url = server.url();
    let history = History::new(format!("{}_server_restart", backend.name()));
    let key = conformance::fresh_key("drill-restart");
    let log = FencedLog::new();
    let c1 = Client::new(&history, "c1", &url).await;
    let c2 = Client::new(&history, "c2", &url).await;

    // A few grants first, so a counter that restarts from zero shows.
    for n in 0..3 {
        let held = c1.acquire(&key, WAIT).await.expect("c1 acquires");
        assert!(write(&c1.rec, &held.hold, &log, &format!("c1#warmup{n}")));
        assert_eq!(c1.release(held).await, Some(true));
    }
    let held1 = c1.acquire(&key, WAIT).await.expect("c1 acquires");
    let f1 = held1.hold.fencing.map_or(0, FencingToken::get);
    assert!(write(&c1.rec, &held1.hold, &log, "c1#1"));

    let fault = history.fault("server killed and restarted", Some(backend.name()));
    let killed = Instant::now();
    server.ctl("kill").await;
    server.ctl("start").await;
    fault.heal();
    let restarted = killed.elapsed();

    // Either the holder kept its lease through the restart (renewed against the restored
    // state) or it was told it lost it. For Redis (state gone) it must be told.
    let lost = held1.wait_lost(2 * TTL + Duration::from_secs(3)).await;
    let durable = backend != Backend::Redis;
    if !durable {
        assert!(
            lost.is_some(),
            "redis: after a restart that lost the lock, the holder must be told it lost"
        );
    }
    let kept = lost.is_none();
    let released = c1.release(held1).await;
    if kept {
        assert_eq!(released, Some(true), "a kept lease releases");
    }

    let held2 = c2
        .acquire(&key, WAIT)
        .await
        .expect("c2 acquires after the restart");
    let f2 = held2.hold.fencing.map_or(0, FencingToken::get);
    let accepted = write(&c2.rec, &held2.hold, &log, "c2#1");
    eprintln!(
        "{}: restart took {restarted:?}; holder {}; fence {f1} before, {f2} after; c2's write {}",
        history.name(),
        if kept {
            "kept its lease"
        } else {
            "was told it lost"
        },
        if accepted { "accepted" } else { "rejected" }
    );
    history.note(format!(
        "fence {f1} before the restart, {f2} after; holder {}",
        if kept { "kept its lease" } else { "lost" }
    ));
    assert_eq!(c2.release(held2).await, Some(true));
    // Liveness after the heal.
    let again = c1.acquire(&key, WAIT).await.expect("c1 acquires again");
    let _ = write(&c1.rec, &again.hold, &log, "c1#2");
    assert_eq!(c1.release(again).await, Some(true));

    if durable {
        assert!(f2 > f1, "fencing must survive the restart: {f1} then {f2}");
        assert!(accepted);
        finish(&history, &log, &[]);
    } else {
        let violations = finish(&history, &log, &[Rule::FencingNotIncreasing]);
        assert!(
            f2 <= f1 && !accepted,
            "the test Redis has no persistence: the counter restarts ({f1} then {f2}) and the \
             fenced resource rejects the new holder's write"
        );
        assert!(
            violations
                .iter()
                .any(|v| v.rule == Rule::FencingNotIncreasing),
            "the measured limit must show in the history"
        );
        let readme = include_str!("../../crates/lock-redis/README.md");
        assert!(
            readme.contains("the server restarts without `appendonly yes`"),
            "lock-redis's README must document that a restart without persistence resets fencing"
        );
        eprintln!(
            "{}: documented limit measured: fencing went {f1} -> {f2} (README: \"the server restarts without `appendonly yes`\")",
            history.name()
        );
    }
}

/// Runs `drill` on a private server of `backend`, unless the servers are not installed here
/// (no `DISTLOCK_TEST_*_URL`, and not required).
fn run(name: &str, backend: Backend, drill: impl std::future::Future<Output = ()>) {
    if std::env::var_os("DISTLOCK_TEST_REDIS_URL").is_none() && !conformance::backends_required() {
        drill_support::skip(
            name,
            backend,
            "the servers are not installed here (DISTLOCK_TEST_*_URL unset)",
        );
        return;
    }
    drill_support::block_on(drill);
}

#[test]
fn redis() {
    run(
        "server_restart",
        Backend::Redis,
        restart_while_held(Backend::Redis, 26391),
    );
}

#[test]
fn etcd() {
    run(
        "server_restart",
        Backend::Etcd,
        restart_while_held(Backend::Etcd, 22701),
    );
}

#[test]
fn zk() {
    run(
        "server_restart",
        Backend::Zk,
        restart_while_held(Backend::Zk, 22801),
    );
}

#[test]
fn pg() {
    run(
        "server_restart",
        Backend::Pg,
        restart_while_held(Backend::Pg, 25501),
    );
}

/// etcd keeps leases across a restart, so a holder keeps its lock; its deletion watch (one
/// shared watch stream per client) broke with the connection and must have been re-established:
/// a key deleted after the restart is reported through `lost()` although every renewal of the
/// (still live) lease succeeds.
async fn etcd_loss_is_still_pushed_after_a_restart(port: u16) {
    use lock_core::{DistributedLockExt, LossReason};
    let server = PrivateServer::start(Backend::Etcd, port).await;
    let lock = distlock::connect(&server.url()).await.expect("connects");
    let key = conformance::fresh_key("restart-watch");
    let ttl = Duration::from_secs(3);
    let guard = lock
        .lock(&key)
        .ttl(ttl)
        .try_acquire()
        .await
        .unwrap()
        .expect("free");
    server.ctl("kill").await;
    server.ctl("start").await;
    // The lease survives the restart: wait for a renewal after it.
    let renewed = guard.renewals();
    let until = Instant::now() + WAIT;
    while guard.renewals() <= renewed {
        assert!(!guard.is_lost(), "the lease survives an etcd restart");
        assert!(Instant::now() < until, "no renewal after the restart");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // An operator deletes the lock's key; only the watch can tell (renewals keep the lease).
    // lock-etcd's key layout: `<prefix><name>/<lease>`, with `%` and `/` escaped in the name.
    let escaped = key.as_str().replace('%', "%25").replace('/', "%2F");
    let deleted = tokio::process::Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints=http://127.0.0.1:{port}"))
        .args(["del", "--prefix", &format!("distlock/{escaped}/")])
        .output()
        .await
        .expect("etcdctl runs");
    assert!(deleted.status.success(), "{deleted:?}");
    assert_eq!(String::from_utf8_lossy(&deleted.stdout).trim(), "1");
    // Without the watch it would never fire (renewals keep the lease), so a generous window
    // loses nothing: the re-watch may wait out a backoff grown while the server was down.
    tokio::time::timeout(WAIT, guard.lost())
        .await
        .expect("the deletion is pushed through the re-established watch");
    assert_eq!(guard.loss_reason(), Some(LossReason::Revoked));
}

#[test]
fn etcd_watch_after_restart() {
    run(
        "server_restart_watch",
        Backend::Etcd,
        etcd_loss_is_still_pushed_after_a_restart(22711),
    );
}
