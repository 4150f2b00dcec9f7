//! The holder identity (`label=`, issue 25 C13) against the real server from
//! `DISTLOCK_TEST_PG_URL`: shown by another client's `inspect`, always the current holder's
//! (after a release and a new grant, a direct grant to a waiter, a takeover of an expired
//! lease, an older client's grant), and tables of older versions.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed expectation is a failed test

use std::{sync::Arc, time::Duration};

use conformance::{backend_url, fresh_key};
use lock_core::{DistributedLock, Error, HolderIdentity, LockKey};
use lock_pg::{PgLock, PgLockConfig, sqlx};
use tokio::time::{Instant, sleep, timeout};

const LONG: Duration = Duration::from_secs(30);

fn url_with(url: &str, query: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{query}")
}

fn suffix() -> String {
    format!("{:016x}", rand::random::<u64>())
}

async fn admin(url: &str) -> sqlx::PgPool {
    sqlx::PgPool::connect(url).await.expect("admin pool")
}

async fn exec(pool: &sqlx::PgPool, sql: String) {
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .execute(pool)
        .await
        .unwrap();
}

/// The identity `observer` shows for `key` (None: no identity, or not held).
async fn shown(observer: &PgLock, key: &LockKey) -> Option<HolderIdentity> {
    observer.inspect(key).await.unwrap()?.holder
}

/// The identity of a client of this process with `label` (the same host, pid and start).
fn ours(label: &str) -> Option<HolderIdentity> {
    let id = HolderIdentity::process(Some(label)).unwrap();
    assert!(id.as_str().starts_with("host="), "{id}");
    assert!(id.as_str().ends_with(&format!(" label={label}")), "{id}");
    Some(id)
}

/// Waits (bounded) until `inspect` shows `n` queued waiters behind the holder of `key`.
async fn wait_for_queue(lock: &PgLock, key: &LockKey, n: usize) {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let waiters = lock.inspect(key).await.unwrap().and_then(|h| h.waiters);
        if waiters == Some(n) {
            return;
        }
        assert!(
            Instant::now() < until,
            "expected {n} queued waiters, inspect shows {waiters:?}"
        );
        sleep(Duration::from_millis(10)).await;
    }
}

/// A labelled holder's identity is shown by another client's `inspect`, and after every change
/// of hands it is the new holder's, never the old one's: release then a new grant, a direct
/// grant by a release to a queued waiter, a polling waiter's grant, a takeover of an expired
/// lease; a release clears it, and a grant by an older client (which does not write the
/// identity) shows none rather than the previous holder's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_shows_the_current_holders_identity() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    // No fallback poll: only a release can hand the lock to a queued waiter.
    let url = url_with(&url, "poll_interval=30s");
    let a = Arc::new(
        PgLock::connect_url(&url_with(&url, "label=holder-a"))
            .await
            .unwrap(),
    );
    let b = PgLock::connect_url(&url_with(&url, "label=holder-b"))
        .await
        .unwrap();
    let poller = PgLock::connect_url(&url_with(&url, "label=poller&listen=false"))
        .await
        .unwrap();
    let observer = PgLock::connect_url(&url).await.unwrap();
    let key = fresh_key("holder-identity");

    let lease = a.try_acquire(&key, LONG).await.unwrap().unwrap();
    assert_eq!(shown(&observer, &key).await, ours("holder-a"));
    assert!(a.release(&lease).await.unwrap());
    assert_eq!(observer.inspect(&key).await.unwrap(), None);

    // Release → the next acquire (the row keeps a's old identity column values until then).
    let lease = b.try_acquire(&key, LONG).await.unwrap().unwrap();
    assert_eq!(shown(&observer, &key).await, ours("holder-b"));

    // A direct grant to a queued waiter: shown as soon as the release returns.
    let waits = {
        let (a, key) = (a.clone(), key.clone());
        tokio::spawn(async move { a.acquire(&key, LONG, Instant::now() + LONG).await })
    };
    wait_for_queue(&observer, &key, 1).await;
    assert!(b.release(&lease).await.unwrap());
    assert_eq!(
        shown(&observer, &key).await,
        ours("holder-a"),
        "the direct grant to a shows b's identity (or none)"
    );
    let lease = timeout(Duration::from_secs(10), waits)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(shown(&observer, &key).await, ours("holder-a"));

    // A polling waiter (no queue entry) takes it after the release.
    let polls = poller.acquire(&key, LONG, Instant::now() + LONG);
    let release = async {
        sleep(Duration::from_millis(50)).await;
        assert!(a.release(&lease).await.unwrap());
    };
    let (polled, ()) = tokio::join!(polls, release);
    let polled = polled.unwrap();
    assert_eq!(shown(&observer, &key).await, ours("poller"));

    // A takeover of an expired lease.
    let pool = admin(&url).await;
    let table = observer.config().table.quoted();
    exec_key(
        &pool,
        format!(
            "UPDATE {table} SET expires_at = clock_timestamp() - interval '1 second' \
             WHERE name = $1"
        ),
        &key,
    )
    .await;
    let lease = b.try_acquire(&key, LONG).await.unwrap().unwrap();
    assert!(!poller.release(&polled).await.unwrap());
    assert_eq!(shown(&observer, &key).await, ours("holder-b"));

    // An older client's grant after b's lease expired: it bumps the fence and leaves the
    // identity columns alone.
    exec_key(
        &pool,
        format!(
            "UPDATE {table} SET owner = md5(random()::text), fence = fence + 1, \
             expires_at = clock_timestamp() + interval '30 seconds' WHERE name = $1"
        ),
        &key,
    )
    .await;
    let info = observer.inspect(&key).await.unwrap().expect("held");
    assert_eq!(
        info.holder, None,
        "an older client's grant shows b's identity"
    );
    assert!(!b.release(&lease).await.unwrap());
    assert!(observer.force_release(&key).await.unwrap());
}

async fn exec_key(pool: &sqlx::PgPool, sql: String, key: &LockKey) {
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(key.as_str())
        .execute(pool)
        .await
        .unwrap();
}

/// A bad label is a configuration error before any I/O (nothing listens on port 1), set in
/// the URL or in the field.
#[tokio::test]
async fn a_bad_label_is_a_config_error_before_io() {
    for bad in ["", "has%20space", "new%0Aline", "%C3%A9", &"x".repeat(65)] {
        let url = format!("postgres://u@127.0.0.1:1/db?label={bad}");
        let err = PgLock::connect_url(&url).await.expect_err(&url);
        assert!(matches!(err, Error::Config(_)), "{url}: {err}");
    }
    let mut config = PgLockConfig::from_url("postgres://u@127.0.0.1:1/db").unwrap();
    config.label = Some("two words".to_owned());
    assert!(matches!(
        PgLock::connect_lazy(config.clone()),
        Err(Error::Config(_))
    ));
    assert!(matches!(
        PgLock::connect(config).await,
        Err(Error::Config(_))
    ));
}

/// A table of an older version without the holder columns: a role that may not alter it
/// (not its owner) still locks, queues and hands over, with no identity shown; its owner's
/// client adds the columns on first use, and identities are shown from then on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_table_this_role_may_not_alter_works_without_identities() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let pool = admin(&url).await;
    let (table, role) = (
        format!("distlock_oldholder_{}", suffix()),
        format!("distlock_noalter_{}", suffix()),
    );
    exec(
        &pool,
        format!(
            "CREATE TABLE {table} (name text PRIMARY KEY, owner text, fence bigint NOT NULL, \
             expires_at timestamptz NOT NULL, waiters text[] NOT NULL DEFAULT '{{}}')"
        ),
    )
    .await;
    exec(&pool, format!("CREATE ROLE {role} LOGIN")).await;
    exec(
        &pool,
        format!("GRANT SELECT, INSERT, UPDATE ON {table} TO {role}"),
    )
    .await;
    // Run in a task so that the table and the role (global to the server) are dropped even
    // when an assertion fails.
    let body = tokio::spawn(old_table_body(url, table.clone(), role.clone())).await;
    exec(&pool, format!("DROP TABLE {table}")).await;
    exec(&pool, format!("DROP OWNED BY {role}")).await;
    exec(&pool, format!("DROP ROLE {role}")).await;
    if let Err(e) = body {
        std::panic::resume_unwind(e.into_panic());
    }
}

async fn old_table_body(url: String, table: String, role: String) {
    // The same server and database as another user (the test server trusts loopback).
    let (scheme, rest) = url.split_once("://").unwrap();
    let host = rest.split_once('@').map_or(rest, |(_, host)| host);
    let limited = url_with(
        &format!("{scheme}://{role}@{host}"),
        &format!("table={table}&poll_interval=30s&label=limited"),
    );
    let a = PgLock::connect_url(&limited).await.unwrap();
    let b = Arc::new(PgLock::connect_url(&limited).await.unwrap());
    let key = fresh_key("old-holder-table");
    let lease = a.try_acquire(&key, LONG).await.unwrap().unwrap();
    let info = a.inspect(&key).await.unwrap().expect("held");
    assert_eq!(info.holder, None);
    let waits = {
        let (b, key) = (b.clone(), key.clone());
        tokio::spawn(async move { b.acquire(&key, LONG, Instant::now() + LONG).await })
    };
    wait_for_queue(&a, &key, 1).await;
    assert!(a.release(&lease).await.unwrap());
    let got = timeout(Duration::from_secs(10), waits)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(a.inspect(&key).await.unwrap().unwrap().holder, None);
    assert!(b.release(&got).await.unwrap());

    // The owner's client adds the columns; a limited client started after that records its
    // identity too (table-wide privileges cover new columns).
    let owner = PgLock::connect_url(&url_with(&url, &format!("table={table}&label=owner")))
        .await
        .unwrap();
    let lease = owner.try_acquire(&key, LONG).await.unwrap().unwrap();
    assert_eq!(shown(&owner, &key).await, ours("owner"));
    // A client that checked the table before the columns existed shows no identity.
    assert_eq!(a.inspect(&key).await.unwrap().unwrap().holder, None);
    assert!(owner.release(&lease).await.unwrap());
    let c = PgLock::connect_url(&limited).await.unwrap();
    let lease = c.try_acquire(&key, LONG).await.unwrap().unwrap();
    assert_eq!(shown(&owner, &key).await, ours("limited"));
    assert!(c.release(&lease).await.unwrap());
    // An old-mode client (a, which checked the table before the columns existed) still
    // works, and its grant shows no identity rather than c's.
    let lease = a.try_acquire(&key, LONG).await.unwrap().unwrap();
    assert_eq!(owner.inspect(&key).await.unwrap().unwrap().holder, None);
    assert!(a.release(&lease).await.unwrap());
}

/// A table of the version before the queue (no `waiters`) gains the queue and the holder
/// columns in one `ALTER TABLE` on first use, and then records identities.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_before_the_queue_gains_the_holder_columns_too() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let pool = admin(&url).await;
    let table = format!("distlock_prequeue_{}", suffix());
    exec(
        &pool,
        format!(
            "CREATE TABLE {table} (name text PRIMARY KEY, owner text, fence bigint NOT NULL, \
             expires_at timestamptz NOT NULL)"
        ),
    )
    .await;
    let body = tokio::spawn({
        let (url, table) = (url.clone(), table.clone());
        async move {
            let lock = PgLock::connect_url(&url_with(&url, &format!("table={table}&label=old")))
                .await
                .unwrap();
            let key = fresh_key("pre-queue-table");
            let lease = lock.try_acquire(&key, LONG).await.unwrap().unwrap();
            assert_eq!(shown(&lock, &key).await, ours("old"));
            assert!(lock.release(&lease).await.unwrap());
        }
    })
    .await;
    exec(&pool, format!("DROP TABLE {table}")).await;
    if let Err(e) = body {
        std::panic::resume_unwind(e.into_panic());
    }
}
