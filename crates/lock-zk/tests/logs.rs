//! The README's "tokens and passwords never reach logs" on ZooKeeper: `conformance::logs::check`
//! (a normal life at TRACE through `Observed`, and failing connects with a password in the URL).
//! One test in its own binary: the capturing subscriber is the process-wide default.
//! (A closed port only: ZooKeeper does not refuse a wrong digest at connect, only later ACL
//! checks.)
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation is a failed test

use conformance::{
    backend_url,
    logs::{SECRET, check, observed},
};
use lock_zk::ZkLock;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_and_passwords_never_reach_trace_logs() {
    let Some(url) = backend_url("DISTLOCK_TEST_ZK_URL") else {
        return;
    };
    check(
        || async { observed(ZkLock::connect_url(&url).await.unwrap()) },
        vec![format!(
            "zk://distlock:{SECRET}@127.0.0.1:1?connect_timeout=1s"
        )],
        |bad| async move { ZkLock::connect_url(&bad).await.err().map(|e| e.to_string()) },
    )
    .await;
}
