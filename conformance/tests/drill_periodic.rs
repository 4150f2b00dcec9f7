//! Drill: the article's opening scenario — three instances of a service scan for timed-out
//! orders every period, their timers skewed by up to 1.4 s — on every backend.
//!
//! Each instance fires at `k × PERIOD + skew` and calls `run_exclusive` on one key with a
//! 100 ms job that writes `period k` to a fenced table (the protected resource, which refuses a
//! stale fencing token). Counted per period:
//! - **with job mode** (`at_least` = 2.2 s, between the largest skew and the period): every
//!   period runs exactly once — also the period in which the instance that got the lock dies
//!   mid-job (its link blackholed: nothing it sends arrives, its release included), after which
//!   it never fires again. A backend without `keep_until` must refuse `at_least` before any
//!   I/O; the drill says so and checks the refusal (all five claim it).
//! - **without it** (plain skip-if-held): the duplicates the article starts from — the 100 ms
//!   job is long released when the next instance's timer fires, so periods run more than once.
//! - **a crash** (with job mode): a holder *process* granted with `at_least` is SIGKILLed right
//!   after its grant; nobody else is granted the key until `at_least` after the holder was
//!   started (its grant came later still), and somebody is soon after (not on memory://, whose
//!   coordinator lives in the holder's process).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed expectation is a failed test

mod drill_support;

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use conformance::drill::{
    History,
    holder::{HolderOptions, HolderProcess},
};
use drill_support::{FencedLog, HOLDER_BIN, Link, SOON, client, linked_client};
use lock_core::{DistributedLockExt, DynLock, Error, LockOptions};
use tokio::time::{Instant, sleep, sleep_until};

const PERIOD: Duration = Duration::from_secs(3);
const SKEWS: [Duration; 3] = [
    Duration::ZERO,
    Duration::from_millis(700),
    Duration::from_millis(1400),
];
/// Longer than the largest skew, shorter than the period, with 0.8 s to spare on either side.
const AT_LEAST: Duration = Duration::from_millis(2200);
const JOB: Duration = Duration::from_millis(100);
const TTL: Duration = Duration::from_secs(1);
const PERIODS: u32 = 4;
/// The period in which the first instance dies mid-job.
const DIES_IN: u32 = 2;

/// Who ran which period.
type Runs = Arc<Mutex<BTreeMap<u32, Vec<usize>>>>;

struct Instance {
    id: usize,
    lock: DynLock,
    /// Its link, for the instance that dies (a blackhole cuts it off).
    link: Option<Link>,
    dies_in: Option<u32>,
}

async fn fire(
    me: Instance,
    key: String,
    opts: LockOptions,
    t0: Instant,
    periods: u32,
    runs: Runs,
    table: Arc<FencedLog>,
) {
    for k in 0..periods {
        sleep_until(t0 + PERIOD * k + SKEWS[me.id]).await;
        let dies = me.dies_in == Some(k);
        let (runs, table, link) = (runs.clone(), table.clone(), me.link.as_ref());
        let result = me
            .lock
            .run_exclusive(key.as_str(), opts, |ctx| async move {
                runs.lock().unwrap().entry(k).or_default().push(me.id);
                if let Some(fence) = ctx.fencing_token() {
                    let owner = format!("instance-{}", me.id);
                    assert!(
                        table
                            .write(fence.get(), &owner, format!("period {k}"))
                            .is_ok(),
                        "the fenced table refused instance {}'s write in period {k}",
                        me.id
                    );
                }
                if dies && let Some(link) = link {
                    // Dead from here on: nothing it sends reaches the coordinator.
                    link.set(conformance::drill::Fault::Blackhole);
                }
                sleep(JOB).await;
            })
            .await;
        match result {
            Ok(_) => {}
            // The dead instance's loss (nothing renews through the blackhole) is expected.
            Err(Error::NotHeld { .. }) if dies => {}
            Err(e) => panic!("instance {} in period {k}: {e}", me.id),
        }
        if dies {
            return;
        }
    }
}

async fn instances(history: &History, url: &str, dying: bool) -> Vec<Instance> {
    let mut out = Vec::new();
    for id in 0..SKEWS.len() {
        if dying && id == 0 {
            let (c, link) = linked_client(history, "instance-0", url).await;
            out.push(Instance {
                id,
                lock: c.lock,
                link: Some(link),
                dies_in: Some(DIES_IN),
            });
        } else {
            out.push(Instance {
                id,
                lock: client(url).await,
                link: None,
                dies_in: None,
            });
        }
    }
    out
}

/// Runs the three instances for `periods` periods with `opts`; who ran each period.
async fn scenario(
    history: &History,
    url: &str,
    opts: LockOptions,
    periods: u32,
    dying: bool,
) -> BTreeMap<u32, Vec<usize>> {
    let key = conformance::fresh_key("drill-periodic").as_str().to_owned();
    let runs: Runs = Arc::default();
    let table = FencedLog::new();
    // A moment to connect everyone before the first timer.
    let t0 = Instant::now() + Duration::from_millis(300);
    let tasks: Vec<_> = instances(history, url, dying)
        .await
        .into_iter()
        .map(|me| {
            tokio::spawn(fire(
                me,
                key.clone(),
                opts,
                t0,
                periods,
                runs.clone(),
                table.clone(),
            ))
        })
        .collect();
    for task in tasks {
        task.await.expect("an instance panicked");
    }
    runs.lock().unwrap().clone()
}

/// A holder process granted with `at_least` is SIGKILLed at once: the coordinator keeps its
/// lease until `at_least` after the grant. Returns when the contender was granted, counted from
/// the holder's start.
async fn killed_holder_keeps_at_least(backend: &str, url: &str) -> Duration {
    let key = conformance::fresh_key("drill-periodic-kill");
    let mut options = HolderOptions::new(url, key.clone(), TTL);
    options.at_least = Some(AT_LEAST);
    let started = Instant::now();
    let holder = HolderProcess::spawn_with(std::path::Path::new(HOLDER_BIN), &options)
        .await
        .expect("spawn the holder");
    assert!(
        holder.wait_acquired(SOON).await.is_some(),
        "{backend}: the holder was never granted: {:?}",
        holder.events()
    );
    holder.kill().expect("SIGKILL the holder");
    let contender = client(url).await;
    let deadline = Instant::now() + AT_LEAST + TTL + SOON;
    let granted = loop {
        match contender.lock(key.as_str()).ttl(TTL).try_acquire().await {
            Ok(Some(guard)) => {
                let at = started.elapsed();
                let _ = guard.release().await;
                break at;
            }
            Ok(None) => {}
            Err(e) => panic!("{backend}: the contender's try_acquire failed: {e}"),
        }
        assert!(
            Instant::now() < deadline,
            "{backend}: the killed holder's lease never ended"
        );
        sleep(Duration::from_millis(50)).await;
    };
    assert!(
        granted >= AT_LEAST,
        "{backend}: the contender was granted {granted:?} after the killed holder started, before its at_least {AT_LEAST:?} ran out"
    );
    granted
}

async fn periodic(backend: &str, url: String) {
    let history = History::new(format!("{backend}_periodic"));
    let probe = client(&url).await;
    let caps = probe.capabilities();
    let job_mode = LockOptions::with_ttl(TTL).at_least(AT_LEAST);
    let plain = LockOptions::with_ttl(TTL);
    let with = async {
        if !(caps.keep_until && caps.renew) {
            let refused = probe
                .run_exclusive("drill-periodic-refused", job_mode, |_| async {})
                .await;
            assert!(
                matches!(refused, Err(Error::Unsupported { .. })),
                "{backend}: at_least without keep_until must be refused before any I/O: {refused:?}"
            );
            println!("SKIP periodic with at_least on {backend}: keep_until not claimed (refused)");
            return None;
        }
        // A memory:// coordinator lives in its process: a holder process would have its own.
        let crash = async {
            if backend == "memory" {
                println!("SKIP the SIGKILLed holder on memory: its coordinator dies with it");
            } else {
                let killed = killed_holder_keeps_at_least(backend, &url).await;
                println!(
                    "{backend}: a holder SIGKILLed right after its grant with at_least {AT_LEAST:?}: the next grant came {killed:?} after it started"
                );
            }
        };
        let (with, ()) = tokio::join!(scenario(&history, &url, job_mode, PERIODS, true), crash);
        Some(with)
    };
    let without = scenario(&history, &url, plain, 2, false);
    let (with, without) = tokio::join!(with, without);
    let duplicated = without.values().filter(|who| who.len() > 1).count();
    println!(
        "{backend}: without at_least, runs per period {without:?} ({duplicated} of 2 periods ran more than once)"
    );
    assert!(
        duplicated > 0,
        "{backend}: skip-if-held alone never ran a period twice — the drill shows nothing: {without:?}"
    );
    if let Some(with) = with {
        println!(
            "{backend}: with at_least {AT_LEAST:?}, runs per period {with:?} (instance 0 died in period {DIES_IN})"
        );
        for k in 0..PERIODS {
            let who = with.get(&k).cloned().unwrap_or_default();
            assert_eq!(
                who.len(),
                1,
                "{backend}: period {k} ran {} times with at_least ({who:?}); all: {with:?}",
                who.len()
            );
        }
        assert!(
            with.range(DIES_IN + 1..).all(|(_, who)| !who.contains(&0)),
            "the dead instance ran again: {with:?}"
        );
    }
}

macro_rules! drill {
    ($($backend:ident),*) => {
        $(
            #[test]
            fn $backend() {
                let name = stringify!($backend);
                let Some(url) = drill_support::drill_target(name) else {
                    println!("SKIP periodic on {name}: no server URL set");
                    return;
                };
                drill_support::block_on(periodic(name, url));
            }
        )*
    };
}

drill!(memory, redis, etcd, zk, pg);
