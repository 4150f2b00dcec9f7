//! Drill 9: the server frozen. A private instance per backend is stopped with SIGSTOP
//! (PostgreSQL: the whole server) for 3 × TTL while a holder holds a key and 8 clients try to
//! acquire it with a 1 s deadline — four already queued behind the holder when the freeze
//! begins, four starting against the frozen server; then it is resumed (SIGCONT).
//!
//! What must hold — the article's "bounded waits under a deadline, fail closed, no permanent lock":
//! - every `acquire` returns (an error: nothing can be granted by a frozen server) within its
//!   deadline plus [`SLACK`], however its requests were stuck;
//! - the holder's `lost()` fires within TTL + [`SLACK`] of the freeze (its renewals cannot get
//!   through, so it must stop trusting the lease by its local deadline);
//! - once the TTL after the resume has passed (plus [`SETTLE`]), nothing is left held or queued,
//!   although the frozen server's socket buffers still held every request the clients sent, and
//!   it executes them on resume: grants and queue entries for clients that gave up long ago must
//!   be undone by their clients, or expire by their TTL;
//! - the next acquire succeeds at once.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed expectation is a failed test

mod drill_support;

use std::time::Duration;

use drill_support::{Backend, PrivateServer, SOON, TTL, client};
use lock_core::{DistributedLockExt, DynLock};
use tokio::time::{Instant, sleep, sleep_until, timeout};

const CLIENTS: usize = 8;
const DEADLINE: Duration = Duration::from_secs(1);
/// What a wait may overshoot its deadline by. A waiter whose deadline passes while it is queued
/// first tries to leave the queue in the foreground for a short grace (Redis 200 ms,
/// PostgreSQL 250 ms, ZooKeeper 100 ms plus its session check: 200-300 ms measured here), then
/// leaves the rest to the background; the remainder is scheduling noise on a loaded 2-core
/// machine. Well below what a request timeout costs: the waiters use the drivers' default
/// request timeouts of several seconds, so an acquire that waited for one of them after its
/// deadline takes 5 s or more (etcd on main `a90aacc`: 6.0 s).
const SLACK: Duration = Duration::from_millis(800);
/// After the resume and one TTL: time for the clients' background clean-ups (a reconnect, a
/// compare-and-release or a queue removal each) and for server-side expiry to run.
const SETTLE: Duration = Duration::from_secs(5);

async fn frozen(backend: Backend, port: u16) {
    let name = backend.name();
    let server = PrivateServer::start(backend, port).await;
    let url = server.url();
    let key = conformance::fresh_key("drill-frozen");
    let holder = client(&url).await;
    // The waiters keep the drivers' default request timeouts (seconds, not the drills' 500 ms):
    // the deadline, not a short request budget, must be what bounds their waits.
    // (ZooKeeper's lease is the session: its timeout is the TTL, so it stays at 1 s.)
    let base = url.split('?').next().unwrap_or(&url);
    let defaults = match backend {
        Backend::Zk => format!("{base}?session_timeout=1s"),
        _ => base.to_owned(),
    };
    let mut clients: Vec<DynLock> = Vec::new();
    for _ in 0..CLIENTS {
        clients.push(client(&defaults).await);
    }
    let guard = holder
        .lock(&key)
        .ttl(TTL)
        .try_acquire()
        .await
        .unwrap()
        .expect("the key is free");

    let wait = |c: &DynLock| {
        let (c, key) = (c.clone(), key.clone());
        tokio::spawn(async move {
            let started = Instant::now();
            let out = c.lock(&key).ttl(TTL).wait(DEADLINE).acquire().await;
            (started.elapsed(), out.map(|g| g.fencing_token()))
        })
    };
    // Half the waiters queue behind the holder before the freeze (their deadlines then pass
    // while the server is frozen: leaving the queue is what must not hold them up); the other
    // half start against the frozen server.
    let (early, late) = clients.split_at(CLIENTS / 2);
    let mut waits: Vec<_> = early.iter().map(wait).collect();
    let queued_by = Instant::now() + DEADLINE / 2;
    while Instant::now() < queued_by {
        let waiters = holder
            .inspect(&key)
            .await
            .ok()
            .flatten()
            .and_then(|i| i.waiters);
        if waiters.is_some_and(|n| n >= early.len()) {
            break;
        }
        sleep(Duration::from_millis(20)).await;
    }
    server.ctl("pause").await;
    let paused = Instant::now();
    waits.extend(late.iter().map(wait));
    let lost = timeout(TTL + SLACK + SLACK, guard.lost()).await;
    let lost_after = paused.elapsed();
    let mut worst = Duration::ZERO;
    let mut outcomes = Vec::new();
    for w in waits {
        let (took, out) = timeout(DEADLINE + SOON, w)
            .await
            .expect("an acquire never returned")
            .unwrap();
        worst = worst.max(took);
        outcomes.push((took, out));
    }
    sleep_until(paused + 3 * TTL).await;
    server.ctl("resume").await;
    let resumed = Instant::now();
    eprintln!(
        "{name}: holder lost after {lost_after:?}; slowest acquire {worst:?} (deadline {DEADLINE:?}); \
         outcomes {:?}",
        outcomes
            .iter()
            .map(|(t, o)| format!(
                "{t:?} {}",
                o.as_ref().map_or_else(|e| e.kind(), |_| "granted")
            ))
            .collect::<Vec<_>>()
    );
    assert!(
        lost.is_ok(),
        "{name}: the holder still trusted its lease {lost_after:?} into the freeze (ttl {TTL:?})"
    );
    for (took, out) in &outcomes {
        assert!(
            out.as_ref().is_err_and(lock_core::Error::is_temporary),
            "{name}: against a frozen server an acquire must fail with a temporary error: {out:?}"
        );
        assert!(
            *took <= DEADLINE + SLACK,
            "{name}: an acquire with a {DEADLINE:?} deadline took {took:?} against a frozen server"
        );
    }

    // Whatever the frozen server executes on resume — the holder's renewals, the clients'
    // attempts and queue registrations — must leave the key free one TTL later.
    let until = resumed + TTL + SETTLE;
    let free_after = loop {
        match timeout(SOON, holder.inspect(&key)).await {
            Ok(Ok(None)) => break resumed.elapsed(),
            Ok(Ok(Some(info))) => {
                assert!(
                    Instant::now() < until,
                    "{name}: {:?} after the resume the key is still held or queued: {info:?}",
                    resumed.elapsed()
                );
            }
            Ok(Err(e)) => assert!(
                Instant::now() < until,
                "{name}: inspect still fails {:?} after the resume: {e}",
                resumed.elapsed()
            ),
            Err(_) => panic!("{name}: inspect hung after the resume"),
        }
        sleep(Duration::from_millis(100)).await;
    };
    let started = Instant::now();
    let next = clients[0]
        .lock(&key)
        .ttl(TTL)
        .wait(Duration::from_secs(3))
        .acquire()
        .await
        .unwrap_or_else(|e| panic!("{name}: the next acquire after the resume failed: {e}"));
    let next_took = started.elapsed();
    eprintln!("{name}: free {free_after:?} after the resume; next acquire took {next_took:?}");
    assert!(
        next_took < Duration::from_secs(2),
        "{name}: the next acquire took {next_took:?}"
    );
    assert!(next.release().await.unwrap());
    let _ = guard.release().await;
    assert!(
        lock_core::raw::cleanup::finish(SOON).await,
        "{name}: background clean-ups did not finish"
    );
}

fn run(backend: Backend, port: u16) {
    if std::env::var_os("DISTLOCK_TEST_REDIS_URL").is_none() && !conformance::backends_required() {
        drill_support::skip(
            "server_frozen",
            backend,
            "the servers are not installed here (DISTLOCK_TEST_*_URL unset)",
        );
        return;
    }
    drill_support::block_on(frozen(backend, port));
}

#[test]
fn redis() {
    run(Backend::Redis, 26411);
}

#[test]
fn etcd() {
    run(Backend::Etcd, 22721);
}

#[test]
fn zk() {
    run(Backend::Zk, 22811);
}

#[test]
fn pg() {
    run(Backend::Pg, 25511);
}
