//! Drill: the article's opening scenario — three instances of a service scan for timed-out
//! orders every period, their timers skewed by up to 1.4 s — on every backend.
//!
//! Each instance fires at `k × PERIOD + skew` and calls `run_exclusive` on one key with a
//! 100 ms job that writes `period k` to a fenced table (the protected resource, which refuses a
//! stale fencing token). Counted per period:
//! - **with job mode** (`at_least` = 2.2 s, between the largest skew and the period): every
//!   period runs exactly once — also the period in which the instance that got the lock dies
//!   mid-job (its link blackholed: nothing it sends arrives, its release included), after which
//!   it never fires again. Read from the fenced table (the protected resource): nobody's write
//!   follows the dead instance's before `at_least` has passed since it asked for the lock (its
//!   lease is kept that long though nothing it sends arrives). Every backend here claims
//!   `keep_until` (what `at_least` needs); the drill fails on one that does not.
//! - **without it** (plain skip-if-held): the duplicates the article starts from — the 100 ms
//!   job is long released when the next instance's timer fires, so periods run more than once.
//! - **a crash** (with job mode): a holder *process* granted with `at_least` is SIGKILLed right
//!   after its grant; nobody else is granted the key until `at_least` after the holder asked
//!   for its grant (its own clock, read just before its acquire: no later than the grant), and
//!   somebody is soon after (not on memory://, whose coordinator lives in the holder's process).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed expectation is a failed test

mod drill_support;

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use conformance::drill::{
    History,
    holder::{HolderEvent, HolderOptions, HolderProcess, monotonic_to_instant},
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

/// One accepted write of the fenced table: who ran which period, when it asked for the lock
/// and when it wrote (microseconds since the drill's start).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Entry {
    period: u32,
    instance: usize,
    fence: u64,
    asked_us: u64,
    wrote_us: u64,
}

fn micros_since(t0: Instant, at: Instant) -> u64 {
    u64::try_from(at.saturating_duration_since(t0).as_micros()).unwrap_or(u64::MAX)
}

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
        // No later than the coordinator's grant, if this attempt gets one.
        let asked = Instant::now();
        let result = me
            .lock
            .run_exclusive(key.as_str(), opts, |ctx| async move {
                runs.lock().unwrap().entry(k).or_default().push(me.id);
                let fence = ctx
                    .fencing_token()
                    .expect("every backend of this drill mints fencing tokens")
                    .get();
                let entry = Entry {
                    period: k,
                    instance: me.id,
                    fence,
                    asked_us: micros_since(t0, asked),
                    wrote_us: micros_since(t0, Instant::now()),
                };
                let owner = format!("instance-{}", me.id);
                assert!(
                    table
                        .write(fence, &owner, serde_json::to_string(&entry).unwrap())
                        .is_ok(),
                    "the fenced table refused instance {}'s write in period {k}",
                    me.id
                );
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

/// Runs the three instances for `periods` periods with `opts`; who ran each period, and the
/// fenced table's accepted writes as stored, in order.
async fn scenario(
    history: &History,
    url: &str,
    opts: LockOptions,
    periods: u32,
    dying: bool,
) -> (BTreeMap<u32, Vec<usize>>, Vec<Entry>) {
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
    let entries = table
        .read_back()
        .iter()
        .map(|line| serde_json::from_str(line).expect("an entry of the fenced table"))
        .collect();
    (runs.lock().unwrap().clone(), entries)
}

/// A holder process granted with `at_least` is SIGKILLed at once: the coordinator keeps its
/// lease until `at_least` after the grant. Counted from when the holder asked for the grant (its
/// own clock, no later than the coordinator's grant) to when the contender's grant returned (no
/// earlier than the coordinator's second grant), so a lease kept for less than `at_least` shows
/// as less. Returns that, and the same counted from when the holder's grant returned.
async fn killed_holder_keeps_at_least(backend: &str, url: &str) -> (Duration, Duration) {
    let key = conformance::fresh_key("drill-periodic-kill");
    let mut options = HolderOptions::new(url, key.clone(), TTL);
    options.at_least = Some(AT_LEAST);
    let holder = HolderProcess::spawn_with(std::path::Path::new(HOLDER_BIN), &options)
        .await
        .expect("spawn the holder");
    assert!(
        holder.wait_acquired(SOON).await.is_some(),
        "{backend}: the holder was never granted: {:?}",
        holder.events()
    );
    holder.kill().expect("SIGKILL the holder");
    let (asked, granted) = holder
        .events()
        .into_iter()
        .find_map(|e| match e {
            HolderEvent::Acquired {
                asked_mono_ns: Some(asked),
                granted_mono_ns: Some(granted),
                ..
            } => Some((asked, granted)),
            _ => None,
        })
        .and_then(|(a, g)| Some((monotonic_to_instant(a)?, monotonic_to_instant(g)?)))
        .unwrap_or_else(|| {
            panic!(
                "{backend}: the holder's grant carries no times: {:?}",
                holder.events()
            )
        });
    let contender = client(url).await;
    let deadline = Instant::now() + AT_LEAST + TTL + SOON;
    let next = loop {
        match contender.lock(key.as_str()).ttl(TTL).try_acquire().await {
            Ok(Some(guard)) => {
                let at = Instant::now();
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
    let kept = next.saturating_duration_since(asked);
    assert!(
        kept >= AT_LEAST,
        "{backend}: the contender was granted {kept:?} after the killed holder asked for its grant, before its at_least {AT_LEAST:?} ran out"
    );
    (kept, next.saturating_duration_since(granted))
}

async fn periodic(backend: &str, url: String) {
    let history = History::new(format!("{backend}_periodic"));
    let caps = client(&url).await.capabilities();
    // What at_least needs (a backend without them refuses it before any I/O): every backend
    // of this drill claims both; one that stops claiming them fails here, not as a skip.
    assert!(
        caps.keep_until && caps.renew,
        "{backend}: keep_until and renew are claimed by every backend of this drill: {caps:?}"
    );
    let job_mode = LockOptions::with_ttl(TTL).at_least(AT_LEAST);
    let plain = LockOptions::with_ttl(TTL);
    // A memory:// coordinator lives in its process: a holder process would have its own.
    let crash = async {
        if backend == "memory" {
            println!("SKIP the SIGKILLed holder on memory: its coordinator dies with it");
        } else {
            let (asked, granted) = killed_holder_keeps_at_least(backend, &url).await;
            println!(
                "{backend}: a holder SIGKILLed right after its grant with at_least {AT_LEAST:?}: the next grant came {asked:?} after it asked for its grant, {granted:?} after its grant returned"
            );
        }
    };
    let with = async {
        let (with, ()) = tokio::join!(scenario(&history, &url, job_mode, PERIODS, true), crash);
        with
    };
    let without = scenario(&history, &url, plain, 2, false);
    let ((with, entries), (without, _)) = tokio::join!(with, without);
    let duplicated = without.values().filter(|who| who.len() > 1).count();
    println!(
        "{backend}: without at_least, runs per period {without:?} ({duplicated} of 2 periods ran more than once)"
    );
    assert!(
        duplicated > 0,
        "{backend}: skip-if-held alone never ran a period twice — the drill shows nothing: {without:?}"
    );
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
    // The dead instance's lease, read from the protected resource: it wrote in the period it
    // died in, and the next write — whoever made it — came no sooner than at_least after the
    // dead instance asked for the lock (the coordinator kept the grant though the holder's
    // release never arrived; a lease that lapsed with its TTL lets the next instance in first).
    let dead = entries
        .iter()
        .position(|e| e.period == DIES_IN && e.instance == 0)
        .unwrap_or_else(|| {
            panic!("{backend}: instance 0 did not write in period {DIES_IN}, the one it dies in: {entries:?}")
        });
    let next = entries
        .get(dead + 1)
        .unwrap_or_else(|| panic!("{backend}: nobody wrote after the dead instance: {entries:?}"));
    let dead = &entries[dead];
    let after = Duration::from_micros(next.wrote_us.saturating_sub(dead.asked_us));
    println!(
        "{backend}: the next write after the dead instance's (instance {} in period {}, fence {} after {}) came {after:?} after it asked for the lock",
        next.instance, next.period, next.fence, dead.fence
    );
    assert!(
        after >= AT_LEAST,
        "{backend}: instance {} wrote in period {} {after:?} after the dead instance asked for the lock, inside its at_least {AT_LEAST:?}: {entries:?}",
        next.instance,
        next.period
    );
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
