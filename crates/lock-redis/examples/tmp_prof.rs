#![allow(clippy::unwrap_used, clippy::expect_used)]
use lock_core::{DistributedLock, LockKey};
use lock_redis::RedisLock;
use std::time::{Duration, Instant};
fn main() {
    let url = std::env::var("DISTLOCK_TEST_REDIS_URL").unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let lock = RedisLock::connect_url(&url).await.unwrap();
        let key = LockKey::new(format!("prof/{:x}", rand::random::<u64>())).unwrap();
        let n: usize = std::env::args()
            .nth(1)
            .map(|s| s.parse().unwrap())
            .unwrap_or(20000);
        let t = Instant::now();
        for _ in 0..n {
            let l = lock
                .try_acquire(&key, Duration::from_secs(30))
                .await
                .unwrap()
                .unwrap();
            assert!(lock.release(&l).await.unwrap());
        }
        let el = t.elapsed();
        eprintln!("{n} cycles, {:?} per cycle", el / n as u32);
    });
}
