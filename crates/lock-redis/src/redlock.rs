//! [`RedlockLock`]: Redlock over N independent Redis masters. No fencing tokens: its
//! capabilities declare `FencingGuarantee::None`, so `require_fencing(SingleNode)` fails before
//! any I/O.

use std::{fmt, sync::Arc, time::Duration};

use lock_core::raw::{
    Capabilities, Driver, Error, FencingGuarantee, HolderIdentity, HolderInfo, Lease, LockKey,
    OwnershipToken, Result, TokenDigest, async_trait, server_expired_lease,
};
use redis::{
    ConnectionAddr, IntoConnectionInfo, RedisConnectionInfo, RedisError, Script,
    aio::{ConnectionManager, ConnectionManagerConfig},
};
use tokio::time::{Instant, timeout};

use crate::{RedisLockConfig, RedisTopology};

const BACKEND: &str = "redlock";

/// Compare-and-extend: the key's value is this lease's token.
const RENEW: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
";

/// Compare-and-delete.
const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
";

/// The masters of a [`RedlockLock`]: `redlock://[user:password@]h1[:p1],h2[:p2],h3[:p3][/db][?options]`.
///
/// Each master gets the same credentials, database and options (`namespace`, `connect_timeout`,
/// `timeout` (alias `response_timeout`), `reconnect_retries`, `label` as for `redis://`;
/// `replicas` is refused: each master is meant to stand alone).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedlockConfig {
    /// One single-server config per master (all with the same namespace and timeouts).
    pub nodes: Vec<RedisLockConfig>,
}

impl RedlockConfig {
    /// Parses a `redlock://` URL.
    ///
    /// # Errors
    /// [`Error::Config`] for another scheme, a bad host list or option. No I/O is done.
    pub fn from_url(url: &str) -> Result<Self> {
        let rest = url
            .get(..10)
            .filter(|scheme| scheme.eq_ignore_ascii_case("redlock://"))
            .and_then(|_| url.get(10..))
            .ok_or_else(|| Error::Config("expected a redlock:// url".to_owned()))?;
        // The host list is parsed as a cluster's would be; each master is then a single server.
        let cluster = RedisLockConfig::from_url(&format!("redis+cluster://{rest}"))
            .or_else(|_| {
                // A database number is allowed here (each master is a plain server).
                let (hosts, tail) = match rest.find(['/', '?', '#']) {
                    Some(i) => rest.split_at(i),
                    None => (rest, ""),
                };
                let (path, query) = match tail.split_once('?') {
                    Some((p, q)) => (p, format!("?{q}")),
                    None => (tail, String::new()),
                };
                let mut c = RedisLockConfig::from_url(&format!("redis+cluster://{hosts}{query}"))?;
                let db = RedisLockConfig::from_url(&format!("redis://h{path}"))?.db;
                c.db = db;
                Ok::<_, Error>(c)
            })
            .map_err(|e| Error::Config(format!("bad redlock url: {e}")))?;
        let RedisTopology::Cluster { nodes } = &cluster.topology else {
            return Err(Error::Config("bad redlock url".to_owned()));
        };
        let config = Self {
            nodes: nodes
                .iter()
                .map(|(host, port)| {
                    let mut node = cluster.clone();
                    node.topology = RedisTopology::Single;
                    node.host = host.clone();
                    node.port = *port;
                    node
                })
                .collect(),
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks the settings (also run by [`RedlockLock::connect_lazy`]).
    ///
    /// # Errors
    /// [`Error::Config`]: no master, a master that is not a single plain server, replica
    /// acknowledgement, or masters with different namespaces.
    pub fn validate(&self) -> Result<()> {
        let Some(first) = self.nodes.first() else {
            return Err(Error::Config(
                "redlock needs at least one master".to_owned(),
            ));
        };
        for node in &self.nodes {
            node.validate()?;
            if node.topology != RedisTopology::Single || node.tls {
                return Err(Error::Config(
                    "each redlock master is one plain redis:// server".to_owned(),
                ));
            }
            if node.replicas > 0 {
                return Err(Error::Config(
                    "replicas= is not supported with redlock".to_owned(),
                ));
            }
            if node.namespace != first.namespace {
                return Err(Error::Config(
                    "every redlock master needs the same namespace".to_owned(),
                ));
            }
        }
        Ok(())
    }

    /// How many masters must agree: a majority.
    pub fn quorum(&self) -> usize {
        self.nodes.len() / 2 + 1
    }
}

/// Redlock over N independent Redis masters (the algorithm of the Redis documentation).
///
/// * **Acquire**: `SET key <token> NX PX ttl` on every master at once; granted when a majority
///   said yes within the validity time — the lease's local deadline, `sent_at + ttl - drift`
///   (1 % + 5 ms), counted from before the first request was sent, so it ends before any
///   master's key can expire. Otherwise the token is deleted on every master (compare-and-delete).
/// * **Renew**: compare-and-`PEXPIRE` on every master; counts when a majority extended it.
/// * **Release**: compare-and-delete on every master; `true` when a majority deleted it.
/// * **No fencing tokens** ([`FencingGuarantee::None`]): there is no single counter the masters
///   agree on. Mutual exclusion rests on timing (bounded pauses, clock rates, no master
///   restarting without persistence within a TTL: see the crate's README for the double grant
///   that causes).
#[derive(Clone)]
pub struct RedlockLock {
    inner: Arc<Inner>,
}

struct Inner {
    config: RedlockConfig,
    /// Who this client is, stored after the token (`<token hex> <identity>`) for `inspect`.
    identity: HolderIdentity,
    nodes: Vec<ConnectionManager>,
    renew: Script,
    release: Script,
}

/// One master's answer.
enum Answer<T> {
    Ok(T),
    /// Nothing was sent (refused connection).
    NotSent,
    /// Sent, no (readable) reply: it may have applied.
    Unknown,
}

impl RedlockLock {
    /// Connects (lazily) and checks that a majority of the masters answers.
    ///
    /// # Errors
    /// [`Error::Config`] for bad settings; [`Error::Unavailable`] when fewer than a majority
    /// of the masters answer `PING`.
    pub async fn connect(config: RedlockConfig) -> Result<Self> {
        let lock = Self::connect_lazy(config)?;
        let answers = lock
            .all(|mut c| async move { redis::cmd("PING").query_async::<()>(&mut c).await })
            .await;
        let up = answers
            .iter()
            .filter(|a| matches!(a, Answer::Ok(())))
            .count();
        if up < lock.inner.config.quorum() {
            return Err(lock.unavailable(
                "connect",
                format!(
                    "{up} of {} masters answered (a majority is needed)",
                    answers.len()
                ),
            ));
        }
        Ok(lock)
    }

    /// [`RedlockLock::connect`] with a URL (see [`RedlockConfig::from_url`]).
    ///
    /// # Errors
    /// As [`RedlockConfig::from_url`] and [`RedlockLock::connect`].
    pub async fn connect_url(url: &str) -> Result<Self> {
        Self::connect(RedlockConfig::from_url(url)?).await
    }

    /// Builds the client without I/O (each master's connection is made on first use and
    /// remade after a disconnect). Must be called inside a tokio runtime.
    ///
    /// # Errors
    /// [`Error::Config`] for bad settings.
    pub fn connect_lazy(config: RedlockConfig) -> Result<Self> {
        config.validate()?;
        let identity =
            HolderIdentity::process(config.nodes.first().and_then(|n| n.label.as_deref()))?;
        let nodes = config
            .nodes
            .iter()
            .map(|node| {
                let mut settings = RedisConnectionInfo::default().set_db(node.db);
                if let Some(user) = &node.username {
                    settings = settings.set_username(user);
                }
                if let Some(password) = &node.password {
                    settings = settings.set_password(password.expose());
                }
                let info = ConnectionAddr::Tcp(node.host.clone(), node.port)
                    .into_connection_info()
                    .map_err(|e| Error::Config(e.to_string()))?
                    .set_redis_settings(settings);
                let client = redis::Client::open(info).map_err(|e| Error::Config(e.to_string()))?;
                let manager_config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(node.connect_timeout))
                    .set_response_timeout(Some(node.timeout))
                    .set_number_of_retries(node.reconnect_retries)
                    .set_min_delay(Duration::from_millis(50))
                    .set_max_delay(Duration::from_secs(1));
                ConnectionManager::new_lazy_with_config(client, manager_config)
                    .map_err(|e| Error::Config(e.to_string()))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                identity,
                nodes,
                renew: Script::new(RENEW),
                release: Script::new(RELEASE),
            }),
        })
    }

    /// The settings this client was built with.
    pub fn config(&self) -> &RedlockConfig {
        &self.inner.config
    }

    /// The key a lock lives at on every master: `<namespace><name>`.
    pub fn redis_key(&self, key: &LockKey) -> String {
        redis_key(&self.inner, key)
    }

    /// Runs `request` on every master at once, each bounded by one request budget.
    async fn all<T, F, Fut>(&self, request: F) -> Vec<Answer<T>>
    where
        F: Fn(ConnectionManager) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        all(&self.inner, request).await
    }

    /// The value a lease is stored with on every master: `<token hex> <holder identity>`.
    fn value(&self, token: &OwnershipToken) -> String {
        format!("{} {}", token.expose_hex(), self.inner.identity.as_str())
    }

    fn unavailable(&self, op: &'static str, message: String) -> Error {
        Error::Unavailable {
            backend: BACKEND,
            op,
            message,
            source: None,
        }
    }
}

fn redis_key(inner: &Inner, key: &LockKey) -> String {
    let namespace = inner
        .config
        .nodes
        .first()
        .map_or("", |n| n.namespace.as_str());
    format!("{namespace}{}", key.as_str())
}

async fn all<T, F, Fut>(inner: &Inner, request: F) -> Vec<Answer<T>>
where
    F: Fn(ConnectionManager) -> Fut,
    Fut: std::future::Future<Output = redis::RedisResult<T>>,
{
    let calls = inner.nodes.iter().zip(&inner.config.nodes).map(|(c, cfg)| {
        let call = request(c.clone());
        let budget = cfg.request_budget();
        async move {
            match timeout(budget, call).await {
                Ok(Ok(v)) => Answer::Ok(v),
                Ok(Err(e)) if not_sent(&e) => Answer::NotSent,
                Ok(Err(_)) | Err(_) => Answer::Unknown,
            }
        }
    });
    futures::future::join_all(calls).await
}

fn not_sent(e: &RedisError) -> bool {
    e.is_connection_refusal()
        || matches!(
            e.kind(),
            redis::ErrorKind::Server(
                redis::ServerErrorKind::BusyLoading
                    | redis::ServerErrorKind::ReadOnly
                    | redis::ServerErrorKind::MasterDown
            )
        )
}

/// Deletes `value` at `key` on every master, in the background (it survives the caller), and
/// resolves once every master answered or its budget passed.
fn spawn_unlock(
    inner: Arc<Inner>,
    key: String,
    value: String,
) -> tokio::sync::oneshot::Receiver<()> {
    let (done, rx) = tokio::sync::oneshot::channel();
    lock_core::raw::cleanup::spawn(async move {
        let release = inner.release.clone();
        let _ = all(&inner, |mut c| {
            let (release, key, value) = (release.clone(), key.clone(), value.clone());
            async move {
                release
                    .key(&key)
                    .arg(&value)
                    .invoke_async::<i64>(&mut c)
                    .await
            }
        })
        .await;
        let _ = done.send(());
    });
    rx
}

/// Deletes a grant nobody will use when the acquiring future is dropped mid-request.
struct Undo {
    inner: Option<Arc<Inner>>,
    key: String,
    value: String,
}

impl Undo {
    fn disarm(mut self) {
        self.inner = None;
    }

    fn run(mut self) -> Option<tokio::sync::oneshot::Receiver<()>> {
        let inner = self.inner.take()?;
        Some(spawn_unlock(
            inner,
            std::mem::take(&mut self.key),
            std::mem::take(&mut self.value),
        ))
    }
}

impl Drop for Undo {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.take() {
            spawn_unlock(
                inner,
                std::mem::take(&mut self.key),
                std::mem::take(&mut self.value),
            );
        }
    }
}

fn ttl_millis(ttl: Duration) -> u64 {
    u64::try_from(ttl.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX)
}

#[async_trait]
impl Driver for RedlockLock {
    fn backend_name(&self) -> &'static str {
        BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        // Each master's key gets any PEXPIRE on renewal and expires on its own; no counter the
        // masters agree on: no fencing tokens at all.
        server_expired_lease(FencingGuarantee::None)
    }

    /// A refusal that is a split vote (clients racing for a free key each got some masters,
    /// none a majority, and each gave its share back) is tried again after a random pause, up
    /// to four rounds, as the Redlock algorithm prescribes; a key that a
    /// majority of masters hold for one owner answers "held" at once.
    ///
    /// # Cancellation safety
    /// Dropping the future mid-request deletes the attempt's token on every master in the
    /// background.
    async fn try_acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>> {
        // Jittered, so racing clients do not split again in lockstep.
        let mut pause = lock_core::raw::Backoff::new(SPLIT_VOTE_PAUSE, SPLIT_VOTE_PAUSE * 8);
        for round in 1..=SPLIT_VOTE_ROUNDS {
            if let Some(lease) = self.attempt(key, ttl).await? {
                return Ok(Some(lease));
            }
            if round == SPLIT_VOTE_ROUNDS || self.held_by_a_majority(key).await {
                break;
            }
            tokio::time::sleep(pause.next_delay()).await;
        }
        Ok(None)
    }

    async fn renew(&self, lease: &mut Lease, ttl: Duration) -> Result<()> {
        let name = self.redis_key(lease.key());
        let value = self.value(lease.token());
        let ms = ttl_millis(ttl);
        let sent_at = Instant::now();
        let script = self.inner.renew.clone();
        let answers = self
            .all(|mut c| {
                let (name, value, script) = (name.clone(), value.clone(), script.clone());
                async move {
                    script
                        .key(&name)
                        .arg(&value)
                        .arg(ms)
                        .invoke_async::<i64>(&mut c)
                        .await
                }
            })
            .await;
        let quorum = self.inner.config.quorum();
        let renewed = answers
            .iter()
            .filter(|a| matches!(a, Answer::Ok(1)))
            .count();
        let refused = answers
            .iter()
            .filter(|a| matches!(a, Answer::Ok(0)))
            .count();
        let unknown = answers.iter().any(|a| matches!(a, Answer::Unknown));
        let mut extended = lease.clone();
        extended.renewed(ttl, sent_at);
        if renewed >= quorum && extended.is_locally_valid() {
            *lease = extended;
            return Ok(());
        }
        // A majority can no longer confirm this token: lost.
        if refused > answers.len() - quorum {
            return Err(Error::not_held(lease.key()));
        }
        if unknown || renewed >= quorum {
            return Err(Error::Indeterminate {
                backend: BACKEND,
                op: "renew",
                key: lease.key().as_str().to_owned(),
                message: format!(
                    "{renewed} of {} masters confirmed the renewal",
                    answers.len()
                ),
            });
        }
        Err(self.unavailable(
            "renew",
            format!(
                "{renewed} of {} masters confirmed the renewal",
                answers.len()
            ),
        ))
    }

    async fn release(&self, lease: &Lease) -> Result<bool> {
        let name = self.redis_key(lease.key());
        let value = self.value(lease.token());
        let script = self.inner.release.clone();
        let answers = self
            .all(|mut c| {
                let (name, value, script) = (name.clone(), value.clone(), script.clone());
                async move {
                    script
                        .key(&name)
                        .arg(&value)
                        .invoke_async::<i64>(&mut c)
                        .await
                }
            })
            .await;
        let quorum = self.inner.config.quorum();
        let deleted = answers
            .iter()
            .filter(|a| matches!(a, Answer::Ok(1)))
            .count();
        let answered = answers
            .iter()
            .filter(|a| matches!(a, Answer::Ok(_)))
            .count();
        if deleted >= quorum || answered >= quorum {
            return Ok(deleted >= quorum);
        }
        Err(self.unavailable(
            "release",
            format!(
                "{answered} of {} masters answered the release",
                answers.len()
            ),
        ))
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        let name = self.redis_key(key);
        let answers = self
            .all(|mut c| {
                let name = name.clone();
                async move {
                    redis::pipe()
                        .cmd("GET")
                        .arg(&name)
                        .cmd("PTTL")
                        .arg(&name)
                        .query_async::<(Option<Vec<u8>>, i64)>(&mut c)
                        .await
                }
            })
            .await;
        let quorum = self.inner.config.quorum();
        let values: Vec<(Vec<u8>, i64)> = answers
            .iter()
            .filter_map(|a| match a {
                Answer::Ok((Some(v), pttl)) => Some((v.clone(), *pttl)),
                _ => None,
            })
            .collect();
        let answered = answers
            .iter()
            .filter(|a| matches!(a, Answer::Ok(_)))
            .count();
        if answered < quorum {
            return Err(self.unavailable(
                "inspect",
                format!("{answered} of {} masters answered", answers.len()),
            ));
        }
        // The holder is the value a majority has (the least time left of those).
        let holder = values.iter().find_map(|(value, _)| {
            let with: Vec<i64> = values
                .iter()
                .filter(|(v, _)| v == value)
                .map(|(_, pttl)| *pttl)
                .collect();
            (with.len() >= quorum).then(|| (value.clone(), with.into_iter().min()))
        });
        Ok(holder.map(|(value, pttl)| {
            // Ours: `<token hex> <identity>`; anything else is a foreign holder's value.
            let ours = std::str::from_utf8(&value).ok().and_then(|v| {
                let (hex, identity) = v.split_once(' ')?;
                let token = OwnershipToken::from_hex(hex).ok()?;
                Some((
                    token.digest(),
                    HolderIdentity::from_stored(identity.as_bytes()),
                ))
            });
            let (digest, identity) = match ours {
                Some((digest, identity)) => (digest, identity),
                None => (TokenDigest::of(&value), None),
            };
            HolderInfo {
                token_digest: Some(digest),
                fencing_token: None,
                ttl_remaining: pttl
                    .and_then(|p| u64::try_from(p).ok())
                    .map(Duration::from_millis),
                waiters: None,
                holder: identity,
            }
        }))
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        let name = self.redis_key(key);
        let answers = self
            .all(|mut c| {
                let name = name.clone();
                async move {
                    redis::cmd("DEL")
                        .arg(&name)
                        .query_async::<i64>(&mut c)
                        .await
                }
            })
            .await;
        let quorum = self.inner.config.quorum();
        let deleted = answers
            .iter()
            .filter(|a| matches!(a, Answer::Ok(1)))
            .count();
        let answered = answers
            .iter()
            .filter(|a| matches!(a, Answer::Ok(_)))
            .count();
        if answered < quorum {
            return Err(self.unavailable(
                "force_release",
                format!("{answered} of {} masters answered", answers.len()),
            ));
        }
        tracing::warn!(%key, deleted, "redlock force-released by an operator");
        Ok(deleted >= quorum)
    }
}

impl fmt::Debug for RedlockLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let nodes: Vec<String> = self
            .inner
            .config
            .nodes
            .iter()
            .map(|n| format!("{}:{}", n.host, n.port))
            .collect();
        f.debug_struct("RedlockLock")
            .field("masters", &nodes)
            .field("quorum", &self.inner.config.quorum())
            .finish_non_exhaustive()
    }
}

/// Rounds of [`RedlockLock`]'s `try_acquire` when the vote splits.
const SPLIT_VOTE_ROUNDS: u32 = 4;
/// The first pause after a split vote (jittered, doubling per round).
const SPLIT_VOTE_PAUSE: Duration = Duration::from_millis(5);

impl RedlockLock {
    /// Whether one owner's value is on a majority of masters (a refusal that is no split
    /// vote). A master that does not answer counts for nobody; any failure answers `true`, so
    /// a refusal is then reported as it is, not retried.
    async fn held_by_a_majority(&self, key: &LockKey) -> bool {
        let name = self.redis_key(key);
        let answers = self
            .all(|mut c| {
                let name = name.clone();
                async move {
                    redis::cmd("GET")
                        .arg(&name)
                        .query_async::<Option<String>>(&mut c)
                        .await
                }
            })
            .await;
        let mut counts: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
        for answer in &answers {
            if let Answer::Ok(Some(v)) = answer {
                *counts.entry(v.as_str()).or_default() += 1;
            }
        }
        let quorum = self.inner.config.quorum();
        counts.values().any(|&n| n >= quorum) || answers.iter().all(|a| !matches!(a, Answer::Ok(_)))
    }

    /// One Redlock round: `SET NX PX` on every master; granted with a majority within the
    /// validity time, else whatever was granted is given back.
    async fn attempt(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>> {
        let token = OwnershipToken::generate();
        let value = self.value(&token);
        let name = self.redis_key(key);
        let ms = ttl_millis(ttl);
        let undo = Undo {
            inner: Some(self.inner.clone()),
            key: name.clone(),
            value: value.clone(),
        };
        let sent_at = Instant::now();
        let answers = self
            .all(|mut c| {
                let (name, value) = (name.clone(), value.clone());
                async move {
                    redis::cmd("SET")
                        .arg(&name)
                        .arg(&value)
                        .arg("NX")
                        .arg("PX")
                        .arg(ms)
                        .query_async::<Option<String>>(&mut c)
                        .await
                }
            })
            .await;
        let granted = answers
            .iter()
            .filter(|a| matches!(a, Answer::Ok(Some(_))))
            .count();
        let held = answers
            .iter()
            .filter(|a| matches!(a, Answer::Ok(None)))
            .count();
        let quorum = self.inner.config.quorum();
        let lease = Lease::new(key.clone(), token, None, ttl, sent_at);
        // The validity time (ttl - elapsed - drift) is what is left of the local deadline.
        if granted >= quorum && lease.is_locally_valid() {
            undo.disarm();
            return Ok(Some(lease));
        }
        // Not ours: give back whatever was granted (on every master, also those without a
        // reply, whose SET may still apply); wait for it within one request budget.
        if let Some(done) = undo.run() {
            let budget = self
                .inner
                .config
                .nodes
                .iter()
                .map(RedisLockConfig::request_budget)
                .max()
                .unwrap_or_default();
            let _ = timeout(budget, done).await;
        }
        let n = answers.len();
        if granted >= quorum {
            return Err(self.unavailable(
                "try_acquire",
                format!("a majority granted, but after the validity time ({ttl:?}) had passed"),
            ));
        }
        if held > 0 && granted + held >= quorum {
            return Ok(None);
        }
        Err(self.unavailable(
            "try_acquire",
            format!(
                "{} of {n} masters answered (a majority of {quorum} is needed)",
                granted + held
            ),
        ))
    }
}
