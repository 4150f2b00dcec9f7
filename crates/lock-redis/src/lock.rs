//! [`RedisLock`], the Redis driver on one server, a Sentinel-managed master or a Cluster: its
//! `impl Driver` and the coordinator's algorithm — an attempt, its undo when its outcome is
//! unknown, release, inspect and the operator's force-release (connections are `client.rs`'s,
//! the waiter queue `queue.rs`'s, renewal `renew.rs`'s, the scripts `scripts.rs`'s).

use std::{fmt, future::Future, sync::Arc, time::Duration};

use futures::future::BoxFuture;
use lock_core::raw::{
    AcquireWait, Backoff, Batcher, Capabilities, Driver, Error, FencingGuarantee, FencingToken,
    HolderIdentity, HolderInfo, Lease, LockKey, LossReason, OwnershipToken, Result, TokenDigest,
    async_trait,
    cleanup::Retries,
    handoff::{self, Asked},
    server_expired_lease,
};
use tokio::time::{Instant, timeout_at};

use crate::{
    RedisLockConfig,
    client::{self, Acked, BACKEND, Conn, Failure, after, map_failure, request_until, run_until},
    keys::KeyNames,
    queue::{QueueWaiter, Waiting, registration_lifetime},
    renew::{self, RENEW_BATCH, RenewItem},
    scripts::{Scripts, holder_of, owner_prefix, parse_fence, parse_owner, ttl_millis},
    wake::{Registry, WAKE_CHANNEL_PREFIX},
};

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
    pub(crate) inner: Arc<Inner>,
}

/// What every request of one client shares.
pub(crate) struct Inner {
    pub(crate) config: RedisLockConfig,
    pub(crate) conn: Conn,
    pub(crate) scripts: Scripts,
    pub(crate) wakeups: Arc<Registry>,
    /// Who this client is (host, pid, start, `label`), recorded next to each of its grants.
    pub(crate) identity: HolderIdentity,
    /// Renewals submitted together (the watchdogs of one process renew on a shared grid) go
    /// out together: one script call per [`renew::RENEW_CHUNK`] locks.
    pub(crate) renewals: Batcher<RenewItem, Result<bool, Failure>>,
}

/// What one acquisition attempt found.
pub(crate) enum Attempt {
    Granted(Lease),
    /// Held by somebody else; the holder's remaining TTL when it has one.
    Held(Option<Duration>),
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
        client::ping(&lock.inner.conn, &lock.inner.config).await?;
        Ok(lock)
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
        let wakeups = Arc::new(Registry::default());
        let conn = client::connect_lazy(&config, &wakeups)?;
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

    pub(crate) fn names(&self, key: &LockKey) -> KeyNames {
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
    pub(crate) async fn attempt(
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
            Err(failure) => {
                match &failure {
                    // Sent, no reply: it may still apply, even after the clean-up ran on
                    // another connection; the clean-up's marker makes it a no-op then.
                    Failure::Unknown(_) => self.settle(inflight.undo(true), by).await,
                    Failure::NotSent(_) => inflight.disarm(),
                    // A script is not rolled back when a command in it fails: an error after
                    // the `SET` leaves a grant behind.
                    Failure::Refused(_) => self.settle(inflight.undo(false), by).await,
                }
                return Err(self.map_failure("try_acquire", key, failure));
            }
        };
        let (lease, inflight) = lease;
        if let Some(Err(message)) = acked {
            // Granted on the master, but not known to be on enough replicas: a failover may
            // lose it, so it does not count; undone like a grant without a reply.
            self.settle(inflight.undo(true), by).await;
            return Err(self.map_failure("try_acquire", key, Failure::Unknown(message)));
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
        Acked::new(&self.inner.conn, &self.inner.config)
    }

    /// Waits for a spawned clean-up's answer within one request budget when the caller has no
    /// deadline (`try_acquire`: its error then comes after the undo). A waiting `acquire` (`by`
    /// given) goes on at once: its next attempt need not wait, and the clean-up goes on in the
    /// background regardless.
    async fn settle(&self, answered: tokio::sync::oneshot::Receiver<()>, by: Option<Instant>) {
        if by.is_none() {
            let _ = timeout_at(request_until(&self.inner.config, None), answered).await;
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
        run_until(request, request_until(&self.inner.config, by)).await
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
                    .force_release(self.inner.conn.is_cluster())
                    .key(&names.lock)
                    .key(names.queue())
                    .key(names.fence())
                    .key(names.holder())
                    .arg(fence)
                    .arg(wake_channel_prefix(&self.inner.conn, &names))
                    .invoke_async::<i64>(&mut self.inner.conn.clone()),
                None,
            )
            .await
            .map_err(|f| self.map_failure("force_release", key, f))?;
        tracing::warn!(%key, deleted = deleted == 1, fencing = ?holder, "lock force-released by an operator");
        Ok(deleted == 1)
    }

    fn map_failure(&self, op: &'static str, key: &LockKey, failure: Failure) -> Error {
        map_failure(&self.inner.config, op, key, failure)
    }
}

/// [`Driver::watch_lost`]: waits for a force-release's message naming this grant (its lock and
/// fence, on [`crate::wake::LOST_CHANNEL`]), then reads the lock: only when its value is no
/// longer this grant's (another token, or gone) is the lease lost — a forged or stale message
/// (the value is still ours) is ignored and the watch goes on, and so is a read that got no
/// answer (the renewals decide then). Never completes when the subscription fails (the renewals
/// find the loss, as before).
async fn watch_force_release(inner: Arc<Inner>, lease: Lease) -> LossReason {
    let Some(fence) = lease.fencing_token() else {
        return std::future::pending().await;
    };
    let names = KeyNames::new(&inner.config.namespace, lease.key());
    let watch = match inner
        .wakeups
        .watch_lost(&inner.conn, names.lock.clone(), fence.get())
        .await
    {
        Ok(watch) => watch,
        Err(e) => {
            tracing::debug!(key = %lease.key(), error = %e, "cannot subscribe to force-release messages; renewals will find a loss");
            return std::future::pending().await;
        }
    };
    let mine = owner_prefix(lease.token());
    loop {
        watch.announced().await;
        let read = run_until(
            redis::cmd("GET")
                .arg(&names.lock)
                .query_async::<Option<Vec<u8>>>(&mut inner.conn.clone()),
            request_until(&inner.config, None),
        )
        .await;
        match read {
            Ok(Some(value)) if value.starts_with(mine.as_bytes()) => {
                tracing::debug!(key = %lease.key(), "a force-release message named this grant, which still holds; ignored");
            }
            Ok(_) => {
                tracing::warn!(key = %lease.key(), fencing = %fence, "the lock was force-released: lease lost");
                return LossReason::Revoked;
            }
            Err(_) => {
                tracing::debug!(key = %lease.key(), "cannot read the lock after a force-release message; renewals will tell");
            }
        }
    }
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
    let mut invocation = inner
        .scripts
        .release(inner.conn.is_cluster())
        .key(&names.lock);
    invocation
        .key(names.queue())
        .key(names.fence())
        .key(names.holder());
    if marker.is_some() {
        invocation.key(names.undone(prefix));
    }
    invocation
        .arg(prefix)
        .arg(wake_channel_prefix(&inner.conn, names))
        .arg(marker.map_or(0, ttl_millis))
        .arg(leaving);
    let mut conn = inner.conn.clone();
    run_until(
        invocation.invoke_async::<i64>(&mut conn),
        request_until(&inner.config, until),
    )
    .await
    .map(|n| n == 1)
}

/// The prefix of the wake channels a release of `names` publishes to (`<prefix><client id>`):
/// the client-wide one, or on a Cluster the lock's shard channels (see [`crate::wake`]).
fn wake_channel_prefix(conn: &Conn, names: &KeyNames) -> Vec<u8> {
    if conn.is_cluster() {
        names.wake_prefix()
    } else {
        WAKE_CHANNEL_PREFIX.to_vec()
    }
}

/// What undoes one request whose grant (or registration) nobody will use: a compare-and-delete
/// of `prefix` that hands the lock on, the removal of `members` from the waiter queue and, when
/// the request it undoes may still reach the server, the undo marker that makes it a no-op.
#[derive(Clone, Default)]
pub(crate) struct Undo {
    pub(crate) names: KeyNames,
    pub(crate) prefix: String,
    pub(crate) members: Vec<String>,
    /// The marker's lifetime; `None` when the undone request has certainly finished (its reply
    /// came), so nothing of it can arrive later.
    pub(crate) marker: Option<Duration>,
}

/// Runs `undo` in the background until it is answered or `until` passes; the receiver hears
/// when it was answered. One answer is final, on whichever connection it came: the request it
/// undoes either ran before it (and was undone) or finds the marker. Independent of the caller,
/// so it survives the caller's future being dropped (and [`lock_core::raw::cleanup::finish`] waits
/// for it).
pub(crate) fn spawn_undo(
    inner: Arc<Inner>,
    undo: Undo,
    until: Instant,
) -> tokio::sync::oneshot::Receiver<()> {
    let (answered, rx) = tokio::sync::oneshot::channel();
    lock_core::raw::cleanup::spawn(async move {
        let mut retries = Retries::until(until);
        while retries.next().await {
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
                Err(Failure::Refused(e)) => {
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
        }
        tracing::debug!(
            lock = %String::from_utf8_lossy(&undo.names.lock),
            "a clean-up got no answer in time; the grant expires by its TTL"
        );
    });
    rx
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

#[async_trait]
impl Driver for RedisLock {
    fn backend_name(&self) -> &'static str {
        BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        // The renew script sets the key's PEXPIRE to any TTL, and Redis expires a key nobody
        // renews on its own.
        Capabilities {
            wait_notify: true,
            relabel: true,
            ..server_expired_lease(FencingGuarantee::SingleNode)
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

    /// Tries at once; when the key is held, subscribes to the client's wake channel (on a
    /// Cluster: the lock's shard channel, on the slot's node), tries
    /// again (registering in the lock's waiter queue; a release may have happened in between)
    /// and then sleeps until a release grants it the lock (returned from the grant message
    /// alone), the holder's TTL runs out, the jittered fallback poll fires or the deadline
    /// passes. Each wake-up or poll is an attempt that renews the registration and finds a
    /// grant whose message was missed.
    ///
    /// A waiter that gives up passes on a grant that crossed its leaving. A release grants a
    /// waiter only a short first lease (1.5 s at most, `queue::HANDOFF_LEASE`), which the waiter
    /// extends to its TTL with one renewal before `acquire` returns: a waiter whose process died
    /// while its registration was still live (up to 2 s by default) may be granted the lock, and
    /// then holds it for that first lease, not for its TTL.
    ///
    /// Every request gets at most what is left of `deadline` (leaving the queue: 200 ms past
    /// it); clean-ups that need longer go on in the background.
    ///
    /// # Cancellation safety
    /// Dropping the future leaves the queue and undoes an attempt in flight, in the background
    /// (`lock_core::raw::cleanup::finish` waits for both).
    async fn acquire(&self, key: &LockKey, ttl: Duration, deadline: Instant) -> Result<Lease> {
        let max = self.inner.config.max_poll_interval;
        let quick = Backoff::new(Duration::from_millis(25), max);
        loop {
            let mut wait = AcquireWait::new(key, deadline, quick.clone())?;
            let mut waiter = QueueWaiter::new(self, Asked { key, ttl, deadline }, quick.clone());
            let mut lease =
                handoff::acquire_queued(&mut waiter, &mut wait, Backoff::new(max, max)).await?;
            drop(waiter);
            if lease.ttl() >= ttl {
                return Ok(lease);
            }
            // A release's grant, taken from its message: the server gave it only its short
            // first lease (`queue::HANDOFF_LEASE`), so that a waiter that died before it could
            // take it blocks the lock that long at most. Confirmed here — one renewal to `ttl`,
            // from its send time — before the caller sees it.
            // Dropped meanwhile, or unconfirmed, the grant is released (passed on) in the
            // background, retried for as long as the renewal could have extended it.
            let inflight = Inflight {
                inner: Some(self.inner.clone()),
                undo: Undo {
                    names: self.names(key),
                    prefix: owner_prefix(lease.token()),
                    members: Vec::new(),
                    marker: None,
                },
                ttl,
            };
            match renew::renew(&self.inner, &mut lease, ttl).await {
                Ok(()) => {
                    inflight.disarm();
                    return Ok(lease);
                }
                Err(e) => {
                    // Gone (expired or force-released before the renewal), or unconfirmed:
                    // released by the undo and, while the deadline allows, the wait starts
                    // again.
                    drop(inflight.undo(false));
                    tracing::debug!(%key, error = %e, "a hand-off could not be confirmed; waiting again");
                    if Instant::now() >= deadline {
                        return Err(wait.timeout());
                    }
                }
            }
        }
    }

    /// Renewals are batched: while one batch is in flight, the renewals that arrive are queued
    /// and go out together in the next (a lone renewal is sent at once).
    async fn renew(&self, lease: &mut Lease, ttl: Duration) -> Result<()> {
        renew::renew(&self.inner, lease, ttl).await
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

    /// Pushed: an operator's force-release announces the grant it removed, and the holder reads
    /// the lock to confirm (see `watch_force_release`); on a Cluster (whose force-release
    /// announces nothing) and for anything else — an expiry, an eviction, a failover that lost
    /// the grant — the renewals and the local deadline find the loss.
    fn watch_lost(&self, lease: &Lease) -> BoxFuture<'static, LossReason> {
        if self.inner.conn.is_cluster() {
            return Box::pin(std::future::pending());
        }
        Box::pin(watch_force_release(self.inner.clone(), lease.clone()))
    }

    /// One script (`RELABEL` in `scripts.rs`): the holder key is rewritten only while the lock's
    /// value is this grant's. Not followed by `WAIT` under `replicas=N`: the holder identity is
    /// what `inspect` and `leader()` show, not part of the grant or its fence.
    async fn relabel(&self, lease: &Lease, holder: &HolderIdentity) -> Result<()> {
        let names = self.names(lease.key());
        let changed = self
            .run(
                self.inner
                    .scripts
                    .relabel
                    .key(&names.lock)
                    .key(names.holder())
                    .arg(owner_prefix(lease.token()))
                    .arg(holder.as_str())
                    .invoke_async::<i64>(&mut self.inner.conn.clone()),
                None,
            )
            .await
            .map_err(|f| self.map_failure("relabel", lease.key(), f))?;
        if changed == 1 {
            Ok(())
        } else {
            Err(Error::not_held(lease.key()))
        }
    }
}

/// Shows the config through its own `Debug`, which redacts the password.
impl fmt::Debug for RedisLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLock")
            .field("config", &self.inner.config)
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
}
