//! Connection settings, parsed from a URL.

use std::{path::PathBuf, time::Duration};

use lock_core::raw::{Error, Result, Secret, check_durations};

/// Everything [`crate::EtcdLock::connect`] needs. Every field can be set from the URL
/// ([`EtcdLockConfig::from_url`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct EtcdLockConfig {
    /// `host:port` of each cluster member (at least one).
    pub endpoints: Vec<String>,
    /// TLS settings; `Some` for `etcds://` URLs.
    pub tls: Option<EtcdTlsConfig>,
    /// User name for etcd authentication.
    pub user: Option<String>,
    /// Password for etcd authentication (never shown by `Debug`).
    pub password: Option<Secret>,
    /// Prepended to every lock's name; may be empty. Default `"distlock/"`, so the lock `NAME` is
    /// the one `etcdctl lock distlock/NAME` takes. A non-empty prefix is used with a trailing
    /// `/` (added when missing: `locks` is `locks/`), so `locks` + `a` and `lock` + `sa` never
    /// collide; no control characters, at most [`EtcdLockConfig::MAX_PREFIX_LEN`] bytes.
    pub prefix: String,
    /// Timeout for establishing a connection (default 3 s; at most
    /// [`EtcdLockConfig::MAX_TIMEOUT`]). URL option `connect_timeout`, alias `dial_timeout`.
    pub connect_timeout: Duration,
    /// Timeout for each request (default 5 s; at most [`EtcdLockConfig::MAX_TIMEOUT`]). URL
    /// option `timeout`, alias `request_timeout`.
    pub timeout: Duration,
    /// The smallest lease TTL the cluster grants. `None` (default): asked from the server at
    /// connect (a 1 s lease is granted and revoked; etcd answers with the TTL it applies).
    /// Setting it skips that probe, so `connect` performs no I/O without credentials.
    pub min_ttl: Option<Duration>,
    /// An optional label added to this client's holder identity (host, pid, start time), which
    /// is stored next to every grant and shown by `inspect`: 1 to 64 ASCII letters, digits and
    /// `-_.:/@` ([`lock_core::raw::HolderIdentity::check_label`]). Not secret: anyone who can read
    /// the lock's keys sees it.
    pub label: Option<String>,
}

/// TLS settings for `etcds://` (file paths and a name: nothing secret, so `Debug` shows all).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EtcdTlsConfig {
    /// PEM file of the CA that signed the server certificates (default: none, i.e. the client
    /// library's default roots).
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate, for mutual TLS (with `key_file`).
    pub cert_file: Option<PathBuf>,
    /// PEM private key of the client certificate.
    pub key_file: Option<PathBuf>,
    /// The name to verify the server certificate against (default: the endpoint host).
    pub domain: Option<String>,
}

impl EtcdLockConfig {
    /// The password as the connection sends it (empty when none is set).
    pub(crate) fn password_text(&self) -> String {
        self.password
            .as_ref()
            .map(|p| p.expose().to_owned())
            .unwrap_or_default()
    }

    /// The default lock name prefix.
    pub const DEFAULT_PREFIX: &'static str = "distlock/";
    /// The longest `connect_timeout` or `timeout` accepted (1 hour).
    pub const MAX_TIMEOUT: Duration = Duration::from_secs(3600);
    /// The longest prefix accepted, in bytes.
    pub const MAX_PREFIX_LEN: usize = 1024;
    /// The longest `min_ttl` accepted: etcd's longest lease (`MaxLeaseTTL`, 9,000,000,000 s).
    pub const MAX_MIN_TTL: Duration = Duration::from_secs(9_000_000_000);

    /// Defaults for the given `host:port` endpoints.
    pub fn new<S: Into<String>>(endpoints: impl IntoIterator<Item = S>) -> Self {
        Self {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            tls: None,
            user: None,
            password: None,
            prefix: Self::DEFAULT_PREFIX.to_owned(),
            connect_timeout: Duration::from_secs(3),
            timeout: Duration::from_secs(5),
            min_ttl: None,
            label: None,
        }
    }

    /// Parses `etcd://[user[:password]@]host:port[,host:port...][/][?option=value&...]`
    /// (`etcds://` for TLS).
    ///
    /// Options: `prefix` (may be empty), `connect_timeout` (alias `dial_timeout`), `timeout`
    /// (per request; alias `request_timeout`), `min_ttl` (durations such as `500ms`, `3s`,
    /// `1m`), `label` (see [`EtcdLockConfig::label`]), and for `etcds://` only `ca_file` (alias `ca`),
    /// `cert_file`, `key_file`, `tls_domain`. User and password are percent-decoded.
    ///
    /// `etcds://` is TLS only (the server certificate is verified against `ca_file`, or the
    /// client library's default roots, and the host name), never a plaintext fallback. With
    /// `user:password@` the client authenticates when connecting; wrong credentials fail
    /// `connect`.
    ///
    /// # Errors
    /// [`Error::Config`] for another scheme, no endpoint, a bad port, an unknown, repeated or
    /// malformed option, an option given together with its alias, or TLS options on `etcd://`.
    pub fn from_url(url: &str) -> Result<Self> {
        let (tls, rest) = if let Some(rest) = url.strip_prefix("etcd://") {
            (false, rest)
        } else if let Some(rest) = url.strip_prefix("etcds://") {
            (true, rest)
        } else {
            return Err(config("the URL must start with etcd:// or etcds://"));
        };
        let (authority, query) = match rest.split_once('?') {
            Some((a, q)) => (a, Some(q)),
            None => (rest, None),
        };
        let authority = match authority.split_once('/') {
            Some((a, "")) => a,
            Some(_) => {
                return Err(config(
                    "the URL has a path; set the key prefix with ?prefix=...",
                ));
            }
            None => authority,
        };
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, authority),
        };
        let endpoints = hosts
            .split(',')
            .map(parse_endpoint)
            .collect::<Result<Vec<_>>>()?;
        let mut cfg = Self::new(endpoints);
        if let Some(userinfo) = userinfo {
            let (user, password) = match userinfo.split_once(':') {
                Some((u, p)) => (u, Some(p)),
                None => (userinfo, None),
            };
            if user.is_empty() {
                return Err(config("the URL has credentials but an empty user name"));
            }
            cfg.user = Some(lock_core::raw::decode_url_credential(user)?);
            cfg.password = password
                .map(lock_core::raw::decode_url_credential)
                .transpose()?
                .map(Secret::from);
        }
        let mut tls_cfg = EtcdTlsConfig::default();
        let mut seen = Vec::new();
        for (name, value) in url::form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
            if seen.contains(&name) {
                return Err(config(format!("the option {name:?} is given twice")));
            }
            // The shared names and this driver's older ones set the same field: one of each.
            for (option, alias) in TIMEOUT_ALIASES {
                let other = match &*name {
                    n if n == option => alias,
                    n if n == alias => option,
                    _ => continue,
                };
                if seen.iter().any(|s| s == other) {
                    return Err(config(format!(
                        "give {option:?} or its alias {alias:?}, not both"
                    )));
                }
            }
            seen.push(name.clone());
            let tls_only = |what: &str| {
                if tls {
                    Ok(())
                } else {
                    Err(config(format!("the option {what:?} needs an etcds:// URL")))
                }
            };
            match &*name {
                "prefix" => cfg.prefix = value.into_owned(),
                "connect_timeout" | "dial_timeout" => {
                    cfg.connect_timeout =
                        lock_core::raw::parse_duration_option(&name, &value, None)?
                }
                "timeout" | "request_timeout" => {
                    cfg.timeout = lock_core::raw::parse_duration_option(&name, &value, None)?
                }
                "min_ttl" => {
                    cfg.min_ttl = Some(lock_core::raw::parse_duration_option(&name, &value, None)?)
                }
                "label" => cfg.label = Some(value.into_owned()),
                "ca_file" | "ca" => {
                    tls_only(&name)?;
                    if tls_cfg.ca_file.is_some() {
                        return Err(config("give the CA file once (ca or ca_file)"));
                    }
                    tls_cfg.ca_file = Some(non_empty(&name, &value)?.into());
                }
                "cert_file" => {
                    tls_only(&name)?;
                    tls_cfg.cert_file = Some(non_empty(&name, &value)?.into());
                }
                "key_file" => {
                    tls_only(&name)?;
                    tls_cfg.key_file = Some(non_empty(&name, &value)?.into());
                }
                "tls_domain" => {
                    tls_only(&name)?;
                    tls_cfg.domain = Some(non_empty(&name, &value)?.to_owned());
                }
                other => return Err(config(format!("unknown option {other:?}"))),
            }
        }
        if tls_cfg.cert_file.is_some() != tls_cfg.key_file.is_some() {
            return Err(config("cert_file and key_file must be given together"));
        }
        if tls {
            cfg.tls = Some(tls_cfg);
        }
        cfg.validate()?;
        cfg.prefix = cfg.normalized_prefix();
        Ok(cfg)
    }

    /// The prefix as the client uses it: with a trailing `/` unless empty. Every lock range is
    /// `<prefix><escaped name>/` and an escaped name has no `/`, so ranges of two prefixes
    /// can only overlap when one prefix nests in the other (`a/` + `b` vs `a/b/` + `x`); the
    /// client then only counts keys shaped like its own entries (`<range><lease hex>`, attached
    /// to that lease), so neither that nor an application's key under an empty prefix blocks
    /// a lock.
    pub fn normalized_prefix(&self) -> String {
        if self.prefix.is_empty() || self.prefix.ends_with('/') {
            self.prefix.clone()
        } else {
            format!("{}/", self.prefix)
        }
    }

    /// Checks the settings however they were set (also done by `connect`, before any I/O).
    ///
    /// # Errors
    /// [`Error::Config`] when there is no endpoint or one is not `host:port`, a timeout is below
    /// 1 ms or above [`EtcdLockConfig::MAX_TIMEOUT`], `min_ttl` is below 1 s or above
    /// [`EtcdLockConfig::MAX_MIN_TTL`], the prefix is too long or has control characters, or
    /// the TLS files are given inconsistently, or the label is not a valid holder label.
    pub fn validate(&self) -> Result<()> {
        if self.endpoints.is_empty() {
            return Err(config("at least one endpoint is needed"));
        }
        for e in &self.endpoints {
            parse_endpoint(e)?;
        }
        check_durations(
            Self::MAX_TIMEOUT,
            &[
                ("connect_timeout", self.connect_timeout),
                ("timeout", self.timeout),
            ],
        )
        .map_err(config)?;
        if self.min_ttl.is_some_and(|t| t < Duration::from_secs(1)) {
            return Err(config(
                "etcd leases are whole seconds: min_ttl must be at least 1s",
            ));
        }
        if self.min_ttl.is_some_and(|t| t > Self::MAX_MIN_TTL) {
            return Err(config(format!(
                "min_ttl must be at most etcd's longest lease, {:?}",
                Self::MAX_MIN_TTL
            )));
        }
        if self.prefix.len() > Self::MAX_PREFIX_LEN {
            return Err(config(format!(
                "the prefix is longer than {} bytes",
                Self::MAX_PREFIX_LEN
            )));
        }
        if self.prefix.chars().any(char::is_control) {
            return Err(config("the prefix has a control character"));
        }
        if let Some(tls) = &self.tls {
            if tls.cert_file.is_some() != tls.key_file.is_some() {
                return Err(config("cert_file and key_file must be given together"));
            }
            if tls.domain.as_ref().is_some_and(String::is_empty) {
                return Err(config("tls domain is empty"));
            }
        }
        if self.user.as_ref().is_some_and(String::is_empty) {
            return Err(config("the user name is empty"));
        }
        if let Some(label) = &self.label {
            lock_core::raw::HolderIdentity::check_label(label).map_err(|e| match e {
                Error::Config(why) => config(why),
                other => other,
            })?;
        }
        Ok(())
    }
}

/// The URL option every backend accepts for a timeout, and this driver's older name for it
/// (still accepted).
const TIMEOUT_ALIASES: [(&str, &str); 2] = [
    ("connect_timeout", "dial_timeout"),
    ("timeout", "request_timeout"),
];

fn config(msg: impl Into<String>) -> Error {
    Error::Config(format!("etcd: {}", msg.into()))
}

fn non_empty<'a>(name: &str, value: &'a str) -> Result<&'a str> {
    if value.is_empty() {
        Err(config(format!("the option {name:?} is empty")))
    } else {
        Ok(value)
    }
}

fn parse_endpoint(hostport: &str) -> Result<String> {
    let (host, port) = hostport
        .rsplit_once(':')
        .ok_or_else(|| config(format!("endpoint {hostport:?} needs host:port")))?;
    if host.is_empty() || host.contains(['/', '@', '?', '#', ' ']) {
        return Err(config(format!("endpoint {hostport:?} has a bad host")));
    }
    let port: u16 = port
        .parse()
        .map_err(|_| config(format!("endpoint {hostport:?} has a bad port")))?;
    if port == 0 {
        return Err(config(format!("endpoint {hostport:?} has port 0")));
    }
    Ok(format!("{host}:{port}"))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_option() {
        let c = EtcdLockConfig::from_url(
            "etcds://al%40ice:p%3Ass@h1:2379,10.0.0.2:2380/?prefix=&dial_timeout=250ms&request_timeout=2s&min_ttl=1s&ca_file=/ca.pem&cert_file=/c.pem&key_file=/k.pem&tls_domain=etcd.local&label=cron%40web-1",
        )
        .unwrap();
        assert_eq!(c.endpoints, ["h1:2379", "10.0.0.2:2380"]);
        assert_eq!(c.user.as_deref(), Some("al@ice"));
        assert_eq!(c.password.as_ref().map(Secret::expose), Some("p:ss"));
        assert_eq!(c.prefix, "");
        assert_eq!(c.connect_timeout, Duration::from_millis(250));
        assert_eq!(c.timeout, Duration::from_secs(2));
        assert_eq!(c.min_ttl, Some(Duration::from_secs(1)));
        assert_eq!(c.label.as_deref(), Some("cron@web-1"));
        let tls = c.tls.unwrap();
        assert_eq!(tls.ca_file, Some(PathBuf::from("/ca.pem")));
        assert_eq!(tls.domain.as_deref(), Some("etcd.local"));

        let d = EtcdLockConfig::from_url("etcd://127.0.0.1:2379").unwrap();
        assert_eq!(d.prefix, "distlock/");
        assert!(d.tls.is_none() && d.user.is_none() && d.min_ttl.is_none());
        let p = EtcdLockConfig::from_url("etcd://h:1?prefix=locks%2Fx%2F").unwrap();
        assert_eq!(p.prefix, "locks/x/");
        let p = EtcdLockConfig::from_url("etcd://h:1?prefix=locks").unwrap();
        assert_eq!(p.prefix, "locks/", "a prefix is one path segment or more");
    }

    /// Review L12: `prefix=locks` + `a` and `prefix=lock` + `sa` must not be the same lock.
    #[test]
    fn prefixes_never_collide_after_normalising() {
        let key = |s: &str| lock_core::raw::LockKey::new(s).unwrap();
        let range = |prefix: &str, name: &str| {
            let c = EtcdLockConfig::from_url(&format!("etcd://h:1?prefix={prefix}")).unwrap();
            crate::keys::name_prefix(&c.prefix, &key(name))
        };
        let (a, b) = (range("locks", "a"), range("lock", "sa"));
        assert!(!a.starts_with(&b) && !b.starts_with(&a), "{a:?} {b:?}");
    }

    /// Review L12: settings set directly on the struct are checked as strictly as URL ones.
    #[test]
    fn struct_set_values_are_validated() {
        let ok = EtcdLockConfig::new(["h:1"]);
        assert!(ok.validate().is_ok());
        type Set = Box<dyn Fn(&mut EtcdLockConfig)>;
        let bad: Vec<Set> = vec![
            Box::new(|c| c.timeout = Duration::MAX),
            Box::new(|c| c.connect_timeout = Duration::MAX),
            Box::new(|c| c.timeout = Duration::ZERO),
            Box::new(|c| c.min_ttl = Some(Duration::MAX)),
            Box::new(|c| c.endpoints = vec!["nonsense".into()]),
            Box::new(|c| c.prefix = "a\0b".into()),
            Box::new(|c| c.prefix = "x".repeat(5000)),
            Box::new(|c| c.user = Some(String::new())),
            Box::new(|c| c.label = Some(String::new())),
            Box::new(|c| c.label = Some("has space".into())),
            Box::new(|c| c.label = Some("x".repeat(65))),
        ];
        for (i, set) in bad.iter().enumerate() {
            let mut c = ok.clone();
            set(&mut c);
            assert!(matches!(c.validate(), Err(Error::Config(_))), "case {i}");
        }
    }

    #[test]
    fn rejects_bad_urls_with_a_config_error() {
        conformance::config_errors::assert_config_errors(
            EtcdLockConfig::from_url,
            &[
                ("redis://h:1", "etcd://"),
                ("etcd://", "needs host:port"),
                ("etcd://h", "needs host:port"),
                ("etcd://h:0", "port 0"),
                ("etcd://h:99999", "bad port"),
                ("etcd://h:1,", "needs host:port"),
                ("etcd://h:1/path", "path"),
                ("etcd://h:1?nope=1", "nope"),
                ("etcd://h:1?prefix=a&prefix=b", "prefix"),
                ("etcd://h:1?dial_timeout=3", "dial_timeout"),
                ("etcd://h:1?dial_timeout=0s", "dial_timeout"),
                ("etcd://h:1?request_timeout=fast", "request_timeout"),
                ("etcd://h:1?min_ttl=500ms", "min_ttl"),
                ("etcd://h:1?ca_file=/ca.pem", "ca_file"),
                ("etcds://h:1?cert_file=/c.pem", "cert_file"),
                ("etcds://h:1?ca_file=", "ca_file"),
                ("etcd://h:1?ca=/ca.pem", "ca"),
                ("etcds://h:1?ca=/a.pem&ca_file=/b.pem", "ca_file"),
                ("etcd://:pw@h:1", "empty user name"),
                ("etcd://u:%zz@h:1", "percent-escape"),
                ("etcd://h:1?label=", "label"),
                ("etcd://h:1?label=a%20b", "label"),
                ("etcd://h:1?label=a%0Ab", "label"),
                ("etcd://h:1?label=a&label=b", "label"),
            ],
        );
    }

    /// Issue 20: `connect_timeout` and `timeout`, the names every backend accepts, set the dial
    /// and request timeouts; the older `dial_timeout` and `request_timeout` still do; a name
    /// together with its alias is a config error, whichever comes first.
    #[test]
    fn shared_timeout_names_and_their_aliases() {
        let c = EtcdLockConfig::from_url("etcd://h:1?connect_timeout=250ms&timeout=2s").unwrap();
        assert_eq!(c.connect_timeout, Duration::from_millis(250));
        assert_eq!(c.timeout, Duration::from_secs(2));
        let c =
            EtcdLockConfig::from_url("etcd://h:1?dial_timeout=750ms&request_timeout=4s").unwrap();
        assert_eq!(c.connect_timeout, Duration::from_millis(750));
        assert_eq!(c.timeout, Duration::from_secs(4));
        let c =
            EtcdLockConfig::from_url("etcd://h:1?connect_timeout=1s&request_timeout=3s").unwrap();
        assert_eq!(c.connect_timeout, Duration::from_secs(1));
        assert_eq!(c.timeout, Duration::from_secs(3));
        conformance::config_errors::assert_config_errors(
            EtcdLockConfig::from_url,
            &[
                (
                    "etcd://h:1?connect_timeout=1s&dial_timeout=1s",
                    "dial_timeout",
                ),
                (
                    "etcd://h:1?dial_timeout=1s&connect_timeout=2s",
                    "connect_timeout",
                ),
                (
                    "etcd://h:1?timeout=1s&request_timeout=1s",
                    "request_timeout",
                ),
                (
                    "etcd://h:1?request_timeout=2s&prefix=x&timeout=1s",
                    "timeout",
                ),
                ("etcd://h:1?timeout=1s&timeout=1s", "timeout"),
                ("etcd://h:1?connect_timeout=0s", "connect_timeout"),
                ("etcd://h:1?timeout=fast", "timeout"),
            ],
        );
    }

    #[test]
    fn ca_is_an_alias_of_ca_file() {
        let c = EtcdLockConfig::from_url("etcds://h:1?ca=/ca.pem").unwrap();
        let tls = c.tls.unwrap();
        assert_eq!(tls.ca_file, Some(PathBuf::from("/ca.pem")));
    }

    #[test]
    fn debug_redacts_the_password() {
        let c = EtcdLockConfig::from_url("etcd://bob:hunter2@h:1").unwrap();
        let shown = format!("{c:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("bob") && shown.contains("redacted"));
    }
}

#[cfg(test)]
mod url_proptests {
    /// Any input gets a config or a typed error, never a panic; a password never shows.
    #[test]
    fn from_url_never_panics_or_shows_the_password() {
        conformance::check_url_parser("etcd|etcds", super::EtcdLockConfig::from_url);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod config_proptests {
    use proptest::{collection::vec, option, prelude::*};

    use super::*;

    fn duration() -> impl Strategy<Value = Duration> {
        prop_oneof![
            Just(Duration::ZERO),
            Just(Duration::MAX),
            Just(EtcdLockConfig::MAX_TIMEOUT),
            (0u64..10_000).prop_map(Duration::from_millis),
            (any::<u64>(), 0u32..1_000_000_000).prop_map(|(s, n)| Duration::new(s, n)),
        ]
    }

    fn duration_text() -> impl Strategy<Value = String> {
        prop_oneof![
            "[0-9]{1,12}(ms|s|m|h|)",
            Just("4294967295m".to_owned()),
            Just("0s".to_owned()),
            "\\PC{0,6}",
        ]
    }

    /// Whatever `validate` accepts can be used without a panic: the client adds the timeouts
    /// to each other and to `Instant::now()`.
    fn usable(c: &EtcdLockConfig) {
        let _ = tokio::time::Instant::now() + c.connect_timeout + c.timeout;
        let _ = c.normalized_prefix();
    }

    /// A valid config connects (lazily, to a closed port) and fails its first lock with a typed
    /// error, never a panic.
    fn connects(c: EtcdLockConfig) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let attempt = async {
                let lock = crate::EtcdLock::connect(c).await?;
                let key = lock_core::raw::LockKey::new("config-prop").unwrap();
                lock_core::raw::DistributedLock::try_acquire(&lock, &key, Duration::from_secs(5))
                    .await
            };
            let _ = tokio::time::timeout(Duration::from_secs(10), attempt).await;
        });
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Review L12: any combination of struct-set fields is a typed error or a config that
        /// works, never a panic.
        #[test]
        fn any_struct_set_config_is_a_typed_error_or_usable(
            endpoints in vec(prop_oneof!["[a-z0-9.:]{0,12}", Just("127.0.0.1:1".to_owned())], 0..3),
            prefix in prop_oneof!["\\PC{0,8}", "[\\x00-\\x1f/a]{0,3}", Just("x".repeat(2000))],
            dial in duration(),
            request in duration(),
            min_ttl in option::of(duration()),
            user in option::of("[a-z]{0,3}"),
            label in option::of(prop_oneof!["[a-z@/ \\x00-\\x1f]{0,4}", "[a-z]{60,70}"]),
        ) {
            let mut c = EtcdLockConfig::new(endpoints);
            c.prefix = prefix;
            c.connect_timeout = dial;
            c.timeout = request;
            c.min_ttl = min_ttl;
            c.user = user;
            c.label = label;
            match c.validate() {
                Ok(()) => {
                    usable(&c);
                    if c.endpoints.iter().all(|e| e == "127.0.0.1:1") && c.min_ttl.is_some() {
                        c.connect_timeout = c.connect_timeout.min(Duration::from_secs(1));
                        connects(c);
                    }
                }
                Err(Error::Config(_)) => {}
                Err(e) => prop_assert!(false, "not a config error: {e:?}"),
            }
        }

        /// Review L12: every URL option with any value is a typed error or a usable config.
        #[test]
        fn any_url_option_value_is_a_typed_error_or_usable(
            dial in duration_text(),
            request in duration_text(),
            min_ttl in duration_text(),
            prefix in "[a-z/%0-9]{0,6}",
            label in prop_oneof!["\\PC{0,6}", "[a-z@:]{1,4}", "[a-z]{60,70}"],
        ) {
            let url = format!(
                "etcd://127.0.0.1:1?dial_timeout={}&request_timeout={}&min_ttl={}&prefix={}&label={}",
                url::form_urlencoded::byte_serialize(dial.as_bytes()).collect::<String>(),
                url::form_urlencoded::byte_serialize(request.as_bytes()).collect::<String>(),
                url::form_urlencoded::byte_serialize(min_ttl.as_bytes()).collect::<String>(),
                prefix,
                url::form_urlencoded::byte_serialize(label.as_bytes()).collect::<String>(),
            );
            match EtcdLockConfig::from_url(&url) {
                Ok(mut c) => {
                    usable(&c);
                    prop_assert!(c.prefix.is_empty() || c.prefix.ends_with('/'));
                    prop_assert!(c.label.as_deref().is_some_and(|l| lock_core::raw::HolderIdentity::check_label(l).is_ok()));
                    c.connect_timeout = c.connect_timeout.min(Duration::from_secs(1));
                    connects(c);
                }
                Err(Error::Config(_)) => {}
                Err(e) => prop_assert!(false, "not a config error: {e:?}"),
            }
        }
    }
}
