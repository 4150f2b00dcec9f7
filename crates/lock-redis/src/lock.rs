//! [`RedisLock`]: the single-node Redis driver.

use std::{fmt, future::Future, sync::Arc, time::Duration};

use lock_core::raw::{
    AcquireWait, Backoff, Batcher, Capabilities, Driver, Error, FencingGuarantee, FencingToken,
    HolderIdentity, HolderInfo, Lease, LockKey, OwnershipToken, Result, TokenDigest, async_trait,
    handoff::Registered,
};
use redis::{
    ConnectionAddr, ErrorKind, IntoConnectionInfo, ProtocolVersion, RedisConnectionInfo,
    RedisError, ServerErrorKind,
    aio::{ConnectionManager, ConnectionManagerConfig},
};
use tokio::time::{Instant, sleep, sleep_until, timeout, timeout_at};

use crate::{
    RedisLockConfig, RedisTopology,
    conn::{Acked, Conn, SentinelConn, SentinelSettings},
    keys::{KeyNames, key_slot},
    scripts::Scripts,
    wakeups::{Registry, WAKE_CHANNEL_PREFIX, Watch},
};

const BACKEND: &str = "redis";

/// A distributed lock client on one Redis server, a Sentinel-managed master or a Redis Cluster
/// (Redlock is [`crate::RedlockLock`]).
///
/// One client holds one reconnecting, multiplexed RESP3 connection that serves every lock it
/// takes, its renewals and the release notifications its waiters subscribe to. Clone it
/// cheaply (an `Arc` inside) or share it as a [`lock_core::raw::DynLock`].
///
/// See the crate documentation for the algorithm, the key layout and what weakens fencing.
#[derive(Clone)]
pub struct RedisLock {
    inner: Arc<Inner>,
}

struct Inner {
    config: RedisLockConfig,
    conn: Conn,
    scripts: Scripts,
    wakeups: Arc<Registry>,
    /// Who this client is (host, pid, start, `label`), recorded next to each of its grants.
    identity: HolderIdentity,
    /// Renewals submitted together (the watchdogs of one process renew on a shared grid) go
    /// out together: one script call per [`RENEW_CHUNK`] locks.
    renewals: Batcher<RenewItem, Result<bool, Failure>>,
}

/// At most this many renewals are handed to one run of the batch function (its chunks are
/// sent concurrently on the multiplexed connection).
const RENEW_BATCH: usize = 16 * RENEW_CHUNK;
/// At most this many keys per renew script call, so that one call keeps the server busy for
/// well under a millisecond and other clients' commands interleave between chunks.
const RENEW_CHUNK: usize = 500;

/// How long past its deadline an `acquire` that gives up waits for the answer to its leaving
/// the queue: a round trip on a loaded machine, far less than a stalled request's budget.
const LEAVE_GRACE: Duration = Duration::from_millis(200);

/// How many times the cluster client retries a request (redirects, reconnects after a
/// failover), within the request budget.
const CLUSTER_RETRIES: u32 = 16;

/// One lock's part in a batched renewal.
struct RenewItem {
    lock: Vec<u8>,
    holder: Vec<u8>,
    prefix: String,
    ttl_ms: u64,
}

/// What one acquisition attempt found.
enum Attempt {
    Granted(Lease),
    /// Held by somebody else; the holder's remaining TTL when it has one.
    Held(Option<Duration>),
}

/// How a failed request ended, as far as the lock is concerned.
#[derive(Clone)]
enum Failure {
    /// Nothing reached the server (connection refused, server loading, …).
    NotSent(RedisError),
    /// The request may have been applied: sent, but no reply (timeout, dropped connection).
    Unknown(String),
    /// The server answered with an error (a script may have run partly: Lua does not roll back).
    Server(RedisError),
}

impl RedisLock {
    /// Connects to the server and checks that it answers.
    ///
    /// # Errors
    /// [`Error::Config`] for invalid settings or an unreadable CA file; [`Error::Backend`] when
    /// the server refuses the credentials (`WRONGPASS`, `NOAUTH`, `NOPERM`) or its TLS
    /// certificate is not trusted; [`Error::Unavailable`] when it cannot be reached (including
    /// a TLS handshake with a server that does not speak TLS).
    pub async fn connect(config: RedisLockConfig) -> Result<Self> {
        let lock = Self::connect_lazy(config)?;
        let mut conn = lock.inner.conn.clone();
        let budget = lock.inner.config.request_budget();
        match timeout(budget, redis::cmd("PING").query_async::<()>(&mut conn)).await {
            Ok(Ok(())) => Ok(lock),
            Ok(Err(e)) if e.kind() == ErrorKind::RESP3NotSupported => Err(Error::unsupported(
                BACKEND,
                "servers without RESP3 (Redis 6 or newer is required; 7.0 is supported)",
            )),
            // Rejected credentials or an untrusted server certificate: retrying cannot help.
            Ok(Err(e)) if is_refused_security(&e) => Err(Error::backend(BACKEND, "connect", e)),
            Ok(Err(e)) => Err(refused_database(&lock.inner.config, &e)
                .unwrap_or_else(|| Error::unavailable(BACKEND, "connect", e))),
            Err(_) => Err(Error::Unavailable {
                backend: BACKEND,
                op: "connect",
                message: format!("no answer within {budget:?}"),
                source: None,
            }),
        }
    }

    /// [`RedisLock::connect`] with a URL (see [`RedisLockConfig::from_url`]).
    ///
    /// # Errors
    /// As [`RedisLockConfig::from_url`] and [`RedisLock::connect`].
    pub async fn connect_url(url: &str) -> Result<Self> {
        Self::connect(RedisLockConfig::from_url(url)?).await
    }

    /// Builds a client without any I/O; it connects on first use (and reconnects by itself
    /// whenever the connection drops). Must be called inside a tokio runtime.
    ///
    /// # Errors
    /// [`Error::Config`] for invalid settings.
    pub fn connect_lazy(config: RedisLockConfig) -> Result<Self> {
        config.validate()?;
        let identity = HolderIdentity::process(config.label.as_deref())?;
        let mut redis_info = RedisConnectionInfo::default()
            .set_db(config.db)
            .set_protocol(ProtocolVersion::RESP3);
        if let Some(user) = &config.username {
            redis_info = redis_info.set_username(user);
        }
        if let Some(password) = &config.password {
            redis_info = redis_info.set_password(password);
        }
        let addr = if config.tls {
            // Verified TLS only: `insecure: false`, no plaintext fallback.
            ConnectionAddr::TcpTls {
                host: config.host.clone(),
                port: config.port,
                insecure: false,
                tls_params: None,
            }
        } else {
            ConnectionAddr::Tcp(config.host.clone(), config.port)
        };
        let info = addr
            .into_connection_info()
            .map_err(|e| Error::Config(e.to_string()))?
            .set_redis_settings(redis_info);
        let client = if config.tls {
            install_crypto_provider();
            let root_cert = match &config.ca_file {
                Some(path) => Some(std::fs::read(path).map_err(|e| {
                    Error::Config(format!("cannot read the CA file {}: {e}", path.display()))
                })?),
                None => None,
            };
            redis::Client::build_with_tls(
                info,
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert,
                },
            )
            .map_err(|e| Error::Config(format!("TLS settings: {e}")))?
        } else {
            redis::Client::open(info).map_err(|e| Error::Config(e.to_string()))?
        };
        let wakeups = Arc::new(Registry::default());
        // A script's reply may also wait for its `WAIT` (replica acknowledgement).
        let response_timeout = config
            .response_timeout
            .saturating_add(config.wait_allowance());
        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(config.connect_timeout))
            .set_response_timeout(Some(response_timeout))
            .set_number_of_retries(config.reconnect_retries)
            .set_min_delay(Duration::from_millis(50))
            .set_max_delay(Duration::from_secs(1))
            .set_push_sender(wakeups.clone())
            .set_automatic_resubscription();
        let conn = match &config.topology {
            RedisTopology::Single => Conn::Single(
                ConnectionManager::new_lazy_with_config(client, manager_config)
                    .map_err(|e| Error::Config(e.to_string()))?,
            ),
            RedisTopology::Sentinel {
                sentinels,
                master_name,
            } => Conn::Sentinel(Arc::new(SentinelConn::new(SentinelSettings {
                sentinels: sentinels.clone(),
                master_name: master_name.clone(),
                redis_info: client.get_connection_info().redis_settings().clone(),
                manager_config,
                connect_timeout: config.connect_timeout,
                response_timeout: config.response_timeout,
                wakeups: wakeups.clone(),
            }))),
            RedisTopology::Cluster { nodes } => {
                let mut builder = redis::cluster::ClusterClientBuilder::new(
                    nodes
                        .iter()
                        .map(|(h, p)| ConnectionAddr::Tcp(h.clone(), *p))
                        .collect::<Vec<_>>(),
                )
                .use_protocol(ProtocolVersion::RESP3)
                .connection_timeout(config.connect_timeout)
                .response_timeout(response_timeout)
                // Redirects (MOVED/ASK) and a failover's reconnects use these retries too; a re-sent
                // request is harmless (see the scripts: an attempt finds its own grant, the rest
                // compare tokens or fences). Our own deadline still bounds each request.
                .retries(CLUSTER_RETRIES)
                .push_sender(wakeups.clone());
                if let Some(user) = &config.username {
                    builder = builder.username(user);
                }
                if let Some(password) = &config.password {
                    builder = builder.password(password);
                }
                let cluster = builder
                    .build()
                    .map_err(|e| Error::Config(format!("cluster settings: {e}")))?;
                let cluster_config = redis::cluster::ClusterConfig::new()
                    .set_connection_timeout(config.connect_timeout)
                    .set_response_timeout(response_timeout);
                Conn::Cluster(cluster.get_pending_async_connection_with_config(cluster_config))
            }
        };
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                conn,
                scripts: Scripts::new(),
                wakeups,
                identity,
                renewals: Batcher::new(RENEW_BATCH),
            }),
        })
    }

    /// The settings this client was built with.
    pub fn config(&self) -> &RedisLockConfig {
        &self.inner.config
    }

    /// The Redis key a lock lives at: exactly `<namespace><name>`.
    pub fn redis_key(&self, key: &LockKey) -> String {
        format!("{}{}", self.inner.config.namespace, key.as_str())
    }

    fn names(&self, key: &LockKey) -> KeyNames {
        KeyNames::new(&self.inner.config.namespace, key)
    }

    /// One acquisition attempt. `waiter`: a waiting `acquire` (subscribed to its wake-ups),
    /// registered in the lock's waiter queue when the lock is held; the attempt also finds a
    /// grant a release made to it. `by`: the caller's deadline, which bounds the request (and
    /// the wait for a clean-up) besides the request budget.
    ///
    /// Never returns a lease whose local deadline passed before its reply came: that grant is
    /// undone and the attempt is `Unavailable` (temporary). A grant whose reply was not read
    /// (no reply, an unexpected one, a script error after the grant) is undone as well: the
    /// undo runs in the background from the moment the outcome is known (or the future is
    /// dropped), retried until answered.
    async fn attempt(
        &self,
        key: &LockKey,
        ttl: Duration,
        waiter: Option<&Waiting<'_>>,
        by: Option<Instant>,
    ) -> Result<Attempt> {
        let token = OwnershipToken::generate();
        let sent_at = Instant::now();
        let names = self.names(key);
        let prefix = owner_prefix(&token);
        let mut invocation = self.inner.scripts.acquire.key(&names.lock);
        invocation
            .key(names.fence())
            .key(names.undone(&prefix))
            .key(names.holder())
            .arg(&prefix)
            .arg(ttl_millis(ttl))
            .arg(self.inner.identity.as_str());
        if let Some(waiting) = waiter {
            let grant_prefix = owner_prefix(&waiting.grant);
            invocation
                .key(names.queue())
                .key(names.undone(&grant_prefix))
                .arg(waiting.member)
                .arg(ttl_millis(self.registration_lifetime()))
                .arg(grant_prefix)
                .arg(waiting.earlier);
        }
        // Should this future be dropped while the request is in flight, the guard undoes a
        // grant (and a registration) that nobody would ever renew or release.
        let inflight = Inflight {
            inner: Some(self.inner.clone()),
            undo: Undo {
                names,
                prefix,
                members: waiter
                    .map(|w| vec![w.member.to_owned()])
                    .unwrap_or_default(),
                marker: None,
            },
            ttl,
        };
        let (reply, acked) = if self.inner.config.replicas > 0 {
            let mut acked = self.acked();
            let reply = self
                .run(invocation.invoke_async::<redis::Value>(&mut acked), by)
                .await;
            (reply, Some(acked.confirmed()))
        } else {
            let reply = self
                .run(
                    invocation.invoke_async::<redis::Value>(&mut self.inner.conn.clone()),
                    by,
                )
                .await;
            (reply, None)
        };
        let bad_reply = |message: String| Error::Backend {
            backend: BACKEND,
            op: "try_acquire",
            message,
            source: None,
        };
        let lease = match reply {
            // The fence as the counter's decimal string (exact over the whole counter range).
            Ok(redis::Value::BulkString(fence)) => match parse_fence(&fence) {
                Some(fence) => {
                    let lease =
                        Lease::new(key.clone(), token, Some(FencingToken(fence)), ttl, sent_at);
                    (lease, inflight)
                }
                None => {
                    // Whatever was granted, take no grant home.
                    self.settle(inflight.undo(false), by).await;
                    return Err(bad_reply(format!(
                        "the fence counter of {key:?} is not a non-negative integer ({:?})",
                        String::from_utf8_lossy(&fence)
                    )));
                }
            },
            // A release had granted the lock to the waiter's grant token; the script restarted
            // its TTL, so this attempt's send time starts the lease.
            Ok(redis::Value::Array(granted)) if waiter.is_some() => {
                let fence = match &granted[..] {
                    [redis::Value::BulkString(fence)] => parse_fence(fence),
                    _ => None,
                };
                match (fence, waiter) {
                    (Some(fence), Some(waiting)) => {
                        let lease = Lease::new(
                            key.clone(),
                            waiting.grant,
                            Some(FencingToken(fence)),
                            ttl,
                            sent_at,
                        );
                        (lease, inflight.regrant(owner_prefix(&waiting.grant)))
                    }
                    // The waiter's `leave` releases its grant when `acquire` gives up.
                    _ => {
                        inflight.disarm();
                        return Err(bad_reply(
                            "the acquire script reported a grant without a fence".to_owned(),
                        ));
                    }
                }
            }
            // Held: the holder's pttl (negative when it has no TTL).
            Ok(redis::Value::Int(pttl)) => {
                inflight.disarm();
                return Ok(Attempt::Held(
                    u64::try_from(pttl).ok().map(Duration::from_millis),
                ));
            }
            Ok(_) => {
                self.settle(inflight.undo(false), by).await;
                return Err(bad_reply(
                    "unexpected reply type from the acquire script".to_owned(),
                ));
            }
            Err(Failure::Unknown(message)) => {
                // Sent, no reply: it may still apply, even after the clean-up ran on another
                // connection; the clean-up's marker makes it a no-op then.
                self.settle(inflight.undo(true), by).await;
                return Err(Error::Indeterminate {
                    backend: BACKEND,
                    op: "try_acquire",
                    key: key.as_str().to_owned(),
                    message,
                });
            }
            Err(Failure::NotSent(e)) => {
                inflight.disarm();
                return Err(refused_database(&self.inner.config, &e)
                    .unwrap_or_else(|| Error::unavailable(BACKEND, "try_acquire", e)));
            }
            Err(Failure::Server(e)) => {
                // A script is not rolled back when a command in it fails: an error after the
                // `SET` leaves a grant behind.
                self.settle(inflight.undo(false), by).await;
                return Err(refused_database(&self.inner.config, &e)
                    .unwrap_or_else(|| Error::backend(BACKEND, "try_acquire", e)));
            }
        };
        let (lease, inflight) = lease;
        if let Some(Err(message)) = acked {
            // Granted on the master, but not known to be on enough replicas: a failover may
            // lose it, so it does not count; undone like a grant without a reply.
            self.settle(inflight.undo(true), by).await;
            return Err(Error::Indeterminate {
                backend: BACKEND,
                op: "try_acquire",
                key: key.as_str().to_owned(),
                message,
            });
        }
        if lease.is_locally_valid() {
            inflight.disarm();
            return Ok(Attempt::Granted(lease));
        }
        // The reply came after the lease's local deadline (a stalled server or link): the
        // grant may already be someone else's by the server's clock soon; never hand it out.
        self.settle(inflight.undo(false), by).await;
        Err(Error::Unavailable {
            backend: BACKEND,
            op: "try_acquire",
            message: format!(
                "the grant's reply came {:?} after the request, past its lease's local deadline \
                 (TTL {ttl:?}); the grant was released",
                sent_at.elapsed()
            ),
            source: None,
        })
    }

    /// A connection that sends each script with its `WAIT` (replica acknowledgement).
    fn acked(&self) -> Acked {
        acked(&self.inner)
    }

    /// Waits for a spawned clean-up's answer within one request budget when the caller has no
    /// deadline (`try_acquire`: its error then comes after the undo). A waiting `acquire` (`by`
    /// given) goes on at once: its next attempt need not wait, and the clean-up goes on in the
    /// background regardless.
    async fn settle(&self, answered: tokio::sync::oneshot::Receiver<()>, by: Option<Instant>) {
        if by.is_none() {
            let _ = timeout_at(request_until(&self.inner, None), answered).await;
        }
    }

    /// How long a waiter's registration in a queue lives unless its next attempt renews it:
    /// longer than the longest fallback poll, so a live waiter never drops out, and short, so a
    /// crashed waiter is skipped soon.
    fn registration_lifetime(&self) -> Duration {
        registration_lifetime(&self.inner.config)
    }

    /// Runs one request under the request budget (and until `by`, when given) and classifies
    /// its failure.
    async fn run<T>(
        &self,
        request: impl Future<Output = redis::RedisResult<T>>,
        by: Option<Instant>,
    ) -> Result<T, Failure> {
        run_until(request, request_until(&self.inner, by)).await
    }

    async fn release_by_prefix(&self, names: &KeyNames, prefix: &str) -> Result<bool, Failure> {
        release_by_prefix(&self.inner, names, prefix, &[], None, None).await
    }

    /// The operator override, of any holder or only of the grant with fence `holder`.
    async fn force_release_if(&self, key: &LockKey, holder: Option<FencingToken>) -> Result<bool> {
        // The cluster client re-sends a request whose connection dropped: an unconditional
        // delete run twice could remove the grant the first run handed to a waiter. Name the
        // grant being removed, so that a re-sent request matches only it.
        let holder = match holder {
            None if self.inner.conn.is_cluster() => {
                self.inspect(key).await?.and_then(|h| h.fencing_token)
            }
            holder => holder,
        };
        let names = self.names(key);
        let fence = holder.map(|f| f.get().to_string()).unwrap_or_default();
        let deleted = self
            .run(
                self.inner
                    .scripts
                    .force_release
                    .key(&names.lock)
                    .key(names.queue())
                    .key(names.fence())
                    .key(names.holder())
                    .arg(fence)
                    .arg(WAKE_CHANNEL_PREFIX)
                    .invoke_async::<i64>(&mut self.inner.conn.clone()),
                None,
            )
            .await
            .map_err(|f| self.map_failure("force_release", key, f))?;
        tracing::warn!(%key, deleted = deleted == 1, fencing = ?holder, "lock force-released by an operator");
        Ok(deleted == 1)
    }

    fn map_failure(&self, op: &'static str, key: &LockKey, failure: Failure) -> Error {
        if let Failure::NotSent(e) | Failure::Server(e) = &failure
            && let Some(config) = refused_database(&self.inner.config, e)
        {
            return config;
        }
        match failure {
            Failure::NotSent(e) => Error::unavailable(BACKEND, op, e),
            Failure::Unknown(message) => Error::Indeterminate {
                backend: BACKEND,
                op,
                key: key.as_str().to_owned(),
                message,
            },
            Failure::Server(e) => Error::backend(BACKEND, op, e),
        }
    }
}

/// Renews a batch: one script call per [`RENEW_CHUNK`] locks, all in flight together on the
/// multiplexed connection. Every item of a failed call gets that call's failure; the other
/// chunks are unaffected.
async fn renew_batch(inner: Arc<Inner>, items: Vec<RenewItem>) -> Vec<Result<bool, Failure>> {
    if !inner.conn.is_cluster() {
        let chunks = items
            .chunks(RENEW_CHUNK)
            .map(|chunk| renew_chunk(&inner, chunk));
        return futures::future::join_all(chunks)
            .await
            .into_iter()
            .flatten()
            .collect();
    }
    // On a Cluster one script call may only touch one slot: group by slot, answer in order.
    let mut by_slot: std::collections::BTreeMap<u16, Vec<usize>> = Default::default();
    for (i, item) in items.iter().enumerate() {
        by_slot.entry(key_slot(&item.lock)).or_default().push(i);
    }
    let mut groups: Vec<(Vec<usize>, Vec<RenewItem>)> = Vec::new();
    let mut items: Vec<Option<RenewItem>> = items.into_iter().map(Some).collect();
    for indices in by_slot.into_values() {
        for part in indices.chunks(RENEW_CHUNK) {
            let chunk = part.iter().filter_map(|i| items[*i].take()).collect();
            groups.push((part.to_vec(), chunk));
        }
    }
    let answers =
        futures::future::join_all(groups.iter().map(|(_, chunk)| renew_chunk(&inner, chunk))).await;
    let mut out: Vec<Result<bool, Failure>> = (0..items.len())
        .map(|_| Err(Failure::Unknown("the renewal was not sent".to_owned())))
        .collect();
    for ((indices, _), answer) in groups.iter().zip(answers) {
        for (i, a) in indices.iter().zip(answer) {
            out[*i] = a;
        }
    }
    out
}

/// A connection of `inner` that sends each script with its `WAIT`.
fn acked(inner: &Inner) -> Acked {
    Acked {
        conn: inner.conn.clone(),
        replicas: inner.config.replicas,
        timeout: inner.config.replica_timeout,
        acked: None,
    }
}

async fn renew_chunk(inner: &Inner, chunk: &[RenewItem]) -> Vec<Result<bool, Failure>> {
    let mut invocation = inner.scripts.renew.prepare_invoke();
    for item in chunk {
        invocation.key(&item.lock);
    }
    for item in chunk {
        invocation.key(&item.holder);
    }
    for item in chunk {
        invocation.arg(&item.prefix).arg(item.ttl_ms);
    }
    let budget = inner.config.request_budget();
    let mut conn = acked(inner);
    let reply = if inner.config.replicas > 0 {
        timeout(budget, invocation.invoke_async::<Vec<i64>>(&mut conn)).await
    } else {
        timeout(
            budget,
            invocation.invoke_async::<Vec<i64>>(&mut inner.conn.clone()),
        )
        .await
    };
    let failure = match reply {
        Ok(Ok(replies)) if replies.len() == chunk.len() => {
            let confirmed = if inner.config.replicas > 0 {
                conn.confirmed()
            } else {
                Ok(())
            };
            // A renewal the replicas did not all acknowledge may be lost on a failover: its
            // outcome is unknown (a lock that is no longer ours stays `NotHeld`).
            return replies
                .into_iter()
                .map(|n| match (&confirmed, n == 1) {
                    (Err(message), true) => Err(Failure::Unknown(message.clone())),
                    (_, held) => Ok(held),
                })
                .collect();
        }
        // Cannot happen with our script; whatever it did, the renewals are not confirmed.
        Ok(Ok(replies)) => Failure::Unknown(format!(
            "the renew script answered {} values for {} locks",
            replies.len(),
            chunk.len()
        )),
        Ok(Err(e)) => classify(e),
        Err(_) => Failure::Unknown(format!("no reply within {budget:?}")),
    };
    vec![Err(failure); chunk.len()]
}

/// Compare-and-delete by owner prefix, handing the lock to the next waiter when one marked it;
/// `leaving`: waiter queue members removed first (a waiter that gives up); `marker`: leave the
/// undo marker of `prefix` for this long (the clean-up of a request that may still arrive);
/// `until`: the latest moment to wait for the reply (the request budget bounds it too).
async fn release_by_prefix(
    inner: &Inner,
    names: &KeyNames,
    prefix: &str,
    leaving: &[String],
    marker: Option<Duration>,
    until: Option<Instant>,
) -> Result<bool, Failure> {
    let mut invocation = inner.scripts.release.key(&names.lock);
    invocation
        .key(names.queue())
        .key(names.fence())
        .key(names.holder());
    if marker.is_some() {
        invocation.key(names.undone(prefix));
    }
    invocation
        .arg(prefix)
        .arg(WAKE_CHANNEL_PREFIX)
        .arg(marker.map_or(0, ttl_millis))
        .arg(leaving);
    let mut conn = inner.conn.clone();
    run_until(
        invocation.invoke_async::<i64>(&mut conn),
        request_until(inner, until),
    )
    .await
    .map(|n| n == 1)
}

/// The end of one request's budget, or `by` when that comes first.
fn request_until(inner: &Inner, by: Option<Instant>) -> Instant {
    let budget = after(inner.config.request_budget());
    by.map_or(budget, |by| by.min(budget))
}

/// `now + d`, saturating far in the future instead of overflowing.
fn after(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d)
        .unwrap_or_else(|| now + Duration::from_secs(86_400 * 365))
}

/// Runs one request until `until` and classifies its failure (no reply by then: unknown).
async fn run_until<T>(
    request: impl Future<Output = redis::RedisResult<T>>,
    until: Instant,
) -> Result<T, Failure> {
    let started = Instant::now();
    match timeout_at(until, request).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(classify(e)),
        Err(_) => Err(Failure::Unknown(format!(
            "no reply within {:?}",
            until.saturating_duration_since(started)
        ))),
    }
}

/// How long a waiter's registration lives unless its next attempt renews it (saturating).
fn registration_lifetime(config: &RedisLockConfig) -> Duration {
    config
        .max_poll_interval
        .saturating_mul(2)
        .saturating_add(Duration::from_secs(1))
}

/// What undoes one request whose grant (or registration) nobody will use: a compare-and-delete
/// of `prefix` that hands the lock on, the removal of `members` from the waiter queue and, when
/// the request it undoes may still reach the server, the undo marker that makes it a no-op.
#[derive(Clone, Default)]
struct Undo {
    names: KeyNames,
    prefix: String,
    members: Vec<String>,
    /// The marker's lifetime; `None` when the undone request has certainly finished (its reply
    /// came), so nothing of it can arrive later.
    marker: Option<Duration>,
}

/// Runs `undo` in the background until it is answered or `until` passes; the receiver hears
/// when it was answered. One answer is final, on whichever connection it came: the request it
/// undoes either ran before it (and was undone) or finds the marker. Independent of the caller,
/// so it survives the caller's future being dropped (and [`lock_core::raw::cleanup::finish`] waits
/// for it).
fn spawn_undo(inner: Arc<Inner>, undo: Undo, until: Instant) -> tokio::sync::oneshot::Receiver<()> {
    let (answered, rx) = tokio::sync::oneshot::channel();
    lock_core::raw::cleanup::spawn(async move {
        let mut backoff = Backoff::new(Duration::from_millis(10), Duration::from_secs(1));
        loop {
            let outcome = release_by_prefix(
                &inner,
                &undo.names,
                &undo.prefix,
                &undo.members,
                undo.marker,
                Some(until),
            )
            .await;
            match outcome {
                Ok(deleted) => {
                    if deleted {
                        tracing::info!(
                            lock = %String::from_utf8_lossy(&undo.names.lock),
                            "removed a grant nobody holds (its reply was lost, came too late or a waiter gave up)"
                        );
                    }
                    let _ = answered.send(());
                    return;
                }
                // An error answer: retrying cannot help; the grant expires by its TTL.
                Err(Failure::Server(e)) => {
                    tracing::warn!(
                        lock = %String::from_utf8_lossy(&undo.names.lock),
                        error = %e,
                        "a clean-up was refused; the grant expires by its TTL"
                    );
                    let _ = answered.send(());
                    return;
                }
                Err(Failure::NotSent(_) | Failure::Unknown(_)) => {}
            }
            let next = Instant::now() + backoff.next_delay();
            if next >= until {
                tracing::debug!(
                    lock = %String::from_utf8_lossy(&undo.names.lock),
                    "a clean-up got no answer in time; the grant expires by its TTL"
                );
                return;
            }
            sleep_until(next).await;
        }
    });
    rx
}

/// What a waiting `acquire`'s attempt sends besides the plain attempt.
struct Waiting<'a> {
    /// The member this attempt registers.
    member: &'a str,
    /// The token a release's grant gives this waiter.
    grant: OwnershipToken,
    /// This waiter's earlier members that may still be queued (removed by the attempt).
    earlier: &'a [String],
}

/// At most this many earlier members ride along with an attempt. Members of attempts without
/// a reply are also removed by those attempts' own clean-ups (which keep trying in the
/// background), so the list is only a fast path: bounded, an attempt's arguments (and Lua's
/// `unpack` of them, which fails at about 8,000) stay small however long attempts keep failing.
const MAX_EARLIER: usize = 16;

/// Adds the member of a finished attempt to `earlier`, dropping the oldest beyond
/// [`MAX_EARLIER`] (it expires with its short registration lifetime, or its clean-up removes it).
fn remember(earlier: &mut Vec<String>, previous: String) {
    if previous.is_empty() {
        return;
    }
    if earlier.len() >= MAX_EARLIER {
        earlier.remove(0);
    }
    earlier.push(previous);
}

/// A waiting `acquire`'s subscription and its entries in a lock's waiter queue. A waiter that
/// gives up leaves the queue ([`Registration::leave`]; dropped while still armed, in the
/// background) and passes on a grant a release made to it meanwhile (which would otherwise
/// block the lock until its TTL).
struct Registration {
    inner: Arc<Inner>,
    names: KeyNames,
    /// The TTL this `acquire` asks for (a grant to it lasts that long).
    ttl: Duration,
    /// The waiter's wake-up subscription and grant messages.
    watch: Watch,
    /// The token a release's grant gives this waiter: one per `acquire`, random. (Each attempt
    /// still grants itself under a fresh token, which its unknown-outcome cleanup goes by.)
    grant: OwnershipToken,
    /// The number of the latest attempt.
    seq: u64,
    /// The member of the latest attempt (empty before the first), which may be queued even
    /// while its attempt is in flight: a dropped `acquire` leaves with it too.
    member: String,
    /// Earlier members that may still be queued: the last confirmed one and those of the
    /// latest attempts without a reply (at most [`MAX_EARLIER`]). An attempt removes them in
    /// the same step as it registers its own.
    earlier: Vec<String>,
    /// The attempt whose reply confirmed the current registration: a grant message naming it
    /// is this waiter's lock (see [`lock_core::raw::handoff`]).
    registered: Option<Registered>,
    /// Cleared when a grant removed the entries already, or the leaving was handed to the
    /// background.
    armed: bool,
    /// An attempt is in flight (sent, no answer yet).
    in_flight: bool,
    /// An attempt got no answer: it may still reach the server after the leaving.
    unsure: bool,
}

impl Registration {
    /// What the next attempt sends: a new member, the last of `members`.
    fn next_attempt(&mut self, ttl: Duration) -> Waiting<'_> {
        self.seq += 1;
        let member = self.watch.member(
            self.seq,
            ttl_millis(ttl),
            &self.grant.expose_hex(),
            &self.inner.identity,
        );
        let previous = std::mem::replace(&mut self.member, member);
        remember(&mut self.earlier, previous);
        self.in_flight = true;
        Waiting {
            member: &self.member,
            grant: self.grant,
            earlier: &self.earlier,
        }
    }

    /// The latest attempt ended; `unanswered`: without an answer (it may still arrive).
    fn ended(&mut self, unanswered: bool) {
        self.in_flight = false;
        self.unsure |= unanswered;
    }

    /// The latest attempt's registration was confirmed: the earlier members are gone.
    fn confirmed(&mut self, sent_at: Instant) {
        self.earlier.clear();
        self.registered = Some(Registered {
            seq: self.seq,
            sent_at,
        });
    }

    /// A lease from a grant message, if one came for the current registration, left most of
    /// its TTL and is still locally valid; otherwise the next attempt finds the grant and
    /// restarts its TTL (or `leave` passes it on).
    fn granted(&mut self, key: &LockKey, ttl: Duration) -> Option<Lease> {
        let grant = self.watch.take_grant()?;
        // With replica acknowledgement the releaser's grant was not WAITed for: the waiter's
        // own attempt confirms it (restarting its TTL) with its WAIT.
        if self.inner.config.replicas > 0 {
            return None;
        }
        let lease = self.registered?.lease(grant, key, self.grant, ttl)?;
        if !lease.is_locally_valid() {
            return None;
        }
        self.armed = false;
        Some(lease)
    }

    /// Hands the leaving to the background: removes every member this waiter may have
    /// queued, releases (passing on) a grant that crossed the leaving and, when an attempt of
    /// this `acquire` may still arrive (one got no answer, or is in flight), leaves the marker
    /// that makes it a no-op (so a plain timeout leaves no key behind). Retried until answered,
    /// for as long as a registration of this waiter could still be granted and its grant last.
    fn spawn_leaving(&mut self) -> Option<tokio::sync::oneshot::Receiver<()>> {
        if !std::mem::replace(&mut self.armed, false) {
            return None;
        }
        let mut members = std::mem::take(&mut self.earlier);
        if !self.member.is_empty() {
            members.push(self.member.clone());
        }
        let lifetime = registration_lifetime(&self.inner.config);
        let undo = Undo {
            names: self.names.clone(),
            prefix: owner_prefix(&self.grant),
            members,
            marker: (self.unsure || self.in_flight).then(|| self.ttl.max(lifetime)),
        };
        let until = after(lifetime.saturating_add(self.ttl));
        Some(spawn_undo(self.inner.clone(), undo, until))
    }

    /// Leaves the queue before `acquire` returns without the lock, waiting for the answer
    /// until `until` (then it goes on in the background). Awaited, so that a process that
    /// exits right after a timeout (the CLI's `run --wait`) leaves no registration that a
    /// release would grant the lock to.
    async fn leave(&mut self, until: Instant) {
        if let Some(answered) = self.spawn_leaving() {
            let _ = timeout_at(until, answered).await;
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.spawn_leaving();
    }
}

/// Undoes the grant of an attempt whose reply will not be read: dropped mid-request, or told
/// to by the attempt.
struct Inflight {
    inner: Option<Arc<Inner>>,
    undo: Undo,
    /// The TTL asked for. The undo is retried for that long from when it starts: a grant made
    /// by then (the server saw the request by the time it answered, or the request was
    /// delayed) lasts at most that long unless the undo's marker voided the request first.
    ttl: Duration,
}

impl Inflight {
    /// The reply came and nothing needs undoing.
    fn disarm(mut self) {
        self.inner = None;
    }

    /// The lease found is the waiter's grant (`prefix`), not this attempt's own.
    fn regrant(mut self, prefix: String) -> Self {
        self.undo.prefix = prefix;
        self.undo.members.clear();
        self
    }

    /// Starts the undo in the background now. `late`: the request may still arrive (no
    /// reply), so the undo leaves its marker.
    fn undo(mut self, late: bool) -> tokio::sync::oneshot::Receiver<()> {
        self.spawn(late)
            .unwrap_or_else(|| tokio::sync::oneshot::channel().1)
    }

    fn spawn(&mut self, late: bool) -> Option<tokio::sync::oneshot::Receiver<()>> {
        let inner = self.inner.take()?;
        let mut undo = std::mem::take(&mut self.undo);
        undo.marker = late.then_some(self.ttl);
        Some(spawn_undo(inner, undo, after(self.ttl)))
    }
}

impl Drop for Inflight {
    fn drop(&mut self) {
        self.spawn(true);
    }
}

/// The value we store is `<token hex>:<fence>`; every compare matches the `<token hex>:` prefix
/// (128 random bits), which is also all an unknown-outcome cleanup knows.
fn owner_prefix(token: &OwnershipToken) -> String {
    let mut s = token.expose_hex();
    s.push(':');
    s
}

/// A connect failure that retrying cannot fix: the server refused the credentials or the
/// permissions, or TLS did not trust the server's certificate.
fn is_refused_security(e: &RedisError) -> bool {
    if e.kind() == ErrorKind::AuthenticationFailed
        || matches!(e.code(), Some("WRONGPASS" | "NOAUTH" | "NOPERM"))
    {
        return true;
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        let tls = err.downcast_ref::<rustls::Error>().or_else(|| {
            err.downcast_ref::<std::io::Error>()
                .and_then(|io| io.get_ref())
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        });
        if let Some(rustls::Error::InvalidCertificate(_)) = tls {
            return true;
        }
        source = err.source();
    }
    e.to_string().contains("invalid peer certificate")
}

/// The server refused the `SELECT` of the configured database (a number beyond its
/// `databases`): a permanent misconfiguration, so [`Error::Config`], never `Unavailable`.
fn refused_database(config: &RedisLockConfig, e: &RedisError) -> Option<Error> {
    (e.to_string().contains("refused to switch database")).then(|| {
        Error::Config(format!(
            "the redis server refused database {} (SELECT): {e}",
            config.db
        ))
    })
}

/// rustls needs a process-wide crypto provider; install ring's unless the application already
/// chose one (losing a race to another installer is fine).
fn install_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

fn ttl_millis(ttl: Duration) -> u64 {
    u64::try_from(ttl.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX)
}

fn classify(e: RedisError) -> Failure {
    if e.is_connection_refusal() || crate::conn::is_read_only(&e) {
        return Failure::NotSent(e);
    }
    match e.kind() {
        ErrorKind::Server(
            ServerErrorKind::BusyLoading
            | ServerErrorKind::TryAgain
            | ServerErrorKind::ClusterDown
            | ServerErrorKind::MasterDown
            | ServerErrorKind::ReadOnly
            // A redirect the cluster client ran out of retries to follow: that node ran nothing.
            | ServerErrorKind::Moved
            | ServerErrorKind::Ask,
        ) => Failure::NotSent(e),
        ErrorKind::Server(_) if e.code() == Some("BUSY") => Failure::NotSent(e),
        // The cluster client had no connection to send it on.
        ErrorKind::ClusterConnectionNotFound => Failure::NotSent(e),
        ErrorKind::Io => Failure::Unknown(e.to_string()),
        _ if e.is_timeout() || e.is_connection_dropped() => Failure::Unknown(e.to_string()),
        _ => Failure::Server(e),
    }
}

/// A fence as the scripts send it: the counter's decimal digits (never a Lua number, which is
/// exact only up to 2^53).
fn parse_fence(digits: &[u8]) -> Option<u64> {
    std::str::from_utf8(digits).ok()?.parse().ok()
}

/// Parses a stored value `<32 hex>:<fence>` written by this driver (with the suffix `:w` once
/// a waiter marked it).
fn parse_owner(value: &[u8]) -> Option<(OwnershipToken, FencingToken)> {
    let value = std::str::from_utf8(value).ok()?;
    let value = value.strip_suffix(":w").unwrap_or(value);
    let (hex, fence) = value.split_once(':')?;
    let token = OwnershipToken::from_hex(hex).ok()?;
    if hex.bytes().any(|b| b.is_ascii_uppercase()) {
        return None;
    }
    Some((token, FencingToken(fence.parse().ok()?)))
}

/// The identity in a holder key `<token hex>:<fence> <identity>`, when that grant is the lock's
/// current value `value` (less its `:w` mark): never a previous holder's, nor one next to a
/// grant by a client that writes no holder key.
fn holder_of(value: &[u8], holder: &[u8]) -> Option<HolderIdentity> {
    let grant = value.strip_suffix(b":w").unwrap_or(value);
    let identity = holder.strip_prefix(grant)?.strip_prefix(b" ")?;
    // Only our format: a foreign value is never matched (not even by a prefix of it).
    parse_owner(grant)?;
    HolderIdentity::from_stored(identity)
}

#[async_trait]
impl Driver for RedisLock {
    fn backend_name(&self) -> &'static str {
        BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            lease_ttl: true,
            renew: true,
            fencing: FencingGuarantee::SingleNode,
            wait_notify: true,
            lost_notify: true,
            force_release: true,
            // A lease must outlast a round trip and the drift margin, or every grant arrives
            // past its local deadline and is given back (the boundary property's finding).
            min_ttl: Duration::from_millis(100),
            max_ttl: Duration::from_secs(365 * 24 * 3600),
            ..Default::default()
        }
    }

    /// # Cancellation safety
    /// Dropping the future mid-request removes a possible grant in the background.
    async fn try_acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>> {
        match self.attempt(key, ttl, None, None).await? {
            Attempt::Granted(lease) => Ok(Some(lease)),
            Attempt::Held(_) => Ok(None),
        }
    }

    /// Tries at once; when the key is held, subscribes to the client's wake channel, tries
    /// again (registering in the lock's waiter queue; a release may have happened in between)
    /// and then sleeps until a release grants it the lock (returned from the grant message
    /// alone), the holder's TTL runs out, the jittered fallback poll fires or the deadline
    /// passes. Each wake-up or poll is an attempt that renews the registration and finds a
    /// grant whose message was missed.
    ///
    /// A waiter that gives up passes on a grant that crossed its leaving. A waiter whose
    /// process died may be granted the lock before its registration lapses, and then holds it
    /// until its TTL runs out.
    ///
    /// Every request gets at most what is left of `deadline` (leaving the queue: 200 ms past
    /// it); clean-ups that need longer go on in the background.
    ///
    /// # Cancellation safety
    /// Dropping the future leaves the queue and undoes an attempt in flight, in the background
    /// (`lock_core::raw::cleanup::finish` waits for both).
    async fn acquire(&self, key: &LockKey, ttl: Duration, deadline: Instant) -> Result<Lease> {
        let backoff = Backoff::new(
            Duration::from_millis(25),
            self.inner.config.max_poll_interval,
        );
        let mut wait = AcquireWait::new(key, deadline, backoff)?;
        let mut subscribed_once = false;
        // The wake-up subscription and queue entry: removes this waiter from the queue when
        // the call ends without the lock (timeout, error: before returning; a dropped future:
        // in the background); a grant removes it in the same script.
        let mut registration: Option<Registration> = None;
        let result = async {
            loop {
                let sent_at = Instant::now();
                let waiting = registration.as_mut().map(|r| r.next_attempt(ttl));
                let outcome = self.attempt(key, ttl, waiting.as_ref(), Some(deadline)).await;
                if let Some(r) = registration.as_mut() {
                    r.ended(matches!(outcome, Err(Error::Indeterminate { .. })));
                }
                let holder_ttl = match (outcome, &mut registration) {
                    (Ok(Attempt::Granted(lease)), r) => {
                        if let Some(r) = r {
                            r.armed = false;
                        }
                        return Ok(lease);
                    }
                    (Ok(Attempt::Held(holder_ttl)), r) => {
                        if let Some(r) = r {
                            r.confirmed(sent_at);
                            // Registered: a release grants to or wakes this waiter, so the
                            // fallback poll (which also moves it back in the queue) need
                            // not be quick.
                            let max = self.inner.config.max_poll_interval;
                            wait.set_backoff(Backoff::new(max, max));
                        }
                        holder_ttl
                    }
                    (Err(e), r) => {
                        if let Some(r) = r {
                            r.registered = None;
                        }
                        // No answer by the deadline (a stalled server, or the attempt cut
                        // short by the deadline; its clean-up runs on): the wait timed out. An
                        // unreachable server stays `Unavailable`.
                        let unanswered = matches!(e, Error::Indeterminate { .. });
                        if unanswered && Instant::now() >= deadline {
                            return Err(wait.timeout());
                        }
                        if let Err(e) = wait.retry_after(e).await {
                            return Err(if unanswered { wait.timeout() } else { e });
                        }
                        continue;
                    }
                };
                if !subscribed_once {
                    subscribed_once = true;
                    match timeout_at(deadline, self.inner.wakeups.watch(&self.inner.conn)).await {
                        Ok(Ok(w)) => {
                            registration = Some(Registration {
                                inner: self.inner.clone(),
                                names: self.names(key),
                                ttl,
                                watch: w,
                                grant: OwnershipToken::generate(),
                                seq: 0,
                                member: String::new(),
                                earlier: Vec::new(),
                                registered: None,
                                armed: true,
                                in_flight: false,
                                unsure: false,
                            });
                            continue;
                        }
                        Ok(Err(e)) => {
                            tracing::debug!(%key, error = %e, "cannot subscribe to wake-ups; polling");
                        }
                        Err(_) => return Err(wait.timeout()),
                    }
                }
                let expiry = async {
                    match holder_ttl {
                        Some(left) => sleep(left + Duration::from_millis(2)).await,
                        None => std::future::pending().await,
                    }
                };
                let woken = async {
                    match &registration {
                        Some(r) => tokio::select! {
                            () = r.watch.woken() => {}
                            () = expiry => {}
                        },
                        None => expiry.await,
                    }
                };
                let waited = wait.wait(woken).await;
                // A grant that came with the deadline is taken rather than handed on.
                if let Some(lease) = registration.as_mut().and_then(|r| r.granted(key, ttl)) {
                    return Ok(lease);
                }
                waited?;
            }
        }
        .await;
        if result.is_err()
            && let Some(r) = registration.as_mut()
        {
            // The deadline bounds the wait for the answer; a small grace lets a healthy
            // server's answer arrive even when the deadline has just passed (else it goes on
            // in the background).
            r.leave(request_until(&self.inner, Some(deadline)).max(Instant::now()) + LEAVE_GRACE)
                .await;
        }
        result
    }

    /// Renewals are batched: while one batch is in flight, the renewals that arrive are queued
    /// and go out together in the next (a lone renewal is sent at once).
    async fn renew(&self, lease: &mut Lease, ttl: Duration) -> Result<()> {
        let names = self.names(lease.key());
        let item = RenewItem {
            holder: names.holder(),
            lock: names.lock,
            prefix: owner_prefix(lease.token()),
            ttl_ms: ttl_millis(ttl),
        };
        // Taken before queueing: time spent waiting for an earlier batch only makes the new
        // local deadline earlier (conservative).
        let sent_at = Instant::now();
        let inner = self.inner.clone();
        let answer = self
            .inner
            .renewals
            .submit(item, move |items| renew_batch(inner.clone(), items))
            .await;
        match answer {
            Some(Ok(true)) => {
                lease.renewed(ttl, sent_at);
                Ok(())
            }
            Some(Ok(false)) => Err(Error::not_held(lease.key())),
            Some(Err(failure)) => Err(self.map_failure("renew", lease.key(), failure)),
            // The batch task died (runtime shutdown): the request may have been sent.
            None => Err(Error::Indeterminate {
                backend: BACKEND,
                op: "renew",
                key: lease.key().as_str().to_owned(),
                message: "the renewal batch ended without an answer".to_owned(),
            }),
        }
    }

    async fn release(&self, lease: &Lease) -> Result<bool> {
        let names = self.names(lease.key());
        self.release_by_prefix(&names, &owner_prefix(lease.token()))
            .await
            .map_err(|f| self.map_failure("release", lease.key(), f))
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        let names = self.names(key);
        let reply = self
            .run(
                self.inner
                    .scripts
                    .inspect
                    .key(&names.lock)
                    .key(names.fence())
                    .key(names.queue())
                    .key(names.holder())
                    .invoke_async::<Option<(Vec<u8>, i64, Vec<u8>, i64, Vec<u8>)>>(
                        &mut self.inner.conn.clone(),
                    ),
                None,
            )
            .await
            .map_err(|f| match f {
                // Not `Indeterminate`: an inspection changes nothing.
                Failure::Unknown(message) => Error::Unavailable {
                    backend: BACKEND,
                    op: "inspect",
                    message,
                    source: None,
                },
                other => self.map_failure("inspect", key, other),
            })?;
        Ok(reply.map(|(value, pttl, _counter, waiters, holder)| {
            let (digest, fencing) = match parse_owner(&value) {
                Some((token, fence)) => (token.digest(), Some(fence)),
                None => (TokenDigest::of(&value), None),
            };
            HolderInfo {
                token_digest: Some(digest),
                fencing_token: fencing,
                ttl_remaining: u64::try_from(pttl).ok().map(Duration::from_millis),
                waiters: usize::try_from(waiters).ok(),
                holder: holder_of(&value, &holder),
            }
        }))
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        self.force_release_if(key, None).await
    }

    async fn force_release_grant(&self, key: &LockKey, holder: FencingToken) -> Result<bool> {
        self.force_release_if(key, Some(holder)).await
    }
}

impl fmt::Debug for RedisLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.inner.config;
        f.debug_struct("RedisLock")
            .field("topology", &c.topology)
            .field("host", &c.host)
            .field("port", &c.port)
            .field("db", &c.db)
            .field("namespace", &c.namespace)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cluster client re-sends a request whose connection dropped: the second run of an
    /// attempt that was granted must return the same grant, not "held" (which left the lock
    /// stranded until its TTL, with the caller told someone else holds it).
    #[tokio::test]
    async fn a_re_sent_attempt_returns_its_own_grant() {
        let Some(url) = conformance::backend_url("DISTLOCK_TEST_REDIS_URL") else {
            return;
        };
        let lock = RedisLock::connect_url(&url).await.unwrap();
        let key = conformance::fresh_key("re-sent-attempt");
        let names = lock.names(&key);
        let prefix = owner_prefix(&OwnershipToken::generate());
        let mut replies = Vec::new();
        for _ in 0..2 {
            let mut invocation = lock.inner.scripts.acquire.key(&names.lock);
            invocation
                .key(names.fence())
                .key(names.undone(&prefix))
                .key(names.holder())
                .arg(&prefix)
                .arg(30_000)
                .arg(lock.inner.identity.as_str());
            replies.push(
                invocation
                    .invoke_async::<redis::Value>(&mut lock.inner.conn.clone())
                    .await
                    .unwrap(),
            );
        }
        let released = lock.release_by_prefix(&names, &prefix).await;
        assert!(matches!(released, Ok(true)));
        assert!(
            matches!(&replies[0], redis::Value::BulkString(_)),
            "{:?}",
            replies[0]
        );
        assert_eq!(
            replies[0], replies[1],
            "the re-sent attempt is its own grant"
        );
    }

    #[test]
    fn ttl_is_rounded_up_to_whole_milliseconds() {
        assert_eq!(ttl_millis(Duration::from_millis(300)), 300);
        assert_eq!(ttl_millis(Duration::from_micros(1500)), 2);
        assert_eq!(ttl_millis(Duration::from_nanos(1)), 1);
    }

    /// L6: a waiter whose attempts keep failing sent every earlier member with each attempt
    /// (O(n²) traffic) until Lua's `unpack` failed at about 8,000 of them, and every attempt
    /// and the leaving failed with it.
    #[test]
    fn the_earlier_members_an_attempt_carries_stay_bounded() {
        let mut earlier = Vec::new();
        for seq in 0..10_000 {
            remember(&mut earlier, format!("client:1:{seq}:30000:grant"));
            assert!(earlier.len() <= MAX_EARLIER);
        }
        assert_eq!(earlier.len(), MAX_EARLIER);
        assert_eq!(earlier.last().unwrap(), "client:1:9999:30000:grant");
        remember(&mut earlier, String::new());
        assert_eq!(earlier.len(), MAX_EARLIER);
    }

    #[test]
    fn the_identity_shows_only_next_to_its_own_grant() {
        let t = OwnershipToken::generate();
        let grant = format!("{}7", owner_prefix(&t));
        let holder = format!("{grant} host=a pid=1 since=2 label=x:w");
        let shown = |value: &str| holder_of(value.as_bytes(), holder.as_bytes());
        let id = shown(&grant).unwrap();
        assert_eq!(id.as_str(), "host=a pid=1 since=2 label=x:w");
        assert_eq!(shown(&format!("{grant}:w")), Some(id));
        // A later grant (another fence, another token), a foreign value, an empty value.
        assert_eq!(shown(&format!("{}8", owner_prefix(&t))), None);
        assert_eq!(shown(&format!("{}70", owner_prefix(&t))), None);
        let other = OwnershipToken::generate();
        assert_eq!(shown(&format!("{}7", owner_prefix(&other))), None);
        assert_eq!(shown("foreign"), None);
        assert_eq!(shown(""), None);
        assert_eq!(holder_of(b"foreign", b"foreign x"), None);
        assert_eq!(holder_of(grant.as_bytes(), grant.as_bytes()), None);
        assert_eq!(holder_of(grant.as_bytes(), b""), None);
    }

    #[test]
    fn owner_values_parse_only_in_our_format() {
        let t = OwnershipToken::generate();
        let value = format!("{}7", owner_prefix(&t));
        assert_eq!(parse_owner(value.as_bytes()), Some((t, FencingToken(7))));
        let marked = format!("{}7:w", owner_prefix(&t));
        assert_eq!(parse_owner(marked.as_bytes()), Some((t, FencingToken(7))));
        assert_eq!(parse_owner(t.expose_hex().as_bytes()), None);
        assert_eq!(parse_owner(b"some-other-client"), None);
        assert_eq!(
            parse_owner(format!("{}x", owner_prefix(&t)).as_bytes()),
            None
        );
    }
}
