//! Hand-off latency of `PgLock` with several waiters on one key, and what it costs the server.
//!
//! ```text
//! DISTLOCK_TEST_PG_URL=postgres://postgres@127.0.0.1:25432/distlock \
//!     cargo run --release -p lock-pg --example handoff [-- WAITERS [HANDOFFS]]
//! ```
//!
//! As the bench's section 3: every client loops on `acquire`, holds 2 ms and releases; a client
//! that released waits until someone else holds before queueing again, so every hand-off goes
//! to a waiter. Prints the hand-off latency (from the holder starting `release` to the next
//! holder's `acquire` returning), the holder's `release` alone, and the statements all clients
//! sent per hand-off (each one transaction). Needs at least 2 clients.

use std::{
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use lock_core::{DistributedLock, LockKey};
use lock_pg::PgLock;
use tokio::{
    sync::watch,
    time::{Instant, sleep, timeout},
};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DISTLOCK_TEST_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:25432/distlock".to_owned());
    let mut args = std::env::args().skip(1);
    let waiters: usize = args.next().map(|n| n.parse()).transpose()?.unwrap_or(8);
    let handoffs: usize = args.next().map(|n| n.parse()).transpose()?.unwrap_or(200);
    let mut clients = Vec::new();
    for _ in 0..waiters {
        clients.push(Arc::new(PgLock::connect_url(&url).await?));
    }
    let key = LockKey::new(format!("handoff-example-{:x}", rand::random::<u64>()))?;
    let ttl = Duration::from_secs(10);
    let released_at: Arc<Mutex<Option<Instant>>> = Arc::default();
    let samples: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let release_samples: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let remaining = Arc::new(AtomicUsize::new(handoffs + 1));
    let (grants, _) = watch::channel(0u64);
    let grants = Arc::new(grants);
    let (done, _) = watch::channel(false);
    let done = Arc::new(done);
    let statements_before: u64 = clients.iter().map(|c| c.statements_sent()).sum();
    let mut tasks = Vec::new();
    for client in &clients {
        let release_samples = release_samples.clone();
        let (client, key, released_at, samples, remaining, grants, done) = (
            client.clone(),
            key.clone(),
            released_at.clone(),
            samples.clone(),
            remaining.clone(),
            grants.clone(),
            done.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut seen = grants.subscribe();
            let mut finished = done.subscribe();
            loop {
                if remaining.load(Ordering::SeqCst) == 0 {
                    return Ok::<(), lock_core::Error>(());
                }
                let deadline = Instant::now() + Duration::from_secs(30);
                let lease = tokio::select! {
                    lease = client.acquire(&key, ttl, deadline) => lease?,
                    _ = finished.wait_for(|d| *d) => return Ok(()),
                };
                let now = Instant::now();
                if remaining.load(Ordering::SeqCst) == 0 {
                    client.release(&lease).await?;
                    return Ok(());
                }
                if let Some(t) = released_at
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .take()
                {
                    samples
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .push(now - t);
                }
                grants.send_modify(|g| *g += 1);
                seen.borrow_and_update();
                remaining.fetch_sub(1, Ordering::SeqCst);
                sleep(Duration::from_millis(2)).await;
                let start = Instant::now();
                *released_at.lock().unwrap_or_else(PoisonError::into_inner) = Some(start);
                client.release(&lease).await?;
                release_samples
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(start.elapsed());
                if remaining.load(Ordering::SeqCst) == 0 {
                    done.send_replace(true);
                    return Ok(());
                }
                let _ = timeout(Duration::from_secs(5), seen.changed()).await;
            }
        }));
    }
    for t in tasks {
        t.await??;
    }
    let statements: u64 =
        clients.iter().map(|c| c.statements_sent()).sum::<u64>() - statements_before;
    let mut samples = std::mem::take(&mut *samples.lock().unwrap_or_else(PoisonError::into_inner));
    samples.sort();
    if samples.is_empty() {
        return Err("no hand-off measured".into());
    }
    let median = samples[samples.len() / 2];
    let p99 = samples[(samples.len() * 99 / 100).min(samples.len() - 1)];
    let deciles: Vec<u128> = (1..10)
        .map(|d| samples[samples.len() * d / 10].as_micros())
        .collect();
    let mut releases = std::mem::take(
        &mut *release_samples
            .lock()
            .unwrap_or_else(PoisonError::into_inner),
    );
    releases.sort();
    println!(
        "{waiters} clients, {} hand-offs: median {:.0} µs, p99 {:.0} µs (release alone: median {:.0} µs); \
         {:.1} statements per hand-off",
        samples.len(),
        median.as_secs_f64() * 1e6,
        p99.as_secs_f64() * 1e6,
        releases[releases.len() / 2].as_secs_f64() * 1e6,
        statements as f64 / handoffs as f64
    );
    println!("hand-off deciles µs: {deciles:?}");
    Ok(())
}
