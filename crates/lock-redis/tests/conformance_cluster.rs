//! The whole conformance suite against a private Redis Cluster of 3 masters and 3 replicas
//! (`support`), reached as `redis+cluster://seed1,seed2,seed3`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed expectation is a failed test

mod support;

use std::{sync::Arc, time::Duration};

use conformance::{Harness, TestBackend, backend_url};
use lock_core::{DynLock, Lease, LockKey, Result};
use lock_redis::{RedisLock, RedisLockConfig};
use redis::cluster_async::ClusterConnection;

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
