//! `PgLockConfig`: connection options plus the driver's own options, all settable in the URL.

use std::{fmt, str::FromStr, time::Duration};

use lock_core::raw::{Error, Result, check_durations};
use sqlx::postgres::PgConnectOptions;
use url::Url;

/// The driver's options that can appear in the URL's query string, next to the standard ones.
const DRIVER_OPTIONS: &[&str] = &[
    "table",
    "pool_size",
    "connect_timeout",
    "timeout",
    // The older name of `timeout`.
    "op_timeout",
    "listen",
    "poll_interval",
    "async_release",
    "create_table",
    "label",
];

/// The connection parameters understood by `sqlx` (libpq names and sqlx's aliases).
const CONNECTION_OPTIONS: &[&str] = &[
    "sslmode",
    "ssl-mode",
    "sslrootcert",
    "ssl-root-cert",
    "ssl-ca",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
    "statement-cache-capacity",
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "application_name",
    "options",
];

/// A validated, possibly schema-qualified table name (`leases` or `locks.leases`).
///
/// Each part must be an SQL identifier: 1 to 63 bytes of ASCII letters, digits, `_` or `$`, not
/// starting with a digit or `$`. It is always written double-quoted, so case is preserved.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct TableName {
    schema: Option<String>,
    table: String,
}

impl TableName {
    /// The default table, `distlock_leases` (in the connection's `search_path`).
    pub const DEFAULT: &'static str = "distlock_leases";

    /// Validates `name`.
    ///
    /// # Errors
    /// [`Error::Config`] when it is not `identifier` or `identifier.identifier`.
    pub fn new(name: &str) -> Result<Self> {
        let mut parts = name.split('.');
        let (schema, table) = match (parts.next(), parts.next(), parts.next()) {
            (Some(table), None, None) => (None, table),
            (Some(schema), Some(table), None) => (Some(schema), table),
            _ => {
                return Err(Error::Config(format!(
                    "table name {name:?}: expected `table` or `schema.table`"
                )));
            }
        };
        if let Some(schema) = schema {
            check_identifier(schema)?;
            // `pg_temp` names the session's own temporary schema: a table there is private to
            // one connection and excludes nobody.
            let lower = schema.to_ascii_lowercase();
            if lower.starts_with("pg_temp") || lower.starts_with("pg_toast_temp") {
                return Err(Error::Config(format!(
                    "table name {name:?}: {schema} is a temporary schema (a table there is \
                     private to one session and cannot exclude anyone)"
                )));
            }
        }
        check_identifier(table)?;
        Ok(Self {
            schema: schema.map(str::to_owned),
            table: table.to_owned(),
        })
    }

    /// The name as written in SQL: each part double-quoted.
    pub fn quoted(&self) -> String {
        match &self.schema {
            Some(schema) => format!("\"{schema}\".\"{}\"", self.table),
            None => format!("\"{}\"", self.table),
        }
    }

    /// The table part, unquoted.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The schema part, if one was given.
    pub fn schema(&self) -> Option<&str> {
        self.schema.as_deref()
    }
}

impl Default for TableName {
    fn default() -> Self {
        Self {
            schema: None,
            table: Self::DEFAULT.to_owned(),
        }
    }
}

impl fmt::Debug for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TableName({self})")
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.schema {
            Some(schema) => write!(f, "{schema}.{}", self.table),
            None => f.write_str(&self.table),
        }
    }
}

impl FromStr for TableName {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Self::new(s)
    }
}

/// Checks one identifier; the only characters allowed cannot end a quoted identifier.
pub(crate) fn check_identifier(part: &str) -> Result<()> {
    let valid = !part.is_empty()
        && part.len() <= 63
        && part
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'$')
        && part
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_');
    if valid {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "{part:?} is not a valid identifier (1-63 ASCII letters, digits, `_` or `$`, starting with a letter or `_`)"
        )))
    }
}

/// Configuration of a [`crate::PgLock`].
///
/// Every option can be given in the URL's query string (see [`PgLockConfig::from_url`]); the
/// fields can also be set directly. `Debug` never shows the password.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct PgLockConfig {
    connect: Connection,
    /// The lease table (`table=`, default `distlock_leases`).
    pub table: TableName,
    /// Maximum connections of the client's pool (`pool_size=`, default 8). The LISTEN
    /// connection is one more, opened on the first `acquire` that has to wait.
    pub pool_size: u32,
    /// How long to wait for a connection from the pool or a new one (`connect_timeout=`,
    /// default 5 s). A bare number is seconds, as in libpq; `ms`, `s` and `m` suffixes work.
    /// The other duration options are distlock's own and need a unit (a bare number is refused).
    pub connect_timeout: Duration,
    /// How long one statement may take before its outcome counts as unknown: the per-request
    /// timeout (`timeout=`, default 5 s; `op_timeout=` is accepted as its older name, and giving
    /// both is a configuration error).
    pub timeout: Duration,
    /// `LISTEN` for releases while waiting (`listen=`, default true). Turn it off behind a
    /// transaction-pooling proxy, where a session cannot keep listening; waiters then poll.
    pub listen: bool,
    /// The longest fallback poll interval of a waiter (`poll_interval=`, default 1 s).
    pub poll_interval: Duration,
    /// Commit releases without waiting for the WAL flush (`async_release=`, default true):
    /// `SET LOCAL synchronous_commit = off` for the release's transaction only. A release lost
    /// in a server crash only delays the lock's expiry by its TTL; acquire and renew stay
    /// durable.
    pub async_release: bool,
    /// Create the table on first use when it does not exist (`create_table=`, default true).
    pub create_table: bool,
    /// A short label added to this client's holder identity (`label=`, default none), shown
    /// by `inspect` next to host, pid and start time: 1 to 64 ASCII letters, digits and
    /// `-_.:/@` ([`lock_core::raw::HolderIdentity::check_label`]). Not a secret: anyone who can
    /// read the lease table sees it.
    pub label: Option<String>,
}

impl PgLockConfig {
    /// Configuration for an already-built set of connection options, with default driver
    /// options.
    pub fn new(connect: PgConnectOptions) -> Self {
        let host = connect.get_host();
        let host = if host.contains(':') {
            format!("[{host}]")
        } else {
            host.to_owned()
        };
        let display = format!(
            "postgres://{}@{}:{}/{}",
            connect.get_username(),
            host,
            connect.get_port(),
            connect.get_database().unwrap_or_default()
        );
        Self {
            connect: Connection {
                options: connect,
                url: display,
            },
            table: TableName::default(),
            pool_size: 8,
            connect_timeout: Duration::from_secs(5),
            timeout: Duration::from_secs(5),
            listen: true,
            poll_interval: Duration::from_secs(1),
            async_release: true,
            create_table: true,
            label: None,
        }
    }

    /// Parses a `postgres://` (or `postgresql://`) URL.
    ///
    /// Besides the standard connection parameters (`sslmode`, `sslrootcert`, `sslcert`,
    /// `sslkey`, `application_name`, `options`, `host`, `port`, `dbname`, `user`, `password`,
    /// `statement-cache-capacity`), the query string takes the driver's options: `table`,
    /// `pool_size`, `connect_timeout`, `timeout` (per statement; `op_timeout` is its older name,
    /// still accepted), `listen`, `poll_interval`, `async_release`, `create_table`, `label` (see
    /// the fields).
    ///
    /// # Errors
    /// [`Error::Config`] for another scheme, an unknown option, a malformed value, or both
    /// `timeout` and `op_timeout`.
    pub fn from_url(url: &str) -> Result<Self> {
        let parsed = Url::parse(url).map_err(|e| Error::Config(format!("invalid URL: {e}")))?;
        if !matches!(parsed.scheme(), "postgres" | "postgresql") {
            return Err(Error::Config(format!(
                "expected a postgres:// URL, got scheme {:?}",
                parsed.scheme()
            )));
        }
        let mut driver: Vec<(String, String)> = Vec::new();
        let mut passthrough = parsed.clone();
        passthrough.set_query(None);
        {
            let mut query = passthrough.query_pairs_mut();
            for (k, v) in parsed.query_pairs() {
                if DRIVER_OPTIONS.contains(&k.as_ref()) {
                    driver.push((k.into_owned(), v.into_owned()));
                } else if CONNECTION_OPTIONS.contains(&k.as_ref()) || k.starts_with("options[") {
                    query.append_pair(&k, &v);
                } else {
                    return Err(Error::Config(format!(
                        "unknown option {k:?} in the PostgreSQL URL"
                    )));
                }
            }
        }
        if passthrough.query() == Some("") {
            passthrough.set_query(None);
        }
        let mut connect = PgConnectOptions::from_str(passthrough.as_str())
            .map_err(|e| Error::Config(format!("invalid PostgreSQL URL: {e}")))?;
        // sqlx keeps an IPv6 literal's brackets (`[::1]`), which no resolver accepts; a `host=`
        // option, applied after the authority, wins as in libpq.
        if let Some(url::Host::Ipv6(addr)) = parsed.host()
            && !parsed.query_pairs().any(|(k, _)| k == "host")
        {
            connect = connect.host(&addr.to_string());
        }
        // `op_timeout` is `timeout`'s older name: two values for one setting is a mistake.
        if driver.iter().any(|(k, _)| k == "timeout")
            && driver.iter().any(|(k, _)| k == "op_timeout")
        {
            return Err(Error::Config(
                "both timeout and op_timeout are given: op_timeout is the older name of timeout; \
                 give one"
                    .to_owned(),
            ));
        }
        let mut config = Self::new(connect);
        config.connect.url = redact(&parsed);
        for (k, v) in driver {
            match k.as_str() {
                "table" => config.table = TableName::new(&v)?,
                "pool_size" => {
                    config.pool_size = v
                        .parse()
                        .ok()
                        .filter(|n| *n > 0)
                        .ok_or_else(|| bad(&k, &v, "a positive integer"))?;
                }
                "connect_timeout" => {
                    config.connect_timeout =
                        lock_core::raw::parse_duration_option(&k, &v, Some(Duration::from_secs(1)))?
                }
                "timeout" | "op_timeout" => {
                    config.timeout = lock_core::raw::parse_duration_option(&k, &v, None)?
                }
                "poll_interval" => {
                    config.poll_interval = lock_core::raw::parse_duration_option(&k, &v, None)?
                }
                "listen" => config.listen = parse_bool(&k, &v)?,
                "async_release" => config.async_release = parse_bool(&k, &v)?,
                "create_table" => config.create_table = parse_bool(&k, &v)?,
                "label" => config.label = Some(v),
                _ => return Err(Error::Config(format!("unknown option {k:?}"))),
            }
        }
        config.validate()?;
        Ok(config)
    }

    /// Checks every option against its bounds, however it was set (URL or field): a pool of 1
    /// to [`MAX_POOL_SIZE`](Self::MAX_POOL_SIZE) connections, and `connect_timeout`,
    /// `timeout` and `poll_interval` between 1 ms and [`MAX_DURATION`](Self::MAX_DURATION),
    /// so that no deadline computed from them can overflow the clock; and the `label`
    /// ([`lock_core::raw::HolderIdentity::check_label`]).
    /// [`crate::PgLock::connect`] and [`crate::PgLock::connect_lazy`] call it before any I/O.
    ///
    /// # Errors
    /// [`Error::Config`] naming the first option out of bounds.
    pub fn validate(&self) -> Result<()> {
        if !(1..=Self::MAX_POOL_SIZE).contains(&self.pool_size) {
            return Err(Error::Config(format!(
                "pool_size={} is out of bounds: expected 1 to {}",
                self.pool_size,
                Self::MAX_POOL_SIZE
            )));
        }
        check_durations(
            Self::MAX_DURATION,
            &[
                ("connect_timeout", self.connect_timeout),
                ("timeout", self.timeout),
                ("poll_interval", self.poll_interval),
            ],
        )
        .map_err(Error::Config)?;
        if let Some(label) = &self.label {
            lock_core::raw::HolderIdentity::check_label(label)?;
        }
        Ok(())
    }

    /// The largest `pool_size`.
    pub const MAX_POOL_SIZE: u32 = 10_000;

    /// The longest `connect_timeout`, `timeout` and `poll_interval`: one day.
    pub const MAX_DURATION: Duration = Duration::from_secs(24 * 3600);

    /// The connection options handed to `sqlx`.
    pub fn connect_options(&self) -> &PgConnectOptions {
        &self.connect.options
    }
}

impl FromStr for PgLockConfig {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Self::from_url(s)
    }
}

/// Where a client connects: sqlx's options (which hold the password) and the URL without its
/// password, which is all `Debug` shows.
#[derive(Clone)]
struct Connection {
    options: PgConnectOptions,
    url: String,
}

impl fmt::Debug for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.url, f)
    }
}

/// The URL without its password (in the userinfo or the query string).
fn redact(url: &Url) -> String {
    let mut shown = url.clone();
    if shown.password().is_some() {
        let _ = shown.set_password(Some("***"));
    }
    if url.query().is_some() {
        let pairs: Vec<(String, String)> = url
            .query_pairs()
            .map(|(k, v)| {
                let v = if k == "password" {
                    "***".to_owned()
                } else {
                    v.into_owned()
                };
                (k.into_owned(), v)
            })
            .collect();
        shown.query_pairs_mut().clear().extend_pairs(pairs);
    }
    shown.to_string()
}

fn bad(key: &str, value: &str, expected: &str) -> Error {
    Error::Config(format!(
        "option {key}={value:?} is malformed: expected {expected}"
    ))
}

fn parse_bool(key: &str, value: &str) -> Result<bool> {
    match value {
        "true" | "1" | "on" | "yes" => Ok(true),
        "false" | "0" | "off" | "no" => Ok(false),
        _ => Err(bad(key, value, "true or false")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_option_can_be_set_in_the_url() {
        let c = PgLockConfig::from_url(
            "postgres://app:s3cret@db.example:6432/jobs?sslmode=disable&application_name=x\
             &table=locks.leases&pool_size=3&connect_timeout=2&op_timeout=750ms&listen=false\
             &poll_interval=200ms&async_release=off&create_table=no&label=nightly-report",
        )
        .unwrap();
        assert_eq!(c.table.quoted(), "\"locks\".\"leases\"");
        assert_eq!(c.pool_size, 3);
        assert_eq!(c.connect_timeout, Duration::from_secs(2));
        assert_eq!(c.timeout, Duration::from_millis(750));
        assert!(!c.listen);
        assert_eq!(c.poll_interval, Duration::from_millis(200));
        assert!(!c.async_release);
        assert!(!c.create_table);
        assert_eq!(c.label.as_deref(), Some("nightly-report"));
        assert_eq!(c.connect_options().get_port(), 6432);
        assert_eq!(c.connect_options().get_database(), Some("jobs"));
        assert_eq!(c.connect_options().get_username(), "app");
    }

    #[test]
    fn timeout_is_the_request_timeout_and_op_timeout_its_older_name() {
        for url in [
            "postgres://h/db?timeout=750ms",
            "postgres://h/db?op_timeout=750ms",
        ] {
            let c = PgLockConfig::from_url(url).unwrap();
            assert_eq!(c.timeout, Duration::from_millis(750), "{url}");
        }
        conformance::config_errors::assert_config_errors(
            PgLockConfig::from_url,
            &[
                (
                    "postgres://h/db?timeout=750ms&op_timeout=750ms",
                    "op_timeout",
                ),
                (
                    "postgres://h/db?op_timeout=1s&connect_timeout=1s&timeout=2s",
                    "op_timeout",
                ),
                // The new name is held to the same grammar and bounds as the old one.
                ("postgres://h/db?timeout=0ms", "timeout"),
                ("postgres://h/db?timeout=2", "timeout"),
            ],
        );
    }

    #[test]
    fn defaults() {
        let c = PgLockConfig::from_url("postgresql://postgres@127.0.0.1/db").unwrap();
        assert_eq!(c.table.to_string(), "distlock_leases");
        assert!(c.listen && c.async_release && c.create_table);
        assert_eq!(c.label, None);
    }

    #[test]
    fn unknown_or_malformed_options_are_config_errors() {
        conformance::config_errors::assert_config_errors(
            PgLockConfig::from_url,
            &[
                ("postgres://h/db?tabel=x", "tabel"),
                ("postgres://h/db?pool_size=0", "pool_size"),
                ("postgres://h/db?pool_size=many", "pool_size"),
                ("postgres://h/db?op_timeout=5x", "op_timeout"),
                ("postgres://h/db?op_timeout=0", "op_timeout"),
                // Only connect_timeout takes libpq's bare seconds; distlock's own options need a unit.
                ("postgres://h/db?op_timeout=2", "op_timeout"),
                ("postgres://h/db?poll_interval=1", "poll_interval"),
                ("postgres://h/db?listen=maybe", "listen"),
                ("postgres://h/db?table=a;drop", "not a valid identifier"),
                ("postgres://h/db?table=\"x\"", "not a valid identifier"),
                ("postgres://h/db?table=a.b.c", "table"),
                ("postgres://h/db?table=1abc", "not a valid identifier"),
                ("postgres://h/db?table=pg_temp.x", "table"),
                ("postgres://h/db?table=PG_TEMP_3.x", "table"),
                ("postgres://h/db?label=", "label"),
                ("postgres://h/db?label=has%20space", "label"),
                ("postgres://h/db?label=new%0Aline", "label"),
                ("redis://h/db", "postgres://"),
                ("not a url", "invalid URL"),
            ],
        );
        assert!(TableName::new(&"a".repeat(64)).is_err());
        assert!(TableName::new(&"a".repeat(63)).is_ok());
    }

    #[test]
    fn ipv6_literal_hosts_are_accepted() {
        let c = PgLockConfig::from_url("postgres://u@[::1]:6432/db").unwrap();
        assert_eq!(c.connect_options().get_host(), "::1");
        assert_eq!(c.connect_options().get_port(), 6432);
        let c = PgLockConfig::from_url("postgresql://u@[fe80::1]/db?host=db2").unwrap();
        assert_eq!(c.connect_options().get_host(), "db2");
    }

    #[test]
    fn options_out_of_bounds_are_config_errors_however_set() {
        conformance::config_errors::assert_config_errors(
            PgLockConfig::from_url,
            &[
                ("postgres://h/db?op_timeout=4294967295m", "timeout"),
                ("postgres://h/db?poll_interval=4294967295m", "poll_interval"),
                (
                    "postgres://h/db?connect_timeout=4294967295",
                    "connect_timeout",
                ),
                ("postgres://h/db?pool_size=4294967295", "pool_size"),
            ],
        );
        let base = PgLockConfig::from_url("postgres://h/db").unwrap();
        assert!(base.validate().is_ok());
        let mut c = base.clone();
        c.timeout = Duration::MAX;
        assert!(matches!(c.validate(), Err(Error::Config(_))));
        let mut c = base.clone();
        c.poll_interval = Duration::ZERO;
        assert!(matches!(c.validate(), Err(Error::Config(_))));
        let mut c = base.clone();
        c.pool_size = 0;
        assert!(matches!(c.validate(), Err(Error::Config(_))));
        let mut c = base;
        c.label = Some("x".repeat(65));
        assert!(matches!(c.validate(), Err(Error::Config(_))));
    }

    #[test]
    fn debug_redacts_passwords() {
        let c =
            PgLockConfig::from_url("postgres://u:hunter2@h/db?password=hunter3&table=t").unwrap();
        let shown = format!("{c:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(!shown.contains("hunter3"), "{shown}");
        assert!(shown.contains("***"), "{shown}");
    }
}

#[cfg(test)]
mod url_proptests {
    /// Any input gets a config or a typed error, never a panic; a password never shows.
    #[test]
    fn from_url_never_panics_or_shows_the_password() {
        conformance::check_url_parser("postgres|postgresql", super::PgLockConfig::from_url);
    }
}

#[cfg(test)]
mod label_proptests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// A `label=` option is accepted exactly when `HolderIdentity::check_label` accepts it
        /// (anything else is a Config error, before any I/O), and is kept as given.
        #[test]
        fn the_label_option_is_checked_like_check_label(label in "\\PC{0,70}|[A-Za-z0-9._:/@-]{1,70}") {
            let mut url = Url::parse("postgres://u@h/db").unwrap();
            url.query_pairs_mut().append_pair("label", &label);
            let parsed = PgLockConfig::from_url(url.as_str());
            match lock_core::raw::HolderIdentity::check_label(&label) {
                Ok(()) => prop_assert_eq!(parsed.unwrap().label, Some(label)),
                Err(_) => prop_assert!(matches!(parsed, Err(Error::Config(_)))),
            }
        }
    }
}

#[cfg(test)]
mod option_proptests {
    use super::*;

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// Every driver option in the URL, any value of the usual shapes: a config that
        /// validates, or a configuration error.
        #[test]
        fn any_url_option_gives_a_valid_config_or_a_config_error(
            key in proptest::sample::select(vec![
                "pool_size", "connect_timeout", "timeout", "op_timeout", "poll_interval", "listen",
                "async_release", "create_table", "table", "label",
            ]),
            n in proptest::prelude::any::<u64>(),
            unit in proptest::sample::select(vec!["", "ms", "s", "m", "h", "x", ".5s"]),
        ) {
            let url = format!("postgres://u@[::1]:5/db?{key}={n}{unit}");
            match PgLockConfig::from_url(&url) {
                Ok(config) => proptest::prop_assert!(config.validate().is_ok()),
                Err(e) => proptest::prop_assert!(matches!(e, Error::Config(_)), "{e}"),
            }
        }
    }
}
