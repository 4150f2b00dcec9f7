//! The whole conformance suite against a Sentinel-managed master with replica acknowledgement
//! (`replicas=1`: every grant and renewal counts only after `WAIT 1` confirmed it).
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed expectation is a failed test

mod support;

async fn setup() -> Option<conformance::Harness> {
    support::sentinel_harness::sentinel_harness(
        "namespace=conf-sentinel-acked:&replicas=1&replica_timeout=2s",
    )
    .await
}

conformance::conformance_tests!(setup; skip: {
    waiters_are_served_in_fifo_order: "fair_queue not claimed: the release grants the oldest live waiter, but a waiter that times out and re-queues loses its place",
});
