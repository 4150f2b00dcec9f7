//! The whole conformance suite against Redlock over three private independent masters
//! (`support::Masters`, `redlock://m1,m2,m3`). Redlock mints no fencing tokens: the fencing
//! properties report themselves skipped by capability.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed expectation is a failed test

mod support;

use std::{sync::Arc, time::Duration};

use conformance::{Harness, TestBackend, backend_url};
use lock_core::{DynLock, Lease, Result};
use lock_redis::{RedlockConfig, RedlockLock};

struct Redlock {
    url: String,
    /// One connection per master for fault injection.
    admins: Vec<redis::aio::MultiplexedConnection>,
    namespace: String,
}

#[conformance::async_trait]
impl TestBackend for Redlock {
    async fn client(&self) -> Result<DynLock> {
        Ok(Arc::new(RedlockLock::connect_url(&self.url).await?))
    }

    fn short_ttl(&self) -> Duration {
        Duration::from_millis(300)
    }

    async fn force_expire(&self, lease: &Lease) -> Result<()> {
        let key = format!("{}{}", self.namespace, lease.key().as_str());
        for admin in &self.admins {
            redis::cmd("DEL")
                .arg(&key)
                .query_async::<()>(&mut admin.clone())
                .await
                .map_err(|e| lock_core::Error::backend("redlock", "force_expire", e))?;
        }
        Ok(())
    }

    async fn unreachable_client(&self) -> Option<DynLock> {
        let config =
            RedlockConfig::from_url("redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3").ok()?;
        Some(Arc::new(RedlockLock::connect_lazy(config).ok()?))
    }
}

async fn setup() -> Option<Harness> {
    backend_url("DISTLOCK_TEST_REDIS_URL")?;
    let masters = tokio::task::spawn_blocking(support::shared_masters)
        .await
        .unwrap();
    let url = masters.url("namespace=conf-redlock:");
    let namespace = RedlockConfig::from_url(&url).unwrap().nodes[0]
        .namespace
        .clone();
    let mut admins = Vec::new();
    for n in &masters.nodes {
        admins.push(
            redis::Client::open(format!("redis://{}", n.addr()))
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap(),
        );
    }
    Some(Harness::new(Redlock {
        url,
        admins,
        namespace,
    }))
}

conformance::conformance_tests!(setup; skip: {
    waiters_are_served_in_fifo_order: "fair_queue not claimed: waiters poll",
    a_release_hands_the_lock_to_the_first_waiter: "wait_notify not claimed: waiters poll, a release hands nothing over",
    waiter_is_woken_promptly_by_release: "wait_notify not claimed: waiters poll",
    fencing_tokens_strictly_increase: "fencing not claimed: Redlock has no counter the masters agree on",
    fences_stay_exact_across_2_pow_53_and_up_to_i64_max: "fencing not claimed",
    stale_holder_write_is_rejected: "fencing not claimed",
    election_never_two_leaders: "fencing not claimed: an election without terms cannot fence (campaign is refused)",
    election_resign_hands_over_promptly: "fencing not claimed: campaign is refused",
    election_leader_agrees_with_the_handle: "fencing not claimed: campaign is refused",
    election_observe_reports_every_term_in_order: "fencing not claimed: campaign is refused",
    election_deposed_leader_is_fenced_out: "fencing not claimed: campaign is refused",
    election_proclaim_changes_the_value_not_the_term: "fencing not claimed: campaign is refused",
    campaign_dropped_at_any_poll_leaves_nothing_behind: "fencing not claimed: campaign is refused",
    resign_dropped_at_any_poll_leaves_nothing_behind: "fencing not claimed: campaign is refused",
    proclaim_dropped_at_any_poll_keeps_the_leader: "fencing not claimed: campaign is refused",
});
