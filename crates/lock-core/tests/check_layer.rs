//! The check layer between [`DistributedLock`] and a [`Driver`]: bad input and missing
//! capabilities are refused before the driver is called (the driver here counts its calls and
//! would grant anything), and what the layer lets through reaches the driver unchanged.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed expectation is a failed test

use std::{
    sync::atomic::{AtomicUsize, Ordering},
    time::Duration,
};

use lock_core::{
    Capabilities, DistributedLock, Error, FencingToken, HolderInfo, Lease, LockKey, OwnershipToken,
    Result,
    raw::{Driver, async_trait},
};
use tokio::time::Instant;

/// Grants everything and counts what reached it. `caps` says what it claims.
#[derive(Debug)]
struct Counting {
    caps: Capabilities,
    calls: AtomicUsize,
}

impl Counting {
    fn new(caps: Capabilities) -> Self {
        Self {
            caps,
            calls: AtomicUsize::new(0),
        }
    }

    fn called(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    fn lease(key: &LockKey, ttl: Duration) -> Lease {
        Lease::new(
            key.clone(),
            OwnershipToken::generate(),
            Some(FencingToken(1)),
            ttl,
            Instant::now(),
        )
    }
}

#[async_trait]
impl Driver for Counting {
    fn backend_name(&self) -> &'static str {
        "counting"
    }

    fn capabilities(&self) -> Capabilities {
        self.caps
    }

    async fn try_acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        Ok(Some(Self::lease(key, ttl)))
    }

    async fn acquire(&self, key: &LockKey, ttl: Duration, _deadline: Instant) -> Result<Lease> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        Ok(Self::lease(key, ttl))
    }

    async fn renew(&self, lease: &mut Lease, ttl: Duration) -> Result<()> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        lease.renewed(ttl, Instant::now());
        Ok(())
    }

    async fn release(&self, _lease: &Lease) -> Result<bool> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        Ok(true)
    }

    async fn inspect(&self, _key: &LockKey) -> Result<Option<HolderInfo>> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        Ok(None)
    }

    async fn force_release(&self, _key: &LockKey) -> Result<bool> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        Ok(true)
    }

    async fn force_release_grant(&self, _key: &LockKey, _holder: FencingToken) -> Result<bool> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        Ok(true)
    }
}

/// The user's view of a driver: the check layer, as a caller sees it (a file that imports both
/// traits must say which one it calls).
fn user(d: &Counting) -> &dyn DistributedLock {
    d
}

fn caps() -> Capabilities {
    Capabilities {
        renew: true,
        force_release: true,
        min_ttl: Duration::from_secs(2),
        max_ttl: Duration::from_secs(60),
        ..Default::default()
    }
}

fn key() -> LockKey {
    LockKey::new("check-layer").unwrap()
}

#[tokio::test]
async fn ttls_the_capabilities_refuse_never_reach_the_driver() {
    let d = Counting::new(caps());
    let later = Instant::now() + Duration::from_secs(1);
    for ttl in [
        Duration::ZERO,
        Duration::from_millis(1999),
        Duration::from_secs(61),
        Capabilities::MAX_TTL + Duration::from_secs(1),
    ] {
        let got = user(&d).try_acquire(&key(), ttl).await;
        assert!(
            matches!(got, Err(Error::InvalidTtl { .. })),
            "{ttl:?}: {got:?}"
        );
        let got = user(&d).acquire(&key(), ttl, later).await;
        assert!(
            matches!(got, Err(Error::InvalidTtl { .. })),
            "{ttl:?}: {got:?}"
        );
    }
    assert_eq!(d.called(), 0, "a refused ttl reached the driver");
    // Through a `DynLock` too.
    let dynamic: lock_core::DynLock = std::sync::Arc::new(Counting::new(caps()));
    assert!(matches!(
        dynamic.try_acquire(&key(), Duration::ZERO).await,
        Err(Error::InvalidTtl { .. })
    ));
    // What the capabilities accept reaches it, unchanged.
    let lease = user(&d)
        .try_acquire(&key(), Duration::from_secs(2))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(lease.ttl(), Duration::from_secs(2));
    user(&d)
        .acquire(&key(), Duration::from_secs(60), later)
        .await
        .unwrap();
    assert_eq!(d.called(), 2);
}

#[tokio::test]
async fn a_renew_ttl_is_checked_against_the_capabilities_or_the_lease_itself() {
    let d = Counting::new(caps());
    let mut lease = user(&d)
        .try_acquire(&key(), Duration::from_secs(10))
        .await
        .unwrap()
        .unwrap();
    let before = d.called();
    for ttl in [
        Duration::ZERO,
        Duration::from_secs(1),
        Duration::from_secs(61),
    ] {
        let got = user(&d).renew(&mut lease, ttl).await;
        assert!(
            matches!(got, Err(Error::InvalidTtl { .. })),
            "{ttl:?}: {got:?}"
        );
    }
    assert_eq!(d.called(), before, "a refused renew ttl reached the driver");
    user(&d)
        .renew(&mut lease, Duration::from_secs(5))
        .await
        .unwrap();
    // A lease the driver granted below `min_ttl` (a server that lowered it) renews with its
    // own TTL or more, never with less.
    let mut short = Counting::lease(&key(), Duration::from_millis(1500));
    user(&d)
        .renew(&mut short, Duration::from_millis(1500))
        .await
        .unwrap();
    let got = user(&d)
        .renew(&mut short, Duration::from_millis(1400))
        .await;
    assert!(matches!(got, Err(Error::InvalidTtl { .. })), "{got:?}");
    assert_eq!(d.called(), before + 2);
}

#[tokio::test]
async fn operations_a_backend_does_not_claim_are_unsupported_before_any_call() {
    let d = Counting::new(Capabilities {
        renew: false,
        force_release: false,
        ..caps()
    });
    let mut lease = Counting::lease(&key(), Duration::from_secs(10));
    assert!(matches!(
        user(&d).renew(&mut lease, Duration::from_secs(10)).await,
        Err(Error::Unsupported { .. })
    ));
    assert!(matches!(
        user(&d).force_release(&key()).await,
        Err(Error::Unsupported { .. })
    ));
    assert!(matches!(
        user(&d).force_release_grant(&key(), FencingToken(1)).await,
        Err(Error::Unsupported { .. })
    ));
    assert_eq!(d.called(), 0);
    // Release and inspect need no capability.
    assert!(user(&d).release(&lease).await.unwrap());
    assert!(user(&d).inspect(&key()).await.unwrap().is_none());
    assert_eq!(d.called(), 2);
}

/// Implements only what a driver must; claims force_release and relabel anyway.
#[derive(Debug)]
struct ClaimsWithoutImplementing;

#[async_trait]
impl Driver for ClaimsWithoutImplementing {
    fn backend_name(&self) -> &'static str {
        "claims"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            force_release: true,
            relabel: true,
            ..caps()
        }
    }

    async fn try_acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>> {
        Ok(Some(Counting::lease(key, ttl)))
    }

    async fn renew(&self, lease: &mut Lease, ttl: Duration) -> Result<()> {
        lease.renewed(ttl, Instant::now());
        Ok(())
    }

    async fn release(&self, _lease: &Lease) -> Result<bool> {
        Ok(true)
    }

    async fn inspect(&self, _key: &LockKey) -> Result<Option<HolderInfo>> {
        Ok(None)
    }
}

/// A driver that claims an operator override or a relabel but never implemented it gets the
/// trait's defaults: `Unsupported`, never a reported success for something that did not happen.
#[tokio::test]
async fn a_claimed_operation_the_driver_does_not_implement_is_unsupported_not_a_success() {
    let d = ClaimsWithoutImplementing;
    let user: &dyn DistributedLock = &d;
    assert!(matches!(
        user.force_release(&key()).await,
        Err(Error::Unsupported { .. })
    ));
    assert!(matches!(
        user.force_release_grant(&key(), FencingToken(1)).await,
        Err(Error::Unsupported { .. })
    ));
    let lease = Counting::lease(&key(), Duration::from_secs(10));
    assert!(matches!(
        lock_core::raw::relabel(user, &lease, "web-1").await,
        Err(Error::Unsupported { .. })
    ));
}

/// Job mode's `at_least` (hold_at_least, keep) needs both `keep_until` and `renew`: with either
/// one alone, or neither, it is `Unsupported` before the driver is called.
#[tokio::test]
async fn keeping_a_lease_needs_keep_until_and_renew_both() {
    for (keep_until, renew) in [(false, false), (true, false), (false, true)] {
        let d = Counting::new(Capabilities {
            keep_until,
            renew,
            ..caps()
        });
        let mut lease = Counting::lease(&key(), Duration::from_secs(10));
        assert!(
            matches!(
                user(&d)
                    .hold_at_least(&lease, Duration::from_secs(20))
                    .await,
                Err(Error::Unsupported { .. })
            ),
            "keep_until {keep_until}, renew {renew}"
        );
        assert!(
            matches!(
                user(&d).keep(&mut lease, Duration::from_secs(20)).await,
                Err(Error::Unsupported { .. })
            ),
            "keep_until {keep_until}, renew {renew}"
        );
        assert_eq!(d.called(), 0);
    }
    let d = Counting::new(Capabilities {
        keep_until: true,
        ..caps()
    });
    let mut lease = Counting::lease(&key(), Duration::from_secs(10));
    user(&d)
        .hold_at_least(&lease, Duration::from_secs(20))
        .await
        .unwrap();
    // The default keep is a renew to what is left, which reaches the driver.
    assert!(
        user(&d)
            .keep(&mut lease, Duration::from_secs(20))
            .await
            .unwrap()
    );
    assert_eq!(d.called(), 1);
    assert_eq!(lease.ttl(), Duration::from_secs(20));
}
