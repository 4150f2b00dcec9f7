//! A conformance harness on a Sentinel set (`redis+sentinel://…`).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::{sync::Arc, time::Duration};

use conformance::{Harness, TestBackend, backend_url};
use lock_core::{DynLock, Lease, LockKey, Result};
use lock_redis::{RedisLock, RedisLockConfig};

pub struct Sentinel {
    url: String,
    /// A connection to the master for fault injection (the set is never failed over here).
    admin: redis::aio::MultiplexedConnection,
    namespace: String,
}

#[conformance::async_trait]
impl TestBackend for Sentinel {
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
        let mut config = RedisLockConfig::from_url("redis+sentinel://127.0.0.1:1/nobody").ok()?;
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

/// A harness on the binary's shared Sentinel set, clients connecting with `options`.
pub async fn sentinel_harness(options: &str) -> Option<Harness> {
    // Gated like every backend test: a run without servers skips, a required run fails.
    backend_url("DISTLOCK_TEST_REDIS_URL")?;
    let set = tokio::task::spawn_blocking(super::shared_sentinel)
        .await
        .unwrap();
    let url = set.url(options);
    let namespace = RedisLockConfig::from_url(&url).unwrap().namespace;
    let master = set.master_port().unwrap();
    let admin = redis::Client::open(format!("redis://127.0.0.1:{master}"))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    Some(Harness::new(Sentinel {
        url,
        admin,
        namespace,
    }))
}
