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

conformance::conformance_tests!(setup; skip: {});

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
            .acquire(&key, Duration::from_secs(1), past)
            .await
            .is_err()
    );
    assert_eq!(coordinator.requests(), before);
    assert!(
        coordinator
            .try_acquire(&key, Duration::from_secs(1))
            .await
            .unwrap()
            .is_some()
    );
    assert_eq!(coordinator.requests(), before + 1);
}
