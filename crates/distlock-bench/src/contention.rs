//! `--contention`: where the time of etcd's contended path goes. Clients (16 by default,
//! `--contenders N`) take turns on one key for a window, each `acquire` then `release` at once
//! (the bench's "16 clients on 1 key"), and this prints the acquisitions per second, the
//! driver's requests per acquisition by kind (`EtcdLock::request_counts`, summed over the
//! clients) and the serial path: from a holder starting `release` to the next grant, and the
//! `release` call itself.
//!
//! After that window as many clients count their acquisitions on etcd's own Lock RPC
//! (`v3lockpb`, the bench's peer: one reused lease per client, `Lock` then `Unlock` at once)
//! and on the bare fair queue (distlock's protocol hand-written, [`bare_window`]), then distlock
//! again, the peer and the bare queue again: windows alternating in one run, each doing the
//! same two writes per acquisition (a queue entry's put and its delete).
//!
//! `--idle-watchers N` adds N clients that, during distlock's and the bare queue's windows,
//! only watch the lock's queue prefix (deletions only), as a waiter does: every release then
//! goes to N more watch streams, which is what a longer queue costs beyond its own requests.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use lock_core::{DistributedLock, LockKey};
use lock_etcd::{EtcdLock, EtcdLockConfig};
use tokio::{task::JoinSet, time::Instant};

use crate::{
    backends::{Res, etcd::endpoints},
    stats::percentile,
};

/// Runs the measurement on `url` and returns it as markdown: distlock's window with its
/// breakdown, then the peer's and the bare queue's, then one more of each (the rates only).
pub async fn run(url: &str, clients: usize, idle: usize, window: Duration) -> Res<String> {
    let config = EtcdLockConfig::from_url(url)?;
    let (mut md, _) = distlock_window(&config, clients, idle, window).await?;
    let mut rates = vec![];
    for round in 0..2 {
        if round > 0 {
            let (_, rate) = distlock_window(&config, clients, idle, window).await?;
            rates.push(("distlock", rate));
        }
        rates.push(("Lock RPC", peer_window(&config, clients, window).await?));
        rates.push((
            "bare queue",
            bare_window(&config, clients, idle, window).await?,
        ));
    }
    md.push_str(&format!(
        "\n## etcd: {clients} clients on 1 key ({idle} more only watching the queue in distlock's and the bare queue's windows), distlock, the server's Lock RPC and the bare queue protocol, alternating {:.0} s windows\n\n",
        window.as_secs_f64()
    ));
    for (what, rate) in rates {
        md.push_str(&format!("- {what}: {rate:.0} acquisitions/s\n"));
    }
    Ok(md)
}

/// `n` etcd clients, each with a lease of its own that outlives a window (no keepalive needed;
/// each client revokes its lease when its window ends).
async fn leased_clients(config: &EtcdLockConfig, n: usize) -> Res<Vec<(etcd_client::Client, i64)>> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let mut client = etcd_client::Client::connect(endpoints(config), None).await?;
        let lease = client.lease_grant(60, None).await?.id();
        out.push((client, lease));
    }
    Ok(out)
}

/// The acquisitions per second of a window's client tasks, each answering its count.
async fn rate<E: Into<lock_core::BoxError>>(
    tasks: Vec<tokio::task::JoinHandle<Result<u64, E>>>,
    window: Duration,
) -> Res<f64> {
    let mut total = 0u64;
    for t in tasks {
        total += t.await?.map_err(Into::into)?;
    }
    Ok(total as f64 / window.as_secs_f64())
}

/// distlock's fair queue with nothing else, hand-written over `etcd-client`: `clients` clients,
/// each with one lease and one queue watch (deletions only) for the window, take turns on one
/// key: a txn puts the attempt's entry and reads the queue (keys only), the attempt waits on
/// the watch until every earlier entry is deleted, then deletes its own. The same two writes
/// and the same reads as the driver (2 txn per acquisition), without its checks, budgets,
/// renewal and bookkeeping; returns the acquisitions per second.
pub(crate) async fn bare_window(
    config: &EtcdLockConfig,
    clients: usize,
    idle: usize,
    window: Duration,
) -> Res<f64> {
    use etcd_client::{
        Compare, CompareOp, EventType, GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp,
        TxnOpResponse, WatchFilterType, WatchOptions,
    };
    let name = format!("bench/{:08x}/bare-contention/", rand::random::<u32>());
    let mut bare = Vec::with_capacity(clients);
    for (mut client, lease) in leased_clients(config, clients).await? {
        let opts = WatchOptions::new()
            .with_prefix()
            .with_filters([WatchFilterType::NoPut]);
        let stream = client.watch(name.clone(), Some(opts)).await?;
        bare.push((client, lease, stream));
    }
    let watchers = idle_watchers(config, &name, idle, &Arc::default()).await?;
    let end = Instant::now() + window;
    let mut tasks = Vec::new();
    for (me, (mut client, lease, mut stream)) in bare.into_iter().enumerate() {
        let name = name.clone();
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while Instant::now() < end {
                let key = format!("{name}{me:02}-{n}");
                let txn = Txn::new()
                    .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
                    .and_then([
                        TxnOp::put(key.clone(), "", Some(PutOptions::new().with_lease(lease))),
                        TxnOp::get(
                            name.clone(),
                            Some(
                                GetOptions::new()
                                    .with_prefix()
                                    .with_sort(SortTarget::Create, SortOrder::Descend)
                                    .with_keys_only(),
                            ),
                        ),
                    ]);
                let resp = client.txn(txn).await?;
                let own_rev = resp.header().map_or(0, |h| h.revision());
                let mut ahead: std::collections::HashSet<Vec<u8>> = resp
                    .op_responses()
                    .into_iter()
                    .filter_map(|r| match r {
                        TxnOpResponse::Get(g) => Some(g),
                        _ => None,
                    })
                    .flat_map(|g| g.kvs().to_vec())
                    .filter(|kv| kv.create_revision() < own_rev)
                    .map(|kv| kv.key().to_vec())
                    .collect();
                // Deletions already reported are of keys no longer in the queue: harmless.
                while !ahead.is_empty() {
                    let left = end + Duration::from_secs(10) - Instant::now();
                    let Ok(msg) = tokio::time::timeout(left, stream.message()).await else {
                        return Err("the bare queue's wait outlived the window".into());
                    };
                    let Some(msg) = msg? else {
                        return Err("the bare queue's watch ended".into());
                    };
                    for ev in msg.events() {
                        if ev.event_type() == EventType::Delete
                            && let Some(kv) = ev.kv()
                        {
                            ahead.remove(kv.key());
                        }
                    }
                }
                client.delete(key, None).await?;
                if Instant::now() <= end {
                    n += 1;
                }
            }
            client.lease_revoke(lease).await?;
            Ok::<u64, lock_core::BoxError>(n)
        }));
    }
    let rate = rate(tasks, window).await;
    drop(watchers);
    rate
}

/// `clients` etcd clients, each with one lease for the window, take turns on one key through
/// the server's Lock RPC; returns the acquisitions per second.
async fn peer_window(config: &EtcdLockConfig, clients: usize, window: Duration) -> Res<f64> {
    let name = format!("bench/{:08x}/peer-contention", rand::random::<u32>());
    let peers = leased_clients(config, clients).await?;
    let end = Instant::now() + window;
    let mut tasks = Vec::new();
    for (mut client, lease) in peers {
        let name = name.clone();
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while Instant::now() < end {
                let opts = etcd_client::LockOptions::new().with_lease(lease);
                let held = tokio::select! {
                    held = client.lock(name.clone(), Some(opts)) => held?,
                    () = tokio::time::sleep_until(end) => break,
                };
                client.unlock(held.key().to_vec()).await?;
                if Instant::now() <= end {
                    n += 1;
                }
            }
            client.lease_revoke(lease).await?;
            Ok::<u64, etcd_client::Error>(n)
        }));
    }
    rate(tasks, window).await
}

/// `n` clients, each watching the deletions under `prefix` and reading every event off its
/// stream, counting the events in `seen`, until the returned set is dropped (which aborts them,
/// on an early error too).
async fn idle_watchers(
    config: &EtcdLockConfig,
    prefix: &str,
    n: usize,
    seen: &Arc<AtomicU64>,
) -> Res<JoinSet<()>> {
    use etcd_client::{WatchFilterType, WatchOptions};
    let mut tasks = JoinSet::new();
    for _ in 0..n {
        let mut client = etcd_client::Client::connect(endpoints(config), None).await?;
        let opts = WatchOptions::new()
            .with_prefix()
            .with_filters([WatchFilterType::NoPut]);
        let mut stream = client.watch(prefix, Some(opts)).await?;
        let seen = seen.clone();
        tasks.spawn(async move {
            let _client = client;
            while let Ok(Some(msg)) = stream.message().await {
                seen.fetch_add(msg.events().len() as u64, Ordering::Relaxed);
            }
        });
    }
    Ok(tasks)
}

/// One window of distlock's clients (with `idle` more clients only watching the lock's
/// queue): the serial path's breakdown as markdown, and the acquisitions per second.
async fn distlock_window(
    config: &EtcdLockConfig,
    clients: usize,
    idle: usize,
    window: Duration,
) -> Res<(String, f64)> {
    let mut locks = Vec::with_capacity(clients);
    for _ in 0..clients {
        locks.push(Arc::new(EtcdLock::connect(config.clone()).await?));
    }
    let run = format!("{:08x}", rand::random::<u32>());
    let key = LockKey::new(format!("bench/{run}/contention"))?;
    // The queue's keys are under the configured prefix, the lock name's `/` escaped; a prefix
    // one level up holds them and nothing of another run.
    let seen = Arc::new(AtomicU64::new(0));
    let prefix = format!("{}bench%2F{run}", config.prefix);
    let watchers = idle_watchers(config, &prefix, idle, &seen).await?;
    let ttl = Duration::from_secs(30);
    let started = Instant::now();
    let end = started + window;
    // When the current holder started its release, which client it is, and whether the
    // previous holder's next put (its re-queueing acquire) had been sent by then (taken by the
    // next grant).
    let released_at: Arc<Mutex<Option<(Instant, usize, bool)>>> = Arc::default();
    // Per client: when it last started an `acquire` right after a release of its own (its put
    // is sent then; the session is fresh in this loop).
    let put_sent: Arc<Vec<Mutex<Option<Instant>>>> =
        Arc::new((0..clients).map(|_| Mutex::new(None)).collect());
    // The hand-offs by whether the previous holder's put was sent before the release.
    let gaps: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let gaps_put_first: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let releases: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let mut tasks = Vec::new();
    for (me, lock) in locks.iter().enumerate() {
        let (lock, key) = (lock.clone(), key.clone());
        let (released_at, gaps, releases) = (released_at.clone(), gaps.clone(), releases.clone());
        let (put_sent, gaps_put_first) = (put_sent.clone(), gaps_put_first.clone());
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            let mut released_once = false;
            while Instant::now() < end {
                if released_once && let Ok(mut p) = put_sent[me].lock() {
                    *p = Some(Instant::now());
                }
                let lease = tokio::select! {
                    lease = lock.acquire(&key, ttl, end + Duration::from_secs(10)) => lease?,
                    () = tokio::time::sleep_until(end) => break,
                };
                let now = Instant::now();
                let previous = released_at.lock().map_or(None, |mut g| g.take());
                if let Some((t, _, put_first)) = previous {
                    let into = if put_first { &gaps_put_first } else { &gaps };
                    if let Ok(mut g) = into.lock() {
                        g.push(now - t);
                    }
                }
                let t = Instant::now();
                // The previous holder's put, if it was sent after that holder's release began
                // and before ours.
                let put_first = previous.is_some_and(|(their_release, them, _)| {
                    put_sent[them]
                        .lock()
                        .ok()
                        .and_then(|p| *p)
                        .is_some_and(|p| p >= their_release && p <= t)
                });
                if let Ok(mut g) = released_at.lock() {
                    *g = Some((t, me, put_first));
                }
                lock.release(&lease).await?;
                released_once = true;
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
    drop(watchers);
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
    let mean = |v: &Mutex<Vec<Duration>>| {
        let v = v.lock().map(|g| g.clone()).unwrap_or_default();
        let n = v.len();
        (n > 0).then(|| {
            (
                n,
                v.iter().map(Duration::as_secs_f64).sum::<f64>() * 1e6 / n as f64,
            )
        })
    };
    let split = [
        ("sent after it", mean(&gaps)),
        ("sent before it", mean(&gaps_put_first)),
    ];
    let split_md = split
        .iter()
        .map(|(what, m)| {
            m.map_or(format!("{what}: none"), |(n, us)| {
                format!("{what}: {n} hand-offs, mean {us:.0} µs")
            })
        })
        .collect::<Vec<_>>()
        .join("; ");
    if let (Ok(mut all), Ok(put_first)) = (gaps.lock(), gaps_put_first.lock()) {
        all.extend(put_first.iter().copied());
    }
    let all_mean = mean(&gaps);
    // Where the time of the serial path goes, by the length of the hand-off: a heavy tail
    // (scheduling on a loaded machine, a stalled watch) weighs on the throughput (1 / mean) but
    // not on a median.
    let buckets_ms = [0.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, f64::INFINITY];
    let tail_md = {
        let v = gaps.lock().map(|g| g.clone()).unwrap_or_default();
        let total: f64 = v.iter().map(Duration::as_secs_f64).sum();
        buckets_ms
            .windows(2)
            .filter_map(|w| {
                let (lo, hi) = (w[0] / 1e3, w[1] / 1e3);
                let inside: Vec<f64> = v
                    .iter()
                    .map(Duration::as_secs_f64)
                    .filter(|&g| g >= lo && g < hi)
                    .collect();
                (!inside.is_empty()).then(|| {
                    format!(
                        "{}–{} ms: {} ({:.0} % of the time)",
                        w[0],
                        w[1],
                        inside.len(),
                        100.0 * inside.iter().sum::<f64>() / total.max(f64::MIN_POSITIVE)
                    )
                })
            })
            .collect::<Vec<_>>()
            .join(", ")
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
        "## etcd: {clients} clients on 1 key ({idle} more only watching its queue), {elapsed:.0} s\n\n- acquisitions: {total} ({:.0}/s)\n",
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
    if let Some((_, us)) = all_mean {
        md.push_str(&format!(
            "- release start → next grant, mean {us:.0} µs; by the previous holder's next put (its \
             re-queueing acquire), {split_md}\n"
        ));
    }
    md.push_str(&format!(
        "- release start → next grant by length: {tail_md}\n"
    ));
    if idle > 0 {
        md.push_str(&format!(
            "- the {idle} idle watchers received {:.2} deletions per acquisition each\n",
            seen.load(Ordering::Relaxed) as f64 / (a * idle as f64)
        ));
    }
    if let Some([median, ..]) = gaps {
        md.push_str(&format!(
            "- the serial path alone would allow {:.0} acquisitions/s (1 / median gap)\n",
            1e6 / median
        ));
    }
    Ok((md, total as f64 / elapsed))
}
