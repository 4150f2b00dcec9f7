//! The shared conformance suite against the real PostgreSQL from `DISTLOCK_TEST_PG_URL`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed expectation is a failed test

use std::{sync::Arc, time::Duration};

use conformance::{Harness, TestBackend, backend_url};
use lock_core::{DynLock, Error, Lease, LockKey, Result};
use lock_pg::{PgLock, PgLockConfig, sqlx};

struct PgBackend {
    url: String,
    admin: sqlx::PgPool,
}

#[conformance::async_trait]
impl TestBackend for PgBackend {
    async fn client(&self) -> Result<DynLock> {
        Ok(Arc::new(PgLock::connect_url(&self.url).await?))
    }

    fn short_ttl(&self) -> Duration {
        Duration::from_millis(400)
    }

    /// `expires_at` in the past, as if the TTL had run out; the holder is not told.
    async fn force_expire(&self, lease: &Lease) -> Result<()> {
        sqlx::query(
            "UPDATE distlock_leases SET expires_at = clock_timestamp() - interval '1 second' \
             WHERE name = $1 AND owner = $2",
        )
        .bind(lease.key().as_str())
        .bind(lease.token().expose_hex())
        .execute(&self.admin)
        .await
        .map_err(|e| Error::backend("postgres", "force_expire", e))?;
        Ok(())
    }

    async fn unreachable_client(&self) -> Option<DynLock> {
        let config = PgLockConfig::from_url(
            "postgres://postgres@127.0.0.1:1/distlock?connect_timeout=2&op_timeout=2s",
        )
        .ok()?;
        Some(Arc::new(PgLock::connect_lazy(config).ok()?))
    }

    /// `UPDATE` of the row's `fence` (the next grant writes `fence + 1`).
    async fn set_fence_counter(&self, key: &LockKey, value: u64) -> Option<Result<()>> {
        let Ok(value) = i64::try_from(value) else {
            return Some(Err(Error::Config(format!("fence {value} is not a bigint"))));
        };
        let updated = sqlx::query("UPDATE distlock_leases SET fence = $2 WHERE name = $1")
            .bind(key.as_str())
            .bind(value)
            .execute(&self.admin)
            .await
            .map_err(|e| Error::backend("postgres", "set_fence_counter", e));
        Some(updated.and_then(|done| {
            if done.rows_affected() == 1 {
                Ok(())
            } else {
                Err(Error::Config(format!("no row for {key}")))
            }
        }))
    }
}

async fn setup() -> Option<Harness> {
    let url = backend_url("DISTLOCK_TEST_PG_URL")?;
    // Connecting a first client creates the table before force_expire can need it.
    PgLock::connect_url(&url).await.expect("connect");
    let admin = sqlx::PgPool::connect(&url).await.expect("admin pool");
    Some(Harness::new(PgBackend { url, admin }))
}

conformance::conformance_tests!(setup; skip: {
    waiters_are_served_in_fifo_order: "fair_queue not claimed",
});
