//! What distlock costs over the bare protocol: N uncontended acquire+release cycles with
//! `RedisLock` (`try_acquire` + `release`: one EVALSHA each) interleaved with the same two round
//! trips done with bare `redis` crate calls (`SET key token NX PX ttl` + an EVALSHA
//! compare-and-delete), in one process, on a tokio **current-thread** runtime.
//!
//! ```text
//! eval "$(scripts/backends.sh env)"
//! cargo run --release -p lock-redis --example redis_overhead [N]
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark: fail loudly

use std::time::{Duration, Instant};

use lock_core::{DistributedLock, LockKey, OwnershipToken};
use lock_redis::RedisLock;

const WARMUP: usize = 200;
const TTL: Duration = Duration::from_secs(30);

const BARE_RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
";

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse().expect("N must be a number"))
        .unwrap_or(2000);
    let url = std::env::var("DISTLOCK_TEST_REDIS_URL")
        .unwrap_or_else(|_| "redis://127.0.0.1:26379".to_owned());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(run(&url, n));
}

async fn run(url: &str, n: usize) {
    let lock = RedisLock::connect_url(url).await.unwrap();
    let mut bare = redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let release = redis::Script::new(BARE_RELEASE);
    let suffix: u64 = rand::random();
    let key = LockKey::new(format!("overhead/{suffix:016x}")).unwrap();
    let bare_key = format!("overhead-bare:{suffix:016x}");
    let ttl_ms = u64::try_from(TTL.as_millis()).unwrap();

    let mut ours = Vec::with_capacity(n);
    let mut theirs = Vec::with_capacity(n);
    for i in 0..WARMUP + n {
        let distlock = async {
            let start = Instant::now();
            let lease = lock.try_acquire(&key, TTL).await.unwrap().expect("free");
            assert!(lock.release(&lease).await.unwrap());
            start.elapsed()
        };
        let plain = async {
            let start = Instant::now();
            let token = OwnershipToken::generate().expose_hex();
            let set: Option<String> = redis::cmd("SET")
                .arg(&bare_key)
                .arg(&token)
                .arg("NX")
                .arg("PX")
                .arg(ttl_ms)
                .query_async(&mut bare)
                .await
                .unwrap();
            assert!(set.is_some(), "free");
            let deleted: i64 = release
                .key(&bare_key)
                .arg(&token)
                .invoke_async(&mut bare.clone())
                .await
                .unwrap();
            assert_eq!(deleted, 1);
            start.elapsed()
        };
        // Alternate the order so neither side always runs on a warmer connection.
        let (a, b) = if i % 2 == 0 {
            let a = distlock.await;
            (a, plain.await)
        } else {
            let b = plain.await;
            (distlock.await, b)
        };
        if i >= WARMUP {
            ours.push(a);
            theirs.push(b);
        }
    }
    let (om, op) = stats(&mut ours);
    let (bm, bp) = stats(&mut theirs);
    println!(
        "runtime: tokio current_thread; {n} uncontended acquire+release cycles after {WARMUP} warm-up, interleaved"
    );
    println!(
        "server:  {}",
        lock.config().host.clone() + ":" + &lock.config().port.to_string()
    );
    println!(
        "distlock RedisLock  (EVALSHA acquire + EVALSHA release): median {:>7.1} µs  p99 {:>7.1} µs",
        micros(om),
        micros(op)
    );
    println!(
        "bare redis crate    (SET NX PX + EVALSHA compare-del):   median {:>7.1} µs  p99 {:>7.1} µs",
        micros(bm),
        micros(bp)
    );
    println!(
        "ratio distlock/bare: median {:.2}x  p99 {:.2}x",
        micros(om) / micros(bm),
        micros(op) / micros(bp)
    );
}

fn stats(samples: &mut [Duration]) -> (Duration, Duration) {
    samples.sort();
    let median = samples[samples.len() / 2];
    let p99 = samples[(samples.len() * 99 / 100).min(samples.len() - 1)];
    (median, p99)
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}
