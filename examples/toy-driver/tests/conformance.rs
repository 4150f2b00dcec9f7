//! The whole distlock conformance suite against the toy driver: what an out-of-tree driver's
//! `tests/conformance.rs` looks like.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed expectation is a failed test

use std::{path::PathBuf, sync::Arc, time::Duration};

use conformance::{Harness, TestBackend};
use distlock_toy_driver::ToyLock;
use lock_core::{DynLock, Lease, LockKey, Result};

/// One store file per test (each property gets a fresh harness), removed at the end.
struct Toy {
    path: PathBuf,
    /// The "operator": changes the store behind the clients' backs.
    admin: ToyLock,
}

impl Drop for Toy {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[conformance::async_trait]
impl TestBackend for Toy {
    async fn client(&self) -> Result<DynLock> {
        Ok(Arc::new(ToyLock::open(&self.path)?))
    }

    fn short_ttl(&self) -> Duration {
        Duration::from_millis(200)
    }

    async fn force_expire(&self, lease: &Lease) -> Result<()> {
        self.admin.expire_now(lease.key())
    }

    async fn set_fence_counter(&self, key: &LockKey, value: u64) -> Option<Result<()>> {
        Some(self.admin.set_fence_counter(key, value))
    }
}

async fn setup() -> Option<Harness> {
    let path = std::env::temp_dir().join(format!(
        "distlock-toy-{}-{:016x}.json",
        std::process::id(),
        rand_suffix()
    ));
    let admin = ToyLock::open(&path).unwrap();
    Some(Harness::new(Toy { path, admin }))
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now())
}

conformance::conformance_tests!(setup; skip: {
    waiters_are_served_in_fifo_order: "fair_queue not claimed",
    waiter_is_woken_promptly_by_release: "wait_notify not claimed",
    a_release_hands_the_lock_to_the_first_waiter: "wait_notify not claimed: waiters poll, a release hands nothing over",
    election_proclaim_changes_the_value_not_the_term: "relabel not claimed: the toy driver does not implement Driver::relabel (proclaim is refused)",
    proclaim_dropped_at_any_poll_keeps_the_leader: "relabel not claimed: the toy driver does not implement Driver::relabel (proclaim is refused)",
});
