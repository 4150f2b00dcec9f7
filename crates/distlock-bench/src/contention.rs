//! `--contention`: where the time of etcd's contended path goes. Clients (16 by default,
//! `--contenders N`) take turns on one key for a window, each `acquire` then `release` at once
//! (the bench's "16 clients on 1 key"), and this prints the acquisitions per second, the
//! driver's requests per acquisition by kind (`EtcdLock::request_counts`, summed over the
//! clients) and the serial path: from a holder starting `release` to the next grant, and the
//! `release` call itself.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use lock_core::{DistributedLock, LockKey};
use lock_etcd::{EtcdLock, EtcdLockConfig};
use tokio::time::Instant;

use crate::{backends::Res, stats::percentile};

/// Runs the measurement on `url` and returns it as markdown.
pub async fn run(url: &str, clients: usize, window: Duration) -> Res<String> {
    let config = EtcdLockConfig::from_url(url)?;
    let mut locks = Vec::with_capacity(clients);
    for _ in 0..clients {
        locks.push(Arc::new(EtcdLock::connect(config.clone()).await?));
    }
    let key = LockKey::new(format!("bench/{:08x}/contention", rand::random::<u32>()))?;
    let ttl = Duration::from_secs(30);
    let started = Instant::now();
    let end = started + window;
    // When the current holder started its release (taken by the next grant).
    let released_at: Arc<Mutex<Option<Instant>>> = Arc::default();
    let gaps: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let releases: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let mut tasks = Vec::new();
    for lock in &locks {
        let (lock, key) = (lock.clone(), key.clone());
        let (released_at, gaps, releases) = (released_at.clone(), gaps.clone(), releases.clone());
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while Instant::now() < end {
                let lease = tokio::select! {
                    lease = lock.acquire(&key, ttl, end + Duration::from_secs(10)) => lease?,
                    () = tokio::time::sleep_until(end) => break,
                };
                let now = Instant::now();
                if let (Some(t), Ok(mut g)) = (
                    released_at.lock().map_or(None, |mut g| g.take()),
                    gaps.lock(),
                ) {
                    g.push(now - t);
                }
                let t = Instant::now();
                if let Ok(mut g) = released_at.lock() {
                    *g = Some(t);
                }
                lock.release(&lease).await?;
                if let Ok(mut g) = releases.lock() {
                    g.push(t.elapsed());
                }
                if Instant::now() <= end {
                    n += 1;
                }
            }
            Ok::<u64, lock_core::Error>(n)
        }));
    }
    let mut total = 0u64;
    for t in tasks {
        total += t.await??;
    }
    let elapsed = window.as_secs_f64();
    let mut sum = lock_etcd::EtcdRequestCounts::default();
    for l in &locks {
        let r = l.request_counts();
        sum.lease_grant += r.lease_grant;
        sum.lease_keepalive += r.lease_keepalive;
        sum.lease_revoke += r.lease_revoke;
        sum.txn += r.txn;
        sum.range += r.range;
        sum.watch += r.watch;
    }
    let a = (total.max(1)) as f64;
    // Median, p90 and p99 in µs.
    let summary = |v: &Mutex<Vec<Duration>>| {
        let mut v = v.lock().map(|g| g.clone()).unwrap_or_default();
        v.sort_unstable();
        let us = |q: f64| percentile(&v, q).as_secs_f64() * 1e6;
        (!v.is_empty()).then(|| [us(0.5), us(0.9), us(0.99)])
    };
    let gaps = summary(&gaps);
    let releases = summary(&releases);
    let fmt = |s: &Option<[f64; 3]>| {
        s.map_or("–".to_owned(), |[m, p90, p99]| {
            format!("{m:.0} / {p90:.0} / {p99:.0}")
        })
    };
    let mut md = String::new();
    md.push_str(&format!(
        "## etcd: {clients} clients on 1 key, {elapsed:.0} s\n\n- acquisitions: {total} ({:.0}/s)\n",
        total as f64 / elapsed
    ));
    md.push_str(&format!(
        "- requests per acquisition: txn {:.2}, watch {:.2}, range {:.2}, lease grant {:.2}, keepalive {:.2}, revoke {:.2}\n",
        sum.txn as f64 / a,
        sum.watch as f64 / a,
        sum.range as f64 / a,
        sum.lease_grant as f64 / a,
        sum.lease_keepalive as f64 / a,
        sum.lease_revoke as f64 / a,
    ));
    md.push_str(&format!(
        "- release start → next grant, µs median / p90 / p99: {}\n- release call, µs median / p90 / p99: {}\n",
        fmt(&gaps),
        fmt(&releases)
    ));
    if let Some([median, ..]) = gaps {
        md.push_str(&format!(
            "- the serial path alone would allow {:.0} acquisitions/s (1 / median gap)\n",
            1e6 / median
        ));
    }
    Ok(md)
}
