//! What the distlock recipe costs over the bare ZooKeeper operations it is made of.
//!
//! Against `DISTLOCK_TEST_ZK_URL` (default `zk://127.0.0.1:22181`), on a tokio **current-thread**
//! runtime, interleaved in one process:
//! * uncontended cycle: distlock `try_acquire` + `release` vs bare zookeeper-client
//!   create(EPHEMERAL_SEQUENTIAL) + getChildren + delete;
//! * hand-off: from the holder calling `release` to the waiter's `acquire` returning, vs the bare
//!   floor: from `delete` of the predecessor to the waiter's watch firing plus its getChildren.
//!
//! `cargo run --release -p lock-zk --example zk_overhead [cycles] [handoffs]`
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{sync::Arc, time::Duration};

use lock_core::{DistributedLock, LockKey};
use lock_zk::{ZkLock, ZkLockConfig};
use tokio::time::Instant;
use zookeeper_client as zk;

fn stats(name: &str, mut v: Vec<Duration>) -> (Duration, Duration) {
    v.sort();
    let p = |q: f64| v[((v.len() as f64 * q) as usize).min(v.len() - 1)];
    let (p50, p99) = (p(0.5), p(0.99));
    println!(
        "{name:<44} n={:<5} median {:>7} µs   p99 {:>7} µs",
        v.len(),
        p50.as_micros(),
        p99.as_micros()
    );
    (p50, p99)
}

fn ratio(a: (Duration, Duration), b: (Duration, Duration)) {
    println!(
        "{:<44} median x{:.2}   p99 x{:.2}",
        "ratio distlock / bare",
        a.0.as_secs_f64() / b.0.as_secs_f64(),
        a.1.as_secs_f64() / b.1.as_secs_f64()
    );
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let mut args = std::env::args().skip(1);
    let cycles: usize = args.next().map_or(2000, |a| a.parse().unwrap());
    let handoffs: usize = args.next().map_or(200, |a| a.parse().unwrap());
    let url = std::env::var("DISTLOCK_TEST_ZK_URL").unwrap_or("zk://127.0.0.1:22181".into());
    let mut config = ZkLockConfig::from_url(&url).unwrap();
    config.root = "/distlock-bench".into();
    let lock = ZkLock::connect(config.clone()).await.unwrap();
    let raw = zk::Client::connector()
        .with_session_timeout(config.session_timeout)
        .connect(&config.connect_string())
        .await
        .unwrap();
    let key = LockKey::new(format!("bench-{:x}", rand::random::<u64>())).unwrap();
    let bare_dir = format!("/distlock-bench/bare-{:x}", rand::random::<u64>());
    let open = zk::Acls::anyone_all();
    raw.mkdir(&bare_dir, &zk::CreateMode::Container.with_acls(open))
        .await
        .unwrap();
    let ttl = config.session_timeout;
    let ephemeral_seq = zk::CreateMode::EphemeralSequential.with_acls(open);
    let bare_prefix = format!("{bare_dir}/_c_00000000-0000-0000-0000-000000000000-lock-");

    let distlock_cycle = || async {
        let t = Instant::now();
        let lease = lock.try_acquire(&key, ttl).await.unwrap().unwrap();
        assert!(lock.release(&lease).await.unwrap());
        t.elapsed()
    };
    let bare_cycle = || async {
        let t = Instant::now();
        let (_stat, seq) = raw.create(&bare_prefix, &[], &ephemeral_seq).await.unwrap();
        let children = raw.list_children(&bare_dir).await.unwrap();
        assert_eq!(children.len(), 1);
        raw.delete(&format!("{bare_prefix}{seq}"), None)
            .await
            .unwrap();
        t.elapsed()
    };
    for _ in 0..200 {
        distlock_cycle().await;
        bare_cycle().await;
    }
    let (mut ours, mut bare) = (Vec::new(), Vec::new());
    for i in 0..cycles {
        if i % 2 == 0 {
            ours.push(distlock_cycle().await);
            bare.push(bare_cycle().await);
        } else {
            bare.push(bare_cycle().await);
            ours.push(distlock_cycle().await);
        }
    }
    println!("uncontended acquire+release (tokio current-thread runtime)");
    let a = stats("distlock try_acquire + release", ours);
    let b = stats("bare create-eph-seq + getChildren + delete", bare);
    ratio(a, b);

    // Hand-off: holder `lock`, waiter `other` (its own session).
    let other = Arc::new(ZkLock::connect(config.clone()).await.unwrap());
    let raw2 = zk::Client::connector()
        .with_session_timeout(config.session_timeout)
        .connect(&config.connect_string())
        .await
        .unwrap();
    let (mut ours, mut bare) = (Vec::new(), Vec::new());
    for _ in 0..handoffs {
        // distlock
        let lease = lock.try_acquire(&key, ttl).await.unwrap().unwrap();
        let waiter = {
            let (other, key) = (other.clone(), key.clone());
            tokio::spawn(async move {
                let l = other
                    .acquire(&key, ttl, Instant::now() + Duration::from_secs(30))
                    .await
                    .unwrap();
                (Instant::now(), l)
            })
        };
        while lock.inspect(&key).await.unwrap().unwrap().waiters != Some(1) {
            tokio::task::yield_now().await;
        }
        tokio::time::sleep(Duration::from_millis(2)).await; // let the waiter set its watch
        let released = Instant::now();
        assert!(lock.release(&lease).await.unwrap());
        let (got_at, got) = waiter.await.unwrap();
        ours.push(got_at - released);
        other.release(&got).await.unwrap();

        // bare: the holder's node, the waiter's node behind it watching it.
        let (_, s1) = raw.create(&bare_prefix, &[], &ephemeral_seq).await.unwrap();
        let (_, s2) = raw2
            .create(&bare_prefix, &[], &ephemeral_seq)
            .await
            .unwrap();
        let first = format!("{bare_prefix}{s1}");
        let (_, watcher) = raw2.check_and_watch_stat(&first).await.unwrap();
        let waiter = {
            let (raw2, dir) = (raw2.clone(), bare_dir.clone());
            tokio::spawn(async move {
                watcher.changed().await;
                let children = raw2.list_children(&dir).await.unwrap();
                assert_eq!(children.len(), 1);
                Instant::now()
            })
        };
        let released = Instant::now();
        raw.delete(&first, None).await.unwrap();
        bare.push(waiter.await.unwrap() - released);
        raw2.delete(&format!("{bare_prefix}{s2}"), None)
            .await
            .unwrap();
    }
    println!("hand-off: release -> next waiter holds the lock");
    let a = stats("distlock release -> waiter's acquire returns", ours);
    let b = stats("bare delete -> watch fires + getChildren", bare);
    ratio(a, b);
}
