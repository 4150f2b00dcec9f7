//! Overhead of `EtcdLock` over the bare etcd-client requests it is made of, and the cost of
//! keeping 1,000 held locks alive.
//!
//! ```text
//! eval "$(scripts/backends.sh env)"
//! cargo run --release -p lock-etcd --example etcd_overhead [-- ITERATIONS [HELD_LOCKS]]
//! ```
//!
//! Part 1 runs ITERATIONS (default 2000, after 200 warm-up rounds) uncontended acquire+release
//! cycles, interleaved round by round: distlock's `try_acquire` + `release`; the same four
//! requests made bare (lease grant, put-if-absent + owner read txn, compare-and-delete txn,
//! lease revoke); and the minimal Go-`concurrency.Mutex`-style cycle (grant, txn, revoke, which
//! deletes the key with the lease). Part 2 holds HELD_LOCKS (default 1000) locks from one
//! client with watchdog guards (ttl 3 s, renewal every 1 s) and counts the requests the
//! watchdogs send over 10 ticks. Runs on a tokio current-thread runtime.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark: failing loudly is fine

use std::{sync::Arc, time::Duration};

use etcd_client::{Compare, CompareOp, GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp};
use lock_core::{DistributedLock, DistributedLockExt, LockKey};
use lock_etcd::{EtcdLock, EtcdLockConfig};
use tokio::time::{Instant, sleep};

fn stats(label: &str, mut v: Vec<Duration>) -> (Duration, Duration) {
    v.sort();
    let median = v[v.len() / 2];
    let p99 = v[(v.len() * 99 / 100).min(v.len() - 1)];
    println!(
        "{label:<44} median {:>8.0} µs   p99 {:>8.0} µs",
        median.as_secs_f64() * 1e6,
        p99.as_secs_f64() * 1e6
    );
    (median, p99)
}

async fn bare_cycle(client: &etcd_client::Client, name: &str, with_delete: bool) {
    let lease = client.lease_client().grant(30, None).await.unwrap().id();
    let key = format!("{name}{lease:x}");
    let owner = GetOptions::new()
        .with_prefix()
        .with_sort(SortTarget::Create, SortOrder::Ascend)
        .with_limit(1);
    let txn = Txn::new()
        .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
        .and_then([
            TxnOp::put(key.clone(), "t", Some(PutOptions::new().with_lease(lease))),
            TxnOp::get(name, Some(owner)),
        ])
        .or_else([TxnOp::get(key.clone(), None)]);
    let resp = client.kv_client().txn(txn).await.unwrap();
    let rev = resp.header().unwrap().revision();
    if with_delete {
        let del = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, rev)])
            .and_then([TxnOp::delete(key, None)]);
        client.kv_client().txn(del).await.unwrap();
    }
    client.lease_client().revoke(lease).await.unwrap();
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run());
}

async fn run() {
    let url = std::env::var("DISTLOCK_TEST_ETCD_URL")
        .expect("set DISTLOCK_TEST_ETCD_URL (eval \"$(scripts/backends.sh env)\")");
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().map_or(2000, |a| a.parse().unwrap());
    let held: usize = args.next().map_or(1000, |a| a.parse().unwrap());
    let cfg = EtcdLockConfig::from_url(&url).unwrap();
    let bare = etcd_client::Client::connect([format!("http://{}", cfg.endpoints[0])], None)
        .await
        .unwrap();
    let lock = Arc::new(EtcdLock::connect(cfg).await.unwrap());
    let run_id: u32 = rand::random();
    let key = LockKey::new(format!("overhead-{run_id:08x}")).unwrap();
    let bare_name = format!("distlock/overhead-bare-{run_id:08x}/");
    let ttl = Duration::from_secs(30);

    println!("runtime: tokio current_thread; {n} cycles after 200 warm-up rounds, interleaved");
    let (mut ours, mut same, mut minimal) = (Vec::new(), Vec::new(), Vec::new());
    let before = lock.request_counts();
    for i in 0..(200 + n) {
        let t = Instant::now();
        let lease = lock.try_acquire(&key, ttl).await.unwrap().unwrap();
        assert!(lock.release(&lease).await.unwrap());
        let d_ours = t.elapsed();
        let t = Instant::now();
        bare_cycle(&bare, &bare_name, true).await;
        let d_same = t.elapsed();
        let t = Instant::now();
        bare_cycle(&bare, &bare_name, false).await;
        let d_min = t.elapsed();
        if i >= 200 {
            ours.push(d_ours);
            same.push(d_same);
            minimal.push(d_min);
        }
    }
    let after = lock.request_counts();
    let per_cycle = (after.total() - before.total()) as f64 / (200 + n) as f64;
    let (om, op) = stats("distlock try_acquire + release", ours);
    let (sm, sp) = stats("bare: grant + txn + guarded delete + revoke", same);
    let (mm, mp) = stats("bare minimal: grant + txn + revoke", minimal);
    println!("distlock requests per cycle: {per_cycle:.2}");
    println!(
        "ratio distlock / bare same requests: median {:.2}, p99 {:.2}",
        om.as_secs_f64() / sm.as_secs_f64(),
        op.as_secs_f64() / sp.as_secs_f64()
    );
    println!(
        "ratio distlock / bare minimal:       median {:.2}, p99 {:.2}",
        om.as_secs_f64() / mm.as_secs_f64(),
        op.as_secs_f64() / mp.as_secs_f64()
    );

    // Part 2: renewal cost of many held locks on one client.
    let ttl = Duration::from_secs(3);
    let interval = ttl / 3;
    let t = Instant::now();
    let mut guards = Vec::with_capacity(held);
    for i in 0..held {
        let key = format!("overhead-held-{run_id:08x}-{i}");
        guards.push(
            lock.lock(key)
                .ttl(ttl)
                .try_acquire()
                .await
                .unwrap()
                .unwrap(),
        );
    }
    println!(
        "\nheld {held} locks (ttl {ttl:?}, watchdog every {interval:?}) in {:?}; sessions: {}",
        t.elapsed(),
        lock.session_count()
    );
    sleep(interval).await; // let every watchdog reach its steady rhythm
    let ticks = 10u32;
    let c0 = lock.request_counts();
    let r0: u64 = guards.iter().map(|g| g.renewals()).sum();
    sleep(interval * ticks).await;
    let c1 = lock.request_counts();
    let r1: u64 = guards.iter().map(|g| g.renewals()).sum();
    let lost = guards.iter().filter(|g| g.is_lost()).count();
    println!(
        "over {ticks} watchdog ticks: {} renewals, {} keepalives, {} requests in total, {lost} locks lost",
        r1 - r0,
        c1.lease_keepalive - c0.lease_keepalive,
        c1.total() - c0.total()
    );
    println!(
        "requests per watchdog tick with {held} held locks: {:.2} (keepalives {:.2})",
        (c1.total() - c0.total()) as f64 / f64::from(ticks),
        (c1.lease_keepalive - c0.lease_keepalive) as f64 / f64::from(ticks)
    );
    let t = Instant::now();
    for g in guards {
        assert!(g.release().await.unwrap());
    }
    println!(
        "released {held} locks in {:?}; sessions: {}",
        t.elapsed(),
        lock.session_count()
    );
}
