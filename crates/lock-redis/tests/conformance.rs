//! The whole conformance suite against a real Redis (`DISTLOCK_TEST_REDIS_URL`).
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed expectation is a failed test

use std::{sync::Arc, time::Duration};

use conformance::{Harness, TestBackend, backend_url};
use lock_core::{DynLock, Lease, LockKey, Result};
use lock_redis::{RedisLock, RedisLockConfig};

struct Redis {
    url: String,
    /// A separate connection for fault injection (the "operator"), not one of the clients.
    admin: redis::aio::MultiplexedConnection,
    namespace: String,
}

#[conformance::async_trait]
impl TestBackend for Redis {
    async fn client(&self) -> Result<DynLock> {
        Ok(Arc::new(RedisLock::connect_url(&self.url).await?))
    }

    fn short_ttl(&self) -> Duration {
        Duration::from_millis(300)
    }

    async fn force_expire(&self, lease: &Lease) -> Result<()> {
        let key = format!("{}{}", self.namespace, lease.key().as_str());
        let mut admin = self.admin.clone();
        redis::cmd("DEL")
            .arg(&key)
            .query_async::<()>(&mut admin)
            .await
            .map_err(|e| lock_core::Error::backend("redis", "force_expire", e))
    }

    async fn unreachable_client(&self) -> Option<DynLock> {
        let mut config = RedisLockConfig::from_url("redis://127.0.0.1:1").ok()?;
        config.namespace = self.namespace.clone();
        Some(Arc::new(RedisLock::connect_lazy(config).ok()?))
    }

    /// `SET` of the fence counter, `{<namespace><key>}\x1ffence` for a key without braces
    /// (the driver's naming, `keys.rs`).
    async fn set_fence_counter(&self, key: &LockKey, value: u64) -> Option<Result<()>> {
        let lock = format!("{}{}", self.namespace, key.as_str());
        if lock.contains(['{', '}']) {
            return None;
        }
        let counter = format!("{{{lock}}}\x1ffence");
        let mut admin = self.admin.clone();
        Some(
            redis::cmd("SET")
                .arg(&counter)
                .arg(value)
                .query_async::<()>(&mut admin)
                .await
                .map_err(|e| lock_core::Error::backend("redis", "set_fence_counter", e)),
        )
    }
}

async fn setup() -> Option<Harness> {
    let url = backend_url("DISTLOCK_TEST_REDIS_URL")?;
    let namespace = RedisLockConfig::from_url(&url)
        .expect("DISTLOCK_TEST_REDIS_URL")
        .namespace;
    let admin = redis::Client::open(url.as_str())
        .expect("redis url")
        .get_multiplexed_async_connection()
        .await
        .expect("the redis server answers");
    Some(Harness::new(Redis {
        url,
        admin,
        namespace,
    }))
}

conformance::conformance_tests!(setup; skip: {
    waiters_are_served_in_fifo_order: "fair_queue not claimed: the release grants the oldest live waiter, but a waiter that times out and re-queues loses its place",
});
