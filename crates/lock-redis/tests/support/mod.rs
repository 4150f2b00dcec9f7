//! Private Redis topologies for the tests that need them (`conformance::servers::redis`, which
//! `distlock-bench --redis-topologies` shares: every process started and faulted through
//! `scripts/backends.sh`), and the sets kept for a whole test binary.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

pub mod sentinel_harness;

use std::sync::OnceLock;

pub use conformance::servers::redis::*;

/// One Sentinel set for the whole test binary (never failed over by the tests using it).
pub fn shared_sentinel() -> &'static SentinelSet {
    static SET: OnceLock<SentinelSet> = OnceLock::new();
    SET.get_or_init(|| SentinelSet::start(false))
}

/// One Cluster for the whole test binary (never broken by the tests using it).
pub fn shared_cluster() -> &'static Cluster {
    static CLUSTER: OnceLock<Cluster> = OnceLock::new();
    CLUSTER.get_or_init(Cluster::start)
}

/// Three masters for the whole test binary.
pub fn shared_masters() -> &'static Masters {
    static MASTERS: OnceLock<Masters> = OnceLock::new();
    MASTERS.get_or_init(Masters::start)
}

/// `PUBSUB <kind> <pattern>` on one node (`kind`: `SHARDCHANNELS` or `CHANNELS`).
pub async fn pubsub_channels(port: u16, kind: &str, pattern: &[u8]) -> Vec<Vec<u8>> {
    let mut c = redis::Client::open(format!("redis://127.0.0.1:{port}"))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    redis::cmd("PUBSUB")
        .arg(kind)
        .arg(pattern)
        .query_async(&mut c)
        .await
        .unwrap()
}

/// A lock held by `holder` (120 s TTL) with one waiter queued behind it (a 50 s wait), for the
/// wake-up tests: the waiter's subscription was confirmed before its registering attempt.
pub struct QueuedWaiter {
    pub holder: lock_redis::RedisLock,
    pub waiter_client: lock_redis::RedisLock,
    pub key: lock_core::LockKey,
    pub lease: lock_core::Lease,
    pub waiter:
        tokio::task::JoinHandle<(tokio::time::Instant, lock_core::Result<lock_core::Lease>)>,
    /// The lock's Redis key, and a `PUBSUB` pattern matching every channel in its hash slot.
    pub redis_key: String,
    pub pattern: String,
}

impl QueuedWaiter {
    /// Two clients of `url`: the first takes a fresh key labelled `label`, the second waits for
    /// it, and this returns once the waiter is registered in the queue.
    pub async fn start(url: &str, label: &str) -> Self {
        use lock_core::DistributedLock;
        use std::time::Duration;
        use tokio::time::{Instant, sleep};
        let holder = lock_redis::RedisLock::connect_url(url).await.unwrap();
        let waiter_client = lock_redis::RedisLock::connect_url(url).await.unwrap();
        let key = conformance::fresh_key(label);
        let ttl = Duration::from_secs(120);
        let lease = holder.try_acquire(&key, ttl).await.unwrap().unwrap();
        let waiter = {
            let (b, key) = (waiter_client.clone(), key.clone());
            tokio::spawn(async move {
                let got = b
                    .acquire(&key, ttl, Instant::now() + Duration::from_secs(50))
                    .await;
                (Instant::now(), got)
            })
        };
        let until = Instant::now() + Duration::from_secs(10);
        while holder.inspect(&key).await.unwrap().and_then(|h| h.waiters) != Some(1) {
            assert!(Instant::now() < until, "the waiter never queued");
            sleep(Duration::from_millis(10)).await;
        }
        let redis_key = holder.redis_key(&key);
        let pattern = format!("*{{{redis_key}}}*");
        Self {
            holder,
            waiter_client,
            key,
            lease,
            waiter,
            redis_key,
            pattern,
        }
    }

    /// The holder releases; the waiter, whose fallback poll is 60 s (the first at 30 s at the
    /// earliest), must be granted within 15 s and after the release, with a greater fence.
    /// Returns the waiter's lease.
    pub async fn release_wakes_the_waiter(
        self,
        what: &str,
    ) -> (lock_redis::RedisLock, lock_core::Lease) {
        use lock_core::DistributedLock;
        use std::time::Duration;
        let released_at = tokio::time::Instant::now();
        assert!(self.holder.release(&self.lease).await.unwrap());
        let (granted_at, got) = tokio::time::timeout(Duration::from_secs(15), self.waiter)
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "{what} wakes the waiter (its poll is 60 s, the first at 30 s at the earliest)"
                )
            })
            .unwrap();
        let got = got.unwrap();
        assert!(granted_at >= released_at);
        assert!(got.fencing_token().unwrap() > self.lease.fencing_token().unwrap());
        (self.waiter_client, got)
    }
}
