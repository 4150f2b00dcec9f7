//! Review L5: the auth token expires under a long-running client. On a private etcd of this
//! test (auth enabled, 2 s simple-token TTL; the shared secured server keeps etcd's 300 s), a
//! client that stays idle past the token's TTL must renew, lock and release again: the token is
//! refreshed instead of every later request failing for good.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation is a failed test

use std::{
    process::{Command, Stdio},
    time::Duration,
};

use conformance::servers::{PrivateServer, ServerKind, free_port};
use lock_core::{DistributedLock, LockKey};
use lock_etcd::EtcdLock;
use tokio::time::{Instant, sleep};

fn etcd_installed() -> bool {
    Command::new("etcd")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A throwaway single-member etcd with `extra` flags (a `backends.sh` instance on a free port,
/// stopped and deleted on drop).
async fn start_etcd(extra: &[&str]) -> PrivateServer {
    PrivateServer::start_with(ServerKind::Etcd, free_port(), extra).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_auth_token_is_refreshed() {
    // Only where the servers are meant to be (the other tests' backends say so); etcd itself
    // must be installed then.
    if conformance::backend_url("DISTLOCK_TEST_ETCD_URL").is_none() {
        return;
    }
    assert!(etcd_installed(), "etcd is not installed");
    let etcd = start_etcd(&["--auth-token", "simple", "--auth-token-ttl", "2"]).await;
    let endpoint = format!("http://127.0.0.1:{}", etcd.port);
    let admin = etcd_client::Client::connect([endpoint.as_str()], None)
        .await
        .unwrap();
    let mut auth = admin.auth_client();
    auth.user_add("root", "pw-root", None).await.unwrap();
    auth.user_grant_role("root", "root").await.unwrap();
    auth.auth_enable().await.unwrap();

    let url = format!("etcd://root:pw-root@127.0.0.1:{}?min_ttl=1s", etcd.port);
    let lock = EtcdLock::connect_url(&url).await.unwrap();
    let ttl = Duration::from_secs(20);
    let key = LockKey::new("l5-token").unwrap();
    let mut lease = lock.try_acquire(&key, ttl).await.unwrap().unwrap();
    // Idle past the token's TTL (a simple token lives 2 s after its last use here).
    sleep(Duration::from_millis(3500)).await;
    lock.renew(&mut lease, ttl)
        .await
        .expect("renew after the token expired");
    let other = LockKey::new("l5-token-other").unwrap();
    sleep(Duration::from_millis(3500)).await;
    let second = lock
        .try_acquire(&other, ttl)
        .await
        .expect("a new lock after the token expired")
        .expect("free");
    assert!(lock.release(&second).await.unwrap());
    assert!(lock.release(&lease).await.unwrap());
}

/// A background clean-up that etcd refuses for good (the user lost its permission on the
/// lock's keys) stops instead of retrying for as long as the client lives: a waiter that gives
/// up after the permission was revoked leaves a clean-up that is refused, gives up (logged
/// once) and leaves the entry to its lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_up_refused_for_good_stops() {
    if conformance::backend_url("DISTLOCK_TEST_ETCD_URL").is_none() {
        return;
    }
    assert!(etcd_installed(), "etcd is not installed");
    let etcd = start_etcd(&[]).await;
    let endpoint = format!("http://127.0.0.1:{}", etcd.port);
    let admin = etcd_client::Client::connect([endpoint.as_str()], None)
        .await
        .unwrap();
    let mut auth = admin.auth_client();
    auth.user_add("root", "pw-root", None).await.unwrap();
    auth.user_grant_role("root", "root").await.unwrap();
    auth.role_add("locks").await.unwrap();
    auth.role_grant_permission(
        "locks",
        etcd_client::Permission::read_write("distlock/").with_prefix(),
    )
    .await
    .unwrap();
    auth.user_add("locker", "pw-locker", None).await.unwrap();
    auth.user_grant_role("locker", "locks").await.unwrap();
    auth.auth_enable().await.unwrap();
    let root = etcd_client::Client::connect(
        [endpoint.as_str()],
        Some(etcd_client::ConnectOptions::new().with_user("root", "pw-root")),
    )
    .await
    .unwrap();

    let url = format!("etcd://locker:pw-locker@127.0.0.1:{}?min_ttl=1s", etcd.port);
    let (holder, waiter) = (
        EtcdLock::connect_url(&url).await.unwrap(),
        std::sync::Arc::new(EtcdLock::connect_url(&url).await.unwrap()),
    );
    let key = LockKey::new("refused-clean-up").unwrap();
    let ttl = Duration::from_secs(30);
    let _held = holder.try_acquire(&key, ttl).await.unwrap().unwrap();
    let task = {
        let (waiter, key) = (waiter.clone(), key.clone());
        tokio::spawn(async move {
            waiter
                .acquire(&key, ttl, Instant::now() + Duration::from_secs(60))
                .await
        })
    };
    let entries = || {
        let mut kv = root.kv_client();
        async move {
            let opts = etcd_client::GetOptions::new()
                .with_prefix()
                .with_count_only();
            kv.get("distlock/refused-clean-up/", Some(opts))
                .await
                .unwrap()
                .count()
        }
    };
    let until = Instant::now() + Duration::from_secs(10);
    while entries().await < 2 {
        assert!(Instant::now() < until, "the waiter never queued");
        sleep(Duration::from_millis(20)).await;
    }
    let mut root_auth = root.auth_client();
    root_auth
        .role_revoke_permission(
            "locks",
            "distlock/",
            Some(etcd_client::RoleRevokePermissionOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    // The waiter gives up: its entry's clean-up starts in the background and is refused.
    task.abort();
    let _ = task.await;
    assert!(
        lock_core::raw::cleanup::finish(Duration::from_secs(10)).await,
        "a clean-up refused for good is still retrying"
    );
    assert_eq!(
        entries().await,
        2,
        "the refused delete did not apply; the entry goes with its lease"
    );
}
