//! Opt-in measurement (`DISTLOCK_REDIS_TOPOLOGY_COSTS=1`): the uncontended acquire+release
//! cycle and the hand-off to a waiter on a single server, a Sentinel-managed master (with and
//! without `replicas=1`) and a 3+3 Cluster, all private servers on this machine, as ratios to
//! the single server. The numbers in the README's *Topologies* come from this test. Without
//! the variable it only checks that a cycle and a hand-off work on each topology.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed expectation is a failed test

mod support;

use std::{sync::Arc, time::Duration};

use conformance::{backend_url, fresh_key};
use lock_core::DynLock;
use lock_redis::{RedisLock, RedlockLock};
use support::{Cluster, Masters, SentinelSet, Server};
use tokio::time::Instant;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

async fn cycle(lock: &DynLock, n: usize) -> Duration {
    let key = fresh_key("cost-cycle");
    let ttl = Duration::from_secs(10);
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let lease = lock
            .try_acquire(&key, ttl)
            .await
            .unwrap()
            .expect("uncontended");
        assert!(lock.release(&lease).await.unwrap());
        times.push(t.elapsed());
    }
    median(times)
}

async fn handoff(a: &DynLock, b: &DynLock, n: usize) -> Duration {
    let key = fresh_key("cost-handoff");
    let ttl = Duration::from_secs(10);
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        let lease = a.try_acquire(&key, ttl).await.unwrap().unwrap();
        let waiter = {
            let (b, key) = (b.clone(), key.clone());
            tokio::spawn(async move {
                let got = b.acquire(&key, ttl, Instant::now() + ttl).await.unwrap();
                (Instant::now(), got)
            })
        };
        // Let the waiter queue (its subscription and registration).
        while a
            .inspect(&key)
            .await
            .unwrap()
            .and_then(|i| i.waiters)
            .unwrap_or(1)
            == 0
        {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
        let released = Instant::now();
        assert!(a.release(&lease).await.unwrap());
        let (granted, lease) = waiter.await.unwrap();
        times.push(granted - released);
        assert!(b.release(&lease).await.unwrap());
    }
    median(times)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uncontended_cycle_and_hand_off_on_each_topology() {
    if backend_url("DISTLOCK_TEST_REDIS_URL").is_none() {
        return;
    }
    let measure = std::env::var_os("DISTLOCK_REDIS_TOPOLOGY_COSTS").is_some();
    let (n, m) = if measure { (500, 40) } else { (3, 2) };
    let (single, set, cluster, masters) = tokio::task::spawn_blocking(|| {
        let base = Masters::start();
        (
            base,
            SentinelSet::start(false),
            Cluster::start(),
            Masters::start(),
        )
    })
    .await
    .unwrap();
    let single_url = format!("redis://{}", Server::addr(&single.nodes[0]));
    let urls = [
        ("single server", single_url),
        (
            "sentinel's master, as redis://",
            format!("redis://127.0.0.1:{}", set.master_port().unwrap()),
        ),
        ("sentinel", set.url("")),
        (
            "sentinel replicas=1",
            set.url("replicas=1&replica_timeout=1s"),
        ),
        ("cluster 3+3", cluster.url("")),
    ];
    let mut rows = Vec::new();
    for (name, url) in &urls {
        let a: DynLock = Arc::new(RedisLock::connect_url(url).await.unwrap());
        let b: DynLock = Arc::new(RedisLock::connect_url(url).await.unwrap());
        rows.push((*name, cycle(&a, n).await, Some(handoff(&a, &b, m).await)));
    }
    let redlock: DynLock = Arc::new(RedlockLock::connect_url(&masters.url("")).await.unwrap());
    rows.push(("redlock 3 masters", cycle(&redlock, n).await, None));
    let (base_cycle, base_handoff) = (rows[0].1, rows[0].2.unwrap());
    if measure {
        eprintln!("| topology | acquire+release p50 | ratio | hand-off p50 | ratio |");
        eprintln!("|---|---:|---:|---:|---:|");
        for (name, c, h) in &rows {
            let h = h.map_or("—".to_owned(), |h| {
                format!(
                    "{} µs | {:.2}",
                    h.as_micros(),
                    h.as_secs_f64() / base_handoff.as_secs_f64()
                )
            });
            eprintln!(
                "| {name} | {} µs | {:.2} | {h} |",
                c.as_micros(),
                c.as_secs_f64() / base_cycle.as_secs_f64()
            );
        }
    }
}
