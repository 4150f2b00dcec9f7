//! TLS and password authentication against the secured PostgreSQL of
//! `scripts/backends.sh up-secure` (`DISTLOCK_TEST_PG_SECURE_URL`: `ssl=on`, only `hostssl` +
//! `scram-sha-256` for the user `distlock`, no plaintext `host` entry).
//!
//! Every failure must fail closed: a typed error within a bounded time, never a connection that
//! silently runs unencrypted or unauthenticated, and never the password in the error.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed expectation is a failed test

use std::time::Duration;

use conformance::{backend_url, fresh_key};
use lock_core::{DistributedLock, Error};
use lock_pg::{PgLock, PgLockConfig};
use tokio::time::timeout;
use url::Url;

/// Far above the driver's own bound (the 5 s connect timeout); hitting it is a hang.
const HANG: Duration = Duration::from_secs(30);
/// What a failing connect may take here.
const BOUND: Duration = Duration::from_secs(15);

use conformance::security::SecureServer as Secure;

fn secure() -> Option<Secure> {
    conformance::security::secure_server("DISTLOCK_TEST_PG_SECURE_URL")
}

/// `url` with query option `name` set to `value` (removed when `None`).
fn with_option(url: &Url, name: &str, value: Option<&str>) -> Url {
    let pairs: Vec<(String, String)> = url
        .query_pairs()
        .filter(|(k, _)| k != name)
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .chain(value.map(|v| (name.to_owned(), v.to_owned())))
        .collect();
    let mut url = url.clone();
    url.query_pairs_mut().clear().extend_pairs(pairs);
    url
}

/// Connects to `url` and expects it to fail closed within [`BOUND`] without showing a secret.
async fn must_fail(url: &str, secrets: &[&str]) -> (Error, String) {
    conformance::security::fails_closed(PgLock::connect_url(url), secrets, BOUND, HANG).await
}

#[tokio::test]
async fn right_password_and_ca_lock_and_unlock_over_tls() {
    let Some(s) = secure() else { return };
    let lock = timeout(HANG, PgLock::connect_url(s.url.as_str()))
        .await
        .unwrap()
        .unwrap();
    for shown in [format!("{lock:?}"), format!("{:?}", lock.config())] {
        assert!(!shown.contains(&s.password), "{shown}");
    }
    let key = fresh_key("pg-secure");
    let lease = lock
        .try_acquire(&key, Duration::from_secs(10))
        .await
        .unwrap()
        .expect("a fresh key is free");
    let other = PgLock::connect_url(s.url.as_str()).await.unwrap();
    assert!(
        other
            .try_acquire(&key, Duration::from_secs(10))
            .await
            .unwrap()
            .is_none()
    );
    assert!(lock.release(&lease).await.unwrap());
    let again = other
        .try_acquire(&key, Duration::from_secs(10))
        .await
        .unwrap()
        .expect("free after release");
    assert!(again.fencing_token() > lease.fencing_token());
    assert!(other.release(&again).await.unwrap());

    // The session really is encrypted (checked with a plain sqlx connection on the same URL).
    use lock_pg::sqlx::{self, Connection};
    let mut conn = sqlx::PgConnection::connect(s.url.as_str()).await.unwrap();
    let ssl: bool = sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert!(ssl);
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
    assert!(shown.contains("password authentication failed"), "{shown}");
}

#[tokio::test]
async fn wrong_ca_fails_closed() {
    let Some(s) = secure() else { return };
    let url = with_option(&s.url, "sslrootcert", Some(&s.wrong_ca));
    let (err, shown) = must_fail(url.as_str(), &[&s.password]).await;
    assert!(shown.contains("certificate"), "{shown}");
    assert!(
        !err.is_temporary(),
        "an untrusted server is permanent: {err:?}"
    );
    // verify-ca checks the chain too.
    let url = with_option(&url, "sslmode", Some("verify-ca"));
    let (_, shown) = must_fail(url.as_str(), &[&s.password]).await;
    assert!(shown.contains("certificate"), "{shown}");
}

#[tokio::test]
async fn plaintext_against_the_tls_server_is_refused() {
    let Some(s) = secure() else { return };
    let url = with_option(&s.url, "sslrootcert", None);
    let url = with_option(&url, "sslmode", Some("disable"));
    let (err, shown) = must_fail(url.as_str(), &[&s.password]).await;
    assert!(!err.is_temporary(), "{err:?}");
    assert!(shown.contains("no encryption"), "{shown}");
}

#[tokio::test]
async fn tls_url_against_a_plaintext_server_fails_closed() {
    let Some(s) = secure() else { return };
    let Some(plain) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let plain = Url::parse(&plain).unwrap();
    let mut url = s.url.clone();
    url.set_port(plain.port()).unwrap();
    let (_, shown) = must_fail(url.as_str(), &[&s.password]).await;
    assert!(shown.contains("tls"), "{shown}");
}

#[test]
fn tls_settings_parse_and_the_password_is_redacted() {
    let c = PgLockConfig::from_url(
        "postgres://u:topsecret@h/db?sslmode=verify-full&sslrootcert=/tmp/ca.pem&password=alsosecret",
    )
    .unwrap();
    let shown = format!("{c:?}");
    assert!(
        !shown.contains("topsecret") && !shown.contains("alsosecret"),
        "{shown}"
    );
    assert!(matches!(
        PgLockConfig::from_url("postgres://h/db?sslmode=sometimes"),
        Err(Error::Config(_))
    ));
}
