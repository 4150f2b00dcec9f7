//! Helpers shared by lock-core's integration tests.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed expectation is a failed test

use std::time::Duration;

use futures::{StreamExt, TryStreamExt, stream};
use lock_core::{DistributedLockExt, DynLock, LockGuard};

/// `n` guards of `lock` on fresh keys `<prefix>/<i>`, taken 16 at a time.
pub async fn hold(lock: &DynLock, prefix: &str, n: usize, ttl: Duration) -> Vec<LockGuard> {
    stream::iter(0..n)
        .map(|i| {
            let lock = lock.clone();
            async move {
                lock.lock(format!("{prefix}/{i}"))
                    .ttl(ttl)
                    .try_acquire()
                    .await
                    .map(|g| g.expect("a fresh key is free"))
            }
        })
        .buffered(16)
        .try_collect()
        .await
        .unwrap()
}
