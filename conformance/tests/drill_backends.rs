//! Fault drills against the shared single-node servers, each on every backend, each recording a
//! history that the checker must find clean (kept with its timeline under
//! `target/drill-histories/<backend>_<drill>.{json,svg}`):
//!
//! 1. `killed_holder`: a holder process is SIGKILLed; a contender is granted after the TTL /
//!    session expiry with a larger fencing token.
//! 2. `paused_holder`: a holder process is SIGSTOPped past its TTL; a contender takes over with a
//!    larger token and writes; on SIGCONT the old holder reports its loss before any write.
//! 3. `blackholed_holder`: the holder's connection is blackholed (proxy) for 2 × TTL; it reports
//!    its loss by its local deadline, before the contender (connected directly) is granted.
//! 4. `lost_acquire_reply`: the reply of an acquire (asked with a 30 s TTL) is dropped: no
//!    grant, no orphan (a contender is granted within the drill TTL + margin while the first
//!    client lives on, long before the attempt's own TTL could free the key), no double holder.
//!    `lost_release_reply`: the reply of a release is dropped; after a new holder is granted,
//!    the stale retry of that release returns `false` and the new incarnation survives.
//!
//! Needs the holder binary with the `drivers` feature (`--all-features` or `--features drivers`).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed expectation is a failed test

mod drill_support;

use std::time::Duration;

use conformance::drill::{History, Hold, HolderEvent, Proxy};
use drill_support::{
    Backend, Client, FencedLog, Holder, SOON, TTL, finish, inspect_answered, write,
};
use lock_core::{Error, FencingToken};
use tokio::time::{Instant, sleep, timeout};

/// A contender's wait: long enough for any expiry here.
const WAIT: Duration = Duration::from_secs(20);
/// The TTL of the acquire whose reply is lost: an orphan would outlive the contender's wait.
const ORPHAN_TTL: Duration = Duration::from_secs(30);

fn fencing(hold: &Hold) -> u64 {
    hold.fencing.map_or(0, FencingToken::get)
}

/// 1. Holder process killed.
async fn killed_holder(backend: Backend, url: String) {
    let history = History::new(format!("{}_killed_holder", backend.name()));
    let key = conformance::fresh_key("drill-kill");
    let log = FencedLog::new();
    let holder = Holder::spawn(
        &history,
        "holder",
        &url,
        &key,
        Some(Duration::from_millis(100)),
        log.clone(),
    )
    .await;
    let f1 = holder.wait_acquired().await;
    holder.wait_writes(2).await;
    // Kill after a renewal, so the checker holds the contender to the renewed deadline.
    holder
        .process
        .wait_for(SOON, |e| matches!(e, HolderEvent::Renewed { .. }))
        .await
        .expect("the holder's watchdog renews");

    let c2 = Client::new(&history, "c2", &url).await;
    let contender = tokio::spawn(c2.start_acquire(&key, WAIT));
    holder.process.kill().expect("SIGKILL");
    let killed = Instant::now();
    history.fault_instant("killed (SIGKILL)", Some("holder"));

    let held = contender
        .await
        .unwrap()
        .expect("the contender is granted after the expiry");
    let granted = Instant::now();
    assert!(
        fencing(&held.hold) > f1,
        "the new token {:?} must exceed the dead holder's {f1}",
        held.hold.fencing
    );
    assert!(write(&c2.rec, &held.hold, &log, "c2#1"));
    assert_eq!(c2.release(held).await, Some(true));
    let status = holder.finish().await;
    assert!(!status.success());
    eprintln!(
        "{}: granted {:?} after the kill (ttl {TTL:?})",
        history.name(),
        granted - killed
    );
    finish(&history, &log, &[]);
}

/// 2. Holder process paused past its TTL, then resumed.
async fn paused_holder(backend: Backend, url: String) {
    let history = History::new(format!("{}_paused_holder", backend.name()));
    let key = conformance::fresh_key("drill-pause");
    let log = FencedLog::new();
    let holder = Holder::spawn(
        &history,
        "holder",
        &url,
        &key,
        Some(Duration::from_millis(50)),
        log.clone(),
    )
    .await;
    let f1 = holder.wait_acquired().await;
    holder.wait_writes(2).await;
    // Pause after a renewal, so the checker holds the contender to the renewed deadline.
    holder
        .process
        .wait_for(SOON, |e| matches!(e, HolderEvent::Renewed { .. }))
        .await
        .expect("the holder's watchdog renews");

    holder.process.stop().await.expect("SIGSTOP");
    let pause = history.fault("paused (SIGSTOP)", Some("holder"));

    let c2 = Client::new(&history, "c2", &url).await;
    let held = c2
        .acquire(&key, WAIT)
        .await
        .expect("the contender is granted while the holder is paused");
    assert!(fencing(&held.hold) > f1);
    assert!(write(&c2.rec, &held.hold, &log, "c2#1"));

    // A stopped process emits nothing, so whatever was read until now (lines still in the pipe
    // at the SIGSTOP included: the pump has had until the lease expired to drain them) came before the pause,
    // and everything after this point was emitted after the SIGCONT.
    let events_at_pause = holder.process.events().len();
    holder.process.cont().await.expect("SIGCONT");
    pause.heal();
    let (_, lost) = holder
        .process
        .wait_for(SOON, |e| matches!(e, HolderEvent::Lost { .. }))
        .await
        .unwrap_or_else(|| {
            panic!(
                "the resumed holder must report its loss: {:?}",
                holder.process.events()
            )
        });
    let after: Vec<HolderEvent> = holder.process.events()[events_at_pause..].to_vec();
    assert!(
        !after.iter().any(|e| matches!(e, HolderEvent::Write { .. })),
        "the resumed holder wrote before (or instead of) reporting its loss: {after:?}"
    );
    eprintln!("{}: the resumed holder reported {lost:?}", history.name());
    // The new holder is untouched: it writes again and releases its own lock.
    assert!(!held.guard.is_lost());
    assert!(write(&c2.rec, &held.hold, &log, "c2#2"));
    assert_eq!(c2.release(held).await, Some(true));
    let status = holder.finish().await;
    assert_eq!(status.code(), Some(3), "the holder exits 3 after a loss");

    // Liveness after the heal: a third client acquires.
    let c3 = Client::new(&history, "c3", &url).await;
    let held = c3
        .acquire(&key, WAIT)
        .await
        .expect("c3 acquires after the heal");
    assert!(write(&c3.rec, &held.hold, &log, "c3#1"));
    assert_eq!(c3.release(held).await, Some(true));
    finish(&history, &log, &[]);
}

/// 3. Client↔server blackholed for 2 × TTL.
async fn blackholed_holder(backend: Backend, url: String) {
    let history = History::new(format!("{}_blackholed_holder", backend.name()));
    let key = conformance::fresh_key("drill-blackhole");
    let log = FencedLog::new();
    let (proxy, proxied) = Proxy::start_for_url(&url).await.expect("proxy");
    let c1 = Client::new(&history, "c1", &proxied).await;
    let c2 = Client::new(&history, "c2", &url).await;

    let held1 = c1.acquire(&key, WAIT).await.expect("c1 acquires");
    assert!(write(&c1.rec, &held1.hold, &log, "c1#1"));

    proxy.blackhole();
    let started = Instant::now();
    let fault = history.fault("blackholed", Some("c1"));
    // Whether c1 still trusted its lease is judged at the moment c2's acquire returns (not after
    // waiting for the loss, which would make the order true by construction), the way the guard
    // judges it: `is_lost()` is true once `lost()` fired or the local deadline passed. The
    // deadline only moves forward, so its final value bounds every earlier one. (Comparing when
    // the recorder task happened to run with c2's grant left a margin of the drift margin,
    // ~15 ms: a flake on a loaded machine. The checker still compares the lost record and the
    // renewed deadline with the grant.)
    let c1_lost = held1.guard.lost_token();
    let contender = tokio::spawn({
        let acquire = c2.start_acquire(&key, WAIT);
        async move {
            let held = acquire.await;
            (held, Instant::now(), c1_lost.is_cancelled())
        }
    });
    let lost_at = held1
        .wait_lost(SOON)
        .await
        .expect("the partitioned holder must give up by its local deadline");
    let (held2, granted_at, lost_before_grant) = contender.await.unwrap();
    let held2 = held2.expect("c2 is granted");
    let deadline = held1.guard.local_deadline();
    assert!(
        lost_before_grant || deadline <= granted_at,
        "c2 was granted at {:?} while c1 still trusted its lease (until {:?}; lost() at {:?})",
        granted_at - started,
        deadline - started,
        lost_at - started
    );
    assert!(fencing(&held2.hold) > fencing(&held1.hold));
    assert!(write(&c2.rec, &held2.hold, &log, "c2#1"));

    let until = started + 2 * TTL;
    tokio::time::sleep_until(until).await;
    proxy.pass();
    fault.heal();
    eprintln!(
        "{}: c1 gave up after {:?}, c2 granted after {:?} (blackhole {:?})",
        history.name(),
        lost_at - started,
        granted_at - started,
        2 * TTL
    );

    // The stale holder's late write is rejected by the fenced log; its release is a no-op.
    assert!(!write(&c1.rec, &held1.hold, &log, "c1#late"));
    let released = c1.release(held1).await;
    assert_ne!(
        released,
        Some(true),
        "a lost lease's release must not succeed"
    );
    assert_eq!(c2.release(held2).await, Some(true));
    // Liveness: c1 acquires again through the healed link.
    let again = c1
        .acquire(&key, WAIT)
        .await
        .expect("c1 acquires after the heal");
    assert!(write(&c1.rec, &again.hold, &log, "c1#2"));
    assert_eq!(c1.release(again).await, Some(true));
    finish(&history, &log, &[]);
}

/// 4a. The reply of an acquire is dropped.
async fn lost_acquire_reply(backend: Backend, url: String) {
    let history = History::new(format!("{}_lost_acquire_reply", backend.name()));
    let key = conformance::fresh_key("drill-lost-grant");
    let log = FencedLog::new();
    let (proxy, proxied) = Proxy::start_for_url(&url).await.expect("proxy");
    let c1 = Client::new(&history, "c1", &proxied).await;
    let c2 = Client::new(&history, "c2", &url).await;

    proxy.drop_replies();
    let fault = history.fault("replies dropped", Some("c1"));
    // A TTL far longer than the contender's wait: an orphan left by the lost reply cannot
    // expire in time, so only the driver's undo lets the contender in.
    let op = c1.rec.acquire(&key, ORPHAN_TTL);
    let outcome = timeout(SOON, c1.lock.try_acquire(&key, ORPHAN_TTL)).await;
    match &outcome {
        // Whatever the driver calls it, the request was sent and its reply lost: unknown.
        Ok(Err(e)) => op.unknown(e),
        Ok(Ok(Some(lease))) => panic!("granted without a reply? {lease:?}"),
        Ok(Ok(None)) => panic!("busy without a reply?"),
        Err(_) => op.unknown("try_acquire did not return"),
    }
    let typed = matches!(
        outcome,
        Ok(Err(Error::Indeterminate { .. } | Error::Unavailable { .. }))
    );
    let note = format!(
        "the acquire without a reply returned {}{}",
        match &outcome {
            Ok(Err(e)) => e.to_string(),
            _ => "nothing".to_owned(),
        },
        if typed {
            ""
        } else {
            " — neither Indeterminate nor Unavailable: a deviation from the trait's contract"
        }
    );
    eprintln!("{}: {note}", history.name());
    history.note(note.clone());
    // Indeterminate, or Unavailable when the driver verified that nothing was applied.
    assert!(typed, "{note}");
    proxy.pass();
    fault.heal();

    // No orphan: c2 is granted well before the attempt's TTL could free the key (within the
    // drill TTL + margin after the heal, checked by the checker) while c1 lives.
    let started = Instant::now();
    let held2 = c2
        .acquire(&key, ORPHAN_TTL / 2)
        .await
        .expect("c2 is granted: no orphan lock");
    eprintln!(
        "{}: c2 granted {:?} after the heal",
        history.name(),
        started.elapsed()
    );
    assert!(write(&c2.rec, &held2.hold, &log, "c2#1"));
    assert_eq!(c2.release(held2).await, Some(true));
    // c1 works again through the healed proxy.
    let held1 = c1
        .acquire(&key, WAIT)
        .await
        .expect("c1 acquires after the heal");
    assert!(write(&c1.rec, &held1.hold, &log, "c1#1"));
    assert_eq!(c1.release(held1).await, Some(true));
    drop(proxy);
    finish(&history, &log, &[]);
}

/// 4b. The reply of a release is dropped; the release is retried after a new grant.
async fn lost_release_reply(backend: Backend, url: String) {
    let history = History::new(format!("{}_lost_release_reply", backend.name()));
    let key = conformance::fresh_key("drill-lost-release");
    let log = FencedLog::new();
    let (proxy, proxied) = Proxy::start_for_url(&url).await.expect("proxy");
    let c1 = Client::new(&history, "c1", &proxied).await;
    let c2 = Client::new(&history, "c2", &url).await;
    let c3 = Client::new(&history, "c3", &url).await;

    let op = c1.rec.acquire(&key, TTL);
    let lease = c1
        .lock
        .try_acquire(&key, TTL)
        .await
        .expect("try_acquire")
        .expect("free");
    op.granted(&lease);
    let hold1 = Hold::from(&lease);
    assert!(write(&c1.rec, &hold1, &log, "c1#1"));

    proxy.drop_replies();
    let fault = history.fault("replies dropped", Some("c1"));
    let op = c1.rec.release(&lease);
    match timeout(SOON, c1.lock.release(&lease)).await {
        Ok(Ok(released)) => panic!("a release without a reply returned {released}"),
        Ok(Err(e)) => {
            eprintln!(
                "{}: the release without a reply returned {e}",
                history.name()
            );
            op.error(&e);
        }
        Err(_) => op.unknown("release did not return"),
    }
    proxy.pass();
    fault.heal();

    // The new incarnation.
    let held2 = c2.acquire(&key, WAIT).await.expect("c2 is granted");
    assert!(fencing(&held2.hold) > fencing(&hold1));
    assert!(write(&c2.rec, &held2.hold, &log, "c2#1"));

    // The stale retry, on a connection that works: the one that lost the reply is reset by
    // the heal, and a request racing that reset would lose its reply too (an honest
    // `Indeterminate`, but not this drill's question).
    inspect_answered(&c1.lock, &key).await;
    let op = c1.rec.release(&lease);
    match timeout(SOON, c1.lock.release(&lease)).await {
        Ok(Ok(released)) => {
            op.released(released);
            assert!(!released, "a stale release must return false");
        }
        Ok(Err(e)) => {
            op.error(&e);
            panic!("the retried release failed: {e}");
        }
        Err(_) => panic!("the retried release did not return"),
    }
    // The new incarnation survived: nobody else can take it, and it is still trusted.
    let op = c3.rec.acquire(&key, TTL);
    match c3.lock.try_acquire(&key, TTL).await {
        Ok(None) => op.busy(),
        other => panic!("c3 must find the lock held by c2: {other:?}"),
    }
    // A renewal after the stale release proves the coordinator still has c2's lease.
    let renewed = held2.guard.renewals();
    let until = Instant::now() + SOON;
    while held2.guard.renewals() <= renewed && !held2.guard.is_lost() && Instant::now() < until {
        sleep(Duration::from_millis(10)).await;
    }
    assert!(
        !held2.guard.is_lost() && held2.guard.renewals() > renewed,
        "the stale release ended the new holder's lease (lost: {}, renewals {} -> {})",
        held2.guard.is_lost(),
        renewed,
        held2.guard.renewals()
    );
    assert!(write(&c2.rec, &held2.hold, &log, "c2#2"));
    assert_eq!(c2.release(held2).await, Some(true));
    let held3 = c3.acquire(&key, WAIT).await.expect("c3 acquires");
    assert!(write(&c3.rec, &held3.hold, &log, "c3#1"));
    assert_eq!(c3.release(held3).await, Some(true));
    drop(proxy);
    finish(&history, &log, &[]);
}

/// One `#[test]` per backend for a drill, each on its own runtime.
macro_rules! drill {
    ($drill:ident) => {
        mod $drill {
            use super::*;

            fn run(backend: Backend) {
                let Some(url) = backend.shared_url() else {
                    drill_support::skip(stringify!($drill), backend, "no server URL set");
                    return;
                };
                drill_support::block_on(super::$drill(backend, url));
            }

            #[test]
            fn redis() {
                run(Backend::Redis);
            }

            #[test]
            fn etcd() {
                run(Backend::Etcd);
            }

            #[test]
            fn zk() {
                run(Backend::Zk);
            }

            #[test]
            fn pg() {
                run(Backend::Pg);
            }
        }
    };
}

drill!(killed_holder);
drill!(paused_holder);
drill!(blackholed_holder);
drill!(lost_acquire_reply);
drill!(lost_release_reply);
