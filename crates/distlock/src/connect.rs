//! `connect(url)`: pick the coordinator by URL scheme, without a global registry of drivers.

use std::{
    collections::HashMap,
    fmt,
    sync::{Arc, LazyLock, Mutex, PoisonError},
};

use lock_core::{DynLock, Error, InMemoryLock, Observed, Result};

/// The coordinators [`connect`] knows, by URL scheme.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Backend {
    /// `memory://NAME`: the in-process reference backend (always available).
    Memory,
    /// `redis://` / `rediss://`, `redis+sentinel://`, `redis+cluster://` and `redlock://`
    /// (feature `redis`).
    Redis,
    /// `etcd://` / `etcds://` (feature `etcd`).
    Etcd,
    /// `zk://` (feature `zk`).
    ZooKeeper,
    /// `postgres://` / `postgresql://` (feature `pg`).
    Postgres,
}

impl Backend {
    /// Every backend, in the order they are listed in messages.
    pub const ALL: [Backend; 5] = [
        Backend::Memory,
        Backend::Redis,
        Backend::Etcd,
        Backend::ZooKeeper,
        Backend::Postgres,
    ];

    /// The backend for a URL scheme (case-insensitive), compiled in or not.
    pub fn from_scheme(scheme: &str) -> Option<Self> {
        let scheme = scheme.to_ascii_lowercase();
        Self::ALL
            .into_iter()
            .find(|b| b.schemes().contains(&scheme.as_str()))
    }

    /// The backend a URL names, checking only its scheme (no I/O, options unchecked).
    ///
    /// # Errors
    /// [`Error::Config`] when `url` has no `SCHEME://`, the scheme is unknown (the message lists
    /// the supported ones) or its driver's Cargo feature is not enabled (the message names it).
    pub fn for_url(url: &str) -> Result<Self> {
        Self::for_url_in(url, Backend::is_enabled)
    }

    /// [`Backend::for_url`] as a build without `missing`'s feature (and with every other one)
    /// answers it: for tests of the missing-feature path (the CLI's among them) in a build that
    /// has every feature.
    #[doc(hidden)]
    pub fn for_url_without(url: &str, missing: Backend) -> Result<Self> {
        Self::for_url_in(url, |b| b != missing)
    }

    /// [`Backend::for_url`] for a build in which `enabled` says which backends are compiled in:
    /// the missing-feature branches are then testable in any build (under `--all-features` the
    /// real set has none missing).
    fn for_url_in(url: &str, enabled: impl Fn(Backend) -> bool + Copy) -> Result<Self> {
        let Some((scheme, _)) = url.split_once("://") else {
            return Err(Error::Config(format!(
                "a lock URL looks like SCHEME://…, e.g. memory://demo or redis://127.0.0.1:6379; {}",
                schemes_sentence(enabled)
            )));
        };
        let Some(backend) = Self::from_scheme(scheme) else {
            return Err(Error::Config(format!(
                "unknown lock URL scheme `{scheme}://`; {}",
                schemes_sentence(enabled)
            )));
        };
        if !enabled(backend) {
            let feature = backend.feature().unwrap_or("full");
            return Err(Error::Config(format!(
                "the `{feature}` feature of distlock is not enabled, so `{}://` URLs cannot be used; \
                 enable it (distlock = {{ features = [\"{feature}\"] }}, or \"full\")",
                scheme.to_ascii_lowercase()
            )));
        }
        Ok(backend)
    }

    /// The URL schemes of this backend.
    pub fn schemes(self) -> &'static [&'static str] {
        match self {
            Backend::Memory => &["memory"],
            Backend::Redis => &[
                "redis",
                "rediss",
                "redis+sentinel",
                "redis+cluster",
                "redlock",
            ],
            Backend::Etcd => &["etcd", "etcds"],
            Backend::ZooKeeper => &["zk"],
            Backend::Postgres => &["postgres", "postgresql"],
        }
    }

    /// The Cargo feature of distlock that compiles this backend in (`None`: always available).
    pub fn feature(self) -> Option<&'static str> {
        match self {
            Backend::Memory => None,
            Backend::Redis => Some("redis"),
            Backend::Etcd => Some("etcd"),
            Backend::ZooKeeper => Some("zk"),
            Backend::Postgres => Some("pg"),
        }
    }

    /// `true` when this build of distlock can connect to this backend.
    pub fn is_enabled(self) -> bool {
        match self {
            Backend::Memory => true,
            Backend::Redis => cfg!(feature = "redis"),
            Backend::Etcd => cfg!(feature = "etcd"),
            Backend::ZooKeeper => cfg!(feature = "zk"),
            Backend::Postgres => cfg!(feature = "pg"),
        }
    }
}

/// The backend's one name: its URL scheme, its `backend_name()` and its metric label.
impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::Memory => "memory",
            Backend::Redis => "redis",
            Backend::Etcd => "etcd",
            Backend::ZooKeeper => "zk",
            Backend::Postgres => "postgres",
        })
    }
}

/// The URL schemes this build of distlock can connect to.
pub fn supported_schemes() -> Vec<&'static str> {
    schemes_of(Backend::is_enabled)
}

/// The URL schemes of the backends `enabled` says are compiled in.
fn schemes_of(enabled: impl Fn(Backend) -> bool) -> Vec<&'static str> {
    Backend::ALL
        .into_iter()
        .filter(|b| enabled(*b))
        .flat_map(|b| b.schemes().iter().copied())
        .collect()
}

/// "supported schemes: …; not compiled in: …" for the set of backends `enabled` says are
/// compiled in.
fn schemes_sentence(enabled: impl Fn(Backend) -> bool + Copy) -> String {
    let supported: Vec<String> = schemes_of(enabled)
        .into_iter()
        .map(|s| format!("{s}://"))
        .collect();
    let disabled: Vec<String> = Backend::ALL
        .into_iter()
        .filter(|b| !enabled(*b))
        .map(|b| {
            let schemes: Vec<String> = b.schemes().iter().map(|s| format!("{s}://")).collect();
            format!(
                "{} (feature `{}`)",
                schemes.join(", "),
                b.feature().unwrap_or("full")
            )
        })
        .collect();
    let mut sentence = format!("supported schemes: {}", supported.join(", "));
    if !disabled.is_empty() {
        sentence.push_str(&format!("; not compiled in: {}", disabled.join(", ")));
    }
    sentence
}

/// Connects to the coordinator named by `url` and returns a client as a [`DynLock`].
///
/// | scheme | backend | feature |
/// |---|---|---|
/// | `memory://NAME` | [`InMemoryLock`] | always |
/// | `redis://`, `rediss://` | Redis | `redis` |
/// | `redis+sentinel://`, `redis+cluster://` | Redis (Sentinel, Cluster) | `redis` |
/// | `redlock://` | Redlock over independent Redis masters (no fencing) | `redis` |
/// | `etcd://`, `etcds://` | etcd | `etcd` |
/// | `zk://` | ZooKeeper | `zk` |
/// | `postgres://`, `postgresql://` | PostgreSQL | `pg` |
///
/// Every driver option (key prefix / namespace / ZooKeeper root, timeouts, table name, TLS
/// files, …) is set in the URL's query string; see each driver's `…LockConfig::from_url`.
/// Unknown or malformed options are an error, never ignored.
///
/// # `memory://`
/// `memory://NAME[?label=L]` is a coordinator living in this process: every `connect` with the same
/// `NAME` returns a new, independent client of the *same* coordinator, so two
/// `connect("memory://orders")` calls in one process contend for the same locks, while
/// `memory://a` and `memory://b` never interact (`memory://` alone is `memory://default`).
/// It takes no options. Different processes never share it: use a real coordinator for that.
///
/// # Errors
/// [`Error::Config`] for a malformed URL, an unknown scheme (the message lists the supported
/// ones), a scheme whose Cargo feature is not enabled (the message names the feature) or an
/// invalid option — all before any I/O; otherwise the driver's connection errors
/// ([`Error::Unavailable`] when the coordinator cannot be reached). Messages never contain the
/// URL's password.
///
/// The client is wrapped in [`Observed`], so it reports distlock's metrics (through the
/// `metrics` facade, a no-op until the application installs a recorder) and tracing spans.
///
/// ```
/// use std::time::Duration;
/// use distlock::{DistributedLockExt, LockOptions};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> distlock::Result<()> {
/// // The same code runs on every coordinator: only the URL changes
/// // ("redis://127.0.0.1:6379", "etcd://127.0.0.1:2379", "zk://…", "postgres://…").
/// let lock = distlock::connect("memory://orders").await?;
/// let ran = lock
///     .run_exclusive("close-timed-out-orders", LockOptions::with_ttl(Duration::from_secs(10)), |ctx| async move {
///         ctx.fencing_token().is_some()
///     })
///     .await?;
/// assert_eq!(ran, Some(true));
/// // Bad input is a typed error before any I/O.
/// assert!(distlock::connect("nosuch://x").await.is_err());
/// # Ok(()) }
/// ```
pub async fn connect(url: &str) -> Result<DynLock> {
    let inner = connect_unobserved(url).await?;
    Ok(Arc::new(Observed::new(inner)))
}

/// [`connect`] without the metrics/tracing wrapper.
///
/// # Errors
/// As [`connect`].
pub async fn connect_unobserved(url: &str) -> Result<DynLock> {
    match Backend::for_url(url)? {
        Backend::Memory => connect_memory(url),
        #[cfg(feature = "redis")]
        Backend::Redis => connect_redis(url).await,
        #[cfg(feature = "etcd")]
        Backend::Etcd => connect_etcd(url).await,
        #[cfg(feature = "zk")]
        Backend::ZooKeeper => connect_zk(url).await,
        #[cfg(feature = "pg")]
        Backend::Postgres => connect_pg(url).await,
        #[allow(unreachable_patterns)] // every backend is enabled under `full`
        other => Err(Error::Config(format!(
            "the {other} backend is not compiled into this build of distlock"
        ))),
    }
}

/// One in-process coordinator per `memory://` name, for the whole process.
static MEMORY: LazyLock<Mutex<HashMap<String, InMemoryLock>>> = LazyLock::new(Mutex::default);

fn connect_memory(url: &str) -> Result<DynLock> {
    let parsed =
        url::Url::parse(url).map_err(|e| Error::Config(format!("invalid memory:// URL: {e}")))?;
    if !parsed.username().is_empty() || parsed.password().is_some() || parsed.port().is_some() {
        return Err(Error::Config(
            "a memory:// URL is memory://NAME: no user, password or port".into(),
        ));
    }
    if !matches!(parsed.path(), "" | "/") {
        return Err(Error::Config(format!(
            "a memory:// URL is memory://NAME: unexpected path `{}`",
            parsed.path()
        )));
    }
    let mut label = None;
    for (option, value) in parsed.query_pairs() {
        match &*option {
            "label" if label.is_none() => label = Some(value.into_owned()),
            "label" => {
                return Err(Error::Config(
                    "the memory:// option `label` is given twice".into(),
                ));
            }
            _ => {
                return Err(Error::Config(format!(
                    "unknown memory:// option `{option}` (the in-memory backend takes only `label`)"
                )));
            }
        }
    }
    let name = match parsed.host_str() {
        None | Some("") => "default".to_owned(),
        Some(name) => name.to_owned(),
    };
    let client = {
        let mut coordinators = MEMORY.lock().unwrap_or_else(PoisonError::into_inner);
        coordinators.entry(name).or_default().client()
    };
    Ok(Arc::new(match label {
        Some(label) => client.with_label(&label)?,
        None => client,
    }))
}

#[cfg(feature = "redis")]
async fn connect_redis(url: &str) -> Result<DynLock> {
    if url
        .get(..10)
        .is_some_and(|s| s.eq_ignore_ascii_case("redlock://"))
    {
        return Ok(Arc::new(lock_redis::RedlockLock::connect_url(url).await?));
    }
    let config = lock_redis::RedisLockConfig::from_url(url)?;
    Ok(Arc::new(lock_redis::RedisLock::connect(config).await?))
}

#[cfg(feature = "etcd")]
async fn connect_etcd(url: &str) -> Result<DynLock> {
    let config = lock_etcd::EtcdLockConfig::from_url(url)?;
    Ok(Arc::new(lock_etcd::EtcdLock::connect(config).await?))
}

#[cfg(feature = "pg")]
async fn connect_pg(url: &str) -> Result<DynLock> {
    let config = lock_pg::PgLockConfig::from_url(url)?;
    Ok(Arc::new(lock_pg::PgLock::connect(config).await?))
}

#[cfg(feature = "zk")]
async fn connect_zk(url: &str) -> Result<DynLock> {
    let config = lock_zk::ZkLockConfig::from_url(url)?;
    Ok(Arc::new(lock_zk::ZkLock::connect(config).await?))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::time::Duration;

    use lock_core::LockKey;

    use super::*;

    fn config_message<T: std::fmt::Debug>(result: Result<T>) -> String {
        match result {
            Err(Error::Config(message)) => message,
            Err(other) => panic!("expected a Config error, got {other}"),
            Ok(value) => panic!("expected a Config error, got {value:?}"),
        }
    }

    #[tokio::test]
    async fn memory_clients_of_one_name_contend() {
        let a = connect("memory://facade-contend").await.unwrap();
        let b = connect("memory://facade-contend").await.unwrap();
        let key = LockKey::new("k").unwrap();
        let ttl = Duration::from_secs(10);
        let lease = a.try_acquire(&key, ttl).await.unwrap().expect("free");
        assert!(b.try_acquire(&key, ttl).await.unwrap().is_none());
        assert_eq!(a.backend_name(), "memory");
        assert!(a.release(&lease).await.unwrap());
        assert!(b.try_acquire(&key, ttl).await.unwrap().is_some());
    }

    #[tokio::test]
    async fn memory_names_are_independent_and_default_exists() {
        let a = connect("memory://facade-a").await.unwrap();
        let b = connect("memory://facade-b").await.unwrap();
        let key = LockKey::new("k").unwrap();
        let ttl = Duration::from_secs(10);
        assert!(a.try_acquire(&key, ttl).await.unwrap().is_some());
        assert!(b.try_acquire(&key, ttl).await.unwrap().is_some());

        let d1 = connect("memory://").await.unwrap();
        let d2 = connect("MEMORY://default").await.unwrap();
        let key = LockKey::new("facade-default").unwrap();
        assert!(d1.try_acquire(&key, ttl).await.unwrap().is_some());
        assert!(d2.try_acquire(&key, ttl).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn memory_rejects_options_ports_and_paths() {
        let msg = config_message(connect("memory://x?ttl=3").await);
        assert!(msg.contains("unknown memory:// option `ttl`"), "{msg}");
        for url in [
            "memory://x:1",
            "memory://u:p@x",
            "memory://x/y",
            "memory://x?label=a&label=b",
            "memory://x?label=has%20space",
        ] {
            config_message(connect(url).await);
        }
    }

    #[tokio::test]
    async fn a_memory_holder_s_label_is_shown_by_inspect() {
        let a = connect("memory://facade-label?label=worker-a")
            .await
            .unwrap();
        let b = connect("memory://facade-label").await.unwrap();
        let key = LockKey::new("facade-label").unwrap();
        let ttl = std::time::Duration::from_secs(5);
        let lease = a.try_acquire(&key, ttl).await.unwrap().unwrap();
        let seen = b.inspect(&key).await.unwrap().unwrap().holder.unwrap();
        assert!(seen.as_str().ends_with(" label=worker-a"), "{seen}");
        assert!(
            seen.as_str()
                .contains(&format!("pid={}", std::process::id()))
        );
        // b queues, a releases: the lock is handed to b, and inspect shows b (no label).
        let waiter = {
            let (b, key) = (b.clone(), key.clone());
            tokio::spawn(async move {
                b.acquire(&key, ttl, tokio::time::Instant::now() + ttl)
                    .await
            })
        };
        while b.inspect(&key).await.unwrap().and_then(|i| i.waiters) != Some(1) {
            tokio::task::yield_now().await;
        }
        assert!(a.release(&lease).await.unwrap());
        let granted = waiter.await.unwrap().unwrap();
        let seen = a.inspect(&key).await.unwrap().unwrap().holder.unwrap();
        assert!(!seen.as_str().contains("label="), "{seen}");
        assert!(b.release(&granted).await.unwrap());
    }

    #[tokio::test]
    async fn unknown_scheme_lists_the_supported_ones() {
        let msg = config_message(connect("foo://bar").await);
        assert!(msg.contains("unknown lock URL scheme `foo://`"), "{msg}");
        assert!(msg.contains("memory://"), "{msg}");
        for scheme in ["redis://", "etcd://", "zk://", "postgres://"] {
            assert!(msg.contains(scheme), "{msg} should mention {scheme}");
        }
    }

    #[tokio::test]
    async fn not_a_url_is_a_config_error() {
        for url in ["", "redis", "localhost:6379", "memory:x"] {
            let msg = config_message(connect(url).await);
            assert!(msg.contains("SCHEME://"), "{msg}");
        }
    }

    #[tokio::test]
    async fn known_schemes_map_to_their_backend_and_feature() {
        let cases = [
            ("redis", Backend::Redis, Some("redis")),
            ("rediss", Backend::Redis, Some("redis")),
            ("redis+sentinel", Backend::Redis, Some("redis")),
            ("redis+cluster", Backend::Redis, Some("redis")),
            ("redlock", Backend::Redis, Some("redis")),
            ("etcd", Backend::Etcd, Some("etcd")),
            ("etcds", Backend::Etcd, Some("etcd")),
            ("zk", Backend::ZooKeeper, Some("zk")),
            ("postgres", Backend::Postgres, Some("pg")),
            ("PostgreSQL", Backend::Postgres, Some("pg")),
            ("memory", Backend::Memory, None),
        ];
        for (scheme, backend, feature) in cases {
            assert_eq!(Backend::from_scheme(scheme), Some(backend), "{scheme}");
            assert_eq!(backend.feature(), feature);
        }
        assert_eq!(Backend::from_scheme("http"), None);
        assert!(supported_schemes().contains(&"memory"));
    }

    /// A known scheme whose driver is not compiled in names the missing feature.
    #[tokio::test]
    async fn missing_feature_is_named() {
        let cases = [
            ("redis://127.0.0.1:1", Backend::Redis),
            ("rediss://127.0.0.1:1", Backend::Redis),
            ("etcd://127.0.0.1:1", Backend::Etcd),
            ("etcds://127.0.0.1:1", Backend::Etcd),
            ("zk://127.0.0.1:1", Backend::ZooKeeper),
            ("postgres://u:secret@127.0.0.1:1/db", Backend::Postgres),
            ("postgresql://127.0.0.1:1/db", Backend::Postgres),
        ];
        // Each case in a build without that backend's feature (the others and memory in), so
        // this runs under `--all-features` too; plus, through `connect`, whatever this build
        // really lacks.
        for (url, backend) in cases {
            let without = move |b: Backend| b != backend;
            let scheme = url.split("://").next().unwrap();
            let msg = config_message(Backend::for_url_in(url, without));
            let feature = backend.feature().unwrap();
            assert!(
                msg.contains(&format!(
                    "the `{feature}` feature of distlock is not enabled, so `{scheme}://` URLs"
                )),
                "{msg}"
            );
            assert!(
                msg.contains(&format!("features = [\"{feature}\"]")),
                "{msg}"
            );
            assert!(!msg.contains("secret"), "{msg} leaks the password");
            assert!(!schemes_of(without).contains(&scheme));
            assert!(schemes_of(without).contains(&"memory"));
            // The other backends are still accepted in that build.
            for other in Backend::ALL.into_iter().filter(|b| *b != backend) {
                let url = format!("{}://127.0.0.1:1", other.schemes()[0]);
                assert_eq!(Backend::for_url_in(&url, without).unwrap(), other, "{url}");
            }
            // An unknown scheme's message lists the missing backend as not compiled in.
            let msg = config_message(Backend::for_url_in("foo://bar", without));
            let (_, missing) = msg.split_once("not compiled in: ").unwrap_or_default();
            assert!(missing.contains(&format!("{scheme}://")), "{msg}");
            assert!(missing.contains(&format!("(feature `{feature}`)")), "{msg}");
            if !backend.is_enabled() {
                let msg = config_message(connect(url).await);
                assert!(
                    msg.contains(&format!(
                        "the `{feature}` feature of distlock is not enabled"
                    )),
                    "{msg}"
                );
                assert!(!msg.contains("secret"), "{msg} leaks the password");
                assert!(!supported_schemes().contains(&scheme));
            }
        }
    }

    /// The sentence of a build with every driver left out names each one's feature, and that of
    /// a build with all of them has no "not compiled in" part.
    #[test]
    fn the_schemes_sentence_names_every_missing_feature() {
        let none = schemes_sentence(|b| b == Backend::Memory);
        assert!(
            none.starts_with("supported schemes: memory://; not compiled in: "),
            "{none}"
        );
        for backend in Backend::ALL.into_iter().filter(|b| *b != Backend::Memory) {
            let feature = backend.feature().unwrap();
            for scheme in backend.schemes() {
                assert!(none.contains(&format!("{scheme}://")), "{none}: {scheme}");
            }
            assert!(
                none.contains(&format!("(feature `{feature}`)")),
                "{none}: {feature}"
            );
        }
        let all = schemes_sentence(|_| true);
        assert!(!all.contains("not compiled in"), "{all}");
        for backend in Backend::ALL {
            for scheme in backend.schemes() {
                assert!(all.contains(&format!("{scheme}://")), "{all}: {scheme}");
            }
        }
    }
}
