//! Cancellation timing variants (issue 19) on every backend: each operation (`try_acquire`,
//! `acquire` with the grant on its way, `renew`, `release`, `force_release`, `inspect`,
//! `run_exclusive`, and the guard's background renewal) dropped while its request or its reply
//! is in flight, then the checks of the drops at every poll (see `conformance::properties::
//! delayed`). The network backends' slow client is behind a drill proxy that delays one
//! direction; the in-memory reference's is behind a wrapper that delays each request (an
//! in-process coordinator has no reply in flight to delay). Needs `--features drivers` for the
//! network backends (as every drill).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed expectation is a failed test

mod drill_support;

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use conformance::{
    drill::Proxy,
    properties::delayed::{self, Delayed, Link},
};
use drill_support::{Backend, TTL};
use futures::future::BoxFuture;
use lock_core::{
    Capabilities, DynLock, FencingToken, HolderInfo, InMemoryLock, Lease, LockKey, LossReason,
    Result,
};
use tokio::time::{Instant, sleep};

/// The slow link's delay: one round trip's worth, well under the drills' 500 ms request
/// timeouts, long enough that a drop at half of it lands inside on a loaded machine.
const DELAY: Duration = Duration::from_millis(50);

async fn network(backend: Backend) {
    let Some(url) = backend.shared_url() else {
        drill_support::skip("cancel_delayed", backend, "no server URL set");
        return;
    };
    let (proxy, proxied) = Proxy::start_for_url(&url).await.expect("start a proxy");
    let d = Delayed {
        name: backend.name(),
        slow: drill_support::client(&proxied).await,
        link: Arc::new(proxy),
        other: drill_support::client(&url).await,
        third: drill_support::client(&url).await,
        short_ttl: TTL,
        delay: DELAY,
    };
    delayed::all(&d).await;
}

#[test]
fn redis() {
    drill_support::block_on(network(Backend::Redis));
}

#[test]
fn etcd() {
    drill_support::block_on(network(Backend::Etcd));
}

#[test]
fn zk() {
    drill_support::block_on(network(Backend::Zk));
}

#[test]
fn pg() {
    drill_support::block_on(network(Backend::Pg));
}

/// The in-memory client's slow link: every call waits `delay` before it reaches the coordinator.
#[derive(Default)]
struct SlowRequests {
    delay: Mutex<Duration>,
    requests: AtomicU64,
}

impl Link for SlowRequests {
    fn delay_replies(&self, _delay: Duration) {
        unreachable!("delays_replies is false")
    }
    fn delay_requests(&self, delay: Duration) {
        *self.delay.lock().unwrap() = delay;
    }
    fn pass(&self) {
        *self.delay.lock().unwrap() = Duration::ZERO;
    }
    fn requests(&self) -> u64 {
        self.requests.load(Ordering::SeqCst)
    }
    fn delays_replies(&self) -> bool {
        false
    }
}

#[derive(Debug)]
struct Slow {
    inner: DynLock,
    link: Arc<SlowRequests>,
}

impl std::fmt::Debug for SlowRequests {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlowRequests").finish_non_exhaustive()
    }
}

impl Slow {
    /// The request is sent now and reaches the coordinator after the current delay.
    async fn send(&self) {
        self.link.requests.fetch_add(1, Ordering::SeqCst);
        let delay = *self.link.delay.lock().unwrap();
        if !delay.is_zero() {
            sleep(delay).await;
        }
    }
}

#[conformance::async_trait]
impl lock_core::raw::Driver for Slow {
    fn backend_name(&self) -> &'static str {
        self.inner.backend_name()
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn try_acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>> {
        self.send().await;
        self.inner.try_acquire(key, ttl).await
    }

    async fn acquire(&self, key: &LockKey, ttl: Duration, deadline: Instant) -> Result<Lease> {
        self.send().await;
        self.inner.acquire(key, ttl, deadline).await
    }

    async fn renew(&self, lease: &mut Lease, ttl: Duration) -> Result<()> {
        self.send().await;
        self.inner.renew(lease, ttl).await
    }

    async fn release(&self, lease: &Lease) -> Result<bool> {
        self.send().await;
        self.inner.release(lease).await
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        self.send().await;
        self.inner.inspect(key).await
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        self.send().await;
        self.inner.force_release(key).await
    }

    async fn force_release_grant(&self, key: &LockKey, holder: FencingToken) -> Result<bool> {
        self.send().await;
        self.inner.force_release_grant(key, holder).await
    }

    fn watch_lost(&self, lease: &Lease) -> BoxFuture<'static, LossReason> {
        self.inner.watch_lost(lease)
    }
}

#[test]
fn memory() {
    drill_support::block_on(async {
        let coordinator = InMemoryLock::new();
        let link = Arc::new(SlowRequests::default());
        let slow: DynLock = Arc::new(Slow {
            inner: Arc::new(coordinator.client()),
            link: link.clone(),
        });
        let d = Delayed {
            name: "memory",
            slow,
            link,
            other: Arc::new(coordinator.client()),
            third: Arc::new(coordinator.client()),
            short_ttl: Duration::from_millis(300),
            delay: DELAY,
        };
        delayed::all(&d).await;
    });
}
