//! The README's "tokens and passwords never reach logs" on Redis: `conformance::logs::check`
//! (a normal life at TRACE through `Observed`, and failing connects with a password in the URL).
//! One test in its own binary: the capturing subscriber is the process-wide default.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation is a failed test

use conformance::{
    backend_url,
    logs::{SECRET, check, observed, with_secret},
};
use lock_redis::RedisLock;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_and_passwords_never_reach_trace_logs() {
    let Some(url) = backend_url("DISTLOCK_TEST_REDIS_URL") else {
        return;
    };
    check(
        || async { observed(RedisLock::connect_url(&url).await.unwrap()) },
        vec![
            format!("redis://distlock:{SECRET}@127.0.0.1:1"),
            with_secret(
                &backend_url("DISTLOCK_TEST_REDIS_SECURE_URL")
                    .unwrap_or_else(|| format!("redis://u:{SECRET}@127.0.0.1:1")),
            ),
        ],
        |bad| async move {
            RedisLock::connect_url(&bad)
                .await
                .err()
                .map(|e| e.to_string())
        },
    )
    .await;
}
