//! Server crash and restart mid-hold, on a private PostgreSQL instance this test starts, crashes
//! (SIGKILL) and restarts through `backends.sh` (`conformance::servers`) — never the shared server.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed expectation is a failed test

use std::time::Duration;

use conformance::{
    backend_url, fresh_key,
    servers::{PrivateServer, ServerKind, free_port},
};
use lock_core::{DistributedLock, FencingToken};
use lock_pg::PgLock;

const LONG: Duration = Duration::from_secs(30);

/// A private PostgreSQL (never the shared one), through `backends.sh` like every test server.
async fn own_postgres() -> Option<PrivateServer> {
    // No PostgreSQL here: skip (a failure under DISTLOCK_REQUIRE_BACKENDS=1).
    backend_url("DISTLOCK_TEST_PG_URL")?;
    Some(PrivateServer::start(ServerKind::Pg, free_port()).await)
}

/// Short timeouts, so calls while the server is down fail fast.
fn url(pg: &PrivateServer) -> String {
    format!("{}?connect_timeout=2&op_timeout=3s", pg.url())
}

/// Crashing and restarting the server mid-hold: while it is down every call fails with a
/// temporary error (no panic); afterwards the client reconnects by itself, the held lease is
/// still there (renew and release work), and fencing tokens keep strictly increasing across
/// several crash-right-after-acquire cycles — the counter lives in durably committed rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_increase_across_server_crashes() {
    let Some(pg) = own_postgres().await else {
        return;
    };
    let a = PgLock::connect_url(&url(&pg)).await.unwrap();
    let key = fresh_key("restart");
    let mut tokens: Vec<FencingToken> = Vec::new();

    let first = a.try_acquire(&key, LONG).await.unwrap().unwrap();
    tokens.extend(first.fencing_token());
    assert!(a.release(&first).await.unwrap());
    let mut held = a.try_acquire(&key, LONG).await.unwrap().unwrap();
    tokens.extend(held.fencing_token());

    pg.ctl("kill").await; // a crash: SIGKILL, no checkpoint; the restart replays the WAL
    let down = a.try_acquire(&fresh_key("restart-down"), LONG).await;
    let err = down.expect_err("no grant while the server is down");
    assert!(err.is_temporary(), "{err}");
    let err = a.renew(&mut held, LONG).await.expect_err("server down");
    assert!(err.is_temporary(), "{err}");
    pg.ctl("start").await;

    // The lease survived; the client reconnects on its own.
    a.renew(&mut held, LONG)
        .await
        .expect("the lease survives the restart");
    assert!(a.try_acquire(&key, LONG).await.unwrap().is_none());
    assert!(a.release(&held).await.unwrap());

    for _ in 0..3 {
        let b = PgLock::connect_url(&url(&pg)).await.unwrap();
        let lease = b.try_acquire(&key, LONG).await.unwrap().expect("free");
        tokens.extend(lease.fencing_token());
        // Crash right after the grant was acknowledged: it must not be forgotten.
        pg.ctl("kill").await;
        pg.ctl("start").await;
        let info = a.inspect(&key).await.unwrap().expect("the grant survived");
        assert_eq!(info.fencing_token, lease.fencing_token());
        assert!(b.release(&lease).await.unwrap());
    }
    // An asynchronously committed release lost in a crash only delays the lock: afterwards the
    // key is either free or still held by the same grant (same digest and fence) until its TTL.
    let short = Duration::from_secs(2);
    let lease = a.try_acquire(&key, short).await.unwrap().unwrap();
    tokens.extend(lease.fencing_token());
    assert!(a.release(&lease).await.unwrap());
    pg.ctl("kill").await;
    pg.ctl("start").await;
    if let Some(info) = a.inspect(&key).await.unwrap() {
        assert_eq!(info.token_digest, Some(lease.token().digest()));
        assert_eq!(info.fencing_token, lease.fencing_token());
    }
    let last = a
        .acquire(&key, LONG, tokio::time::Instant::now() + short * 3)
        .await
        .unwrap();
    tokens.extend(last.fencing_token());
    assert_eq!(tokens.len(), 7);
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "fencing tokens went back: {tokens:?}"
    );
}
