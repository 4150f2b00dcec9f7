//! The measurements that are the same for every backend.

use rand::seq::SliceRandom;
use std::{
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use futures::{StreamExt, TryStreamExt, stream};
use lock_core::{DistributedLockExt, DynLock, LockGuard, LockKey};
use tokio::{
    sync::watch,
    time::{Instant, sleep, sleep_until, timeout},
};

use crate::{
    backends::{Cycle, RequestCounter, Res},
    report::{Handoff, Throughput, Variant, WatchdogCost},
    stats::{Summary, ratio},
    system,
};

/// Runs every variant `warmup + rounds` times, one cycle of each per round in a random order,
/// and summarises the measured rounds. A variant that fails stops being run and reports why.
pub async fn uncontended(
    variants: &mut [Box<dyn Cycle>],
    warmup: usize,
    rounds: usize,
) -> Vec<Variant> {
    let k = variants.len();
    let mut samples: Vec<Vec<Duration>> = vec![Vec::with_capacity(rounds); k];
    let mut errors: Vec<Option<String>> = vec![None; k];
    let mut order: Vec<usize> = (0..k).collect();
    for round in 0..warmup + rounds {
        // A fresh order every round: with a fixed rotation every variant always ran right
        // after the same one (the distlock variant right after the write floor, two steps after
        // the idle floor's 2 ms sleep), so what the predecessor left behind (parked threads,
        // an idle CPU) always hit the same variant.
        order.shuffle(&mut rand::rng());
        for &i in &order {
            if errors[i].is_some() {
                continue;
            }
            let idle = variants[i].idle_before();
            if !idle.is_zero() {
                sleep(idle).await;
            }
            let start = Instant::now();
            let outcome = variants[i].run().await;
            let took = start.elapsed();
            match outcome {
                Ok(()) if round >= warmup => samples[i].push(took),
                Ok(()) => {}
                Err(e) => errors[i] = Some(e.to_string()),
            }
        }
    }
    variants
        .iter()
        .zip(samples.iter_mut().zip(errors))
        .map(|(v, (s, error))| Variant {
            kind: v.kind(),
            label: v.label(),
            latency: if error.is_some() {
                None
            } else {
                Summary::of(s)
            },
            error,
        })
        .collect()
}

/// How long a holder holds in the hand-off measurement.
pub const HANDOFF_HOLD: Duration = Duration::from_millis(2);

/// The round-trip floors a hand-off is expressed in.
#[derive(Clone, Copy, Debug, Default)]
pub struct HandoffFloors<'a> {
    /// Back-to-back bare round trip.
    pub rtt: Option<&'a Summary>,
    /// Bare round trip after [`HANDOFF_HOLD`] of idle.
    pub idle_rtt: Option<&'a Summary>,
    /// Bare write.
    pub write_rtt: Option<&'a Summary>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Handoff latency with `clients.len()` contenders on one key: from the moment the holder starts
/// `release` to the moment the next holder's `acquire` returns. A client that just released
/// waits until someone else holds before queueing again, so every handoff goes to a waiter.
/// The first `clients.len()` handoffs are warm-up and not counted: until each client has waited
/// once, a handoff can include setting up its wake-up path (a `LISTEN` connection, a watch
/// stream, a subscription), which is a one-time cost, not a handoff's.
pub async fn handoff(
    clients: &[DynLock],
    key: &LockKey,
    ttl: Duration,
    handoffs: usize,
    floors: HandoffFloors<'_>,
) -> Res<Handoff> {
    let released_at: Arc<Mutex<Option<Instant>>> = Arc::default();
    let samples: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let warmup = clients.len();
    let remaining = Arc::new(AtomicUsize::new(warmup + handoffs + 1));
    // Bumped on every grant, so a client that just released can wait for the next one.
    let (grants, _) = watch::channel(0u64);
    let grants = Arc::new(grants);
    // Set when the last handoff was measured: the remaining waiters stop waiting.
    let (done, _) = watch::channel(false);
    let done = Arc::new(done);
    let mut tasks = Vec::new();
    for client in clients {
        let (client, key) = (client.clone(), key.clone());
        let (released_at, samples, remaining, grants, done) = (
            released_at.clone(),
            samples.clone(),
            remaining.clone(),
            grants.clone(),
            done.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut seen = grants.subscribe();
            let mut finished = done.subscribe();
            loop {
                if remaining.load(Ordering::SeqCst) == 0 {
                    return Ok::<(), lock_core::Error>(());
                }
                let deadline = Instant::now() + Duration::from_secs(30);
                let lease = tokio::select! {
                    lease = client.acquire(&key, ttl, deadline) => lease?,
                    _ = finished.wait_for(|d| *d) => return Ok(()),
                };
                let now = Instant::now();
                // Only the holder counts down, so this check and the decrement do not race.
                if remaining.load(Ordering::SeqCst) == 0 {
                    client.release(&lease).await?;
                    return Ok(());
                }
                if let Some(t) = lock(&released_at).take() {
                    lock(&samples).push(now - t);
                }
                grants.send_modify(|g| *g += 1);
                seen.borrow_and_update();
                remaining.fetch_sub(1, Ordering::SeqCst);
                // A short hold, so the other waiters are parked on the wake-up path.
                sleep(HANDOFF_HOLD).await;
                *lock(&released_at) = Some(Instant::now());
                client.release(&lease).await?;
                if remaining.load(Ordering::SeqCst) == 0 {
                    done.send_replace(true);
                    return Ok(());
                }
                // Wait until a waiter holds before queueing again (or the run ends).
                let _ = timeout(Duration::from_secs(5), seen.changed()).await;
            }
        }));
    }
    for t in tasks {
        t.await??;
    }
    let mut samples = std::mem::take(&mut *lock(&samples));
    samples.drain(..warmup.min(samples.len()));
    let latency = Summary::of(&mut samples).ok_or("no handoff was measured")?;
    let in_units =
        |floor: Option<&Summary>| floor.and_then(|f| ratio(latency.median_us, f.median_us));
    Ok(Handoff {
        waiters: clients.len(),
        median_in_rtts: in_units(floors.rtt),
        median_in_write_rtts: in_units(floors.write_rtt),
        median_in_idle_rtts: in_units(floors.idle_rtt),
        latency,
    })
}

/// Completed acquire+release cycles per second with every client looping on key
/// `i % keys` for `window`.
pub async fn throughput(
    clients: &[DynLock],
    run: &str,
    keys: usize,
    ttl: Duration,
    window: Duration,
) -> Res<Throughput> {
    let done = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let end = start + window;
    let mut tasks = Vec::new();
    for (i, client) in clients.iter().enumerate() {
        let client = client.clone();
        let key = LockKey::new(format!("bench/{run}/tp{keys}/{}", i % keys))?;
        let done = done.clone();
        tasks.push(tokio::spawn(async move {
            while Instant::now() < end {
                let acquired = tokio::select! {
                    lease = client.acquire(&key, ttl, end + Duration::from_secs(5)) => lease?,
                    () = sleep_until(end) => break,
                };
                client.release(&acquired).await?;
                if Instant::now() <= end {
                    done.fetch_add(1, Ordering::Relaxed);
                }
            }
            Ok::<(), lock_core::Error>(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let seconds = window.as_secs_f64();
    Ok(Throughput {
        clients: clients.len(),
        keys,
        seconds,
        acquisitions_per_s: done.load(Ordering::Relaxed) as f64 / seconds,
    })
}

/// Takes the fresh key `key` for the watchdog measurement. A temporary error (a server behind
/// on the puts of the 64 takes in flight and the renewals of the locks already held: etcd's
/// "request timed out" at 100,000) is retried for up to [`TAKE_RETRY_FOR`] after the first
/// attempt (backoff 100 ms to 2 s) and counted; so is "held" after such an error (the unknown
/// attempt's entry, until the driver's clean-up removes it). "Held" at the first attempt is an
/// error: the key is fresh.
async fn take_fresh(
    client: &DynLock,
    key: &str,
    ttl: Duration,
    retried: &AtomicU64,
) -> Result<LockGuard, lock_core::Error> {
    let give_up = Instant::now() + TAKE_RETRY_FOR;
    let mut backoff =
        lock_core::raw::Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
    let mut first = true;
    loop {
        let err = match client.lock(key).ttl(ttl).try_acquire().await {
            Ok(Some(guard)) => return Ok(guard),
            Ok(None) if first => {
                return Err(lock_core::Error::Config("a fresh key was held".into()));
            }
            Ok(None) => None,
            Err(e) if e.is_temporary() => Some(e),
            Err(e) => return Err(e),
        };
        first = false;
        if Instant::now() >= give_up {
            return Err(err.unwrap_or_else(|| {
                lock_core::Error::Config(format!("{key}: still held by an unknown attempt"))
            }));
        }
        retried.fetch_add(1, Ordering::Relaxed);
        sleep(backoff.next_delay()).await;
    }
}

/// How long [`take_fresh`] goes on retrying one key.
const TAKE_RETRY_FOR: Duration = Duration::from_secs(30);

/// Takes `held` locks on one client with guard watchdogs (renewing every `ttl / 3`), lets them
/// settle for one and a half intervals, then counts requests, renewals, CPU and memory over `ticks`
/// intervals. Releases everything afterwards.
pub async fn watchdog(
    client: &DynLock,
    counter: &dyn RequestCounter,
    run: &str,
    held: usize,
    ttl: Duration,
    ticks: u32,
) -> Res<WatchdogCost> {
    let interval = ttl / 3;
    // Background rate of a shared counter, over one interval with nothing of ours held.
    let background = if counter.exclusive() {
        0.0
    } else {
        let c0 = counter.read().await?.total;
        let t0 = Instant::now();
        sleep(interval).await;
        counter.read().await?.total.saturating_sub(c0) as f64 / t0.elapsed().as_secs_f64()
    };
    let rss0 = system::resident_bytes();
    let start = Instant::now();
    let retried = Arc::new(AtomicU64::new(0));
    let guards: Vec<LockGuard> = stream::iter(0..held)
        .map(|i| {
            let client = client.clone();
            let key = format!("bench/{run}/held{held}/{i}");
            let retried = retried.clone();
            async move { take_fresh(&client, &key, ttl, &retried).await }
        })
        .buffer_unordered(64)
        .try_collect()
        .await?;
    let acquire_s = start.elapsed().as_secs_f64();
    let retried = retried.load(Ordering::Relaxed);
    let details = match (counter.details(), retried) {
        (d, 0) => d,
        (d, n) => Some(
            d.map_or_else(String::new, |d| format!("{d}; "))
                + &format!("{n} takes retried after a temporary error"),
        ),
    };
    // Locks taken together renew together: start the window half an interval off the renewal
    // bursts so that it holds exactly `ticks` of them.
    sleep(interval + interval / 2).await;
    let rss1 = system::resident_bytes();

    // The window's CPU is the drivers' and lock-core's alone: the bench's own O(held) sums of
    // the guards' renewal counts, and its counter reads, fall outside it (each sum of 100,000
    // guards costs milliseconds, which counted as renewal CPU before).
    let r0: u64 = guards.iter().map(LockGuard::renewals).sum();
    let c0 = counter.read().await?;
    let cpu0 = system::cpu_time();
    let t0 = Instant::now();
    sleep(interval * ticks).await;
    let cpu1 = system::cpu_time();
    let elapsed = t0.elapsed();
    let c1 = counter.read().await?;
    let r1: u64 = guards.iter().map(LockGuard::renewals).sum();
    let lost = guards.iter().filter(|g| g.is_lost()).count();

    stream::iter(guards)
        .map(|g| async move {
            let _ = g.release().await;
        })
        .buffer_unordered(64)
        .collect::<()>()
        .await;

    let observed_ticks = elapsed.as_secs_f64() / interval.as_secs_f64();
    let requests = c1.total.saturating_sub(c0.total) as f64 - background * elapsed.as_secs_f64();
    let request_mix = c1
        .top_growth(&c0, 4)
        .into_iter()
        .map(|(kind, n)| (kind, n as f64 / observed_ticks))
        .collect();
    Ok(WatchdogCost {
        held,
        ttl_s: ttl.as_secs_f64(),
        interval_s: interval.as_secs_f64(),
        acquire_s,
        ticks: observed_ticks,
        requests_per_tick: Some(requests.max(0.0) / observed_ticks),
        counter: counter.source(),
        request_mix,
        details,
        renewals_per_tick: (r1 - r0) as f64 / observed_ticks,
        cpu_ms_per_tick: match (cpu0, cpu1) {
            (Some(a), Some(b)) => Some((b - a).as_secs_f64() * 1e3 / observed_ticks),
            _ => None,
        },
        rss_bytes_per_lock: match (rss0, rss1) {
            (Some(a), Some(b)) if held > 0 => Some((b as f64 - a as f64) / held as f64),
            _ => None,
        },
        lost,
    })
}
