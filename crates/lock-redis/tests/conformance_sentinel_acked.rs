//! The whole conformance suite against a Sentinel-managed master with replica acknowledgement
//! (`replicas=1`: every grant and renewal counts only after `WAIT 1` confirmed it).
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed expectation is a failed test

mod support;

use std::time::Duration;

/// The clients' options, for the suite and for the check that they wait for the replica.
const OPTIONS: &str = "namespace=conf-sentinel-acked:&replicas=1&replica_timeout=2s";

async fn setup() -> Option<conformance::Harness> {
    support::sentinel_harness::sentinel_harness(OPTIONS).await
}

conformance::conformance_tests!(setup; skip: {
    waiters_are_served_in_fifo_order: "fair_queue not claimed: the release grants the oldest live waiter, but a waiter that times out and re-queues loses its place",
});

/// The suite above runs against acknowledged writes only if `replicas=1` is really waited for:
/// a grant and a renewal each send `WAIT` to the master (counted in its `INFO commandstats`),
/// which the driver requires to answer at least 1 (else `Indeterminate`). A release does not
/// wait (the README's "replicas=N"): one lost in a failover delays the next grant to the TTL
/// and never makes two holders.
#[tokio::test]
async fn every_write_is_acknowledged_by_the_replica() {
    use lock_core::{DistributedLock, LockKey};
    let Some(_) = conformance::backend_url("DISTLOCK_TEST_REDIS_URL") else {
        return;
    };
    let set = tokio::task::spawn_blocking(support::shared_sentinel)
        .await
        .unwrap();
    let master = set.master_port().unwrap();
    let admin = redis::Client::open(format!("redis://127.0.0.1:{master}"))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let waits = |stats: String| -> u64 {
        stats
            .lines()
            .find_map(|l| l.strip_prefix("cmdstat_wait:calls="))
            .map_or(0, |rest| rest.split(',').next().unwrap().parse().unwrap())
    };
    let info = |section: &'static str| {
        let mut admin = admin.clone();
        async move {
            redis::cmd("INFO")
                .arg(section)
                .query_async::<String>(&mut admin)
                .await
                .unwrap()
        }
    };
    let lock = lock_redis::RedisLock::connect_url(&set.url(OPTIONS))
        .await
        .unwrap();
    let key = LockKey::new(format!("wait-{:x}", rand::random::<u64>())).unwrap();
    let step = |name: &'static str, before: u64, after: u64| {
        assert!(
            after > before,
            "{name} sent no WAIT to the master ({before} → {after} calls)"
        );
    };
    let before = waits(info("commandstats").await);
    let mut lease = lock
        .try_acquire(&key, Duration::from_secs(10))
        .await
        .unwrap()
        .expect("a fresh key");
    let granted = waits(info("commandstats").await);
    step("the grant", before, granted);
    lock.renew(&mut lease, Duration::from_secs(10))
        .await
        .unwrap();
    let renewed = waits(info("commandstats").await);
    step("the renewal", granted, renewed);
    assert!(lock.release(&lease).await.unwrap());
    assert_eq!(
        waits(info("commandstats").await),
        renewed,
        "a release waits for no replica"
    );
}
