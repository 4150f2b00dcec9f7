//! The README's "tokens and passwords never reach logs", for every driver's own test: every
//! tracing event and span field, at TRACE, is captured during a normal life — acquire, a queued
//! waiter handed the lock by the release, renew, a guard whose watchdog renews, release, all
//! through `Observed` (the facade's wrapper) — and during failing connects with a password in
//! the URL. Neither a full ownership token (nor its first 12 hex digits) nor the password may
//! appear.
//!
//! [`check`] installs the capturing subscriber as the process-wide default (so the driver's
//! background tasks on every runtime thread are captured too): call it from the only test of
//! its own test binary.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation is a failed test

use std::{
    fmt::{self, Write as _},
    future::Future,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use lock_core::{DistributedLockExt, DynLock, Observed};
use tokio::time::{Instant, sleep, timeout};
use tracing::{
    Event, Metadata, Subscriber,
    field::{Field, Visit},
    span,
};

use crate::fresh_key;

/// A password no test server knows, so that it can only come from the URLs below.
pub const SECRET: &str = "pw-h2-S3cr3t-9f4e";

/// Writes every event and span field of every level as text.
#[derive(Clone, Default)]
struct Capture {
    text: Arc<Mutex<String>>,
    ids: Arc<AtomicU64>,
}

struct Fields<'a>(&'a mut String);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        let _ = write!(self.0, " {}={value:?}", field.name());
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        let _ = write!(self.0, " {}={value}", field.name());
    }
}

impl Capture {
    fn line(&self, head: fmt::Arguments<'_>, record: impl FnOnce(&mut Fields<'_>)) {
        let mut line = head.to_string();
        record(&mut Fields(&mut line));
        let mut text = self.text.lock().unwrap();
        text.push_str(&line);
        text.push('\n');
    }
}

impl Subscriber for Capture {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }

    fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
        Some(tracing::level_filters::LevelFilter::TRACE)
    }

    fn new_span(&self, span: &span::Attributes<'_>) -> span::Id {
        let meta = span.metadata();
        self.line(
            format_args!("span {} {}", meta.target(), meta.name()),
            |f| span.record(f),
        );
        span::Id::from_u64(self.ids.fetch_add(1, Ordering::Relaxed) + 1)
    }

    fn record(&self, _: &span::Id, values: &span::Record<'_>) {
        self.line(format_args!("record"), |f| values.record(f));
    }

    fn record_follows_from(&self, _: &span::Id, _: &span::Id) {}

    fn event(&self, event: &Event<'_>) {
        let meta = event.metadata();
        self.line(format_args!("{} {}", meta.level(), meta.target()), |f| {
            event.record(f)
        });
    }

    fn enter(&self, _: &span::Id) {}

    fn exit(&self, _: &span::Id) {}
}

/// `url` with its password replaced by [`SECRET`] (`scheme://user:password@rest`).
pub fn with_secret(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("a URL");
    let (userinfo, host) = rest.split_once('@').expect("credentials in the secure URL");
    let user = userinfo.split(':').next().unwrap_or(userinfo);
    format!("{scheme}://{user}:{SECRET}@{host}")
}

/// The normal life of two clients on one key; returns every full token it was granted.
async fn normal_life(a: DynLock, b: DynLock) -> Vec<String> {
    let ttl = a.capabilities().min_ttl.max(Duration::from_secs(1));
    let key = fresh_key("logs");
    let mut tokens = Vec::new();
    let mut lease = a
        .try_acquire(&key, ttl)
        .await
        .unwrap()
        .expect("a fresh key");
    tokens.push(lease.token().expose_hex());
    let waits = {
        let (b, key) = (b.clone(), key.clone());
        tokio::spawn(async move { b.acquire(&key, ttl * 10, Instant::now() + ttl * 20).await })
    };
    let until = Instant::now() + Duration::from_secs(10);
    while a.inspect(&key).await.unwrap().and_then(|i| i.waiters) == Some(0) {
        assert!(Instant::now() < until, "the waiter never queued");
        sleep(Duration::from_millis(10)).await;
    }
    a.renew(&mut lease, ttl).await.unwrap();
    assert!(a.release(&lease).await.unwrap());
    let got = timeout(Duration::from_secs(10), waits)
        .await
        .expect("the waiter got the lock")
        .unwrap()
        .unwrap();
    tokens.push(got.token().expose_hex());
    assert!(!a.release(&lease).await.unwrap(), "a stale release");
    assert!(b.release(&got).await.unwrap());
    let guard = a
        .lock(&key)
        .ttl(ttl)
        .try_acquire()
        .await
        .unwrap()
        .expect("free");
    tokens.push(guard.granted_lease().token().expose_hex());
    let until = Instant::now() + Duration::from_secs(10);
    while guard.renewals() == 0 {
        assert!(Instant::now() < until, "the watchdog never renewed");
        sleep(Duration::from_millis(10)).await;
    }
    assert!(guard.release().await.unwrap());
    tokens
}

/// A driver's client as `distlock::connect` makes it: inside `Observed`.
pub fn observed(lock: impl lock_core::DistributedLock + 'static) -> DynLock {
    Arc::new(Observed::new(Arc::new(lock)))
}

/// The whole check. `client` makes a connected client of the server under test; `try_bad`
/// connects to a URL holding [`SECRET`] (a closed port, a wrong password) and returns the error's
/// text, or `None` when it connected (a failure of the test).
pub async fn check<C, CF, B, BF>(client: C, bad_urls: Vec<String>, try_bad: B)
where
    C: Fn() -> CF,
    CF: Future<Output = DynLock>,
    B: Fn(String) -> BF,
    BF: Future<Output = Option<String>>,
{
    let capture = Capture::default();
    tracing::subscriber::set_global_default(capture.clone()).expect("the only subscriber");
    let tokens = normal_life(client().await, client().await).await;
    // Failing connects with the password in the URL.
    let mut failed = Vec::new();
    for bad in bad_urls {
        match timeout(Duration::from_secs(20), try_bad(bad.clone())).await {
            Ok(Some(error)) => failed.push(error),
            Ok(None) => panic!("connected with a wrong password or to a closed port: {bad}"),
            Err(_) => panic!("connect did not fail within 20 s: {bad}"),
        }
    }
    // The background clean-ups and watchdogs have finished what they log.
    assert!(lock_core::raw::cleanup::finish(Duration::from_secs(20)).await);
    let logs = capture.text.lock().unwrap().clone();
    assert!(
        logs.contains("distlock.try_acquire") && logs.contains("distlock.release"),
        "the spans were not captured:\n{logs}"
    );
    for token in &tokens {
        assert!(
            !logs.contains(token.as_str()),
            "a full token reached the logs:\n{logs}"
        );
        assert!(
            !logs.contains(&token[..12]),
            "a token's first 12 digits reached the logs:\n{logs}"
        );
    }
    assert!(
        !logs.contains(SECRET),
        "the password reached the logs:\n{logs}"
    );
    for error in failed {
        assert!(
            !error.contains(SECRET),
            "the password reached an error: {error}"
        );
    }
}
