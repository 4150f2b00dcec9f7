//! Connect errors are one line with the server's address (never the credentials) and the
//! cause, without the PostgreSQL source line `sqlx` appends ("… at line 768").
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed expectation is a failed test

use conformance::backend_url;
use lock_core::Error;
use lock_pg::PgLock;

fn check_one_line(err: &Error, address: &str, cause: &str) {
    let text = err.to_string();
    assert!(!text.contains('\n'), "{text}");
    assert!(
        text.contains(&format!("cannot connect to {address}: ")),
        "{text}"
    );
    assert!(text.contains(cause), "{text}");
    assert!(!text.contains("hunter2"), "{text}");
    assert!(!text.contains("at line"), "{text}");
    assert!(
        !text.contains("error communicating with database"),
        "{text}"
    );
}

/// Nothing listens: Unavailable, during connect, the address and the refusal.
#[tokio::test]
async fn a_refused_connect_is_one_line_with_the_address() {
    let err = PgLock::connect_url("postgres://app:hunter2@127.0.0.1:1/jobs?connect_timeout=2")
        .await
        .expect_err("nothing listens on port 1");
    assert!(
        matches!(err, Error::Unavailable { op: "connect", .. }),
        "{err}"
    );
    check_one_line(&err, "127.0.0.1:1/jobs", "refused");
}

/// The server refuses the login (a role that does not exist): a permanent Backend error, one
/// line with the address and PostgreSQL's message and SQLSTATE, no source line.
#[tokio::test]
async fn a_refused_login_is_one_line_without_the_source_line() {
    let Some(url) = backend_url("DISTLOCK_TEST_PG_URL") else {
        return;
    };
    let (scheme, rest) = url.split_once("://").unwrap();
    let host = rest.split_once('@').map_or(rest, |(_, host)| host);
    let (authority, _) = host.split_once('/').unwrap_or((host, ""));
    let bad = format!("{scheme}://distlock_no_such_role:hunter2@{authority}/distlock_no_such_db");
    let err = PgLock::connect_url(&bad).await.expect_err("no such role");
    assert!(matches!(err, Error::Backend { op: "connect", .. }), "{err}");
    check_one_line(
        &err,
        &format!("{authority}/distlock_no_such_db"),
        "role \"distlock_no_such_role\" does not exist (SQLSTATE 28000)",
    );
}
