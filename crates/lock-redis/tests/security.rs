//! TLS and ACL authentication against the secured Redis of `scripts/backends.sh up-secure`
//! (`DISTLOCK_TEST_REDIS_SECURE_URL`: TLS only, default user off, ACL user `distlock`).
//!
//! Every failure must fail closed: a typed error within a bounded time, never a connection that
//! silently runs unencrypted or unauthenticated, and never the password in the error.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed expectation is a failed test

use std::time::Duration;

use conformance::{backend_url, fresh_key};
use lock_core::{DistributedLock, Error};
use lock_redis::{RedisLock, RedisLockConfig};
use tokio::time::timeout;
use url::Url;

/// Far above the driver's own bound (connect attempts + response timeout); hitting it is a hang.
const HANG: Duration = Duration::from_secs(30);
/// What a failing connect may take here (a few attempts of the 1 s connect timeout).
const BOUND: Duration = Duration::from_secs(15);

use conformance::security::SecureServer as Secure;

fn secure() -> Option<Secure> {
    conformance::security::secure_server("DISTLOCK_TEST_REDIS_SECURE_URL")
}

fn with_query(url: &Url, pairs: &[(&str, &str)]) -> Url {
    let mut url = url.clone();
    url.query_pairs_mut()
        .clear()
        .extend_pairs(pairs.iter().copied());
    url
}

/// Connects to `url` and expects it to fail closed within [`BOUND`] without showing a secret.
async fn must_fail(url: &str, secrets: &[&str]) -> (Error, String) {
    conformance::security::fails_closed(RedisLock::connect_url(url), secrets, BOUND, HANG).await
}

#[tokio::test]
async fn right_credentials_and_ca_lock_and_unlock() {
    let Some(s) = secure() else { return };
    let lock = timeout(HANG, RedisLock::connect_url(s.url.as_str()))
        .await
        .unwrap()
        .unwrap();
    assert!(lock.config().tls);
    for shown in [format!("{lock:?}"), format!("{:?}", lock.config())] {
        assert!(!shown.contains(&s.password), "{shown}");
    }
    let key = fresh_key("redis-secure");
    let lease = lock
        .try_acquire(&key, Duration::from_secs(10))
        .await
        .unwrap()
        .expect("a fresh key is free");
    let other = RedisLock::connect_url(s.url.as_str()).await.unwrap();
    assert!(
        other
            .try_acquire(&key, Duration::from_secs(10))
            .await
            .unwrap()
            .is_none(),
        "held by the first client"
    );
    assert!(lock.release(&lease).await.unwrap());
    let again = other
        .try_acquire(&key, Duration::from_secs(10))
        .await
        .unwrap()
        .expect("free after release");
    assert!(again.fencing_token() > lease.fencing_token());
    assert!(other.release(&again).await.unwrap());
}

#[tokio::test]
async fn wrong_password_fails_closed() {
    let Some(s) = secure() else { return };
    let mut url = s.url.clone();
    let wrong = format!("wrong-{:016x}", rand::random::<u64>());
    url.set_password(Some(&wrong)).unwrap();
    let (err, shown) = must_fail(url.as_str(), &[&s.password, &wrong]).await;
    assert!(
        !err.is_temporary(),
        "bad credentials are permanent: {err:?}"
    );
    assert!(
        shown.contains("wrongpass") || shown.contains("authentication"),
        "{shown}"
    );
}

#[tokio::test]
async fn no_credentials_fail_closed() {
    let Some(s) = secure() else { return };
    let mut url = s.url.clone();
    url.set_password(None).unwrap();
    url.set_username("").unwrap();
    let (_, shown) = must_fail(url.as_str(), &[&s.password]).await;
    assert!(
        shown.contains("noauth") || shown.contains("authentication"),
        "{shown}"
    );
}

#[tokio::test]
async fn wrong_ca_or_system_roots_fail_closed() {
    let Some(s) = secure() else { return };
    let wrong = with_query(&s.url, &[("ca", &s.wrong_ca)]);
    let (err, shown) = must_fail(wrong.as_str(), &[&s.password]).await;
    assert!(shown.contains("certificate"), "{shown}");
    assert!(
        !err.is_temporary(),
        "an untrusted server is permanent: {err:?}"
    );
    // Without `ca` the system roots are used, and they do not know the test CA either.
    let system = with_query(&s.url, &[]);
    let (_, shown) = must_fail(system.as_str(), &[&s.password]).await;
    assert!(shown.contains("certificate"), "{shown}");
}

#[tokio::test]
async fn plaintext_url_against_the_tls_server_fails_closed() {
    let Some(s) = secure() else { return };
    let mut url = with_query(&s.url, &[]);
    url.set_scheme("redis").unwrap();
    must_fail(url.as_str(), &[&s.password]).await;
}

#[tokio::test]
async fn tls_url_against_a_plaintext_server_fails_closed() {
    let Some(s) = secure() else { return };
    let Some(plain) = backend_url("DISTLOCK_TEST_REDIS_URL") else {
        return;
    };
    let plain = Url::parse(&plain).unwrap();
    let mut url = s.url.clone();
    url.set_port(plain.port()).unwrap();
    let (_, shown) = must_fail(url.as_str(), &[&s.password]).await;
    assert!(
        shown.contains("tls") || shown.contains("message"),
        "{shown}"
    );
}

#[test]
fn tls_options_need_rediss() {
    assert!(matches!(
        RedisLockConfig::from_url("redis://h?ca=/tmp/ca.pem"),
        Err(Error::Config(_))
    ));
    let c = RedisLockConfig::from_url("rediss://u:topsecret@h?ca=/tmp/ca.pem").unwrap();
    assert!(!format!("{c:?}").contains("topsecret"));
}
