//! The whole conformance suite against a private Redis Cluster of 3 masters and 3 replicas
//! (`support`), reached as `redis+cluster://seed1,seed2,seed3`, and the proof that waiters on a
//! Cluster are woken by sharded pub/sub on their lock's slot (same shared cluster).
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed expectation is a failed test

mod support;

use std::{sync::Arc, time::Duration};

use conformance::{Harness, TestBackend, backend_url};
use lock_core::{DistributedLock, DynLock, Lease, LockKey, Result};
use lock_redis::{RedisLock, RedisLockConfig};
use redis::cluster_async::ClusterConnection;
use tokio::time::{Instant, sleep};

struct Cluster {
    url: String,
    /// A cluster connection for fault injection (routes each key to its slot's master).
    admin: ClusterConnection,
    namespace: String,
}

#[conformance::async_trait]
impl TestBackend for Cluster {
    async fn client(&self) -> Result<DynLock> {
        Ok(Arc::new(RedisLock::connect_url(&self.url).await?))
    }

    fn short_ttl(&self) -> Duration {
        Duration::from_millis(300)
    }

    async fn force_expire(&self, lease: &Lease) -> Result<()> {
        let key = format!("{}{}", self.namespace, lease.key().as_str());
        redis::cmd("DEL")
            .arg(&key)
            .query_async::<()>(&mut self.admin.clone())
            .await
            .map_err(|e| lock_core::Error::backend("redis", "force_expire", e))
    }

    async fn unreachable_client(&self) -> Option<DynLock> {
        let mut config = RedisLockConfig::from_url("redis+cluster://127.0.0.1:1").ok()?;
        config.namespace = self.namespace.clone();
        Some(Arc::new(RedisLock::connect_lazy(config).ok()?))
    }

    async fn set_fence_counter(&self, key: &LockKey, value: u64) -> Option<Result<()>> {
        let lock = format!("{}{}", self.namespace, key.as_str());
        if lock.contains(['{', '}']) {
            return None;
        }
        Some(
            redis::cmd("SET")
                .arg(format!("{{{lock}}}\x1ffence"))
                .arg(value)
                .query_async::<()>(&mut self.admin.clone())
                .await
                .map_err(|e| lock_core::Error::backend("redis", "set_fence_counter", e)),
        )
    }
}

async fn setup() -> Option<Harness> {
    backend_url("DISTLOCK_TEST_REDIS_URL")?;
    let cluster = tokio::task::spawn_blocking(support::shared_cluster)
        .await
        .unwrap();
    let url = cluster.url("namespace=conf-cluster:");
    let namespace = RedisLockConfig::from_url(&url).unwrap().namespace;
    let admin = redis::cluster::ClusterClient::new(
        cluster
            .nodes
            .iter()
            .map(|n| format!("redis://{}", n.addr()))
            .collect::<Vec<_>>(),
    )
    .unwrap()
    .get_async_connection()
    .await
    .unwrap();
    Some(Harness::new(Cluster {
        url,
        admin,
        namespace,
    }))
}

conformance::conformance_tests!(setup; skip: {
    waiters_are_served_in_fifo_order: "fair_queue not claimed: the release grants the oldest live waiter, but a waiter that times out and re-queues loses its place",
});

/// A waiter on a Cluster listens on its lock's shard channel (`SSUBSCRIBE`, on the master of
/// the lock's slot only; no classic subscription anywhere) and the release's `SPUBLISH` there
/// wakes it — promptly, although neither its fallback poll (60 s, jittered: 30 s at the
/// earliest) nor the holder's TTL (120 s) would have within the test's window; the channel is
/// unsubscribed when the wait ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_waiters_are_woken_by_their_locks_shard_channel() {
    if backend_url("DISTLOCK_TEST_REDIS_URL").is_none() {
        return;
    }
    let cluster = tokio::task::spawn_blocking(support::shared_cluster)
        .await
        .unwrap();
    let url = cluster.url("namespace=shard-wake:&max_poll_interval=60s");
    // Registered in the queue: its subscription was confirmed before that attempt.
    let q = support::QueuedWaiter::start(&url, "shard-wake").await;
    let (redis_key, pattern) = (q.redis_key.clone(), q.pattern.clone());
    let master = cluster.master_of(redis_key.as_bytes()).unwrap();
    let prefix = format!("{{{redis_key}}}\x1fwake:");
    for node in &cluster.nodes {
        let shard = support::pubsub_channels(node.port, "SHARDCHANNELS", pattern.as_bytes()).await;
        let classic = support::pubsub_channels(node.port, "CHANNELS", pattern.as_bytes()).await;
        assert!(
            classic.is_empty(),
            "a classic subscription on {}",
            node.port
        );
        let all_classic = support::pubsub_channels(node.port, "CHANNELS", b"*wake*").await;
        assert!(
            all_classic.is_empty(),
            "a classic wake channel on {}",
            node.port
        );
        if node.port == master {
            assert_eq!(shard.len(), 1, "one shard channel on the slot's master");
            assert!(shard[0].starts_with(prefix.as_bytes()), "{:?}", shard[0]);
        } else {
            assert!(
                shard.is_empty(),
                "a shard channel on {} (not the slot's master)",
                node.port
            );
        }
    }
    let (b, got) = q.release_wakes_the_waiter("the release's SPUBLISH").await;
    // The wait is over: its shard channel is given up.
    let until = Instant::now() + Duration::from_secs(10);
    while !support::pubsub_channels(master, "SHARDCHANNELS", pattern.as_bytes())
        .await
        .is_empty()
    {
        assert!(
            Instant::now() < until,
            "the shard channel stayed subscribed"
        );
        sleep(Duration::from_millis(20)).await;
    }
    assert!(b.release(&got).await.unwrap());
}
