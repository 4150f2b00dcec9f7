//! Configuration is validated however it was set: every value of every field of
//! `RedisLockConfig` and every URL option value gives a client or `Error::Config`, never a panic
//! — and a client built from it answers with a typed error, never a panic, even when its
//! durations are extreme (no deadline computed from them may overflow).
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed expectation is a failed test

use std::time::Duration;

use lock_core::{DistributedLock, Error, LockKey};
use lock_redis::{RedisLock, RedisLockConfig};
use proptest::prelude::*;
use tokio::time::Instant;

/// Durations across the whole range: zero, tiny, ordinary, just around the cap, huge, MAX.
fn duration() -> impl Strategy<Value = Duration> {
    prop_oneof![
        Just(Duration::ZERO),
        Just(Duration::MAX),
        Just(RedisLockConfig::MAX_DURATION),
        Just(RedisLockConfig::MAX_DURATION + Duration::from_nanos(1)),
        (0u64..5_000).prop_map(Duration::from_millis),
        any::<u64>().prop_map(Duration::from_nanos),
        any::<u64>().prop_map(Duration::from_secs),
        (any::<u64>(), 0u32..1_000_000_000).prop_map(|(s, n)| Duration::new(s, n)),
    ]
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Builds a client from `config` (nothing listens on port 1: every request is refused at
/// once) and uses it: `Error::Config` up front, or typed errors from the requests.
fn exercise(config: RedisLockConfig) -> Result<(), TestCaseError> {
    let used = runtime().block_on(async {
        tokio::time::timeout(Duration::from_secs(20), use_client(config)).await
    });
    used.unwrap_or_else(|_| Err(TestCaseError::fail("the client hung")))
}

async fn use_client(config: RedisLockConfig) -> Result<(), TestCaseError> {
    {
        let lock = match RedisLock::connect_lazy(config.clone()) {
            Ok(lock) => lock,
            Err(Error::Config(_)) => {
                prop_assert!(config.validate().is_err());
                return Ok(());
            }
            Err(other) => return Err(TestCaseError::fail(format!("connect_lazy: {other}"))),
        };
        prop_assert!(config.validate().is_ok());
        let key = LockKey::new("config-props").unwrap();
        let ttl = Duration::from_secs(1);
        let err = lock.try_acquire(&key, ttl).await.unwrap_err();
        prop_assert!(err.is_temporary(), "try_acquire: {err}");
        let deadline = Instant::now() + Duration::from_millis(30);
        let err = lock.acquire(&key, ttl, deadline).await.unwrap_err();
        prop_assert!(err.is_temporary(), "acquire: {err}");
        prop_assert!(lock.inspect(&key).await.is_err());
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn any_field_values_give_a_client_or_a_config_error(
        connect_timeout in duration(),
        timeout in duration(),
        max_poll_interval in duration(),
        reconnect_retries in prop_oneof![0usize..6, Just(6usize), Just(100usize), any::<usize>()],
        db in prop_oneof![0i64..16, any::<i64>(), Just(i64::MAX), Just(i64::MIN)],
        namespace in "\\PC{0,8}|[a-z]{0,3}\\x1f[a-z]{0,3}",
        empty_host in any::<bool>(),
        label in proptest::option::of("\\PC{0,8}|[a-z:@./_-]{1,70}"),
    ) {
        let mut config = RedisLockConfig::from_url("redis://127.0.0.1:1").unwrap();
        config.connect_timeout = connect_timeout;
        config.timeout = timeout;
        config.max_poll_interval = max_poll_interval;
        config.reconnect_retries = reconnect_retries;
        config.db = db;
        config.namespace = namespace;
        config.label = label;
        if empty_host {
            config.host = String::new();
        }
        exercise(config)?;
    }

    #[test]
    fn any_url_option_value_gives_a_client_or_a_config_error(
        option in prop_oneof![
            Just("connect_timeout"),
            Just("response_timeout"),
            Just("timeout"),
            Just("max_poll_interval"),
            Just("reconnect_retries"),
            Just("namespace"),
            Just("ca"),
            Just("label"),
        ],
        value in prop_oneof![
            "[0-9]{0,11}(ms|s|m|h|)",
            "4294967295(ms|s|m)",
            "6[0-9](m)",
            "[0-9]{1,25}",
            "\\PC{0,6}",
        ],
        db in "[0-9]{0,20}|-1",
    ) {
        let url = format!("redis://127.0.0.1:1/{db}?{option}={value}");
        match RedisLockConfig::from_url(&url) {
            Ok(config) => exercise(config)?,
            Err(Error::Config(_)) => {}
            Err(other) => return Err(TestCaseError::fail(format!("{url}: {other}"))),
        }
    }
}

#[test]
fn durations_beyond_the_cap_are_refused_from_the_url_and_the_fields() {
    for url in [
        "redis://h?response_timeout=61m",
        "redis://h?connect_timeout=4294967295m",
        "redis://h?max_poll_interval=3601s",
        "redis://h/2147483648",
    ] {
        assert!(
            matches!(RedisLockConfig::from_url(url), Err(Error::Config(_))),
            "{url}"
        );
    }
    assert!(RedisLockConfig::from_url("redis://h?max_poll_interval=60m").is_ok());
    let mut config = RedisLockConfig::default();
    config.max_poll_interval = Duration::MAX;
    let _rt = runtime().enter();
    assert!(matches!(
        RedisLock::connect_lazy(config),
        Err(Error::Config(_))
    ));
}

#[test]
fn a_bad_label_is_a_config_error_before_any_io() {
    let rt = runtime();
    let _entered = rt.enter();
    // Nothing listens on port 1: an error other than `Config` would mean I/O was tried.
    for label in ["", "two words", "é", "a\nb", &"x".repeat(65)] {
        let mut config = RedisLockConfig::from_url("redis://127.0.0.1:1").unwrap();
        config.label = Some(label.to_owned());
        assert!(
            matches!(config.validate(), Err(Error::Config(_))),
            "{label:?}"
        );
        assert!(
            matches!(RedisLock::connect_lazy(config), Err(Error::Config(_))),
            "{label:?}"
        );
    }
    for url in [
        "redis://127.0.0.1:1?label=",
        "redis://127.0.0.1:1?label=a%20b",
    ] {
        let err = rt.block_on(RedisLock::connect_url(url)).unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{url}: {err}");
    }
    let mut config = RedisLockConfig::from_url("redis://127.0.0.1:1?label=ok-label").unwrap();
    assert_eq!(config.label.as_deref(), Some("ok-label"));
    config.label = Some("nightly/report@web-1.example:42".to_owned());
    RedisLock::connect_lazy(config).unwrap();
}
