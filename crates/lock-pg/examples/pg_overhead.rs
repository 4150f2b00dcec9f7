//! Uncontended acquire+release cost of `PgLock` next to the bare SQL it wraps, in one process.
//!
//! ```text
//! DISTLOCK_TEST_PG_URL=postgres://postgres@127.0.0.1:25432/distlock \
//!     cargo run --release -p lock-pg --example pg_overhead [-- CYCLES]
//! ```
//!
//! Runs on a tokio **current-thread** runtime. Each round runs one cycle of every variant, in
//! rotating order, so drift on the machine hits all of them alike:
//! * `distlock`: `PgLock::try_acquire` + `release` (release with `synchronous_commit = off`, the
//!   default),
//! * `distlock sync release`: the same with `async_release=false` (two durable commits),
//! * `bare SQL`: the same upsert and a guarded `UPDATE … SET owner = NULL` on one plain sqlx
//!   connection (two durable commits, no driver logic),
//! * `advisory`: `pg_try_advisory_lock` + `pg_advisory_unlock` on one plain sqlx connection
//!   (no TTL, no fencing, session-bound, no commit at all).

use std::time::{Duration, Instant};

use lock_core::{DistributedLock, LockKey, OwnershipToken};
use lock_pg::{PgLock, PgLockConfig, sqlx};
use sqlx::{Connection, PgConnection};

const WARMUP: usize = 200;

fn with_query(url: &str, query: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{query}")
}

fn summary(name: &str, samples: &mut [Duration]) -> Duration {
    samples.sort();
    let median = samples[samples.len() / 2];
    let p99 = samples[(samples.len() * 99 / 100).min(samples.len() - 1)];
    println!(
        "{name:<24} median {:>7.1} µs   p99 {:>7.1} µs",
        median.as_secs_f64() * 1e6,
        p99.as_secs_f64() * 1e6
    );
    median
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DISTLOCK_TEST_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:25432/distlock".to_owned());
    let cycles: usize = std::env::args()
        .nth(1)
        .map(|n| n.parse())
        .transpose()?
        .unwrap_or(2000);

    let lock = PgLock::connect(PgLockConfig::from_url(&url)?).await?;
    let sync_lock = PgLock::connect(PgLockConfig::from_url(&with_query(
        &url,
        "async_release=false",
    ))?)
    .await?;
    let mut bare = PgConnection::connect(&url).await?;
    let mut advisory = PgConnection::connect(&url).await?;

    let run = rand::random::<u64>();
    let key = LockKey::new(format!("bench/overhead/{run:016x}"))?;
    let sync_key = LockKey::new(format!("bench/overhead-sync/{run:016x}"))?;
    let bare_key = format!("bench/overhead-bare/{run:016x}");
    let advisory_key = i64::from_ne_bytes(run.to_ne_bytes());
    let ttl = Duration::from_secs(30);

    let upsert = "INSERT INTO distlock_leases AS l (name, owner, fence, expires_at) \
                  VALUES ($1, $2, 1, clock_timestamp() + $3::bigint * interval '1 microsecond') \
                  ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, fence = l.fence + 1, \
                  expires_at = clock_timestamp() + $3::bigint * interval '1 microsecond' \
                  WHERE l.owner IS NULL OR l.expires_at <= clock_timestamp() RETURNING l.fence";
    let delete = "UPDATE distlock_leases SET owner = NULL, expires_at = clock_timestamp() \
                  WHERE name = $1 AND owner = $2";

    let mut results: [Vec<Duration>; 4] = Default::default();
    for round in 0..WARMUP + cycles {
        for step in 0..4 {
            let variant = (round + step) % 4;
            let start = Instant::now();
            match variant {
                0 | 1 => {
                    let (l, k) = if variant == 0 {
                        (&lock, &key)
                    } else {
                        (&sync_lock, &sync_key)
                    };
                    let lease = l.try_acquire(k, ttl).await?.ok_or("held")?;
                    if !l.release(&lease).await? {
                        return Err("release reported false".into());
                    }
                }
                2 => {
                    let token = OwnershipToken::generate().expose_hex();
                    let fence: Option<i64> = sqlx::query_scalar(upsert)
                        .bind(&bare_key)
                        .bind(&token)
                        .bind(30_000_000_i64)
                        .fetch_optional(&mut bare)
                        .await?;
                    fence.ok_or("held")?;
                    sqlx::query(delete)
                        .bind(&bare_key)
                        .bind(&token)
                        .execute(&mut bare)
                        .await?;
                }
                _ => {
                    let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
                        .bind(advisory_key)
                        .fetch_one(&mut advisory)
                        .await?;
                    if !got {
                        return Err("advisory lock held".into());
                    }
                    let _: bool = sqlx::query_scalar("SELECT pg_advisory_unlock($1)")
                        .bind(advisory_key)
                        .fetch_one(&mut advisory)
                        .await?;
                }
            }
            if round >= WARMUP {
                results[variant].push(start.elapsed());
            }
        }
    }

    println!(
        "{cycles} uncontended acquire+release cycles each, after {WARMUP} warm-up rounds; tokio current-thread runtime"
    );
    let [d, ds, b, a] = &mut results;
    let d = summary("distlock", d);
    let ds = summary("distlock sync release", ds);
    let b = summary("bare SQL (2 commits)", b);
    let a = summary("advisory lock+unlock", a);
    println!(
        "ratio distlock / bare SQL: {:.2}   distlock sync release / bare SQL: {:.2}   distlock / advisory: {:.2}",
        d.as_secs_f64() / b.as_secs_f64(),
        ds.as_secs_f64() / b.as_secs_f64(),
        d.as_secs_f64() / a.as_secs_f64()
    );
    Ok(())
}
