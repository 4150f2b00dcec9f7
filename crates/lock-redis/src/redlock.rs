//! [`RedlockLock`]: Redlock over N independent Redis masters. No fencing tokens: its
//! capabilities declare `FencingGuarantee::None`, so `require_fencing(SingleNode)` fails before
//! any I/O.

use std::{fmt, sync::Arc, time::Duration};

use futures::stream::{FuturesUnordered, StreamExt};
use lock_core::raw::{
    AcquireWait, Backoff, Capabilities, Driver, Error, FencingGuarantee, HolderIdentity,
    HolderInfo, Lease, LockKey, OwnershipToken, Result, TokenDigest, async_trait, cleanup,
    server_expired_lease,
};
use redis::{
    ConnectionAddr, IntoConnectionInfo, RedisConnectionInfo, RedisError, Script,
    aio::{ConnectionManager, ConnectionManagerConfig},
};
use tokio::time::{Instant, timeout_at};

use crate::{RedisLockConfig, RedisTopology};

const BACKEND: &str = "redlock";

/// The grant: `SET key value PX ttl` where the key is free, unless this attempt was undone
/// already (its tombstone `KEYS[2]` exists) or the master's clock has passed `ARGV[3]`, the last
/// moment (Unix ms) at which the attempt may still apply. 1: granted; the holder's value: held;
/// -1: undone; -2: too late. A grant that a frozen master had buffered and runs once it is
/// thawed is refused by either: its attempt was given up long ago.
const GRANT: &str = r"
if redis.call('EXISTS', KEYS[2]) == 1 then
  return -1
end
local t = redis.call('TIME')
if tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) > tonumber(ARGV[3]) then
  return -2
end
local holder = redis.call('GET', KEYS[1])
if holder then
  return holder
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
";

/// Compare-and-extend: the key's value is this lease's token.
const RENEW: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
";

/// Compare-and-delete; where the value is not there, the grant's tombstone `KEYS[2]` is left
/// until `ARGV[2]` (the grant's last moment, Unix ms, by the master's clock), so that a grant
/// still on its way (sent to a master that has not answered) is refused when it arrives.
const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
local t = redis.call('TIME')
local left = tonumber(ARGV[2]) - (tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
if left > 0 then
  redis.call('SET', KEYS[2], '1', 'PX', math.floor(left) + 1)
end
return 0
";

/// How far a master's clock may be from this client's, for the one use Redlock makes of wall
/// clocks: bounding when a grant that a master has not answered may still apply
/// ([`GRANT`]'s `ARGV[3]`). A master whose clock runs ahead by more than the TTL plus this
/// refuses every grant (reported as such); one behind by more may apply a buffered grant after
/// its undo gave up (that grant then holds one master for one TTL).
const CLOCK_OFFSET: Duration = Duration::from_secs(10);

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
/// * **Acquire**: `SET key <token> PX ttl` where free (one script) on every master at once;
///   granted when a majority said yes within the validity time — the lease's local deadline,
///   `sent_at + ttl - drift` (1 % + 5 ms), counted from before the first request was sent, so it
///   ends before any master's key can expire. Otherwise the token is deleted, in the
///   background, on every master that granted it or did not answer (compare-and-delete, and a
///   tombstone that refuses the grant should it still arrive).
/// * **Renew**: compare-and-`PEXPIRE` on every master; counts when a majority extended it.
/// * **Release**: compare-and-delete on every master; `true` when a majority deleted it.
/// * **Every call is decided as the answers arrive** — at a majority, or once a majority can
///   no longer be reached — so one silent master (down, frozen, partitioned) costs nothing while
///   the others answer; no master is waited for past the attempt's validity time, the caller's
///   deadline or its request budget.
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
    grant: Script,
    renew: Script,
    release: Script,
}

/// One master's answer.
enum Answer<T> {
    Ok(T),
    /// Nothing was sent (refused connection).
    NotSent,
    /// Sent, or maybe sent, and no (readable) reply: it may have applied, or may still apply. A
    /// request left unanswered when the call was decided without it is one too.
    Unknown,
}

impl<T> Answer<T> {
    fn is(&self, f: impl FnOnce(&T) -> bool) -> bool {
        matches!(self, Answer::Ok(v) if f(v))
    }
}

/// What the masters answered so far (`None`: not yet), for a call's rule of when it is
/// decided.
struct Votes<'a, T> {
    answers: &'a [Option<Answer<T>>],
    quorum: usize,
}

impl<T> Votes<'_, T> {
    /// Answers that satisfy `f`.
    fn count(&self, f: impl Fn(&T) -> bool) -> usize {
        self.answers
            .iter()
            .filter(|a| a.as_ref().is_some_and(|a| a.is(&f)))
            .count()
    }

    /// Masters that have not answered yet.
    fn pending(&self) -> usize {
        self.answers.iter().filter(|a| a.is_none()).count()
    }

    /// Masters that answered without a reply (not sent, or no reply in time).
    fn failed(&self) -> usize {
        self.answers
            .iter()
            .filter(|a| matches!(a, Some(Answer::NotSent | Answer::Unknown)))
            .count()
    }

    /// Whether the answers satisfying `f` have a majority, or can no longer get one.
    fn settled(&self, f: impl Fn(&T) -> bool) -> bool {
        let yes = self.count(f);
        yes >= self.quorum || yes + self.pending() < self.quorum
    }
}

/// Grant-specific state a lease carries: the last moment its grant could still have applied on
/// a master that did not answer (Unix ms; [`GRANT`]'s `ARGV[3]`), for the release's tombstone.
#[derive(Clone, Copy, Debug)]
struct GrantLimit {
    unix_ms: u64,
    /// When the undo of a grant that did not answer gives up (a local instant past
    /// `unix_ms`, with [`CLOCK_OFFSET`] to spare).
    end: Instant,
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
            .gather(
                None,
                |mut c| async move { redis::cmd("PING").query_async::<()>(&mut c).await },
                |v| v.settled(|()| true),
            )
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
                grant: Script::new(GRANT),
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

    /// Runs `request` on every master at once (see [`gather`]).
    async fn gather<T, F, Fut>(
        &self,
        until: Option<Instant>,
        request: F,
        decided: impl Fn(&Votes<'_, T>) -> bool,
    ) -> Vec<Answer<T>>
    where
        F: Fn(ConnectionManager) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        gather(&self.inner, until, request, decided).await
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

/// Runs `request` on every master at once, each bounded by its request budget and by `until`,
/// and returns as soon as `decided` says the answers so far settle the call (a majority, or a
/// majority no longer possible) — or all are in. A master still unanswered then is
/// [`Answer::Unknown`]: its request is dropped, and may still apply if it was sent (the callers
/// that write undo that, in the background). Past `until`, nothing more is sent.
async fn gather<T, F, Fut>(
    inner: &Inner,
    until: Option<Instant>,
    request: F,
    decided: impl Fn(&Votes<'_, T>) -> bool,
) -> Vec<Answer<T>>
where
    F: Fn(ConnectionManager) -> Fut,
    Fut: std::future::Future<Output = redis::RedisResult<T>>,
{
    let now = Instant::now();
    let mut calls: FuturesUnordered<_> = inner
        .nodes
        .iter()
        .zip(&inner.config.nodes)
        .enumerate()
        .map(|(i, (c, cfg))| {
            let call = request(c.clone());
            let mut limit = now + cfg.request_budget();
            if let Some(until) = until {
                limit = limit.min(until);
            }
            async move {
                if limit <= Instant::now() {
                    return (i, Answer::NotSent);
                }
                let answer = match timeout_at(limit, call).await {
                    Ok(Ok(v)) => Answer::Ok(v),
                    Ok(Err(e)) if not_sent(&e) => Answer::NotSent,
                    Ok(Err(_)) | Err(_) => Answer::Unknown,
                };
                (i, answer)
            }
        })
        .collect();
    let mut answers: Vec<Option<Answer<T>>> = (0..inner.nodes.len()).map(|_| None).collect();
    let quorum = inner.config.quorum();
    while let Some((i, answer)) = calls.next().await {
        if let Some(slot) = answers.get_mut(i) {
            *slot = Some(answer);
        }
        if decided(&Votes {
            answers: &answers,
            quorum,
        }) {
            break;
        }
    }
    answers
        .into_iter()
        .map(|a| a.unwrap_or(Answer::Unknown))
        .collect()
}

/// `now` on the wall clock, in Unix milliseconds.
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Where a grant's tombstone lives: after its lock's key, with the token (`\x1f`: no
/// [`LockKey`] contains it).
fn tombstone(name: &str, token_hex: &str) -> String {
    format!("{name}\x1fundone\x1f{token_hex}")
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

/// What an undo deletes: `value` at `name`, and the grant's tombstone where it is not there.
#[derive(Clone)]
struct UndoTarget {
    name: String,
    tomb: String,
    value: String,
    limit: GrantLimit,
}

/// Deletes a grant on the masters `which`, in the background through lock-core's clean-ups
/// ([`lock_core::raw::cleanup`]; it survives the caller, and `finish` waits for it), never on
/// the caller's path. Each master is asked again, paced by [`cleanup::Retries`], until it
/// answers — a frozen master answers once thawed, after the grant it had buffered, which its
/// tombstone then refuses — or until `end`, past which no grant of this attempt can apply any
/// more ([`GRANT`]'s wall-clock limit, with [`CLOCK_OFFSET`] to spare).
fn spawn_undo(inner: Arc<Inner>, target: UndoTarget, which: Vec<usize>, end: Instant) {
    if which.is_empty() {
        return;
    }
    cleanup::spawn(async move {
        let mut left = which;
        let mut retries = cleanup::Retries::until(end);
        while !left.is_empty() && retries.next().await {
            let round = left.iter().map(|&i| {
                let (inner, target) = (&inner, &target);
                async move {
                    let (Some(conn), Some(cfg)) = (inner.nodes.get(i), inner.config.nodes.get(i))
                    else {
                        return None;
                    };
                    let limit = (Instant::now() + cfg.request_budget()).min(end);
                    let mut conn = conn.clone();
                    let mut call = inner.release.key(&target.name);
                    call.key(&target.tomb)
                        .arg(&target.value)
                        .arg(target.limit.unix_ms);
                    match timeout_at(limit, call.invoke_async::<i64>(&mut conn)).await {
                        Ok(Ok(_)) => None,
                        Ok(Err(_)) | Err(_) => Some(i),
                    }
                }
            });
            left = futures::future::join_all(round)
                .await
                .into_iter()
                .flatten()
                .collect();
        }
        if !left.is_empty() {
            tracing::debug!(
                key = %target.name,
                masters = ?left,
                "redlock: masters that never answered the undo (a late grant there is refused by their clock)"
            );
        }
    });
}

/// Undoes an attempt's grant on every master when the acquiring future is dropped
/// mid-request (or the attempt fails and names the masters that need it).
struct Undo {
    inner: Option<Arc<Inner>>,
    target: UndoTarget,
    end: Instant,
}

impl Undo {
    fn disarm(mut self) {
        self.inner = None;
    }

    /// Undoes the grant on `which` (in the background).
    fn run(mut self, which: Vec<usize>) {
        if let Some(inner) = self.inner.take() {
            spawn_undo(inner, self.target.clone(), which, self.end);
        }
    }
}

impl Drop for Undo {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.take() {
            let all = (0..inner.nodes.len()).collect();
            spawn_undo(inner, self.target.clone(), all, self.end);
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
    /// to four rounds, as the Redlock algorithm prescribes; a key that a majority of masters
    /// may hold for one owner answers "held" at once. Each round is decided as the answers
    /// arrive, and no master is waited for past the attempt's validity time.
    ///
    /// # Cancellation safety
    /// Dropping the future mid-request deletes the attempt's token on every master in the
    /// background.
    async fn try_acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>> {
        self.rounds(key, ttl, None).await
    }

    /// Polls like [`lock_core::raw::poll_acquire`], but no attempt, split-vote pause or
    /// master's request outlives `deadline`.
    async fn acquire(&self, key: &LockKey, ttl: Duration, deadline: Instant) -> Result<Lease> {
        let mut wait = AcquireWait::new(key, deadline, Backoff::default())?;
        loop {
            match self.rounds(key, ttl, Some(deadline)).await {
                Ok(Some(lease)) => return Ok(lease),
                Ok(None) => wait.wait(std::future::pending()).await?,
                Err(e) => wait.retry_after(e).await?,
            }
        }
    }

    /// Decided once a majority extended the lease (or can no longer); no master is waited for
    /// past the lease's local deadline.
    async fn renew(&self, lease: &mut Lease, ttl: Duration) -> Result<()> {
        let name = self.redis_key(lease.key());
        let value = self.value(lease.token());
        let ms = ttl_millis(ttl);
        let sent_at = Instant::now();
        let until = Some(lease.local_deadline()).filter(|d| *d > sent_at);
        let script = self.inner.renew.clone();
        let answers = self
            .gather(
                until,
                |mut c| {
                    let (name, value, script) = (name.clone(), value.clone(), script.clone());
                    async move {
                        script
                            .key(&name)
                            .arg(&value)
                            .arg(ms)
                            .invoke_async::<i64>(&mut c)
                            .await
                    }
                },
                |v| v.settled(|&r| r == 1),
            )
            .await;
        let quorum = self.inner.config.quorum();
        let renewed = answers.iter().filter(|a| a.is(|&r| r == 1)).count();
        let refused = answers.iter().filter(|a| a.is(|&r| r == 0)).count();
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

    /// Decided once a majority deleted the token (or answered and can no longer); a master
    /// left without an answer gets the release again in the background (with the grant's
    /// tombstone, so that a grant it may still have buffered is refused when it arrives).
    async fn release(&self, lease: &Lease) -> Result<bool> {
        let target = self.undo_target(lease);
        let script = self.inner.release.clone();
        let answers = self
            .gather(
                None,
                |mut c| {
                    let (target, script) = (target.clone(), script.clone());
                    async move {
                        script
                            .key(&target.name)
                            .key(&target.tomb)
                            .arg(&target.value)
                            .arg(target.limit.unix_ms)
                            .invoke_async::<i64>(&mut c)
                            .await
                    }
                },
                |v| {
                    let deleted = v.count(|&r| r == 1);
                    let answered = v.count(|_| true);
                    deleted >= v.quorum
                        || (answered >= v.quorum && deleted + v.pending() < v.quorum)
                        || v.failed() > v.answers.len() - v.quorum
                },
            )
            .await;
        let unanswered: Vec<usize> = answers
            .iter()
            .enumerate()
            .filter(|(_, a)| matches!(a, Answer::Unknown))
            .map(|(i, _)| i)
            .collect();
        spawn_undo(
            self.inner.clone(),
            target.clone(),
            unanswered,
            target.limit.end,
        );
        let quorum = self.inner.config.quorum();
        let deleted = answers.iter().filter(|a| a.is(|&r| r == 1)).count();
        let answered = answers.iter().filter(|a| a.is(|_| true)).count();
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
            .gather(
                None,
                |mut c| {
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
                },
                // Settled when one value (or its absence) is on a majority, or too few answer.
                |v| {
                    let values: Vec<&Option<Vec<u8>>> = v
                        .answers
                        .iter()
                        .filter_map(|a| match a {
                            Some(Answer::Ok((value, _))) => Some(value),
                            _ => None,
                        })
                        .collect();
                    values
                        .iter()
                        .any(|x| values.iter().filter(|y| *y == x).count() >= v.quorum)
                        || v.failed() > v.answers.len() - v.quorum
                },
            )
            .await;
        let quorum = self.inner.config.quorum();
        let values: Vec<(Vec<u8>, i64)> = answers
            .iter()
            .filter_map(|a| match a {
                Answer::Ok((Some(v), pttl)) => Some((v.clone(), *pttl)),
                _ => None,
            })
            .collect();
        let answered = answers.iter().filter(|a| a.is(|_| true)).count();
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

    /// An operator's delete: sent to every master, and waited for on each (within its
    /// request budget), so that none is left to apply later unseen.
    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        let name = self.redis_key(key);
        let answers = self
            .gather(
                None,
                |mut c| {
                    let name = name.clone();
                    async move {
                        redis::cmd("DEL")
                            .arg(&name)
                            .query_async::<i64>(&mut c)
                            .await
                    }
                },
                |_| false,
            )
            .await;
        let quorum = self.inner.config.quorum();
        let deleted = answers.iter().filter(|a| a.is(|&r| r == 1)).count();
        let answered = answers.iter().filter(|a| a.is(|_| true)).count();
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

/// How one Redlock round ended, when it did not fail.
enum Round {
    Granted(Lease),
    /// Refused: one owner may hold a majority.
    Held,
    /// Refused, and no owner can hold a majority (clients racing for a free key each got
    /// some masters): worth another round.
    Split,
}

/// One master's answer to [`GRANT`].
enum Grant {
    Granted,
    /// Held, by this value.
    Held(Vec<u8>),
    /// Refused: this attempt was undone already, or came too late by the master's clock.
    Refused(i64),
}

fn grant_reply(value: redis::Value) -> redis::RedisResult<Grant> {
    match value {
        redis::Value::Int(1) => Ok(Grant::Granted),
        redis::Value::Int(n) => Ok(Grant::Refused(n)),
        redis::Value::BulkString(v) => Ok(Grant::Held(v)),
        redis::Value::SimpleString(v) => Ok(Grant::Held(v.into_bytes())),
        other => Err(RedisError::from((
            redis::ErrorKind::Client,
            "unexpected reply to the grant",
            format!("{other:?}"),
        ))),
    }
}

impl RedlockLock {
    /// [`Driver::try_acquire`]'s rounds, none past `deadline`.
    async fn rounds(
        &self,
        key: &LockKey,
        ttl: Duration,
        deadline: Option<Instant>,
    ) -> Result<Option<Lease>> {
        // Jittered, so racing clients do not split again in lockstep.
        let mut pause = Backoff::new(SPLIT_VOTE_PAUSE, SPLIT_VOTE_PAUSE * 8);
        for round in 1..=SPLIT_VOTE_ROUNDS {
            match self.attempt(key, ttl, deadline).await? {
                Round::Granted(lease) => return Ok(Some(lease)),
                Round::Held => break,
                Round::Split if round == SPLIT_VOTE_ROUNDS => break,
                Round::Split => {
                    let wake = Instant::now() + pause.next_delay();
                    if deadline.is_some_and(|d| wake >= d) {
                        break;
                    }
                    tokio::time::sleep_until(wake).await;
                }
            }
        }
        Ok(None)
    }

    /// What a release or an undo of `lease`'s grant deletes.
    fn undo_target(&self, lease: &Lease) -> UndoTarget {
        let name = self.redis_key(lease.key());
        let hex = lease.token().expose_hex();
        UndoTarget {
            tomb: tombstone(&name, &hex),
            name,
            value: self.value(lease.token()),
            // A lease this client did not grant (none today) leaves no tombstone.
            limit: lease
                .backend_state::<GrantLimit>()
                .copied()
                .unwrap_or(GrantLimit {
                    unix_ms: 0,
                    end: Instant::now(),
                }),
        }
    }

    /// One Redlock round: [`GRANT`] on every master at once, decided as the answers arrive
    /// and never past the validity time or `deadline`; granted with a majority within the
    /// validity time, else whatever was (or may yet be) granted is undone in the background.
    async fn attempt(
        &self,
        key: &LockKey,
        ttl: Duration,
        deadline: Option<Instant>,
    ) -> Result<Round> {
        let token = OwnershipToken::generate();
        let ms = ttl_millis(ttl);
        let sent_at = Instant::now();
        let offset = ttl_millis(CLOCK_OFFSET);
        let limit = GrantLimit {
            unix_ms: unix_ms().saturating_add(ms).saturating_add(offset),
            end: sent_at + ttl + CLOCK_OFFSET * 2,
        };
        let lease = Lease::new(key.clone(), token, None, ttl, sent_at).with_backend_state(limit);
        let target = self.undo_target(&lease);
        let undo = Undo {
            inner: Some(self.inner.clone()),
            target: target.clone(),
            end: limit.end,
        };
        let until = deadline.map_or(lease.local_deadline(), |d| d.min(lease.local_deadline()));
        let script = self.inner.grant.clone();
        let answers = self
            .gather(
                Some(until),
                |mut c| {
                    let (target, script) = (target.clone(), script.clone());
                    async move {
                        let reply = script
                            .key(&target.name)
                            .key(&target.tomb)
                            .arg(&target.value)
                            .arg(ms)
                            .arg(target.limit.unix_ms)
                            .invoke_async::<redis::Value>(&mut c)
                            .await?;
                        grant_reply(reply)
                    }
                },
                // Granted; or refused, and whether it is a refusal ("held") or a failure is
                // known too.
                |v| {
                    let granted = v.count(|g| matches!(g, Grant::Granted));
                    let held = v.count(|g| matches!(g, Grant::Held(_)));
                    let pending = v.pending();
                    granted >= v.quorum
                        || (granted + pending < v.quorum
                            && (granted + held >= v.quorum || granted + held + pending < v.quorum))
                },
            )
            .await;
        let quorum = self.inner.config.quorum();
        let granted = answers
            .iter()
            .filter(|a| a.is(|g| matches!(g, Grant::Granted)))
            .count();
        if granted >= quorum && lease.is_locally_valid() {
            undo.disarm();
            return Ok(Round::Granted(lease));
        }
        // Not ours: undo it where it was, or may yet be, granted — in the background.
        undo.run(
            answers
                .iter()
                .enumerate()
                .filter(|(_, a)| {
                    matches!(a, Answer::Unknown) || a.is(|g| matches!(g, Grant::Granted))
                })
                .map(|(i, _)| i)
                .collect(),
        );
        let n = answers.len();
        if granted >= quorum {
            return Err(self.unavailable(
                "try_acquire",
                format!("a majority granted, but after the validity time ({ttl:?}) had passed"),
            ));
        }
        let holders: Vec<&Vec<u8>> = answers
            .iter()
            .filter_map(|a| match a {
                Answer::Ok(Grant::Held(v)) => Some(v),
                _ => None,
            })
            .collect();
        let held = holders.len();
        if held > 0 && granted + held >= quorum {
            // A split vote only if no holder (not even with every unanswered master's vote)
            // can have a majority.
            let unknown = answers
                .iter()
                .filter(|a| matches!(a, Answer::Unknown))
                .count();
            let most = holders
                .iter()
                .map(|h| holders.iter().filter(|o| *o == h).count())
                .max()
                .unwrap_or(0);
            return Ok(if most + unknown >= quorum {
                Round::Held
            } else {
                Round::Split
            });
        }
        let late = answers
            .iter()
            .filter(|a| a.is(|g| matches!(g, Grant::Refused(-2))))
            .count();
        if late > 0 {
            return Err(self.unavailable(
                "try_acquire",
                format!(
                    "{late} of {n} masters refused the grant as too late: their clock is ahead \
                     of this client's by more than the TTL + {CLOCK_OFFSET:?}"
                ),
            ));
        }
        Err(self.unavailable(
            "try_acquire",
            format!("{granted} of {n} masters granted (a majority of {quorum} is needed)"),
        ))
    }
}
