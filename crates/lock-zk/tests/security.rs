//! Digest authentication and the `creator` ACL against the secured ZooKeeper of
//! `scripts/backends.sh up-secure` (`DISTLOCK_TEST_ZK_SECURE_URL`: every session must present
//! `digest` credentials; the URL asks for `acl=creator`).
//!
//! ZooKeeper's digest scheme accepts any `user:password` as an identity: a wrong password is a
//! different identity, not a refused login. What must hold is that it can neither take, inspect
//! nor delete the locks of the right identity, and that a session without credentials is refused.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed expectation is a failed test

use std::time::Duration;

use conformance::{backend_url, fresh_key};
use lock_core::{DistributedLock, Error, LockKey};
use lock_zk::{ZkAcl, ZkLock, ZkLockConfig};
use tokio::time::{Instant, timeout};
use zookeeper_client as zk;

/// Far above the driver's own bounds (5 s connect, 5 s per request); hitting it is a hang.
const HANG: Duration = Duration::from_secs(30);
/// What a failing connect or request may take here.
const BOUND: Duration = Duration::from_secs(15);
const TTL: Duration = Duration::from_secs(10);

struct Secure {
    config: ZkLockConfig,
    password: String,
}

fn secure() -> Option<Secure> {
    let url = backend_url("DISTLOCK_TEST_ZK_SECURE_URL")?;
    let config = ZkLockConfig::from_url(&url).unwrap();
    assert_eq!(config.acl, ZkAcl::Creator);
    let password = config
        .auth
        .clone()
        .expect("credentials in the secure URL")
        .1
        .expose()
        .to_owned();
    Some(Secure { config, password })
}

fn with_password(config: &ZkLockConfig, password: &str) -> ZkLockConfig {
    let mut config = config.clone();
    let user = config.auth.as_ref().unwrap().0.clone();
    config.auth = Some((user, password.into()));
    config
}

/// Expects `result` to be an error within [`BOUND`] of `started` that shows no secret.
fn failed<T: std::fmt::Debug>(
    what: &str,
    started: Instant,
    result: Result<T, Error>,
    secrets: &[&str],
) -> String {
    let elapsed = started.elapsed();
    let err = match result {
        Ok(v) => panic!("{what} succeeded where it must fail: {v:?}"),
        Err(e) => e,
    };
    let shown = format!("{err} | {err:?}");
    for secret in secrets {
        assert!(!shown.contains(secret), "a secret leaked: {shown}");
    }
    assert!(elapsed < BOUND, "{what}: failing took {elapsed:?}: {shown}");
    eprintln!("{what}: failed closed in {elapsed:?}: {err}");
    shown.to_lowercase()
}

async fn hold(s: &Secure, key: &LockKey) -> (ZkLock, lock_core::Lease) {
    let lock = timeout(HANG, ZkLock::connect(s.config.clone()))
        .await
        .unwrap()
        .unwrap();
    let lease = lock
        .try_acquire(key, TTL)
        .await
        .unwrap()
        .expect("a fresh key is free");
    (lock, lease)
}

#[tokio::test]
async fn right_credentials_lock_and_unlock() {
    let Some(s) = secure() else { return };
    let key = fresh_key("zk-secure");
    let (lock, lease) = hold(&s, &key).await;
    for shown in [format!("{lock:?}"), format!("{:?}", lock.config())] {
        assert!(!shown.contains(&s.password), "{shown}");
    }
    // Another session with the same identity contends normally.
    let other = ZkLock::connect(s.config.clone()).await.unwrap();
    assert!(other.try_acquire(&key, TTL).await.unwrap().is_none());
    assert!(lock.release(&lease).await.unwrap());
    let again = other
        .try_acquire(&key, TTL)
        .await
        .unwrap()
        .expect("free after release");
    assert!(again.fencing_token() > lease.fencing_token());
    assert!(other.release(&again).await.unwrap());
}

#[tokio::test]
async fn wrong_password_cannot_take_inspect_or_release_the_lock() {
    let Some(s) = secure() else { return };
    // No `/` in the name, so its directory is `<root>/<name>` verbatim.
    let key = LockKey::new(format!("zk-secure-wrong-{:016x}", rand::random::<u64>())).unwrap();
    let (lock, lease) = hold(&s, &key).await;
    let wrong = format!("wrong-{:016x}", rand::random::<u64>());
    let secrets = [s.password.as_str(), wrong.as_str()];

    // Refused at connect: the lock root's ACL proves the identity before any lock operation
    // (ZooKeeper's digest scheme takes any password at login).
    let t = Instant::now();
    let shown = failed(
        "connect",
        t,
        ZkLock::connect(with_password(&s.config, &wrong)).await,
        &secrets,
    );
    assert!(shown.contains("refuses the digest identity"), "{shown}");
    // A lazily connected client is refused the same way at its first operation, whichever.
    let unchecked = ZkLock::new(with_password(&s.config, &wrong)).unwrap();
    let t = Instant::now();
    let shown = failed(
        "try_acquire",
        t,
        unchecked.try_acquire(&key, TTL).await,
        &secrets,
    );
    assert!(shown.contains("refuses the digest identity"), "{shown}");
    let t = Instant::now();
    let shown = failed(
        "acquire",
        t,
        unchecked
            .acquire(&key, TTL, Instant::now() + Duration::from_secs(2))
            .await,
        &secrets,
    );
    assert!(
        !shown.contains("timed out"),
        "denied, not merely kept waiting: {shown}"
    );
    let t = Instant::now();
    failed("inspect", t, unchecked.inspect(&key).await, &secrets);
    let t = Instant::now();
    failed(
        "force_release",
        t,
        unchecked.force_release(&key).await,
        &secrets,
    );

    // Nor with the raw client: the holder's node cannot be deleted or overwritten.
    let raw = zk::Client::connector()
        .with_auth("digest", format!("distlock:{wrong}").as_bytes())
        .connect(&s.config.connect_string())
        .await
        .unwrap();
    let dir = format!("{}/{}", s.config.root.trim_end_matches('/'), key.as_str());
    let children = raw.list_children(&dir).await;
    assert!(matches!(children, Err(zk::Error::NoAuth)), "{children:?}");

    // The holder still holds it.
    let held = lock.inspect(&key).await.unwrap().expect("still held");
    assert_eq!(held.fencing_token, lease.fencing_token());
    assert!(lock.release(&lease).await.unwrap());
}

#[tokio::test]
async fn a_session_without_credentials_is_refused() {
    let Some(s) = secure() else { return };
    let mut config = s.config.clone();
    config.auth = None;
    config.acl = ZkAcl::Open;
    let started = Instant::now();
    let result = timeout(HANG, async {
        let lock = ZkLock::connect(config).await?;
        lock.try_acquire(&fresh_key("zk-secure-anon"), TTL).await
    })
    .await
    .expect("hung instead of failing");
    failed("anonymous lock", started, result, &[&s.password]);
}

#[test]
fn creator_acl_needs_credentials_and_debug_redacts_them() {
    assert!(matches!(
        ZkLockConfig::from_url("zk://127.0.0.1:1?acl=creator"),
        Err(Error::Config(_))
    ));
    let c = ZkLockConfig::from_url("zk://u:topsecret@127.0.0.1:1?acl=creator").unwrap();
    assert!(!format!("{c:?}").contains("topsecret"));
}
