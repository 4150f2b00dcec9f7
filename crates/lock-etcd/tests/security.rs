//! TLS and user/password authentication against the secured etcd of
//! `scripts/backends.sh up-secure` (`DISTLOCK_TEST_ETCD_SECURE_URL`: client TLS only, auth
//! enabled, user `distlock` with read/write on the key prefix `distlock/` only).
//!
//! Every failure must fail closed: a typed error within a bounded time, never a connection that
//! silently runs unencrypted or unauthenticated, and never the password in the error.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed expectation is a failed test

use std::time::Duration;

use conformance::{backend_url, fresh_key};
use lock_core::{DistributedLock, Error};
use lock_etcd::{EtcdLock, EtcdLockConfig};
use tokio::time::timeout;
use url::Url;

/// Far above the driver's own bounds (3 s dial + 5 s request); hitting it is a hang.
const HANG: Duration = Duration::from_secs(40);
/// What a failing connect or first request may take here.
const BOUND: Duration = Duration::from_secs(20);
const TTL: Duration = Duration::from_secs(10);

use conformance::security::SecureServer as Secure;

fn secure() -> Option<Secure> {
    conformance::security::secure_server("DISTLOCK_TEST_ETCD_SECURE_URL")
}

fn with_query(url: &Url, pairs: &[(&str, &str)]) -> String {
    let mut url = url.clone();
    url.query_pairs_mut()
        .clear()
        .extend_pairs(pairs.iter().copied());
    url.as_str().trim_end_matches('?').to_owned()
}

/// Connects to `url` and takes a fresh lock, expecting a failure at either step to fail closed
/// within [`BOUND`] without showing a secret.
async fn must_fail(url: &str, secrets: &[&str]) -> (Error, String) {
    let attempt = async {
        let lock = EtcdLock::connect_url(url).await?;
        lock.try_acquire(&fresh_key("etcd-secure-denied"), TTL)
            .await
            .map(|lease| (lock, lease))
    };
    conformance::security::fails_closed(attempt, secrets, BOUND, HANG).await
}

#[tokio::test]
async fn right_credentials_and_ca_lock_and_unlock() {
    let Some(s) = secure() else { return };
    let lock = timeout(HANG, EtcdLock::connect_url(s.url.as_str()))
        .await
        .unwrap()
        .unwrap();
    assert!(lock.config().tls.is_some());
    for shown in [format!("{lock:?}"), format!("{:?}", lock.config())] {
        assert!(!shown.contains(&s.password), "{shown}");
    }
    let key = fresh_key("etcd-secure");
    let lease = lock
        .try_acquire(&key, TTL)
        .await
        .unwrap()
        .expect("a fresh key is free");
    let other = EtcdLock::connect_url(s.url.as_str()).await.unwrap();
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
    assert!(shown.contains("authentication failed"), "{shown}");
}

#[tokio::test]
async fn no_credentials_fail_closed() {
    let Some(s) = secure() else { return };
    let mut url = s.url.clone();
    url.set_password(None).unwrap();
    url.set_username("").unwrap();
    let (err, shown) = must_fail(url.as_str(), &[&s.password]).await;
    assert!(!err.is_temporary(), "{err:?}");
    assert!(shown.contains("user name is empty"), "{shown}");
}

#[tokio::test]
async fn a_prefix_outside_the_role_is_denied() {
    let Some(s) = secure() else { return };
    let ca = s
        .url
        .query_pairs()
        .find(|(k, _)| k == "ca")
        .map(|(_, v)| v.into_owned())
        .unwrap();
    let url = with_query(&s.url, &[("ca", &ca), ("prefix", "elsewhere/")]);
    let (err, shown) = must_fail(&url, &[&s.password]).await;
    assert!(!err.is_temporary(), "{err:?}");
    assert!(shown.contains("permission denied"), "{shown}");
}

#[tokio::test]
async fn wrong_ca_fails_closed() {
    let Some(s) = secure() else { return };
    let (_, shown) = must_fail(&with_query(&s.url, &[("ca", &s.wrong_ca)]), &[&s.password]).await;
    assert!(
        shown.contains("certificate") || shown.contains("unknownissuer"),
        "{shown}"
    );
}

#[tokio::test]
async fn plaintext_url_against_the_tls_server_fails_closed() {
    let Some(s) = secure() else { return };
    let mut url = with_query(&s.url, &[]);
    url = url.replacen("etcds://", "etcd://", 1);
    must_fail(&url, &[&s.password]).await;
}

#[tokio::test]
async fn tls_url_against_a_plaintext_server_fails_closed() {
    let Some(s) = secure() else { return };
    let Some(plain) = backend_url("DISTLOCK_TEST_ETCD_URL") else {
        return;
    };
    let plain = EtcdLockConfig::from_url(&plain).unwrap();
    let port = plain.endpoints[0].rsplit_once(':').unwrap().1;
    let mut url = s.url.clone();
    url.set_port(Some(port.parse().unwrap())).unwrap();
    must_fail(url.as_str(), &[&s.password]).await;
}
