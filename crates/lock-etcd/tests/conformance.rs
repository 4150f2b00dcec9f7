//! The shared conformance suite on a real etcd (`DISTLOCK_TEST_ETCD_URL`).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation is a failed test

use std::{sync::Arc, time::Duration};

use conformance::{Harness, TestBackend, backend_url};
use lock_core::{DistributedLock, DynLock, Error, Lease, Result};
use lock_etcd::{EtcdLock, EtcdLockConfig};

struct EtcdBackend {
    url: String,
    admin: etcd_client::Client,
    min_ttl: Duration,
}

#[conformance::async_trait]
impl TestBackend for EtcdBackend {
    /// A separate `EtcdLock` per call: its own connection and its own session leases, so one
    /// test client's lease revoke never touches another's locks.
    async fn client(&self) -> Result<DynLock> {
        Ok(Arc::new(EtcdLock::connect_url(&self.url).await?))
    }

    fn short_ttl(&self) -> Duration {
        self.min_ttl
    }

    /// Revokes the lease the entry is attached to (every lock of that client with that TTL goes
    /// with it — the harness gives each test client its own `EtcdLock`).
    async fn force_expire(&self, lease: &Lease) -> Result<()> {
        let id = EtcdLock::lease_id(lease).ok_or_else(|| Error::not_held(lease.key()))?;
        self.admin
            .lease_client()
            .revoke(id)
            .await
            .map_err(|e| Error::backend("etcd", "force_expire", e))?;
        Ok(())
    }

    async fn unreachable_client(&self) -> Option<DynLock> {
        let client = EtcdLock::connect_url("etcd://127.0.0.1:1?min_ttl=1s&dial_timeout=500ms")
            .await
            .expect("building a client for a closed port does no I/O");
        Some(Arc::new(client))
    }
}

async fn setup() -> Option<Harness> {
    let url = backend_url("DISTLOCK_TEST_ETCD_URL")?;
    let cfg = EtcdLockConfig::from_url(&url).expect("DISTLOCK_TEST_ETCD_URL");
    let endpoints: Vec<String> = cfg
        .endpoints
        .iter()
        .map(|e| format!("http://{e}"))
        .collect();
    let admin = etcd_client::Client::connect(endpoints, None)
        .await
        .expect("admin client");
    let probe = EtcdLock::connect_url(&url).await.expect("etcd reachable");
    let min_ttl = probe.capabilities().min_ttl;
    Some(Harness::new(EtcdBackend {
        url,
        admin,
        min_ttl,
    }))
}

conformance::conformance_tests!(setup; skip: {
    fences_stay_exact_across_2_pow_53_and_up_to_i64_max: "fences are etcd revisions, which cannot be set",
});
