//! A randomized soak on every backend (`memory://` and the shared single-node servers, through
//! `distlock::connect`), all backends at once in parallel threads.
//!
//! Per backend, [`CLIENTS`] clients, each connected through its own fault link (the drill
//! `Proxy`; for `memory://` an in-process wrapper applying the same faults), loop on one key:
//! acquire (TTL 1 s, watchdog on) → random work (0–0.4 s; one job in five 1–2.5 s) → fenced write (and 30 % of the time
//! more work, 0–0.8 s, and a second write) (only while the
//! guard still trusts its lease) → release. A client that lost its lease mid-hold then tries
//! the zombie write a paused process would make: once a newer holder has written, it writes
//! with its stale token — the fenced log must reject it. Meanwhile a fault injector picks a
//! random client (half the time the current holder) every 200–600 ms and applies a random fault to its link: blackhole
//! (0.1–2.5 s), dropped replies (0.1–1 s), delay (20–300 ms per chunk for 0.2–1.5 s) or a
//! connection reset. At the end every fault is healed, the loops stop, one scripted zombie
//! (c1 blackholed until its guard gives up, c2 takes over and writes, c1 writes with its stale
//! token) makes sure the zombie path runs at least once, and every client must acquire again
//! (liveness); the checker must find the whole history clean.
//!
//! The schedule comes from a seeded RNG: the seed is printed, and `DISTLOCK_SOAK_SEED=<n>`
//! replays the same fault schedule and client choices (the interleaving still depends on real
//! timing). `DISTLOCK_SOAK_SECS` sets the fault phase's length per backend (default 5 s):
//!
//! ```text
//! DISTLOCK_SOAK_SECS=120 cargo test -p distlock-conformance --all-features --test drill_soak -- --nocapture
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed expectation is a failed test

mod drill_support;

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use conformance::drill::{Fault, FaultHandle, History, Hold};
use drill_support::{Client, FencedLog, Link, SOON, finish, linked_client, write, write_if_held};
use lock_core::{FencingToken, LockKey};
use rand::{Rng, SeedableRng, rngs::StdRng};
use tokio::time::{Instant, sleep, timeout};

/// Clients per backend.
const CLIENTS: usize = 4;
/// A loop iteration's acquire wait.
const LOOP_WAIT: Duration = Duration::from_secs(2);
/// The longest a driver here takes to find a dead connection and open a new one: the drills'
/// operation timeouts are 500 ms and their connect/dial timeouts 1 s (`Backend::options`).
const RECONNECT: Duration = Duration::from_millis(1500);
/// Scheduling slack for five soaks running at once on a loaded 2-core machine.
const LOADED: Duration = Duration::from_secs(5);

/// How long after the heal a client may wait to be granted, from the backend's own numbers: a
/// grant the fault phase left behind (an unknown outcome whose undo had not got through) lives
/// one lease — the TTL the coordinator really applies (etcd rounds 1 s up to its lease floor;
/// ZooKeeper's lease is the session, its minimum TTL) — then the waiter's link may need one
/// reconnect, twice (before and after that expiry), plus the slack of a loaded machine.
fn liveness_window(c: &Client) -> Duration {
    let caps = c.lock.capabilities();
    let lease = caps.effective_ttl(drill_support::TTL).max(caps.min_ttl);
    lease + RECONNECT * 2 + LOADED
}

/// The soak's length per backend (the fault phase).
fn soak_secs() -> u64 {
    std::env::var("DISTLOCK_SOAK_SECS")
        .ok()
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse()
                .expect("DISTLOCK_SOAK_SECS is a number of seconds")
        })
        .unwrap_or(5)
}

fn soak_seed() -> u64 {
    std::env::var("DISTLOCK_SOAK_SEED")
        .ok()
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().expect("DISTLOCK_SOAK_SEED is a u64"))
        .unwrap_or_else(rand::random)
}

#[derive(Debug, Default)]
struct Stats {
    grants: AtomicU64,
    writes: AtomicU64,
    losses: AtomicU64,
    zombie_writes: AtomicU64,
    zombie_rejected: AtomicU64,
    faults: AtomicU64,
    /// The index + 1 of the client holding the lock now (0: none), for the injector.
    holder: AtomicUsize,
}

/// The zombie write of a client that lost `hold`: once a newer holder has written (bounded),
/// write with the stale token. Recorded.
async fn zombie_write(c: &Client, hold: &Hold, log: &FencedLog, stop: &AtomicBool, stats: &Stats) {
    let mine = hold.fencing.map_or(0, FencingToken::get);
    let deadline = Instant::now() + Duration::from_secs(3);
    while log.highest().is_none_or(|h| h <= mine) {
        if stop.load(Ordering::SeqCst) || Instant::now() >= deadline {
            return;
        }
        sleep(Duration::from_millis(20)).await;
    }
    stats.zombie_writes.fetch_add(1, Ordering::SeqCst);
    let value = format!("{}#zombie-{mine}", c.rec.id());
    if !write(&c.rec, hold, log, &value) {
        stats.zombie_rejected.fetch_add(1, Ordering::SeqCst);
    }
}

async fn client_loop(
    c: Client,
    index: usize,
    key: LockKey,
    log: Arc<FencedLog>,
    stop: Arc<AtomicBool>,
    stats: Arc<Stats>,
    seed: u64,
) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut n = 0u64;
    while !stop.load(Ordering::SeqCst) {
        let Some(held) = c.acquire(&key, LOOP_WAIT).await else {
            sleep(Duration::from_millis(rng.random_range(10..50))).await;
            continue;
        };
        stats.grants.fetch_add(1, Ordering::SeqCst);
        stats.holder.store(index + 1, Ordering::SeqCst);
        // Mostly short work; one job in five is slow (1–2.5 s: the watchdog must keep it).
        let work = if rng.random_bool(0.2) {
            Duration::from_millis(rng.random_range(1000..2500))
        } else {
            Duration::from_millis(rng.random_range(0..400))
        };
        sleep(work).await;
        n += 1;
        if write_if_held(&c.rec, &held, &log, &format!("{}#{n}", c.rec.id())) == Some(true) {
            stats.writes.fetch_add(1, Ordering::SeqCst);
        }
        if rng.random_bool(0.3) {
            sleep(Duration::from_millis(rng.random_range(0..800))).await;
            n += 1;
            if write_if_held(&c.rec, &held, &log, &format!("{}#{n}", c.rec.id())) == Some(true) {
                stats.writes.fetch_add(1, Ordering::SeqCst);
            }
        }
        let lost = held.guard.is_lost();
        let hold = held.hold.clone();
        let _ = stats
            .holder
            .compare_exchange(index + 1, 0, Ordering::SeqCst, Ordering::SeqCst);
        c.release(held).await;
        if lost {
            stats.losses.fetch_add(1, Ordering::SeqCst);
            zombie_write(&c, &hold, &log, &stop, &stats).await;
        }
        sleep(Duration::from_millis(rng.random_range(0..30))).await;
    }
}

struct Slot {
    id: String,
    link: Link,
    active: Option<(FaultHandle, Instant)>,
}

async fn soak(backend: &'static str, url: String, seed: u64, secs: u64) -> String {
    let history = History::new(format!("{backend}_soak"));
    history.note(format!(
        "seed {seed}, {secs} s of faults, {CLIENTS} clients"
    ));
    let key = conformance::fresh_key("drill-soak");
    let log = FencedLog::new();
    let stop = Arc::new(AtomicBool::new(false));
    let stats = Arc::new(Stats::default());
    let mut rng = StdRng::seed_from_u64(seed);

    let mut clients = Vec::new();
    let mut slots = Vec::new();
    for i in 1..=CLIENTS {
        let id = format!("c{i}");
        let (c, link) = linked_client(&history, &id, &url).await;
        clients.push(c);
        slots.push(Slot {
            id,
            link,
            active: None,
        });
    }
    let loops: Vec<_> = clients
        .iter()
        .enumerate()
        .map(|(i, c)| {
            tokio::spawn(client_loop(
                c.clone(),
                i,
                key.clone(),
                log.clone(),
                stop.clone(),
                stats.clone(),
                rng.random(),
            ))
        })
        .collect();

    // The fault injector.
    let end = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < end {
        sleep(Duration::from_millis(rng.random_range(200..600))).await;
        let now = Instant::now();
        for slot in &mut slots {
            if slot.active.as_ref().is_some_and(|(_, until)| *until <= now) {
                slot.link.pass();
                slot.active.take().unwrap().0.heal();
            }
        }
        // Half the time the current holder (the interesting victim), else anyone.
        let holder = stats.holder.load(Ordering::SeqCst);
        let victim = if holder > 0 && rng.random_bool(0.5) {
            holder - 1
        } else {
            rng.random_range(0..CLIENTS)
        };
        let slot = &mut slots[victim];
        if slot.active.is_some() {
            continue;
        }
        stats.faults.fetch_add(1, Ordering::SeqCst);
        let ms =
            |rng: &mut StdRng, lo: u64, hi: u64| Duration::from_millis(rng.random_range(lo..hi));
        let (fault, name, lasts) = match rng.random_range(0..4) {
            0 => (
                Fault::Blackhole,
                "blackholed".to_owned(),
                ms(&mut rng, 100, 2500),
            ),
            1 => (
                Fault::DropReplies,
                "replies dropped".to_owned(),
                ms(&mut rng, 100, 1000),
            ),
            2 => {
                let d = ms(&mut rng, 20, 300);
                (
                    Fault::Delay(d),
                    format!("delayed {d:?}"),
                    ms(&mut rng, 200, 1500),
                )
            }
            _ => {
                slot.link.reset();
                history.fault_instant("connections reset", Some(&slot.id));
                continue;
            }
        };
        slot.link.set(fault);
        let handle = history.fault(&name, Some(&slot.id));
        slot.active = Some((handle, Instant::now() + lasts));
    }
    // Heal everything, stop the loops.
    stop.store(true, Ordering::SeqCst);
    for slot in &mut slots {
        if let Some((handle, _)) = slot.active.take() {
            slot.link.pass();
            handle.heal();
        }
    }
    let healed = Instant::now();
    for l in loops {
        timeout(SOON, l)
            .await
            .expect("a client loop did not stop")
            .expect("a client loop panicked");
    }
    // A zombie for certain (the random schedule may make none): c1 holds, its link is
    // blackholed until its guard gives up, c2 takes over and writes, then c1 writes with its
    // stale token, as a paused process would; the fenced log must reject it.
    {
        let (zombie, taker) = (&clients[0], &clients[1]);
        let held = zombie
            .acquire(&key, Duration::from_secs(10))
            .await
            .unwrap_or_else(|| panic!("{backend}: c1 could not acquire for the zombie"));
        slots[0].link.set(Fault::Blackhole);
        let fault = history.fault("blackholed", Some(&slots[0].id));
        held.wait_lost(SOON)
            .await
            .unwrap_or_else(|| panic!("{backend}: c1's guard never gave up behind the blackhole"));
        let newer = taker
            .acquire(&key, Duration::from_secs(10))
            .await
            .unwrap_or_else(|| panic!("{backend}: c2 could not take over from the zombie"));
        assert!(write(&taker.rec, &newer.hold, &log, "c2#takeover"));
        stats.losses.fetch_add(1, Ordering::SeqCst);
        stats.zombie_writes.fetch_add(1, Ordering::SeqCst);
        if !write(&zombie.rec, &held.hold, &log, "c1#zombie-scripted") {
            stats.zombie_rejected.fetch_add(1, Ordering::SeqCst);
        }
        assert_eq!(taker.release(newer).await, Some(true));
        slots[0].link.pass();
        fault.heal();
        assert_ne!(
            zombie.release(held).await,
            Some(true),
            "{backend}: a lost lease released"
        );
    }
    // Liveness: every client acquires again, each within the window the backend's numbers give
    // (counted from its own attempt: the ones before it held the lock in turn).
    for c in &clients {
        let window = liveness_window(c);
        let held = c.acquire(&key, window).await.unwrap_or_else(|| {
            panic!(
                "{backend}: {} could not acquire within {window:?} (one lease, two reconnects \
                 and the slack) after the heal",
                c.rec.id()
            )
        });
        assert!(
            write(&c.rec, &held.hold, &log, &format!("{}#final", c.rec.id())),
            "{backend}: {}'s final write was rejected",
            c.rec.id()
        );
        assert_eq!(c.release(held).await, Some(true));
    }
    let liveness = healed.elapsed();
    drop(slots);
    finish(&history, &log, &[]);
    let s = &stats;
    let summary = format!(
        "{backend}: seed {seed}: {} faults, {} grants, {} accepted writes, {} losses, {} zombie writes ({} rejected), all {CLIENTS} clients re-acquired {liveness:?} after the heal (each within {:?})",
        s.faults.load(Ordering::SeqCst),
        s.grants.load(Ordering::SeqCst),
        s.writes.load(Ordering::SeqCst),
        s.losses.load(Ordering::SeqCst),
        s.zombie_writes.load(Ordering::SeqCst),
        s.zombie_rejected.load(Ordering::SeqCst),
        liveness_window(&clients[0]),
    );
    assert!(
        s.zombie_writes.load(Ordering::SeqCst) >= 1,
        "{summary}: no zombie write was tried"
    );
    assert_eq!(
        s.zombie_writes.load(Ordering::SeqCst),
        s.zombie_rejected.load(Ordering::SeqCst),
        "{summary}: a stale write got in"
    );
    assert!(
        s.grants.load(Ordering::SeqCst) > 0,
        "{summary}: no progress"
    );
    summary
}

/// Every backend at once, each on its own thread and runtime.
#[test]
fn soak_all_backends() {
    let seed = soak_seed();
    let secs = soak_secs();
    eprintln!("soak: seed {seed} (replay with DISTLOCK_SOAK_SEED={seed}), {secs} s per backend");
    let started = std::time::Instant::now();
    let threads: Vec<_> = drill_support::drill_targets()
        .into_iter()
        .enumerate()
        .map(|(i, (backend, url))| {
            let seed = seed.wrapping_add(i as u64);
            std::thread::spawn(move || {
                let Some(url) = url else {
                    return format!("SKIP soak on {backend}: no server URL set");
                };
                drill_support::block_on(soak(backend, url, seed, secs))
            })
        })
        .collect();
    let mut failed = Vec::new();
    for t in threads {
        match t.join() {
            Ok(summary) => eprintln!("{summary}"),
            Err(panic) => failed.push(
                panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                    .unwrap_or_default(),
            ),
        }
    }
    eprintln!("soak: {:?} in all (seed {seed})", started.elapsed());
    assert!(failed.is_empty(), "soak failed (seed {seed}): {failed:#?}");
}
