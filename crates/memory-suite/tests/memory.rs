//! The whole suite on the in-memory reference backend.

use std::time::Duration;

use conformance::{Harness, TestBackend};
use lock_core::{DistributedLock, DynLock, InMemoryLock, Lease, Result};

struct Memory {
    coordinator: InMemoryLock,
}

#[conformance::async_trait]
impl TestBackend for Memory {
    async fn client(&self) -> Result<DynLock> {
        Ok(std::sync::Arc::new(self.coordinator.client()))
    }

    fn short_ttl(&self) -> Duration {
        Duration::from_millis(300)
    }

    async fn force_expire(&self, lease: &Lease) -> Result<()> {
        self.coordinator.force_expire(lease.key());
        Ok(())
    }

    async fn unreachable_client(&self) -> Option<DynLock> {
        let client = self.coordinator.client();
        client.set_offline(true);
        Some(std::sync::Arc::new(client))
    }
}

async fn setup() -> Option<Harness> {
    Some(Harness::new(Memory {
        coordinator: InMemoryLock::new(),
    }))
}

conformance::conformance_tests!(setup; skip: {
    fences_stay_exact_across_2_pow_53_and_up_to_i64_max: "the in-memory reference has no way to set its fence counter from outside",
});

/// The "no I/O" half of bad-input checks, which only the in-memory coordinator can count.
#[tokio::test]
async fn bad_input_makes_no_request() {
    let coordinator = InMemoryLock::new();
    let key = lock_core::LockKey::new("k").unwrap();
    let before = coordinator.requests();
    assert!(coordinator.try_acquire(&key, Duration::ZERO).await.is_err());
    let past = tokio::time::Instant::now() - Duration::from_millis(1);
    assert!(
        coordinator
            .acquire(&key, Duration::ZERO, past)
            .await
            .is_err()
    );
    assert_eq!(coordinator.requests(), before);
    // A deadline already past is no bad input: exactly one attempt, which takes the free key;
    // on the held key, one attempt again and then `Timeout`, with no wait.
    let lease = coordinator
        .acquire(&key, Duration::from_secs(1), past)
        .await
        .unwrap();
    assert_eq!(coordinator.requests(), before + 1);
    let err = coordinator
        .acquire(&key, Duration::from_secs(1), past)
        .await
        .unwrap_err();
    assert!(matches!(err, lock_core::Error::Timeout { .. }), "{err}");
    assert_eq!(coordinator.requests(), before + 2);
    drop(lease);
}

/// The whole suite on a backend that does not claim `renew` (the in-memory coordinator behind a
/// wrapper that refuses renewals): the renewal properties are declared skipped (reported as
/// ignored, each checked against the capability), and `capabilities_are_honest` runs its
/// "renew refused" branch, which no real backend reaches.
mod without_renew {
    use std::{sync::Arc, time::Duration};

    use conformance::{Harness, TestBackend};
    use futures::future::BoxFuture;
    use lock_core::{
        Capabilities, DynLock, Error, FencingToken, HolderInfo, InMemoryLock, Lease, LockKey,
        LossReason, Result,
    };
    use tokio::time::Instant;

    #[derive(Debug)]
    struct NoRenew(DynLock);

    #[conformance::async_trait]
    impl lock_core::raw::Driver for NoRenew {
        fn backend_name(&self) -> &'static str {
            self.0.backend_name()
        }

        fn capabilities(&self) -> Capabilities {
            Capabilities {
                renew: false,
                ..self.0.capabilities()
            }
        }

        async fn try_acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>> {
            self.0.try_acquire(key, ttl).await
        }

        async fn acquire(&self, key: &LockKey, ttl: Duration, deadline: Instant) -> Result<Lease> {
            self.0.acquire(key, ttl, deadline).await
        }

        async fn renew(&self, _lease: &mut Lease, _ttl: Duration) -> Result<()> {
            Err(Error::unsupported(self.0.backend_name(), "renew"))
        }

        async fn release(&self, lease: &Lease) -> Result<bool> {
            self.0.release(lease).await
        }

        async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
            self.0.inspect(key).await
        }

        async fn force_release(&self, key: &LockKey) -> Result<bool> {
            self.0.force_release(key).await
        }

        async fn force_release_grant(&self, key: &LockKey, holder: FencingToken) -> Result<bool> {
            self.0.force_release_grant(key, holder).await
        }

        fn watch_lost(&self, lease: &Lease) -> BoxFuture<'static, LossReason> {
            self.0.watch_lost(lease)
        }

        async fn relabel(&self, lease: &Lease, holder: &lock_core::HolderIdentity) -> Result<()> {
            self.0.relabel(lease, holder).await
        }

        fn watch_holder(&self, key: &LockKey) -> Option<futures::stream::BoxStream<'static, ()>> {
            self.0.watch_holder(key)
        }
    }

    struct MemoryWithoutRenew {
        coordinator: InMemoryLock,
    }

    #[conformance::async_trait]
    impl TestBackend for MemoryWithoutRenew {
        async fn client(&self) -> Result<DynLock> {
            Ok(Arc::new(NoRenew(Arc::new(self.coordinator.client()))))
        }

        fn short_ttl(&self) -> Duration {
            Duration::from_millis(300)
        }

        async fn force_expire(&self, lease: &Lease) -> Result<()> {
            self.coordinator.force_expire(lease.key());
            Ok(())
        }
    }

    async fn setup() -> Option<Harness> {
        Some(Harness::new(MemoryWithoutRenew {
            coordinator: InMemoryLock::new(),
        }))
    }

    conformance::conformance_tests!(setup; skip: {
        renew_extends_the_lease: "renew not claimed",
        renew_after_expiry_fails_and_does_not_extend_the_new_holder: "renew not claimed",
        watchdog_keeps_the_lease_alive: "renew not claimed",
        renew_dropped_at_any_poll_leaves_nothing_behind: "renew not claimed",
        many_guards_on_one_client_keep_their_leases_alive: "renew not claimed",
        at_least_outlives_the_job_and_the_holders_exit: "renew not claimed: nothing can keep a lease until at_least",
        at_most_cancels_a_hung_job_and_frees_the_lock: "renew not claimed",
        fences_stay_exact_across_2_pow_53_and_up_to_i64_max: "the in-memory reference has no way to set its fence counter from outside",
    });
}
