//! The whole conformance suite against a Sentinel-managed master: a private set of one master, two replicas and three sentinels
//! (`support`), reached as `redis+sentinel://s1,s2,s3/NAME`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed expectation is a failed test

mod support;

async fn setup() -> Option<conformance::Harness> {
    support::sentinel_harness::sentinel_harness("namespace=conf-sentinel:").await
}

conformance::conformance_tests!(setup; skip: {
    waiters_are_served_in_fifo_order: "fair_queue not claimed: the release grants the oldest live waiter, but a waiter that times out and re-queues loses its place",
});
