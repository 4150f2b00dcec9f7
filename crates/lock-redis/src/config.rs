//! The config: [`RedisLockConfig`] and [`RedisTopology`] (connection and driver options) and
//! the parsing of `redis://`, `rediss://`, `redis+sentinel://` and `redis+cluster://` URLs.

use std::{path::PathBuf, time::Duration};

use lock_core::raw::{Error, Result, Secret, check_durations};

/// How to reach Redis and how the driver behaves.
///
/// Build it with [`RedisLockConfig::from_url`] (every option can be set in the query string) or
/// start from [`RedisLockConfig::default`] (`redis://127.0.0.1:6379/0`) and set fields.
///
/// ```text
/// redis://[user:password@]host[:port][/db][?option=value&...]
/// rediss://[user:password@]host[:port][/db][?ca=/path/ca.pem&option=value&...]   (TLS)
/// redis+sentinel://[user:password@]s1[:p1],s2[:p2]/MASTERNAME[/db][?option=value&...]
/// redis+cluster://[user:password@]n1[:p1],n2[:p2][?option=value&...]
/// ```
///
/// | option | default | meaning |
/// |---|---|---|
/// | `namespace` | `distlock:` | prefix of every lock key (may be empty: `namespace=`) |
/// | `connect_timeout` | `1s` | one TCP connect + handshake attempt |
/// | `timeout` | `1s` | per request: a sent command without a reply is "outcome unknown" after this ([`RedisLockConfig::timeout`]) |
/// | `response_timeout` | | an alias of `timeout` (its name before the drivers shared one vocabulary); giving both is an [`Error::Config`] |
/// | `reconnect_retries` | `2` | connection attempts retried per (re)connect before a request fails (at most 5) |
/// | `max_poll_interval` | `500ms` | cap of the jittered fallback poll of a waiting `acquire` |
/// | `ca` | system roots | `rediss://` only: PEM file of the CA(s) the server certificate must chain to |
/// | `label` | none | a short label shown by `inspect` next to this client's grants (see [`RedisLockConfig::label`]) |
/// | `replicas` | `0` | acquire and renew count only after `WAIT N` confirmed N replicas (not on Cluster; see the crate's *Topologies*) |
/// | `replica_timeout` | `500ms` | how long that `WAIT` may take; fewer replicas by then: `Indeterminate`, undone |
///
/// Durations take a unit: `250ms`, `2s`, `1m`, `1m30s` (a bare number is refused, not guessed), and are
/// from 1 ms to one hour ([`RedisLockConfig::MAX_DURATION`]), whether set in the URL or on the fields
/// ([`RedisLockConfig::validate`]). Unknown or malformed
/// options are an [`Error::Config`], and so is `ca` on a plain `redis://` URL (a TLS setting
/// never silently runs unencrypted). With `rediss://` the connection is TLS only: the server
/// certificate is verified against `ca` (or the system roots) and the host name, with no
/// plaintext fallback. `user:password@` is sent with `AUTH` (an ACL user, or only a password
/// for `requirepass`).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedisLockConfig {
    /// Server host name or IP address.
    pub host: String,
    /// Server port.
    pub port: u16,
    /// Database number (`SELECT`).
    pub db: i64,
    /// ACL user name.
    pub username: Option<String>,
    /// Password (redacted in `Debug`).
    pub password: Option<Secret>,
    /// TLS (`rediss://`): the connection is encrypted and the server certificate verified.
    pub tls: bool,
    /// PEM file of the CA certificate(s) to trust for TLS instead of the system roots (`ca=`).
    pub ca_file: Option<PathBuf>,
    /// Prefix of every lock key: the lock for name `N` lives at exactly `<namespace>N`.
    pub namespace: String,
    /// Timeout of one connection attempt.
    pub connect_timeout: Duration,
    /// Time a sent command may wait for its reply before its outcome is unknown (the URL
    /// option `timeout`, or its alias `response_timeout`).
    pub timeout: Duration,
    /// How many times a failed (re)connection is retried before requests fail with
    /// `Unavailable` (the next request starts a new attempt).
    pub reconnect_retries: usize,
    /// The longest delay between two attempts of a waiting `acquire` that was not woken.
    pub max_poll_interval: Duration,
    /// A label (1 to 64 ASCII letters, digits and `-_.:/@`, checked by
    /// [`lock_core::raw::HolderIdentity::check_label`]) added to the holder identity (host, pid,
    /// start time) this client records next to each of its grants, which `inspect` shows.
    /// Not secret: any client that can read the lock can see it.
    pub label: Option<String>,
    /// Which servers: one (`host`/`port`, the default), a master found through Sentinel, or a
    /// Cluster (see [`RedisTopology`]).
    pub topology: RedisTopology,
    /// Replica acknowledgement (`replicas=N`): an acquire or a renewal counts only after
    /// `WAIT N` confirms that N replicas have its write; 0 (the default) does not wait. Not
    /// available on a Cluster.
    pub replicas: u32,
    /// How long `WAIT` may wait for the replicas (`replica_timeout`, default 500 ms); a WAIT
    /// that ends with fewer is an unknown outcome (undone, `Error::Indeterminate`).
    pub replica_timeout: Duration,
}

/// Which Redis servers a [`RedisLockConfig`] names.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum RedisTopology {
    /// One server at `host:port`.
    #[default]
    Single,
    /// `redis+sentinel://h1:p1,h2:p2/MASTERNAME[/db]`: the master named `master_name`, asked
    /// of the sentinels in order; re-resolved after a failover.
    Sentinel {
        /// The sentinels' addresses (default port 26379).
        sentinels: Vec<(String, u16)>,
        /// The name the sentinels monitor the master under.
        master_name: String,
    },
    /// `redis+cluster://h1:p1,h2:p2`: Redis Cluster, reached through these seed nodes.
    Cluster {
        /// The seed nodes (default port 6379).
        nodes: Vec<(String, u16)>,
    },
}

impl RedisLockConfig {
    /// The default namespace.
    pub const DEFAULT_NAMESPACE: &'static str = "distlock:";

    /// The longest `connect_timeout`, `timeout` and `max_poll_interval` accepted (one
    /// hour), from a URL or set on the fields.
    pub const MAX_DURATION: Duration = Duration::from_secs(3600);

    /// The most `reconnect_retries` accepted. Each retry may wait up to a second, and a request
    /// without a deadline (`try_acquire`, `inspect`) waits for all of them: 100 retries made a
    /// `try_acquire` against an unreachable server take minutes.
    pub const MAX_RECONNECT_RETRIES: usize = 5;

    /// The most replicas `replicas=` may ask for.
    pub const MAX_REPLICAS: u32 = 64;

    /// URL options accepted under an older name: `(alias, option)`. Either name sets the same
    /// field; giving both in one URL is an [`Error::Config`] (which one was meant?).
    const ALIASES: &'static [(&'static str, &'static str)] = &[("response_timeout", "timeout")];

    /// Parses `redis://[user:password@]host[:port][/db][?option=value&...]`.
    ///
    /// # Errors
    /// [`Error::Config`] for another scheme, a bad host, port or database, and for unknown or
    /// malformed options. No I/O is done.
    pub fn from_url(url: &str) -> Result<Self> {
        if let Some((scheme, rest)) = url.split_once("://")
            && let Some(kind) = scheme.strip_prefix("redis+")
        {
            return Self::from_multi_host_url(kind, rest);
        }
        let parsed = url::Url::parse(url).map_err(|e| config_err(format!("bad redis url: {e}")))?;
        let tls = match parsed.scheme() {
            "redis" => false,
            "rediss" => true,
            other => {
                return Err(config_err(format!(
                    "unsupported scheme {other:?}: expected redis://, rediss://, redis+sentinel:// or redis+cluster://"
                )));
            }
        };
        if parsed.fragment().is_some() {
            return Err(config_err("a redis url has no #fragment"));
        }
        let mut config = Self {
            host: match parsed.host() {
                Some(url::Host::Domain(d)) if !d.is_empty() => d.to_owned(),
                Some(url::Host::Ipv4(ip)) => ip.to_string(),
                Some(url::Host::Ipv6(ip)) => ip.to_string(),
                _ => return Err(config_err("the redis url has no host")),
            },
            port: parsed.port().unwrap_or(6379),
            tls,
            ..Self::default()
        };
        config.db = match parsed.path().trim_matches('/') {
            "" => 0,
            db => db
                .parse::<i64>()
                .ok()
                .filter(|db| *db >= 0)
                .ok_or_else(|| config_err(format!("bad database number {db:?}")))?,
        };
        if !parsed.username().is_empty() {
            config.username = Some(decode(parsed.username(), "user name")?);
        }
        if let Some(password) = parsed.password() {
            config.password = Some(decode(password, "password")?.into());
        }
        // The name each aliased option was given under, to refuse an alias next to its option.
        let mut given: Vec<(&str, String)> = Vec::new();
        for (name, value) in parsed.query_pairs() {
            if let Some((alias, option)) = Self::ALIASES
                .iter()
                .find(|(alias, option)| name == *alias || name == *option)
            {
                match given.iter().find(|(o, _)| o == option) {
                    Some((_, first)) if *first != name => {
                        return Err(config_err(format!(
                            "the options {first:?} and {name:?} set the same thing \
                             ({alias} is an alias of {option}): give only {option}"
                        )));
                    }
                    Some(_) => {}
                    None => given.push((option, name.to_string())),
                }
            }
            config.set_option(&name, &value)?;
        }
        config.validate()?;
        Ok(config)
    }

    /// `redis+sentinel://[user:password@]h1[:p1],h2[:p2]/MASTERNAME[/db][?options]` and
    /// `redis+cluster://[user:password@]h1[:p1],h2[:p2][?options]`: the host list is split
    /// here, the rest is read as the `redis://` URL of the first host would be.
    fn from_multi_host_url(kind: &str, rest: &str) -> Result<Self> {
        let (authority, tail) = match rest.find(['/', '?', '#']) {
            Some(i) => rest.split_at(i),
            None => (rest, ""),
        };
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, authority),
        };
        let default_port = match kind {
            "sentinel" => 26379,
            "cluster" => 6379,
            other => {
                return Err(config_err(format!(
                    "unsupported scheme \"redis+{other}\": expected redis+sentinel:// or redis+cluster://"
                )));
            }
        };
        let mut nodes = Vec::new();
        for host in hosts.split(',') {
            let one = Self::from_url(&format!("redis://{host}"))
                .map_err(|_| config_err(format!("bad host {host:?} in the redis+{kind} url")))?;
            let port = if host.ends_with(']') || !host.contains(':') {
                default_port
            } else {
                one.port
            };
            if one.db != 0 || one.host.is_empty() {
                return Err(config_err(format!(
                    "bad host {host:?} in the redis+{kind} url"
                )));
            }
            nodes.push((one.host, port));
        }
        if tail.contains('#') {
            return Err(config_err("a redis url has no #fragment"));
        }
        let (path, query) = match tail.split_once('?') {
            Some((p, q)) => (p, Some(q)),
            None => (tail, None),
        };
        let mut segments = path.trim_start_matches('/').splitn(2, '/');
        let first = segments.next().unwrap_or_default();
        let (master_name, db) = match kind {
            "sentinel" => {
                let name = decode(first, "master name")?;
                if name.is_empty() || name.chars().any(|c| c.is_control() || c.is_whitespace()) {
                    return Err(config_err(
                        "a redis+sentinel url names the master: redis+sentinel://host:port/MASTERNAME",
                    ));
                }
                (name, segments.next().unwrap_or_default())
            }
            _ => (String::new(), first),
        };
        // Everything else as a single-host URL would have it (credentials, db, options).
        let userinfo = userinfo.map(|u| format!("{u}@")).unwrap_or_default();
        let query = query.map(|q| format!("?{q}")).unwrap_or_default();
        let mut config = Self::from_url(&format!(
            "redis://{userinfo}{}/{db}{query}",
            hosts.split(',').next().unwrap_or_default()
        ))?;
        config.topology = match kind {
            "sentinel" => RedisTopology::Sentinel {
                sentinels: nodes,
                master_name,
            },
            _ => RedisTopology::Cluster { nodes },
        };
        config.validate()?;
        Ok(config)
    }

    fn set_option(&mut self, name: &str, value: &str) -> Result<()> {
        match name {
            "replicas" => {
                self.replicas = value
                    .parse()
                    .ok()
                    .filter(|n| *n <= Self::MAX_REPLICAS)
                    .ok_or_else(|| {
                        config_err(format!(
                            "replicas must be a number from 0 to {}, not {value:?}",
                            Self::MAX_REPLICAS
                        ))
                    })?;
            }
            "replica_timeout" => {
                self.replica_timeout = lock_core::raw::parse_duration_option(name, value, None)?
            }
            "namespace" => {
                if value.chars().any(char::is_control) {
                    return Err(config_err(
                        "the namespace must not contain control characters",
                    ));
                }
                self.namespace = value.to_owned();
            }
            "connect_timeout" => {
                self.connect_timeout = lock_core::raw::parse_duration_option(name, value, None)?
            }
            "timeout" | "response_timeout" => {
                let timeout = lock_core::raw::parse_duration_option(name, value, None)?;
                // Bounded here too, so an error names the option as the URL gave it.
                check_durations(Self::MAX_DURATION, &[(name, timeout)]).map_err(config_err)?;
                self.timeout = timeout;
            }
            "max_poll_interval" => {
                self.max_poll_interval = lock_core::raw::parse_duration_option(name, value, None)?
            }
            "ca" | "ca_file" => {
                if !self.tls {
                    return Err(config_err(format!(
                        "the option {name:?} needs a rediss:// (TLS) url"
                    )));
                }
                if value.is_empty() {
                    return Err(config_err(format!("the option {name:?} is empty")));
                }
                self.ca_file = Some(PathBuf::from(value));
            }
            "label" => {
                lock_core::raw::HolderIdentity::check_label(value)?;
                self.label = Some(value.to_owned());
            }
            "reconnect_retries" => {
                self.reconnect_retries = value
                    .parse()
                    .ok()
                    .filter(|n| *n <= Self::MAX_RECONNECT_RETRIES)
                    .ok_or_else(|| {
                        config_err(format!(
                            "reconnect_retries must be a number from 0 to {}, not {value:?}",
                            Self::MAX_RECONNECT_RETRIES
                        ))
                    })?;
            }
            other => {
                return Err(config_err(format!(
                    "unknown option {other:?} (known: namespace, connect_timeout, timeout (alias response_timeout), reconnect_retries, max_poll_interval, ca, label, replicas, replica_timeout)"
                )));
            }
        }
        Ok(())
    }

    /// Checks values that may have been set directly on the fields (also run by
    /// [`RedisLockConfig::from_url`] and by every constructor of the client, `connect_lazy`
    /// included).
    ///
    /// # Errors
    /// [`Error::Config`]: an empty host, a namespace with control characters, a duration that
    /// is below 1 ms or longer than [`RedisLockConfig::MAX_DURATION`], more than
    /// [`RedisLockConfig::MAX_RECONNECT_RETRIES`] retries, a database number outside
    /// `0..=i32::MAX`, a CA file without TLS, or a bad label.
    pub fn validate(&self) -> Result<()> {
        if self.host.is_empty() {
            return Err(config_err("the host is empty"));
        }
        if self.namespace.chars().any(char::is_control) {
            return Err(config_err(
                "the namespace must not contain control characters",
            ));
        }
        check_durations(
            Self::MAX_DURATION,
            &[
                ("connect_timeout", self.connect_timeout),
                ("timeout", self.timeout),
                ("max_poll_interval", self.max_poll_interval),
                ("replica_timeout", self.replica_timeout),
            ],
        )
        .map_err(config_err)?;
        if self.reconnect_retries > Self::MAX_RECONNECT_RETRIES {
            return Err(config_err(format!(
                "reconnect_retries must be at most {}, not {}",
                Self::MAX_RECONNECT_RETRIES,
                self.reconnect_retries
            )));
        }
        if !(0..=i64::from(i32::MAX)).contains(&self.db) {
            return Err(config_err(format!(
                "the database number must be from 0 to {}, not {}",
                i32::MAX,
                self.db
            )));
        }
        if self.ca_file.is_some() && !self.tls {
            return Err(config_err("ca_file needs tls (rediss://)"));
        }
        if let Some(label) = &self.label {
            lock_core::raw::HolderIdentity::check_label(label)?;
        }
        if self.replicas > Self::MAX_REPLICAS {
            return Err(config_err(format!(
                "replicas must be at most {}, not {}",
                Self::MAX_REPLICAS,
                self.replicas
            )));
        }
        match &self.topology {
            RedisTopology::Single => {}
            RedisTopology::Sentinel {
                sentinels,
                master_name,
            } => {
                if sentinels.is_empty() || sentinels.iter().any(|(h, _)| h.is_empty()) {
                    return Err(config_err("a sentinel topology needs sentinel addresses"));
                }
                if master_name.is_empty() || master_name.chars().any(char::is_control) {
                    return Err(config_err("a sentinel topology needs a master name"));
                }
                if self.tls {
                    return Err(config_err("TLS is not supported with Sentinel"));
                }
            }
            RedisTopology::Cluster { nodes } => {
                if nodes.is_empty() || nodes.iter().any(|(h, _)| h.is_empty()) {
                    return Err(config_err("a cluster topology needs seed nodes"));
                }
                if self.db != 0 {
                    return Err(config_err("Redis Cluster has only database 0"));
                }
                if self.tls {
                    return Err(config_err("TLS is not supported with Redis Cluster"));
                }
                if self.replicas > 0 {
                    return Err(config_err(
                        "replicas= (WAIT) is not supported on Redis Cluster",
                    ));
                }
            }
        }
        Ok(())
    }

    /// The longest a single request can take before the driver gives up on it: connection
    /// attempts plus the response timeout.
    pub(crate) fn request_budget(&self) -> Duration {
        let attempts = u32::try_from(self.reconnect_retries.saturating_add(1)).unwrap_or(u32::MAX);
        self.connect_timeout
            .saturating_mul(attempts)
            .saturating_add(self.timeout)
            .saturating_add(self.wait_allowance())
            .saturating_add(Duration::from_millis(200))
    }

    /// What a reply may take beyond `timeout`: the `WAIT` for the replicas.
    pub(crate) fn wait_allowance(&self) -> Duration {
        if self.replicas > 0 {
            self.replica_timeout
        } else {
            Duration::ZERO
        }
    }
}

impl Default for RedisLockConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".to_owned(),
            port: 6379,
            db: 0,
            username: None,
            password: None,
            tls: false,
            ca_file: None,
            namespace: Self::DEFAULT_NAMESPACE.to_owned(),
            connect_timeout: Duration::from_secs(1),
            timeout: Duration::from_secs(1),
            reconnect_retries: 2,
            max_poll_interval: Duration::from_millis(500),
            label: None,
            topology: RedisTopology::Single,
            replicas: 0,
            replica_timeout: Duration::from_millis(500),
        }
    }
}

fn config_err(message: impl Into<String>) -> Error {
    Error::Config(message.into())
}

fn decode(s: &str, what: &str) -> Result<String> {
    percent_decode(s)
        .ok_or_else(|| config_err(format!("the {what} is not valid percent-encoded UTF-8")))
}

/// Percent-decodes a URL component (no `+` → space translation, unlike form encoding).
fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3)?;
            let hex = std::str::from_utf8(hex).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_part_and_option() {
        let c = RedisLockConfig::from_url(
            "redis://alice:s%40cret@example.com:7000/3?namespace=app%3Alocks%3A&connect_timeout=250ms&response_timeout=2s&reconnect_retries=5&max_poll_interval=1m",
        )
        .unwrap();
        assert_eq!(c.host, "example.com");
        assert_eq!(c.port, 7000);
        assert_eq!(c.db, 3);
        assert_eq!(c.username.as_deref(), Some("alice"));
        assert_eq!(c.password.as_ref().map(Secret::expose), Some("s@cret"));
        assert_eq!(c.namespace, "app:locks:");
        assert_eq!(c.connect_timeout, Duration::from_millis(250));
        assert_eq!(c.timeout, Duration::from_secs(2));
        assert_eq!(c.reconnect_retries, 5);
        assert_eq!(c.max_poll_interval, Duration::from_secs(60));
        assert_eq!(c.label, None);
        let c = RedisLockConfig::from_url("redis://h?label=nightly-report%40web.1").unwrap();
        assert_eq!(c.label.as_deref(), Some("nightly-report@web.1"));
    }

    #[test]
    fn defaults_and_empty_namespace() {
        let c = RedisLockConfig::from_url("redis://localhost").unwrap();
        assert_eq!((c.port, c.db), (6379, 0));
        assert_eq!(c.namespace, "distlock:");
        assert_eq!(c.password, None);
        let c = RedisLockConfig::from_url("redis://[::1]:6380/?namespace=").unwrap();
        assert_eq!(c.host, "::1");
        assert_eq!(c.namespace, "");
        assert_eq!(
            RedisLockConfig::from_url("redis://h?response_timeout=1500ms")
                .unwrap()
                .timeout,
            Duration::from_millis(1500)
        );
    }

    #[test]
    fn rejects_bad_urls_and_options() {
        conformance::config_errors::assert_config_errors(
            RedisLockConfig::from_url,
            &[
                ("http://localhost", "unsupported scheme"),
                ("redis://localhost?ca=/tmp/ca.pem", "ca"),
                ("rediss://localhost?ca=", "ca"),
                ("redis://", "no host"),
                ("redis://h/x", "database number"),
                ("redis://h/-1", "database number"),
                ("redis://h?nope=1", "nope"),
                ("redis://h?connect_timeout=0", "connect_timeout"),
                ("redis://h?connect_timeout=fast", "connect_timeout"),
                ("redis://h?response_timeout=5h", "response_timeout"),
                // A bare number is refused rather than read in some unit.
                ("redis://h?response_timeout=1500", "response_timeout"),
                ("redis://h?max_poll_interval=1", "max_poll_interval"),
                ("redis://h?reconnect_retries=-1", "reconnect_retries"),
                ("redis://h?namespace=a%0Ab", "namespace"),
                ("redis://h?label=", "label"),
                ("redis://h?label=a%20b", "label"),
                ("redis://h?label=%C3%A9", "label"),
                ("redis://h?label=a%0Ab", "label"),
                ("redis://h#frag", "fragment"),
                ("not a url", "bad redis url"),
            ],
        );
    }

    #[test]
    fn tls_url_and_ca() {
        let c = RedisLockConfig::from_url("rediss://u:p@h:6390/1?ca=/etc/ca.pem").unwrap();
        assert!(c.tls);
        assert_eq!(c.ca_file, Some(PathBuf::from("/etc/ca.pem")));
        assert_eq!((c.port, c.db), (6390, 1));
        let c = RedisLockConfig::from_url("rediss://h").unwrap();
        assert!(c.tls && c.ca_file.is_none());
        assert!(!RedisLockConfig::from_url("redis://h").unwrap().tls);
    }

    #[test]
    fn sentinel_and_cluster_urls() {
        let c = RedisLockConfig::from_url(
            "redis+sentinel://u:p%40ss@10.0.0.1:26380,s2,[::1]:26390/mymaster/2?replicas=1&replica_timeout=250ms&namespace=x:",
        )
        .unwrap();
        assert_eq!(
            c.topology,
            RedisTopology::Sentinel {
                sentinels: vec![
                    ("10.0.0.1".into(), 26380),
                    ("s2".into(), 26379),
                    ("::1".into(), 26390)
                ],
                master_name: "mymaster".into(),
            }
        );
        assert_eq!((c.db, c.replicas), (2, 1));
        assert_eq!(c.replica_timeout, Duration::from_millis(250));
        assert_eq!(c.password.as_ref().map(Secret::expose), Some("p@ss"));
        assert_eq!(c.namespace, "x:");
        let c = RedisLockConfig::from_url("redis+sentinel://s1/m").unwrap();
        assert_eq!(c.db, 0);
        let c = RedisLockConfig::from_url("redis+cluster://a:7000,b").unwrap();
        assert_eq!(
            c.topology,
            RedisTopology::Cluster {
                nodes: vec![("a".into(), 7000), ("b".into(), 6379)]
            }
        );
        assert_eq!(
            RedisLockConfig::from_url("redis://h").unwrap().topology,
            RedisTopology::Single
        );
        conformance::config_errors::assert_config_errors(
            RedisLockConfig::from_url,
            &[
                ("redis+sentinel://s1", "names the master"),
                ("redis+sentinel://s1/", "names the master"),
                ("redis+sentinel:///m", "bad host"),
                ("redis+sentinel://s1,,s2/m", "bad host"),
                ("redis+sentinel://s1:x/m", "bad host"),
                ("redis+sentinel://s1/m/x", "database number"),
                ("redis+sentinel://s1/m?nope=1", "nope"),
                ("redis+sentinel://s1/m#f", "fragment"),
                ("redis+cluster://a/1", "only database 0"),
                ("redis+cluster://a?replicas=1", "replicas"),
                ("redis+cluster://", "bad host"),
                ("redis+other://a", "unsupported scheme"),
                ("redis://h?replicas=65", "replicas"),
                ("redis://h?replicas=-1", "replicas"),
                ("redis://h?replica_timeout=0", "replica_timeout"),
            ],
        );
        let shown = format!(
            "{:?}",
            RedisLockConfig::from_url("redis+sentinel://u:hunter2@s/m").unwrap()
        );
        assert!(!shown.contains("hunter2"), "{shown}");
    }

    /// One vocabulary across drivers: `timeout` is the per-request option, `timeout`
    /// stays accepted as its alias, and giving both is refused rather than one silently winning.
    #[test]
    fn timeout_and_its_alias_response_timeout_set_the_request_timeout_and_not_both() {
        let by = |url: &str| RedisLockConfig::from_url(url).map(|c| c.timeout);
        assert_eq!(
            by("redis://h?timeout=250ms").unwrap(),
            Duration::from_millis(250)
        );
        assert_eq!(
            by("redis://h?response_timeout=250ms").unwrap(),
            Duration::from_millis(250)
        );
        assert_eq!(
            by("redis://h?timeout=1s&timeout=2s").unwrap(),
            Duration::from_secs(2)
        );
        assert_eq!(
            by("redis+sentinel://s1/m?timeout=3s").unwrap(),
            Duration::from_secs(3)
        );
        conformance::config_errors::assert_config_errors(
            by,
            &[
                (
                    "redis://h?timeout=1s&response_timeout=1s",
                    "response_timeout",
                ),
                ("redis://h?response_timeout=2s&timeout=1s", "timeout"),
                (
                    "redis+sentinel://s1/m?timeout=1s&response_timeout=2s",
                    "response_timeout",
                ),
                (
                    "redis+cluster://a,b?response_timeout=1s&timeout=2s",
                    "timeout",
                ),
                ("redis://h?timeout=0s", "timeout"),
                ("redis://h?timeout=2h", "timeout"),
            ],
        );
        assert!(matches!(
            crate::RedlockConfig::from_url("redlock://a,b,c?timeout=1s&response_timeout=1s"),
            Err(Error::Config(_))
        ));
        assert_eq!(
            crate::RedlockConfig::from_url("redlock://a,b,c?timeout=700ms")
                .unwrap()
                .nodes[0]
                .timeout,
            Duration::from_millis(700)
        );
    }

    #[test]
    fn debug_redacts_the_password() {
        let c = RedisLockConfig::from_url("redis://u:hunter2@h").unwrap();
        let shown = format!("{c:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("<redacted>"));
    }
}

#[cfg(test)]
mod url_proptests {
    /// Any input gets a config or a typed error, never a panic; a password never shows.
    #[test]
    fn from_url_never_panics_or_shows_the_password() {
        conformance::check_url_parser("redis|rediss", super::RedisLockConfig::from_url);
    }

    /// The same for the multi-host forms (host lists, master names) and Redlock's.
    #[test]
    fn multi_host_urls_never_panic_or_show_the_password() {
        conformance::check_url_parser(
            "redis\\+sentinel|redis\\+cluster",
            super::RedisLockConfig::from_url,
        );
        conformance::check_url_parser("redlock|REDLOCK", crate::RedlockConfig::from_url);
    }
}
