//! The whole conformance suite against the local ZooKeeper (`DISTLOCK_TEST_ZK_URL`).
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed expectation is a failed test

use std::{sync::Arc, time::Duration};

use conformance::{Harness, TestBackend, backend_url};
use lock_core::{DistributedLock, DynLock, Lease, Result};
use lock_zk::{ZkLock, ZkLockConfig};

/// Test clients' session timeout: also their minimum TTL and how long an abandoned lock lives.
const SESSION: Duration = Duration::from_secs(1);

struct Zk {
    config: ZkLockConfig,
    admin: ZkLock,
}

#[conformance::async_trait]
impl TestBackend for Zk {
    async fn client(&self) -> Result<DynLock> {
        Ok(Arc::new(ZkLock::connect(self.config.clone()).await?))
    }

    fn short_ttl(&self) -> Duration {
        SESSION
    }

    /// An operator deletes the holder's node (what session expiry does to it, without waiting).
    async fn force_expire(&self, lease: &Lease) -> Result<()> {
        self.admin.force_release(lease.key()).await?;
        Ok(())
    }

    async fn unreachable_client(&self) -> Option<DynLock> {
        let mut config = self.config.clone();
        config.hosts = "127.0.0.1:1".into();
        Some(Arc::new(ZkLock::new(config).ok()?))
    }
}

async fn setup() -> Option<Harness> {
    setup_with(ZkLockConfig::DEFAULT_SESSION_WATCH_FROM).await
}

/// A harness whose clients put their held locks on the session's watch on the lock root once
/// they hold `session_watch_from` (the admin client too).
async fn setup_with(session_watch_from: usize) -> Option<Harness> {
    let url = backend_url("DISTLOCK_TEST_ZK_URL")?;
    let mut config = ZkLockConfig::from_url(&url).expect("DISTLOCK_TEST_ZK_URL");
    config.session_timeout = SESSION;
    config.root = "/distlock-test".into();
    config.session_watch_from = Some(session_watch_from);
    let admin = ZkLock::connect(config.clone()).await.expect("connect");
    Some(Harness::new(Zk { config, admin }))
}

conformance::conformance_tests!(setup; skip: {
    lost_fires_at_the_local_deadline_before_anyone_else_is_granted: "lease_ttl not claimed: the lease is the session",
    fences_stay_exact_across_2_pow_53_and_up_to_i64_max: "fences are zxids, which cannot be set",
});

/// The whole suite again with every held lock on its session's watch on the lock root
/// (`session_watch_from = 0`) instead of a node watch of its own: the suite's clients hold a
/// few locks each, below the default threshold.
mod session_watch {
    use super::{Harness, setup_with};

    async fn setup() -> Option<Harness> {
        setup_with(0).await
    }

    conformance::conformance_tests!(setup; skip: {
        lost_fires_at_the_local_deadline_before_anyone_else_is_granted: "lease_ttl not claimed: the lease is the session",
        fences_stay_exact_across_2_pow_53_and_up_to_i64_max: "fences are zxids, which cannot be set",
    });
}
