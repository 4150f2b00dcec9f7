//! Configuration however it is made — any field values, or a URL with any
//! option values — gives a working client or a typed `Error::Config`, never a panic (no server
//! needed: `ZkLock::new` connects lazily).
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed expectation is a failed test

use std::time::Duration;

use lock_core::{DistributedLock, Error};
use lock_zk::{ZkAcl, ZkLock, ZkLockConfig};
use proptest::prelude::*;

fn duration() -> impl Strategy<Value = Duration> {
    prop_oneof![
        Just(Duration::ZERO),
        Just(Duration::MAX),
        Just(Duration::from_nanos(1)),
        Just(Duration::from_millis(i32::MAX as u64)),
        Just(Duration::from_millis(i32::MAX as u64 + 1)),
        Just(ZkLockConfig::MAX_TIMEOUT),
        Just(ZkLockConfig::MAX_TIMEOUT + Duration::from_nanos(1)),
        (0u64..100_000).prop_map(Duration::from_millis),
        (any::<u64>(), 0u32..1_000_000_000).prop_map(|(s, n)| Duration::new(s, n)),
    ]
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just("/".to_owned()),
        Just("/app".to_owned()),
        Just("127.0.0.1:2181".to_owned()),
        Just("h1:1,h2:2".to_owned()),
        Just("h:0".to_owned()),
        Just("h:99999".to_owned()),
        Just(":1".to_owned()),
        Just("a,,b".to_owned()),
        Just("/a/../b".to_owned()),
        Just("/a//b".to_owned()),
        ".{0,24}",
    ]
}

fn config() -> impl Strategy<Value = ZkLockConfig> {
    (
        text(),
        proptest::option::of(text()),
        text(),
        (duration(), duration(), duration()),
        proptest::option::of((text(), text())),
        any::<bool>(),
        proptest::option::of(label()),
    )
        .prop_map(
            |(hosts, chroot, root, (session, connect, op), auth, creator, label)| {
                let mut c = ZkLockConfig::new(hosts);
                c.chroot = chroot;
                c.root = root;
                c.session_timeout = session;
                c.connect_timeout = connect;
                c.timeout = op;
                // A password no other field can contain by chance, to look for it in `Debug`.
                c.auth = auth.map(|(user, password)| (user, format!("Zq9~{password}~pw").into()));
                c.acl = if creator { ZkAcl::Creator } else { ZkAcl::Open };
                c.label = label;
                c
            },
        )
}

fn label() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just("cron@web-1:/etc/cron.d/x".to_owned()),
        Just("x".repeat(64)),
        Just("x".repeat(65)),
        Just("a b".to_owned()),
        Just("a\nb".to_owned()),
        "[a-z0-9@:/._-]{1,8}",
        ".{0,24}",
    ]
}

fn option_value() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("0ms".to_owned()),
        Just("1ms".to_owned()),
        Just("10s".to_owned()),
        Just("24h".to_owned()),
        Just("25h".to_owned()),
        Just("18446744073709551615s".to_owned()),
        Just("99999999999999h".to_owned()),
        Just("-1s".to_owned()),
        Just("1.5s".to_owned()),
        Just("/r".to_owned()),
        Just("creator".to_owned()),
        Just("cron@web-1".to_owned()),
        Just("a%20b".to_owned()),
        Just("a%0Ab".to_owned()),
        "[a-z0-9./%]{0,12}",
    ]
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 512,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Any field values: `new` (the lazy constructor) validates it before any I/O, so a client
    /// exists only for a usable configuration, and `Debug` never shows the password.
    #[test]
    fn any_config_gives_a_client_or_a_config_error(c in config()) {
        let shown = format!("{c:?}");
        if let Some((_, password)) = &c.auth {
            prop_assert!(!shown.contains(password.expose()), "{shown}");
        }
        let validated = c.validate();
        match ZkLock::new(c.clone()) {
            Ok(lock) => {
                prop_assert!(validated.is_ok());
                if let Some(label) = &c.label {
                    prop_assert!(lock_core::HolderIdentity::check_label(label).is_ok());
                }
                prop_assert!(lock.capabilities().max_ttl == lock_core::Capabilities::MAX_TTL);
                prop_assert!(lock.capabilities().min_ttl == c.session_timeout);
                prop_assert!(c.timeout <= ZkLockConfig::MAX_TIMEOUT);
                prop_assert!(c.connect_timeout <= ZkLockConfig::MAX_TIMEOUT);
            }
            Err(Error::Config(_)) => prop_assert!(validated.is_err()),
            Err(e) => prop_assert!(false, "not a config error: {e}"),
        }
    }

    /// Any value of any URL option gives a configuration that validates, or `Error::Config`.
    #[test]
    fn any_url_option_value_gives_a_config_or_a_config_error(
        option in prop_oneof![
            Just("session_timeout"),
            Just("connect_timeout"),
            Just("timeout"),
            Just("op_timeout"),
            Just("root"),
            Just("acl"),
            Just("label"),
        ],
        value in option_value(),
        chroot in prop_oneof![Just(""), Just("/app"), Just("/"), Just("//x")],
    ) {
        let url = format!("zk://127.0.0.1:2181{chroot}?{option}={value}");
        match ZkLockConfig::from_url(&url) {
            Ok(c) => {
                prop_assert!(c.validate().is_ok(), "{url}");
                prop_assert!(ZkLock::new(c).is_ok(), "{url}");
            }
            Err(Error::Config(_)) => {}
            Err(e) => prop_assert!(false, "{url}: not a config error: {e}"),
        }
    }
}

#[test]
fn struct_set_bounds_are_checked() {
    let base = ZkLockConfig::new("127.0.0.1:2181");
    // Field by field (the struct is non-exhaustive: no literal outside the crate).
    let with = |set: &dyn Fn(&mut ZkLockConfig)| {
        let mut c = base.clone();
        set(&mut c);
        c
    };
    for bad in [
        with(&|c| c.timeout = Duration::MAX),
        with(&|c| c.connect_timeout = ZkLockConfig::MAX_TIMEOUT + Duration::from_secs(1)),
        with(&|c| c.chroot = Some("relative".into())),
        with(&|c| c.hosts = "h:1,,h:2".into()),
        with(&|c| c.hosts = "h:70000".into()),
        with(&|c| c.label = Some("no spaces".into())),
    ] {
        assert!(
            matches!(ZkLock::new(bad.clone()), Err(Error::Config(_))),
            "{bad:?}"
        );
    }
    assert!(ZkLock::new(base).is_ok());
}

/// The capabilities state the largest TTL that `try_acquire`/`acquire` accept (what `distlock
/// check` shows), not "no maximum".
#[test]
fn capabilities_state_the_max_ttl_that_is_enforced() {
    let caps = ZkLock::new(ZkLockConfig::new("127.0.0.1:2181"))
        .unwrap()
        .capabilities();
    assert_eq!(caps.max_ttl, lock_core::Capabilities::MAX_TTL);
    assert!(caps.check_ttl(caps.max_ttl).is_ok());
    assert!(matches!(
        caps.check_ttl(caps.max_ttl + Duration::from_secs(1)),
        Err(Error::InvalidTtl { .. })
    ));
}
