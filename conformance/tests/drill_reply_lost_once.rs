//! A lost reply whose retry reaches the server only after the first run committed (issue 19,
//! review S5): the case `drill_lost_replies` cannot reach, because there the link keeps dropping
//! replies until the operation returns, so a client that re-sends a request only ever re-sends
//! it into the same fault — and `lock-pg`'s own S5 test re-sends while the first run still holds
//! the row (the re-sent statement then waits for it and is re-checked on the new row version).
//!
//! PostgreSQL: the operator's `force_release` runs through a drill proxy; a trigger keeps its
//! statement sleeping (1.5 s, only for the operator's `application_name`) after it removed the
//! holder and granted the queued waiter. Meanwhile its connection is reset and the proxy holds
//! every new connection's bytes (blackhole) until the statement has committed and the waiter
//! holds the lock; then the held retry goes through. A driver that re-sends "remove whoever
//! holds it" then frees the waiter's fresh grant. Invariant: the waiter's grant survives and is
//! the coordinator's holder; the operator's answer is `true` or an unknown outcome.
//!
//! Seen red: `conformance/mutants/driver-08-pg-force-release-resent-without-a-fence.patch`
//! (force release without the fence it read first, re-sent after the reset) — which both
//! `lock-pg`'s S5 test and `drill_lost_replies` let pass. Uses `psql` for the trigger.
//! Needs `--features drivers` (as every drill).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed expectation is a failed test

mod drill_support;

use std::time::Duration;

use conformance::drill::Proxy;
use drill_support::{Backend, SOON};
use lock_core::{DistributedLockExt, DynLock, LockKey};
use tokio::time::{Instant, sleep, timeout};

/// The grants' TTL: long enough that nothing expires while the check runs, so a grant that is
/// gone was removed.
const TTL: Duration = Duration::from_secs(15);

/// Runs `sql` with `psql` on the database of `url` (its query, the driver's options, left off).
async fn psql(url: &str, sql: &str) -> String {
    let conn = url.split('?').next().unwrap_or(url);
    let out = tokio::process::Command::new("psql")
        .args([
            conn,
            "-X",
            "-q",
            "-t",
            "-A",
            "-v",
            "ON_ERROR_STOP=1",
            "-c",
            sql,
        ])
        .output()
        .await
        .expect("run psql");
    assert!(
        out.status.success(),
        "psql {sql}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn with_query(url: &str, query: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{query}")
}

async fn holder_fence(lock: &DynLock, key: &LockKey) -> Option<u64> {
    lock.inspect(key)
        .await
        .expect("inspect")
        .and_then(|h| h.fencing_token)
        .map(|f| f.get())
}

async fn force_release_retried_after_commit(url: String) {
    let sfx = format!("{:016x}", rand::random::<u64>());
    let (table, func, app) = (
        format!("distlock_once_{sfx}"),
        format!("distlock_once_slow_{sfx}"),
        format!("distlock_once_op_{sfx}"),
    );
    let url = with_query(&url, &format!("table={table}"));
    let direct = drill_support::client(&url).await;
    let waiter = drill_support::client(&url).await;
    let key = conformance::fresh_key("reply-lost-once");
    // The table exists once the first grant is made.
    let first = direct
        .lock(key.as_str())
        .ttl(TTL)
        .try_acquire()
        .await
        .expect("try_acquire")
        .expect("a fresh key is free");
    psql(
        &url,
        &format!(
            "CREATE FUNCTION \"{func}\"() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
             IF current_setting('application_name') = '{app}' THEN PERFORM pg_sleep(1.5); \
             END IF; RETURN NULL; END $$; \
             CREATE TRIGGER slow AFTER UPDATE ON \"{table}\" FOR EACH ROW \
             EXECUTE FUNCTION \"{func}\"()"
        ),
    )
    .await;
    let (granted_tx, granted_rx) = tokio::sync::oneshot::channel();
    let queued = tokio::spawn({
        let (waiter, key) = (waiter.clone(), key.clone());
        async move {
            let guard = waiter
                .lock(key.as_str())
                .ttl(TTL)
                .wait(SOON)
                .acquire()
                .await
                .expect("the waiter is granted");
            let _ = granted_tx.send(());
            guard
        }
    });
    let until = Instant::now() + SOON;
    while direct.inspect(&key).await.unwrap().and_then(|i| i.waiters) != Some(1) {
        assert!(Instant::now() < until, "the waiter never queued");
        sleep(Duration::from_millis(10)).await;
    }

    let (proxy, proxied) = Proxy::start_for_url(&url).await.expect("start a proxy");
    let operator = drill_support::client(&with_query(
        &proxied,
        &format!("timeout=10s&connect_timeout=10s&pool_size=1&application_name={app}"),
    ))
    .await;
    let forced = tokio::spawn({
        let key = key.clone();
        async move { operator.force_release(&key).await }
    });
    // The statement removed the holder and granted the waiter; it sleeps in the trigger before
    // its commit. Its connection is cut now, and whatever the operator sends next is held.
    let sleeping = format!(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = '{app}' \
         AND wait_event = 'PgSleep'"
    );
    while psql(&url, &sleeping).await == "0" {
        assert!(
            Instant::now() < until,
            "the statement never reached the trigger"
        );
        sleep(Duration::from_millis(10)).await;
    }
    proxy.blackhole();
    proxy.reset();
    timeout(SOON, granted_rx)
        .await
        .expect("the force release committed and handed the lock on")
        .expect("the waiter's task");
    // Committed: let the held retry through.
    proxy.pass();
    let answer = timeout(SOON, forced)
        .await
        .expect("force_release returns")
        .expect("the operator's task");
    println!("OUTCOME pg force_release {answer:?}");
    if let Ok(removed) = &answer {
        assert!(*removed, "force_release removed nobody from a held key");
    }
    let second = timeout(SOON, queued)
        .await
        .expect("the waiter's acquire returns")
        .expect("the waiter's task");
    let fence = second.fencing_token().map(|f| f.get());
    assert!(fence > first.fencing_token().map(|f| f.get()));
    assert_eq!(
        holder_fence(&direct, &key).await,
        fence,
        "the force release re-sent after its first run committed removed the waiter's fresh grant too"
    );
    assert!(!second.is_lost(), "the waiter's guard reports a loss");
    assert!(
        second.release().await.expect("the waiter's release"),
        "the waiter's grant was gone"
    );
    let _ = first.release().await;
    psql(
        &url,
        &format!("DROP TABLE \"{table}\"; DROP FUNCTION \"{func}\"()"),
    )
    .await;
}

#[test]
fn pg_force_release_retried_after_its_first_run_committed_keeps_the_waiters_grant() {
    let Some(url) = Backend::Pg.shared_url() else {
        drill_support::skip("reply_lost_once", Backend::Pg, "no server URL set");
        return;
    };
    drill_support::block_on(force_release_retried_after_commit(url));
}
