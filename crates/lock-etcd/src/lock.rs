//! `EtcdLock`: a client-side mutex on etcd with Go `concurrency.Mutex`'s key layout.

use std::{
    collections::HashSet,
    fmt,
    sync::{Arc, Mutex, Weak},
    time::Duration,
};

use async_trait::async_trait;
use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, Identity,
    KeyValue, PutOptions, SortOrder, SortTarget, TlsOptions, Txn, TxnOp, TxnOpResponse,
    TxnResponse, WatchFilterType, WatchOptions, WatchStream,
};
use futures::future::BoxFuture;
use lock_core::raw::{
    AcquireWait, Backoff, Batcher, Capabilities, Driver, Error, FencingGuarantee, FencingToken,
    HolderIdentity, HolderInfo, Lease, LockKey, LossReason, OwnershipToken, Result,
};
use tokio::time::{Instant, sleep, sleep_until};
use tokio_util::sync::CancellationToken;

use crate::{
    EtcdLockConfig,
    error::{self, BACKEND, Failure, RequestError, protocol},
    keys,
    session::{Counters, Grant, KeepAliveError, Session, lock},
    watch::{Outcome, WatchMux},
};

/// The longest lease TTL etcd accepts (`MaxLeaseTTL`, 9,000,000,000 s).
const MAX_LEASE_TTL_SECS: u64 = 9_000_000_000;

/// A distributed lock client for etcd v3.
///
/// The mutex runs in the client, as Go's `concurrency.Mutex` does (etcd's server-side Lock RPC
/// is not used: in etcd 3.4 it can report success to a waiter whose lease already expired,
/// etcd#11456). Every contender of the lock `NAME` puts the key
/// `<prefix><NAME>/<lease id in hex>` attached to its lease; the one with the smallest create
/// revision holds the lock, and that create revision is the fencing token. `etcdctl lock
/// <prefix>NAME` and this client exclude each other.
///
/// All locks one client takes with the same TTL (in whole seconds) share one etcd lease (a
/// session), so keeping N held locks alive costs about one keepalive per renewal round, not N,
/// plus one batched read (up to 128 entries per txn) that proves each renewed entry still exists.
/// Releasing deletes only the lock's own key; the lease is revoked a short grace period after
/// no lock uses it any more (an acquisition meanwhile reuses it). A lock on a shared lease that is not renewed is deleted by this client at its local
/// deadline, so it does not outlive its TTL just because its neighbours are renewed.
///
/// Clones share the connection and the sessions.
#[derive(Clone)]
pub struct EtcdLock {
    inner: Arc<Inner>,
}

struct Inner {
    /// This client itself, for the idle-lease reapers it spawns.
    me: Weak<Inner>,
    client: Client,
    config: EtcdLockConfig,
    caps: Capabilities,
    sessions: Mutex<Vec<Arc<Session>>>,
    /// Serializes lease grants (see `session_for`).
    granting: tokio::sync::Mutex<()>,
    /// The deletion watches of held locks, on one stream.
    watches: WatchMux,
    /// Renewals' proofs that their entries still exist, batched into one read-only txn.
    checks: Batcher<Check, CheckAnswer>,
    counters: Arc<Counters>,
    /// Who this client is, written next to each of its entries' tokens (see
    /// [`keys::entry_value`]).
    identity: HolderIdentity,
}

/// An entry a renewal must find: key, create revision, lease.
type Check = (Vec<u8>, i64, i64);
/// Whether it was found as it should be, or why the read failed.
type CheckAnswer = std::result::Result<bool, (Failure, Arc<str>)>;

/// How long past its deadline an `acquire` may spend leaving the queue in the foreground.
const LEAVE_GRACE: Duration = Duration::from_millis(150);

/// The most operations etcd accepts in one txn by default (`--max-txn-ops`).
const MAX_TXN_OPS: usize = 128;

/// A waiter behind at most this many entries watches the whole queue and needs no read when
/// its turn comes ([`Inner::wait_turn`]); behind more it watches its predecessor only, so a
/// release wakes at most this many waiters.
const QUEUE_WATCH_MAX: usize = 32;

/// Who a waiter waits for, from one read of the queue.
enum Ahead {
    /// Every earlier entry (newest first), watched through the queue prefix from `from`.
    All { keys: Vec<Vec<u8>>, from: i64 },
    /// Only the newest earlier entry, watched from `from`; the queue is read again when it goes.
    Predecessor { key: Vec<u8>, from: i64 },
}

/// How many requests one [`EtcdLock`] client has sent to etcd, by kind (for measuring overhead).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EtcdRequestCounts {
    /// `LeaseGrant` calls.
    pub lease_grant: u64,
    /// `LeaseKeepAlive` requests (messages on keepalive streams, including each stream's first).
    pub lease_keepalive: u64,
    /// `LeaseRevoke` calls.
    pub lease_revoke: u64,
    /// `Txn` calls.
    pub txn: u64,
    /// `Range` calls.
    pub range: u64,
    /// Watches created.
    pub watch: u64,
}

impl EtcdRequestCounts {
    /// All requests.
    pub fn total(&self) -> u64 {
        self.lease_grant
            + self.lease_keepalive
            + self.lease_revoke
            + self.txn
            + self.range
            + self.watch
    }
}

/// Driver state carried by each lease.
struct Held {
    session: Arc<Session>,
    name: Vec<u8>,
    key: Vec<u8>,
    rev: i64,
    phase: Mutex<Phase>,
    /// Cancelled when the entry is known to be gone (lease dead, key deleted).
    gone: CancellationToken,
    /// Cancelled when the lease was released through this client.
    stop: CancellationToken,
}

struct Phase {
    /// When the keepalive (or grant) behind the current local deadline was sent.
    base: Instant,
    deadline: Instant,
    /// Released, reaped or gone: the session user was (or is being) removed.
    finished: bool,
}

impl Held {
    fn is_finished(&self) -> bool {
        lock(&self.phase).finished
    }

    /// Marks the entry finished; `true` for the one caller that did it.
    fn claim(&self) -> bool {
        let mut phase = lock(&self.phase);
        !std::mem::replace(&mut phase.finished, true)
    }

    fn claim_if_expired(&self) -> bool {
        let mut phase = lock(&self.phase);
        if phase.finished || phase.deadline > Instant::now() {
            return false;
        }
        phase.finished = true;
        true
    }
}

/// A contender's key in the queue, owned until it becomes a held lease or is discarded. Dropped
/// while armed (a cancelled acquire, an error), it deletes itself in the background.
struct Entry {
    inner: Arc<Inner>,
    session: Arc<Session>,
    name: Vec<u8>,
    key: Vec<u8>,
    token: OwnershipToken,
    /// Create revision; 0 while unknown (then the key is matched by its value).
    rev: i64,
    /// This attempt's abandonment marker (see [`keys::attempt_marker`]).
    marker: Vec<u8>,
    armed: bool,
    /// Who was ahead in the queue when the put applied (read by the put itself), so a waiter
    /// starts watching without reading the queue first.
    ahead: Option<Ahead>,
}

impl Entry {
    /// The entry's value: token and this client's holder identity ([`keys::entry_value`]). The
    /// identity rides in the put that creates the entry: no extra request, and it is deleted
    /// with the entry (lease expiry, release, force-release).
    fn value(&self) -> String {
        keys::entry_value(&self.token, &self.inner.identity)
    }

    /// The attempt's put (Go's `tryAcquire` txn): put our key if it does not exist and read the
    /// oldest key of the range and the newest [`QUEUE_WATCH_MAX`] + 1 (ours and who is ahead of
    /// it), else read our key. Conditional on the attempt's marker too: once a withdrawal wrote
    /// it, this put can never apply, however late it arrives (review L1).
    fn put_txn(&self) -> Txn {
        Txn::new()
            .when([
                Compare::create_revision(self.key.clone(), CompareOp::Equal, 0),
                Compare::create_revision(self.marker.clone(), CompareOp::Equal, 0),
            ])
            .and_then([
                TxnOp::put(
                    self.key.clone(),
                    self.value(),
                    Some(PutOptions::new().with_lease(self.session.id)),
                ),
                TxnOp::get(self.name.clone(), Some(first_create())),
                TxnOp::get(
                    self.name.clone(),
                    Some(
                        GetOptions::new()
                            .with_prefix()
                            .with_sort(SortTarget::Create, SortOrder::Descend)
                            .with_limit(QUEUE_WATCH_MAX as i64 + 1),
                    ),
                ),
            ])
            .or_else([TxnOp::get(self.key.clone(), None)])
    }

    /// Deletes the entry now, bounded by `until` (falling back to background retries when that
    /// fails).
    async fn discard(mut self, until: Instant) {
        self.armed = false;
        let target = Target::of(&self);
        if let Err(e) = self.inner.remove_entry(&target, until).await {
            tracing::debug!(error = %e.source, "deleting a queue entry failed; retrying in the background");
            spawn_cleanup(Arc::downgrade(&self.inner), target);
        }
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        if self.armed {
            spawn_cleanup(Arc::downgrade(&self.inner), Target::of(self));
        }
    }
}

/// What identifies an entry for a compare-and-delete.
#[derive(Clone)]
struct Target {
    session: Arc<Session>,
    name: Vec<u8>,
    key: Vec<u8>,
    rev: i64,
    /// The entry's value (token and identity), matched when the create revision is unknown.
    value: String,
    /// Set when the create revision is unknown (a put whose outcome is unknown may still be
    /// applied later): removing it also puts this marker, which the put requires absent.
    marker: Option<Vec<u8>>,
}

impl Target {
    fn of(e: &Entry) -> Self {
        Self {
            session: e.session.clone(),
            name: e.name.clone(),
            key: e.key.clone(),
            rev: e.rev,
            value: e.value(),
            marker: (e.rev <= 0).then(|| e.marker.clone()),
        }
    }

    /// The compare-and-delete of this entry. With an unknown create revision it matches the
    /// token, and also puts the attempt's marker in the same txn whatever the compare says:
    /// from then on the original put (conditional on the marker's absence) can never apply, so
    /// a put still in flight cannot leave a ghost entry behind (review L1).
    fn removal(&self) -> Txn {
        match &self.marker {
            None => Txn::new()
                .when([Compare::create_revision(
                    self.key.clone(),
                    CompareOp::Equal,
                    self.rev,
                )])
                .and_then([TxnOp::delete(self.key.clone(), None)]),
            Some(marker) => {
                let put_marker = TxnOp::put(
                    marker.clone(),
                    "",
                    Some(PutOptions::new().with_lease(self.session.id)),
                );
                Txn::new()
                    .when([Compare::value(
                        self.key.clone(),
                        CompareOp::Equal,
                        self.value.clone(),
                    )])
                    .and_then([TxnOp::delete(self.key.clone(), None), put_marker.clone()])
                    .or_else([put_marker])
            }
        }
    }
}

fn spawn_cleanup(inner: Weak<Inner>, target: Target) {
    let spawned = lock_core::raw::cleanup::spawn(async move {
        let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
        loop {
            if target.session.gone.is_cancelled() {
                if let Some(inner) = inner.upgrade() {
                    inner.drop_user(&target.session, &target.name).await;
                }
                return;
            }
            let Some(inner) = inner.upgrade() else {
                return; // The client is gone: the entry expires with its lease.
            };
            let until = Instant::now() + inner.timeout();
            match inner.remove_entry(&target, until).await {
                Ok(()) => return,
                Err(e) if e.is_permanent() => {
                    // Retrying cannot help (permission denied, credentials refused): stop, say
                    // so once, and let the entry go with its lease — no longer registered, the
                    // session is revoked or expires once its other locks are released.
                    tracing::warn!(
                        lock = %String::from_utf8_lossy(&target.name),
                        error = %e.source,
                        "etcd refuses to delete a lock entry for good; giving up: it goes when its lease ends"
                    );
                    inner.drop_user(&target.session, &target.name).await;
                    return;
                }
                Err(e) => {
                    tracing::debug!(error = %e.source, "deleting a lock entry failed; retrying")
                }
            }
            drop(inner);
            tokio::select! {
                () = sleep(backoff.next_delay()) => {}
                () = target.session.gone.cancelled() => {}
            }
        }
    });
    if !spawned {
        tracing::warn!("lock entry abandoned outside a runtime; it expires with its lease");
    }
}

fn ttl_secs(ttl: Duration) -> i64 {
    let secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
    i64::try_from(secs).unwrap_or(i64::MAX)
}

fn first_create() -> GetOptions {
    GetOptions::new()
        .with_prefix()
        .with_sort(SortTarget::Create, SortOrder::Ascend)
        .with_limit(1)
}

fn txn_get(resp: &TxnResponse, index: usize) -> Option<etcd_client::GetResponse> {
    match resp.op_responses().into_iter().nth(index)? {
        TxnOpResponse::Get(get) => Some(get),
        _ => None,
    }
}

fn queue_entry_lost(key: &LockKey) -> Error {
    Error::Backend {
        backend: BACKEND,
        op: "acquire",
        message: format!(
            "the queue entry for lock {:?} was deleted while waiting (its lease expired or was revoked)",
            key.as_str()
        ),
        source: None,
    }
}

impl EtcdLock {
    /// Connects to the cluster described by `config`.
    ///
    /// The connection itself is made lazily by the first request. Unless `config.min_ttl` is
    /// set, this asks the server for its smallest lease (one grant and one revoke).
    ///
    /// # Errors
    /// [`Error::Config`] for bad settings or unreadable TLS files; `Unavailable` when the server
    /// cannot be reached for authentication or the probe.
    pub async fn connect(mut config: EtcdLockConfig) -> Result<Self> {
        config.validate()?;
        let identity = HolderIdentity::process(config.label.as_deref())?;
        config.prefix = config.normalized_prefix();
        let mut options = ConnectOptions::new()
            .with_connect_timeout(config.dial_timeout)
            .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5))
            // A member that has lost its leader refuses at once instead of serving stale
            // watches or stalling requests (review L4).
            .with_require_leader(true);
        if let Some(user) = &config.user {
            // Re-authenticates when the token expired (etcd's simple tokens live 5 min by
            // default), instead of failing every later request for good (review L5).
            options = options
                .with_user(user.clone(), config.password.clone().unwrap_or_default())
                .with_auto_token_refresh(true);
        }
        let scheme = if let Some(tls) = &config.tls {
            let mut t = TlsOptions::new();
            if let Some(ca) = &tls.ca_file {
                t = t.ca_certificate(Certificate::from_pem(read_file(ca, "ca_file")?));
            }
            if let (Some(cert), Some(key)) = (&tls.cert_file, &tls.key_file) {
                t = t.identity(Identity::from_pem(
                    read_file(cert, "cert_file")?,
                    read_file(key, "key_file")?,
                ));
            }
            if let Some(domain) = &tls.domain {
                t = t.domain_name(domain.clone());
            }
            options = options.with_tls(t);
            "https"
        } else {
            "http"
        };
        let endpoints: Vec<String> = config
            .endpoints
            .iter()
            .map(|e| format!("{scheme}://{e}"))
            .collect();
        let client = error::request(
            config.dial_timeout.saturating_add(config.request_timeout),
            Client::connect(endpoints, Some(options)),
        )
        .await
        .map_err(|e| e.into_error("connect"))?;
        let counters = Arc::new(Counters::default());
        let min_ttl = match config.min_ttl {
            Some(t) => t,
            None => probe_min_ttl(&client, &config, &counters).await?,
        };
        let caps = Capabilities {
            lease_ttl: true,
            renew: true,
            fencing: FencingGuarantee::Quorum,
            wait_notify: true,
            fair_queue: true,
            lost_notify: true,
            force_release: true,
            min_ttl,
            max_ttl: Duration::from_secs(MAX_LEASE_TTL_SECS),
            ttl_granularity: Duration::from_secs(1),
            ..Default::default()
        };
        let watches = WatchMux::new(client.clone(), counters.clone());
        Ok(Self {
            inner: Arc::new_cyclic(|me| Inner {
                me: me.clone(),
                client,
                config,
                caps,
                sessions: Mutex::new(Vec::new()),
                granting: tokio::sync::Mutex::new(()),
                watches,
                checks: Batcher::new(MAX_TXN_OPS),
                counters,
                identity,
            }),
        })
    }

    /// Parses `url` ([`EtcdLockConfig::from_url`]) and connects.
    ///
    /// # Errors
    /// As [`EtcdLockConfig::from_url`] and [`EtcdLock::connect`].
    pub async fn connect_url(url: &str) -> Result<Self> {
        Self::connect(EtcdLockConfig::from_url(url)?).await
    }

    /// The settings this client was built with (the prefix as used: see
    /// [`EtcdLockConfig::normalized_prefix`]).
    pub fn config(&self) -> &EtcdLockConfig {
        &self.inner.config
    }

    /// Requests sent so far, by kind.
    pub fn request_counts(&self) -> EtcdRequestCounts {
        use std::sync::atomic::Ordering::Relaxed;
        let c = &self.inner.counters;
        EtcdRequestCounts {
            lease_grant: c.lease_grant.load(Relaxed),
            lease_keepalive: c.lease_keepalive.load(Relaxed),
            lease_revoke: c.lease_revoke.load(Relaxed),
            txn: c.txn.load(Relaxed),
            range: c.range.load(Relaxed),
            watch: c.watch.load(Relaxed),
        }
    }

    /// How many etcd leases (sessions) this client keeps for its locks right now.
    pub fn session_count(&self) -> usize {
        lock(&self.inner.sessions).len()
    }

    /// The etcd lease id `lease` is attached to (shared with this client's other locks of the
    /// same TTL), or `None` for a lease from another backend.
    pub fn lease_id(lease: &Lease) -> Option<i64> {
        lease.backend_state::<Arc<Held>>().map(|h| h.session.id)
    }

    /// The etcd key of `lease`'s entry (`<prefix><name>/<lease id hex>`).
    pub fn entry_key(lease: &Lease) -> Option<Vec<u8>> {
        lease.backend_state::<Arc<Held>>().map(|h| h.key.clone())
    }
}

impl EtcdLock {
    /// One pass of `acquire`: put our entry, wait for our turn, prove the lease alive. Every
    /// request gets at most what is left of the wait's deadline.
    async fn acquire_once(
        &self,
        key: &LockKey,
        ttl: Duration,
        wait: &AcquireWait,
    ) -> Result<Lease> {
        let inner = &self.inner;
        let until = wait.deadline();
        let (mut entry, owned, base) = inner.put_entry(key, ttl, "acquire", until).await?;
        let (entry, base) = if owned {
            (entry, base)
        } else {
            let first = entry.ahead.take();
            if let Err(e) = inner.wait_turn(&entry, first, key, ttl, wait).await {
                // Leave the queue before returning when that is quick (a waiter that timed out
                // must not be handed the lock next); past a short grace the rest goes to the
                // background, so the deadline is overshot by that grace at most.
                entry.discard(until.max(Instant::now()) + LEAVE_GRACE).await;
                return Err(e);
            }
            match entry.session.keep_alive(ttl / 8, None, until).await {
                Ok(base) => (entry, base),
                Err(KeepAliveError::Gone) => {
                    entry.discard(until).await;
                    return Err(queue_entry_lost(key));
                }
                // The waiter's last acknowledged keepalive still bounds the lease; `hold`
                // refuses it if that is already too old.
                Err(KeepAliveError::Failed(_)) => {
                    let ack = entry.session.ack();
                    (entry, ack)
                }
            }
        };
        match inner.hold(entry, key, ttl, base) {
            Ok(lease) => Ok(lease),
            Err(entry) => {
                // Too late to trust: give the turn up (the next in line is granted) and try
                // again while the deadline allows (review S3).
                (*entry).discard(Instant::now() + inner.timeout()).await;
                Err(expired_on_arrival("acquire"))
            }
        }
    }
}

/// Whom to wait for, from a read of the queue at `revision` (`from` − 1) holding the newest
/// keys of `name` (newest first; keys created at or after `own_rev` are skipped), `more` when
/// the read was cut by its limit. `None`: nobody contends ahead of us, or the read says too
/// little (the waiter then reads the queue itself).
fn ahead_of(
    name: &[u8],
    own_rev: i64,
    newest: &[KeyValue],
    more: bool,
    from: i64,
) -> Option<Ahead> {
    let mut earlier = newest
        .iter()
        .filter(|kv| kv.create_revision() < own_rev && keys::is_entry(name, kv.key(), kv.lease()))
        .map(|kv| kv.key().to_vec());
    if more {
        let key = earlier.next()?;
        return Some(Ahead::Predecessor { key, from });
    }
    let keys: Vec<Vec<u8>> = earlier.collect();
    (!keys.is_empty()).then_some(Ahead::All { keys, from })
}

/// A grant whose local deadline had passed by the time it was confirmed.
fn expired_on_arrival(op: &'static str) -> Error {
    Error::Unavailable {
        backend: BACKEND,
        op,
        message: "etcd answered too late: the lease's local deadline had already passed, so the grant was withdrawn".into(),
        source: None,
    }
}

fn read_file(path: &std::path::Path, what: &str) -> Result<Vec<u8>> {
    std::fs::read(path)
        .map_err(|e| Error::Config(format!("etcd: cannot read {what} {}: {e}", path.display())))
}

/// Asks the server which TTL it grants for a 1 s lease (etcd raises short leases to its
/// minimum, about 1.5 election timeouts).
async fn probe_min_ttl(
    client: &Client,
    config: &EtcdLockConfig,
    counters: &Counters,
) -> Result<Duration> {
    Counters::bump(&counters.lease_grant);
    let resp = error::request(config.request_timeout, client.lease_client().grant(1, None))
        .await
        .map_err(|e| e.into_error("connect"))?;
    Counters::bump(&counters.lease_revoke);
    if let Err(e) = error::request(
        config.request_timeout,
        client.lease_client().revoke(resp.id()),
    )
    .await
    {
        tracing::debug!(error = %e.source, "revoking the probe lease failed; it expires by itself");
    }
    let secs = u64::try_from(resp.ttl()).unwrap_or(0).max(1);
    Ok(Duration::from_secs(secs))
}

impl Inner {
    fn timeout(&self) -> Duration {
        self.config.request_timeout
    }

    /// The owner of `key` (its oldest contender entry) and how many entries wait behind it.
    /// Keys under the range that are no entries ([`keys::is_entry`]) are skipped.
    async fn read_owner(
        &self,
        key: &LockKey,
        op: &'static str,
    ) -> Result<Option<(KeyValue, usize)>> {
        let name = keys::name_prefix(&self.config.prefix, key);
        let until = Instant::now() + self.timeout();
        Counters::bump(&self.counters.range);
        let resp = error::request(
            self.timeout(),
            self.client
                .kv_client()
                .get(name.clone(), Some(first_create())),
        )
        .await
        .map_err(|e| e.into_error(op))?;
        match resp.kvs().first() {
            None => Ok(None),
            Some(kv) if keys::is_entry(&name, kv.key(), kv.lease()) => {
                let waiters = usize::try_from(resp.count() - 1).unwrap_or(0);
                Ok(Some((kv.clone(), waiters)))
            }
            Some(_) => {
                let entries = self
                    .entries_of(&name, None, until)
                    .await
                    .map_err(|e| e.into_error(op))?;
                let waiters = entries.len().saturating_sub(1);
                Ok(entries.into_iter().next().map(|kv| (kv, waiters)))
            }
        }
    }

    fn forget(&self, session: &Arc<Session>) {
        lock(&self.sessions).retain(|s| !Arc::ptr_eq(s, session));
    }

    /// Revokes a retired session's lease, bounded by `until`. On failure the lease expires by
    /// its TTL: nothing keeps a retired session alive.
    async fn revoke(&self, session: &Session, until: Instant) -> Result<(), RequestError> {
        Counters::bump(&self.counters.lease_revoke);
        match error::request_until(
            self.timeout(),
            until,
            self.client.lease_client().revoke(session.id),
        )
        .await
        {
            Ok(_)
            | Err(RequestError {
                failure: Failure::LeaseNotFound,
                ..
            }) => {
                session.mark_gone();
                Ok(())
            }
            Err(e) => {
                tracing::debug!(error = %e.source, "revoking an unused lease failed; it expires by its ttl");
                Err(e)
            }
        }
    }

    /// Unregisters `name` from `session`. A lease that nothing uses any more stays in the pool
    /// for a short grace period (a quarter of its TTL, at most 1 s), so the next acquisition
    /// with that TTL reuses it instead of granting a new one — a lock taken and released in a
    /// loop then costs two requests, not four. It is revoked when the grace period ends unused;
    /// an idle lease has no keys, so leaving it to expire (client gone) is harmless.
    async fn drop_user(&self, session: &Arc<Session>, name: &[u8]) {
        let Some(idle_since) = session.remove_user(name) else {
            return;
        };
        if session.gone.is_cancelled() {
            self.forget(session);
            return;
        }
        let grace = (session.granted / 4).min(Duration::from_secs(1));
        let (me, session) = (self.me.clone(), session.clone());
        tokio::spawn(async move {
            sleep(grace).await;
            if session.retire_if_idle(idle_since)
                && let Some(inner) = me.upgrade()
            {
                // An idle lease has no keys: if this fails it just expires by its TTL.
                let _ = inner
                    .revoke(&session, Instant::now() + inner.timeout())
                    .await;
                inner.forget(&session);
            }
        });
    }

    /// Compare-and-delete of one entry; revokes the session instead when it was its last user.
    async fn remove_entry(&self, t: &Target, until: Instant) -> Result<(), RequestError> {
        if t.session.gone.is_cancelled() {
            self.drop_user(&t.session, &t.name).await;
            return Ok(());
        }
        if t.session.take_last_user(&t.name) {
            // Revoking the lease deletes the entry with it. Should that fail, the session is
            // retired all the same (nothing keeps its lease alive) and the caller's retries
            // delete the entry itself, so it does not block the lock until the lease expires.
            self.forget(&t.session);
            return self.revoke(&t.session, until).await;
        }
        Counters::bump(&self.counters.txn);
        match error::request_until(
            self.timeout(),
            until,
            self.client.kv_client().txn(t.removal()),
        )
        .await
        {
            Ok(_) => {}
            Err(RequestError {
                failure: Failure::LeaseNotFound,
                ..
            }) => {
                // The lease is gone, and every key on it; a late put on it fails.
                t.session.mark_gone();
                self.forget(&t.session);
            }
            Err(e) => return Err(e),
        }
        self.drop_user(&t.session, &t.name).await;
        Ok(())
    }

    /// Proves that each entry still exists with its create revision on its lease: one
    /// linearizable read-only txn for every renewal that asks while another batch is out.
    async fn check_entries(&self, check: Check, until: Instant) -> CheckAnswer {
        let (client, counters, timeout) =
            (self.client.clone(), self.counters.clone(), self.timeout());
        let run = move |items: Vec<Check>| {
            let (client, counters) = (client.clone(), counters.clone());
            async move {
                Counters::bump(&counters.txn);
                let reads = items.iter().map(|(key, _, _)| {
                    TxnOp::get(key.clone(), Some(GetOptions::new().with_keys_only()))
                });
                let txn = Txn::new().and_then(reads.collect::<Vec<_>>());
                match error::request(timeout, client.kv_client().txn(txn)).await {
                    Ok(resp) => items
                        .iter()
                        .enumerate()
                        .map(|(i, (_, rev, lease))| match txn_get(&resp, i) {
                            Some(get) => Ok(get.kvs().first().is_some_and(|kv| {
                                kv.create_revision() == *rev && kv.lease() == *lease
                            })),
                            None => {
                                Err((Failure::Rejected, "etcd's txn reply lacks a read".into()))
                            }
                        })
                        .collect(),
                    Err(e) => {
                        let why: Arc<str> = e.source.to_string().into();
                        items
                            .iter()
                            .map(|_| Err((e.failure, why.clone())))
                            .collect()
                    }
                }
            }
        };
        match tokio::time::timeout_at(until, self.checks.submit(check, run)).await {
            Ok(Some(answer)) => answer,
            Ok(None) => Err((
                Failure::Unknown,
                "the entry check ended without an answer".into(),
            )),
            Err(_) => Err((
                Failure::Unknown,
                "no answer to the entry check within the caller's deadline".into(),
            )),
        }
    }

    /// A live session for `ttl` with `name` registered on it, and when its lease was last
    /// confirmed alive (the lease lives at least until then plus its TTL).
    async fn session_for(
        &self,
        name: &[u8],
        ttl: Duration,
        until: Instant,
    ) -> Result<(Arc<Session>, Instant)> {
        let secs = ttl_secs(ttl);
        // Held while granting, so acquisitions that start together share one new lease
        // instead of granting one each.
        let mut granting = None;
        loop {
            let existing = lock(&self.sessions)
                .iter()
                .find(|s| s.requested_secs == secs && s.try_add_user(name))
                .cloned();
            let Some(session) = existing else {
                if granting.is_none() {
                    granting = Some(
                        tokio::time::timeout_at(until, self.granting.lock())
                            .await
                            .map_err(|_| {
                                Error::unavailable(
                                    BACKEND,
                                    "acquire",
                                    "waiting for another acquisition's lease grant took the whole deadline",
                                )
                            })?,
                    );
                    // Someone may have granted while we waited: look again.
                    continue;
                }
                break;
            };
            drop(granting.take());
            match session.keep_alive(ttl / 8, None, until).await {
                Ok(base) => return Ok((session, base)),
                Err(KeepAliveError::Gone) => {
                    self.forget(&session);
                }
                Err(KeepAliveError::Failed(e)) => {
                    self.drop_user(&session, name).await;
                    return Err(e.into_error("acquire"));
                }
            }
        }
        let sent = Instant::now();
        Counters::bump(&self.counters.lease_grant);
        let resp = error::request_until(
            self.timeout(),
            until,
            self.client.lease_client().grant(secs, None),
        )
        .await
        .map_err(|e| e.into_error("acquire"))?;
        let granted = Duration::from_secs(u64::try_from(resp.ttl()).unwrap_or(0));
        let session = Arc::new(Session::new(
            Grant {
                id: resp.id(),
                requested_secs: secs,
                granted,
                sent_at: sent,
            },
            name.to_vec(),
            self.client.lease_client(),
            self.timeout(),
            self.counters.clone(),
        ));
        if granted < ttl {
            // Never happens with etcd (it only raises short TTLs), but never trust a shorter lease.
            let _ = self.revoke(&session, until).await;
            return Err(protocol(
                "acquire",
                format!("etcd granted a {granted:?} lease for a {ttl:?} ttl"),
            ));
        }
        lock(&self.sessions).push(session.clone());
        Ok((session, sent))
    }

    /// Puts this contender's entry for `key` (Go's `tryAcquire`): returns it, whether it is the
    /// owner, and the base instant of its local deadline. Every request gets at most what is
    /// left until `until`.
    async fn put_entry(
        self: &Arc<Self>,
        key: &LockKey,
        ttl: Duration,
        op: &'static str,
        until: Instant,
    ) -> Result<(Entry, bool, Instant)> {
        let name = keys::name_prefix(&self.config.prefix, key);
        for _ in 0..3 {
            let (session, base) = self.session_for(&name, ttl, until).await?;
            let token = OwnershipToken::generate();
            let mut entry = Entry {
                inner: self.clone(),
                key: keys::entry_key(&name, session.id),
                name: name.clone(),
                session,
                token,
                rev: 0,
                marker: keys::attempt_marker(&self.config.prefix, rand::random()),
                armed: true,
                ahead: None,
            };
            let txn = entry.put_txn();
            Counters::bump(&self.counters.txn);
            match error::request_until(self.timeout(), until, self.client.kv_client().txn(txn))
                .await
            {
                Ok(resp) if resp.succeeded() => {
                    let rev = resp.header().map_or(0, |h| h.revision());
                    let first = txn_get(&resp, 1).and_then(|g| g.kvs().first().cloned());
                    let Some(first) = first.filter(|_| rev > 0) else {
                        // Applied, but unreadable: ours to remove (the marker makes sure).
                        entry.discard(until).await;
                        return Err(protocol(op, "etcd's txn reply lacks a revision or owner"));
                    };
                    entry.rev = rev;
                    entry.ahead = txn_get(&resp, 2).and_then(|newest| {
                        ahead_of(&name, rev, newest.kvs(), newest.more(), rev + 1)
                    });
                    let owner = match self.owner_rev(&name, &first, until).await {
                        Ok(owner) => owner,
                        Err(e) => {
                            entry.discard(until).await;
                            return Err(e.into_error(op));
                        }
                    };
                    return Ok((entry, owner == Some(rev), base));
                }
                Ok(resp) => {
                    // Our key already exists although nobody in this client has an entry for
                    // this name on this lease (the name is registered per session): a leftover
                    // of an attempt whose outcome was unknown. Nobody owns it; delete it and try
                    // again, so it can never block this or any other client for good.
                    let leftover = txn_get(&resp, 0)
                        .and_then(|g| g.kvs().first().map(KeyValue::create_revision));
                    entry.armed = false;
                    if let Some(rev) = leftover {
                        tracing::debug!(%key, "deleting a leftover entry on this client's lease");
                        let target = Target {
                            session: entry.session.clone(),
                            name: entry.name.clone(),
                            key: entry.key.clone(),
                            rev,
                            value: entry.value(),
                            marker: None,
                        };
                        if let Err(e) = self.remove_entry(&target, until).await {
                            spawn_cleanup(Arc::downgrade(self), target);
                            return Err(e.into_error(op));
                        }
                    } else {
                        self.drop_user(&entry.session, &name).await;
                    }
                }
                Err(e) if e.failure == Failure::LeaseNotFound => {
                    entry.armed = false;
                    entry.session.mark_gone();
                    self.forget(&entry.session);
                }
                Err(e) if e.failure == Failure::Unknown => {
                    return self.find_lost_put(entry, key, e, base, op, until).await;
                }
                Err(e) => {
                    entry.armed = false;
                    self.drop_user(&entry.session, &name).await;
                    return Err(e.into_error(op));
                }
            }
        }
        Err(Error::unavailable(
            BACKEND,
            op,
            "the session lease kept vanishing or a leftover entry kept coming back",
        ))
    }

    /// The create revision of the owner of the range `name`, given the oldest key under it.
    /// Keys that are not contender entries ([`keys::is_entry`]) are skipped with a full read
    /// of the range (only then: normally the oldest key is an entry).
    async fn owner_rev(
        &self,
        name: &[u8],
        first: &KeyValue,
        until: Instant,
    ) -> Result<Option<i64>, RequestError> {
        if keys::is_entry(name, first.key(), first.lease()) {
            return Ok(Some(first.create_revision()));
        }
        Ok(self
            .entries_of(name, None, until)
            .await?
            .first()
            .map(|kv| kv.create_revision()))
    }

    /// Every contender entry under `name` (created at or before `max_rev`), oldest first.
    async fn entries_of(
        &self,
        name: &[u8],
        max_rev: Option<i64>,
        until: Instant,
    ) -> Result<Vec<KeyValue>, RequestError> {
        let mut opts = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend);
        if let Some(rev) = max_rev {
            opts = opts.with_max_create_revision(rev);
        }
        Counters::bump(&self.counters.range);
        let resp = error::request_until(
            self.timeout(),
            until,
            self.client.kv_client().get(name.to_vec(), Some(opts)),
        )
        .await?;
        Ok(resp
            .kvs()
            .iter()
            .filter(|kv| keys::is_entry(name, kv.key(), kv.lease()))
            .cloned()
            .collect())
    }

    /// The put's reply was lost: look for our key (its name is known) before deciding. Found
    /// with our token → adopted. Absent is not trusted on its own (the put may still be on its
    /// way): the attempt is abandoned with its marker, which also deletes the entry should it
    /// have landed meanwhile. Only once that succeeded is "not applied" certain.
    async fn find_lost_put(
        self: &Arc<Self>,
        mut entry: Entry,
        key: &LockKey,
        err: RequestError,
        base: Instant,
        op: &'static str,
        until: Instant,
    ) -> Result<(Entry, bool, Instant)> {
        Counters::bump(&self.counters.range);
        let found = error::request_until(
            self.timeout(),
            until,
            self.client.kv_client().get(entry.key.clone(), None),
        )
        .await;
        if let Ok(resp) = found
            && let Some(kv) = resp.kvs().first()
            && kv.value() == entry.value().as_bytes()
            && kv.lease() == entry.session.id
        {
            entry.rev = kv.create_revision();
            if let Ok(owner) = self.entries_of(&entry.name, None, until).await {
                let owned = owner.first().map(KeyValue::create_revision) == Some(entry.rev);
                return Ok((entry, owned, base));
            }
            // Ours, but its place is unknown: delete it by its create revision.
        }
        let target = Target::of(&entry);
        entry.armed = false;
        match self.remove_entry(&target, until).await {
            Ok(()) => Err(Error::Unavailable {
                backend: BACKEND,
                op,
                message: format!("{}; the attempt was withdrawn", err.source),
                source: Some(err.source),
            }),
            Err(e) => {
                tracing::debug!(error = %e.source, "withdrawing an attempt failed; retrying in the background");
                spawn_cleanup(Arc::downgrade(self), target);
                Err(Error::Indeterminate {
                    backend: BACKEND,
                    op,
                    key: key.as_str().to_owned(),
                    message: err.source.to_string(),
                })
            }
        }
    }

    /// Turns an owning entry into a lease, and arms its reaper. Hands the entry back when the
    /// lease's local deadline (from `base`, the send time of the request that last proved the
    /// session alive) has already passed: such a lease must never reach the caller (review S3).
    fn hold(
        self: &Arc<Self>,
        mut entry: Entry,
        key: &LockKey,
        ttl: Duration,
        base: Instant,
    ) -> std::result::Result<Lease, Box<Entry>> {
        let fence = u64::try_from(entry.rev).ok().map(FencingToken);
        let lease = Lease::new(key.clone(), entry.token, fence, ttl, base);
        if !lease.is_locally_valid() {
            return Err(Box::new(entry));
        }
        entry.armed = false;
        let held = Arc::new(Held {
            gone: entry.session.gone.child_token(),
            session: entry.session.clone(),
            name: std::mem::take(&mut entry.name),
            key: std::mem::take(&mut entry.key),
            rev: entry.rev,
            phase: Mutex::new(Phase {
                base,
                deadline: base,
                finished: false,
            }),
            stop: CancellationToken::new(),
        });
        let lease = lease.with_backend_state(held.clone());
        lock(&held.phase).deadline = lease.local_deadline();
        tokio::spawn(reap(Arc::downgrade(self), held));
        Ok(lease)
    }

    /// Waits until every entry created before ours is gone (Go's `waitDeletes`), keeping our
    /// lease alive meanwhile, and makes sure our own entry still exists (the check etcd#11456 is
    /// about).
    ///
    /// Each look at the queue is one read-only transaction that also reads our own entry (gone →
    /// error, never `Ok`). It reads up to [`QUEUE_WATCH_MAX`] entries older than ours. When that
    /// is all of them, the waiter watches the whole queue prefix (deletions only) from just
    /// after the read and crosses each earlier entry off as its deletion arrives: events arrive
    /// in revision order, so when the last earlier entry's deletion arrives with no deletion of
    /// our own key before it, at that revision no earlier entry existed (create revisions only
    /// grow, so none can appear) and ours did — the lock is ours without another read. A
    /// hand-off then costs the holder's delete and one watch event, wherever the waiter stood
    /// in the queue (with only the next in line watching the prefix, every other waiter read
    /// the queue again when its predecessor went: one more round trip on the contended path).
    /// Behind more entries than that, a waiter watches only its immediate predecessor (no herd
    /// of events) and looks again when that one goes.
    async fn wait_turn(
        &self,
        entry: &Entry,
        mut first: Option<Ahead>,
        key: &LockKey,
        ttl: Duration,
        wait: &AcquireWait,
    ) -> Result<()> {
        let until = wait.deadline();
        let keepalive_every = ttl / 3;
        let mut next_keepalive = Instant::now() + keepalive_every;
        let mut backoff = Backoff::new(Duration::from_millis(20), Duration::from_secs(1));
        // Even with a watch open, look at the queue again on this period: a watch served by a
        // member cut off from the cluster, or an event lost, must not leave the waiter asleep
        // until its deadline (review L4).
        let reread_every = (ttl / 2).clamp(Duration::from_secs(1), Duration::from_secs(5));
        let session = &entry.session;
        // Cleared when a queue watch was refused (compacted).
        let mut queue_watch_ok = true;
        // A queue watch kept across a read of the queue: it reports every deletion after the
        // revision it started at, so a read at that revision or later can go on with it.
        let mut carried: Option<(WatchStream, i64)> = None;
        'queue: loop {
            if Instant::now() >= until {
                return Err(wait.timeout());
            }
            // The put's own read says who is ahead the first time; later looks read the queue.
            let pred = if let Some(ahead) = first.take() {
                Some(ahead)
            } else {
                // One read-only transaction: the newest entries older than ours, and our own entry.
                Counters::bump(&self.counters.txn);
                let opts = GetOptions::new()
                    .with_prefix()
                    .with_sort(SortTarget::Create, SortOrder::Descend)
                    .with_max_create_revision(entry.rev - 1)
                    .with_limit(QUEUE_WATCH_MAX as i64);
                let read = Txn::new().and_then([
                    TxnOp::get(entry.name.clone(), Some(opts)),
                    TxnOp::get(entry.key.clone(), None),
                ]);
                let read =
                    error::request_until(self.timeout(), until, self.client.kv_client().txn(read))
                        .await;
                match read {
                    Ok(resp) => {
                        let (Some(queue), Some(own)) = (txn_get(&resp, 0), txn_get(&resp, 1))
                        else {
                            return Err(protocol("acquire", "etcd's txn reply lacks a read"));
                        };
                        match own.kvs().first() {
                            Some(kv) if kv.create_revision() == entry.rev => {}
                            _ => return Err(queue_entry_lost(key)),
                        }
                        let earlier: Vec<&KeyValue> = queue
                            .kvs()
                            .iter()
                            .filter(|kv| keys::is_entry(&entry.name, kv.key(), kv.lease()))
                            .collect();
                        match (queue.kvs().first(), resp.header()) {
                            // No earlier entry and ours exists, at one revision: the lock is ours.
                            (None, _) => return Ok(()),
                            // `more` is computed after the create-revision filter: false means
                            // these are all the keys older than ours.
                            (Some(_), Some(h)) if !queue.more() => {
                                if earlier.is_empty() {
                                    // Only keys that are no contender: nobody is ahead of us.
                                    return Ok(());
                                }
                                Some(Ahead::All {
                                    keys: earlier.iter().map(|kv| kv.key().to_vec()).collect(),
                                    from: h.revision() + 1,
                                })
                            }
                            (Some(_), Some(h)) if !earlier.is_empty() => Some(Ahead::Predecessor {
                                key: earlier[0].key().to_vec(),
                                from: h.revision() + 1,
                            }),
                            (Some(_), Some(_)) => {
                                // A key under our range that is no contender: look at the entries
                                // only (rare). No shortcut: the watch is then on the predecessor.
                                match self
                                    .entries_of(&entry.name, Some(entry.rev - 1), until)
                                    .await
                                {
                                    Ok(earlier) => match earlier.last() {
                                        None => {
                                            // Ours must still exist: read again, it costs one txn.
                                            if self.own_entry_exists(entry, until).await? {
                                                return Ok(());
                                            }
                                            return Err(queue_entry_lost(key));
                                        }
                                        Some(kv) => Some(Ahead::Predecessor {
                                            key: kv.key().to_vec(),
                                            from: kv.mod_revision().max(kv.create_revision()) + 1,
                                        }),
                                    },
                                    Err(e) => {
                                        tracing::debug!(%key, error = %e.source, "reading the lock queue failed; retrying");
                                        None
                                    }
                                }
                            }
                            (Some(_), None) => None,
                        }
                    }
                    Err(e) => {
                        tracing::debug!(%key, error = %e.source, "reading the lock queue failed; retrying");
                        None
                    }
                }
            };
            // The earlier entries not yet seen deleted, while watching the whole queue, and the
            // first revision whose deletions count (older ones happened before the read).
            let mut ahead: Option<HashSet<Vec<u8>>> = None;
            let mut min_rev = 0;
            let carried_watch = carried.take();
            let pred = match pred {
                // A refused queue watch (compacted): watch the newest earlier entry instead.
                Some(Ahead::All { keys, from }) if !queue_watch_ok => {
                    let newest = keys.into_iter().next();
                    newest.map(|key| Ahead::Predecessor { key, from })
                }
                other => other,
            };
            let mut stream = match pred {
                Some(Ahead::All { keys, from }) => {
                    let watch = match carried_watch {
                        Some((stream, start)) if start < from => Some((stream, start)),
                        _ => self.queue_watch(&entry.name, until).await,
                    };
                    match watch {
                        // It reports everything after the read: go on with it.
                        Some((stream, start)) if start < from => {
                            ahead = Some(keys.into_iter().collect());
                            min_rev = from;
                            Some(stream)
                        }
                        // Deletions between the read and the watch's start were not seen:
                        // read the queue again (at or after the start) and keep this watch.
                        Some(started) => {
                            carried = Some(started);
                            continue 'queue;
                        }
                        None => None,
                    }
                }
                Some(Ahead::Predecessor {
                    key: pred_key,
                    from,
                }) => {
                    Counters::bump(&self.counters.watch);
                    let opts = WatchOptions::new()
                        .with_start_revision(from)
                        .with_filters([WatchFilterType::NoPut]);
                    error::request_until(
                        self.timeout(),
                        until,
                        self.client.watch_client().watch(pred_key, Some(opts)),
                    )
                    .await
                    .ok()
                }
                None => None,
            };
            let mut retry_at = if stream.is_some() {
                Instant::now() + reread_every
            } else {
                Instant::now() + backoff.next_delay()
            };
            loop {
                tokio::select! {
                    biased;
                    () = session.gone.cancelled() => return Err(queue_entry_lost(key)),
                    () = sleep_until(until) => return Err(wait.timeout()),
                    () = sleep_until(next_keepalive) => {
                        // Bounded by the deadline: a stalled keepalive never holds the waiter
                        // past it (review L3).
                        next_keepalive = match session.keep_alive(ttl / 8, None, until).await {
                            Ok(_) => Instant::now() + keepalive_every,
                            Err(KeepAliveError::Gone) => return Err(queue_entry_lost(key)),
                            Err(KeepAliveError::Failed(e)) => {
                                tracing::debug!(%key, error = %e.source, "waiter keepalive failed; retrying");
                                Instant::now() + (keepalive_every / 4)
                            }
                        };
                    }
                    () = sleep_until(retry_at) => {
                        // A queue watch stays valid across the look at the queue.
                        if let (Some(s), Some(_)) = (stream.take(), ahead.as_ref()) {
                            carried = Some((s, min_rev - 1));
                        }
                        continue 'queue;
                    }
                    msg = async { match stream.as_mut() { Some(s) => s.message().await, None => std::future::pending().await } } => {
                        match msg {
                            Ok(Some(resp)) if resp.events().is_empty() && !resp.canceled() => {}
                            Ok(Some(resp)) => {
                                let Some(waiting_for) = ahead.as_mut() else {
                                    backoff.reset();
                                    continue 'queue;
                                };
                                if resp.canceled() {
                                    // Most likely compacted past our creation: fall back to
                                    // watching the predecessor and reading again.
                                    queue_watch_ok = false;
                                    continue 'queue;
                                }
                                for event in resp.events() {
                                    let Some(kv) = event.kv() else { continue };
                                    // A deletion before the read is already in `waiting_for`
                                    // (and may be an earlier entry of the same key name).
                                    if event.event_type() != EventType::Delete
                                        || kv.mod_revision() < min_rev
                                    {
                                        continue;
                                    }
                                    if kv.key() == entry.key.as_slice() {
                                        return Err(queue_entry_lost(key));
                                    }
                                    if waiting_for.remove(kv.key()) && waiting_for.is_empty() {
                                        return Ok(());
                                    }
                                }
                            }
                            Ok(None) | Err(_) => {
                                stream = None;
                                retry_at = retry_at.min(Instant::now() + backoff.next_delay());
                            }
                        }
                    }
                }
            }
        }
    }

    /// Watches the deletions under the queue prefix `name` from now on, and returns the stream
    /// with the revision the watch started after (from its creation reply). No start revision
    /// on purpose: etcd registers a watch that asks for a past revision as "unsynced" and
    /// catches those up only every 100 ms (`syncWatchersLoop`), which under contention — the
    /// queue changes between a read and the watch — put a 100 ms stall on most hand-offs.
    async fn queue_watch(&self, name: &[u8], until: Instant) -> Option<(WatchStream, i64)> {
        Counters::bump(&self.counters.watch);
        let opts = WatchOptions::new()
            .with_prefix()
            .with_filters([WatchFilterType::NoPut]);
        let mut stream = error::request_until(
            self.timeout(),
            until,
            self.client.watch_client().watch(name.to_vec(), Some(opts)),
        )
        .await
        .ok()?;
        let by = until.min(Instant::now() + self.timeout());
        match tokio::time::timeout_at(by, stream.message()).await {
            Ok(Ok(Some(created))) if created.created() && !created.canceled() => {
                let start = created.header()?.revision();
                Some((stream, start))
            }
            _ => None,
        }
    }

    /// Whether `entry`'s own key still exists with its create revision.
    async fn own_entry_exists(&self, entry: &Entry, until: Instant) -> Result<bool> {
        Counters::bump(&self.counters.range);
        let resp = error::request_until(
            self.timeout(),
            until,
            self.client.kv_client().get(entry.key.clone(), None),
        )
        .await
        .map_err(|e| e.into_error("acquire"))?;
        Ok(resp
            .kvs()
            .first()
            .is_some_and(|kv| kv.create_revision() == entry.rev))
    }
}

/// Deletes a held entry at its local deadline unless it was renewed or released first: on a
/// shared lease the neighbours' renewals would otherwise keep it alive past its TTL.
async fn reap(inner: Weak<Inner>, held: Arc<Held>) {
    loop {
        // A little after the local deadline: the holder's `lost()` fires at the deadline, and
        // the next contender is only granted once this delete lands, so the two never meet
        // within a round trip (safe either way: deleting later only delays the next grant).
        let deadline = {
            let phase = lock(&held.phase);
            let ttl = phase.deadline.saturating_duration_since(phase.base);
            phase.deadline + (ttl / 20).clamp(Duration::from_millis(5), Duration::from_millis(250))
        };
        tokio::select! {
            () = held.stop.cancelled() => return,
            () = held.gone.cancelled() => {
                if held.claim()
                    && let Some(inner) = inner.upgrade()
                {
                    inner.drop_user(&held.session, &held.name).await;
                }
                return;
            }
            () = sleep_until(deadline) => {}
        }
        if held.claim_if_expired() {
            tracing::debug!(lease = %format_args!("{:x}", held.session.id), "lock not renewed before its local deadline; deleting its entry");
            let target = Target {
                session: held.session.clone(),
                name: held.name.clone(),
                key: held.key.clone(),
                rev: held.rev,
                value: String::new(),
                marker: None,
            };
            if let Some(inner) = inner.upgrade()
                && inner
                    .remove_entry(&target, Instant::now() + inner.timeout())
                    .await
                    .is_err()
            {
                spawn_cleanup(Arc::downgrade(&inner), target);
            }
            return;
        }
    }
}

#[async_trait]
impl Driver for EtcdLock {
    fn backend_name(&self) -> &'static str {
        BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.caps
    }

    async fn try_acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>> {
        // One attempt is bounded as a whole by one request timeout (review L3); a clean-up that
        // needs longer goes on in the background.
        let until = Instant::now() + self.inner.timeout();
        let (entry, owned, base) = self.inner.put_entry(key, ttl, "try_acquire", until).await?;
        if !owned {
            entry.discard(until).await;
            return Ok(None);
        }
        match self.inner.hold(entry, key, ttl, base) {
            Ok(lease) => Ok(Some(lease)),
            Err(entry) => {
                (*entry)
                    .discard(Instant::now() + self.inner.timeout())
                    .await;
                Err(expired_on_arrival("try_acquire"))
            }
        }
    }

    async fn acquire(&self, key: &LockKey, ttl: Duration, deadline: Instant) -> Result<Lease> {
        let mut wait = AcquireWait::new(key, deadline, Backoff::default())?;
        loop {
            let err = match self.acquire_once(key, ttl, &wait).await {
                Ok(lease) => return Ok(lease),
                Err(e) => e,
            };
            if matches!(err, Error::Timeout { .. }) || Instant::now() >= deadline {
                return Err(if err.is_temporary() {
                    wait.timeout()
                } else {
                    err
                });
            }
            if let Err(e) = wait.retry_after(err).await {
                return Err(if e.is_temporary() { wait.timeout() } else { e });
            }
        }
    }

    async fn renew(&self, lease: &mut Lease, ttl: Duration) -> Result<()> {
        let Some(held) = lease.backend_state::<Arc<Held>>().cloned() else {
            return Err(Error::not_held(lease.key()));
        };
        if ttl > held.session.granted {
            return Err(Error::InvalidTtl {
                ttl,
                reason: format!(
                    "this lock's etcd lease has a ttl of {:?}; renew with at most that, or acquire again with the longer ttl",
                    held.session.granted
                ),
            });
        }
        let previous = {
            let phase = lock(&held.phase);
            if phase.finished || held.gone.is_cancelled() {
                return Err(Error::not_held(lease.key()));
            }
            phase.base
        };
        let until = Instant::now() + self.inner.timeout();
        let base = match held
            .session
            .keep_alive(ttl / 4, Some(previous), until)
            .await
        {
            Ok(base) => base,
            Err(KeepAliveError::Gone) => {
                held.gone.cancel();
                return Err(Error::not_held(lease.key()));
            }
            Err(KeepAliveError::Failed(e)) => return Err(e.into_error("renew")),
        };
        // The keepalive proves the lease; a read after it proves our entry is still on it
        // (deleted by an operator, `release --force`: `NotHeld`, review S8). Batched: one txn
        // answers every renewal that asks while another check is out.
        let check = (held.key.clone(), held.rev, held.session.id);
        match self.inner.check_entries(check, until).await {
            Ok(true) => {}
            Ok(false) => {
                held.gone.cancel();
                return Err(Error::not_held(lease.key()));
            }
            Err((failure, why)) => {
                return Err(RequestError {
                    failure,
                    source: why.to_string().into(),
                }
                .into_error("renew"));
            }
        }
        let mut phase = lock(&held.phase);
        if phase.finished || held.gone.is_cancelled() {
            return Err(Error::not_held(lease.key()));
        }
        lease.renewed(ttl, base);
        phase.base = phase.base.max(base);
        phase.deadline = lease.local_deadline();
        Ok(())
    }

    async fn release(&self, lease: &Lease) -> Result<bool> {
        let Some(held) = lease.backend_state::<Arc<Held>>().cloned() else {
            return Ok(false);
        };
        if held.is_finished() {
            return Ok(false);
        }
        let inner = &self.inner;
        Counters::bump(&inner.counters.txn);
        let txn = Txn::new()
            .when([Compare::create_revision(
                held.key.clone(),
                CompareOp::Equal,
                held.rev,
            )])
            .and_then([TxnOp::delete(held.key.clone(), None)]);
        let deleted = delete_if_created_at(inner, txn, "release", lease.key()).await?;
        if held.claim() {
            held.stop.cancel();
            inner.drop_user(&held.session, &held.name).await;
        }
        Ok(deleted)
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        let inner = &self.inner;
        let Some((kv, waiters)) = inner.read_owner(key, "inspect").await? else {
            return Ok(None);
        };
        // The owner entry's own value: its identity was written with it, so it can never be a
        // previous holder's.
        let (token, holder) = keys::parse_entry_value(kv.value());
        let token_digest = token.map(|t| t.digest());
        let ttl_remaining = if kv.lease() != 0 {
            Counters::bump(&inner.counters.range);
            error::request(
                inner.timeout(),
                inner.client.lease_client().time_to_live(kv.lease(), None),
            )
            .await
            .ok()
            .and_then(|t| u64::try_from(t.ttl()).ok())
            .map(Duration::from_secs)
        } else {
            None
        };
        Ok(Some(HolderInfo {
            token_digest,
            fencing_token: u64::try_from(kv.create_revision()).ok().map(FencingToken),
            ttl_remaining,
            waiters: Some(waiters),
            holder,
        }))
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        force_release_if(&self.inner, key, None).await
    }

    async fn force_release_grant(&self, key: &LockKey, holder: FencingToken) -> Result<bool> {
        force_release_if(&self.inner, key, Some(holder)).await
    }

    fn watch_lost(&self, lease: &Lease) -> BoxFuture<'static, LossReason> {
        let Some(held) = lease.backend_state::<Arc<Held>>().cloned() else {
            return Box::pin(std::future::pending());
        };
        let inner = self.inner.clone();
        Box::pin(async move {
            tokio::select! {
                biased;
                () = held.stop.cancelled() => std::future::pending().await,
                reason = watch_entry(&inner, &held) => reason,
            }
        })
    }
}

/// The operator override: removes the holder of `key` (any holder, or only the grant whose
/// fencing token — its create revision — is `holder`; the delete is conditional on that create
/// revision, so it is one atomic step on etcd).
async fn force_release_if(
    inner: &Inner,
    key: &LockKey,
    holder: Option<FencingToken>,
) -> Result<bool> {
    let Some((owner, _)) = inner.read_owner(key, "force_release").await? else {
        return Ok(false);
    };
    if holder.is_some_and(|f| i64::try_from(f.get()).ok() != Some(owner.create_revision())) {
        // Held by another grant than the one the operator confirmed.
        return Ok(false);
    }
    // Delete exactly that holder's entry (a contender queued behind it may be granted next).
    Counters::bump(&inner.counters.txn);
    let txn = Txn::new()
        .when([Compare::create_revision(
            owner.key().to_vec(),
            CompareOp::Equal,
            owner.create_revision(),
        )])
        .and_then([TxnOp::delete(owner.key().to_vec(), None)]);
    let deleted = delete_if_created_at(inner, txn, "force_release", key).await?;
    tracing::warn!(%key, fencing = owner.create_revision(), "lock force-released by an operator");
    Ok(deleted)
}

/// Runs `txn` — a delete of one entry compared on its create revision — and answers whether it
/// deleted. The compare makes it idempotent (no entry is created twice at one revision), so a
/// request whose reply did not come (a timeout, a leader change, a member gone mid-request) is
/// sent again with a jittered pause, for up to two request timeouts, and one that was not
/// sent (connection refused) twice more — a coordinator that is down fails the release fast
/// (the lease then ends by its TTL). Classified by what may have applied: when an earlier send may have, a re-send
/// that finds the entry gone, or a last attempt that fails, is [`Error::Indeterminate`] (the
/// first send may have deleted it); when none can have, a failure is `Unavailable` — a
/// timed-out request is never reported as one that applied nothing.
async fn delete_if_created_at(
    inner: &Inner,
    txn: Txn,
    op: &'static str,
    key: &LockKey,
) -> Result<bool> {
    // request_timeout is at most an hour (config), so this cannot overflow the clock.
    let until = Instant::now() + inner.timeout().saturating_mul(2);
    let mut backoff = Backoff::new(Duration::from_millis(25), Duration::from_millis(400));
    let mut maybe_applied = false;
    let mut not_sent_left = 2;
    let indeterminate = |message: String| Error::Indeterminate {
        backend: BACKEND,
        op,
        key: key.to_string(),
        message,
    };
    loop {
        match error::request_until(
            inner.timeout(),
            until,
            inner.client.kv_client().txn(txn.clone()),
        )
        .await
        {
            Ok(resp) if !resp.succeeded() && maybe_applied => {
                return Err(indeterminate(
                    "a send's reply was lost and its re-send found the entry gone: deleted by \
                     that send, or expired or removed before it"
                        .into(),
                ));
            }
            Ok(resp) => return Ok(resp.succeeded()),
            Err(e) => {
                let transient = match e.failure {
                    Failure::Unknown => true,
                    Failure::NotSent if not_sent_left > 0 => {
                        not_sent_left -= 1;
                        true
                    }
                    _ => false,
                };
                maybe_applied |= e.failure == Failure::Unknown;
                let pause = backoff.next_delay();
                if !transient || Instant::now() + pause >= until {
                    if maybe_applied {
                        return Err(indeterminate(format!(
                            "no send was answered, and one may have applied: {}",
                            e.source
                        )));
                    }
                    return Err(e.into_error(op));
                }
                tracing::debug!(%key, op, error = %e.source, "delete not answered; sending it again");
                tokio::time::sleep(pause).await;
            }
        }
    }
}

/// Completes when `held`'s entry is deleted (lease expired or revoked, key deleted).
async fn watch_entry(inner: &Inner, held: &Held) -> LossReason {
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
    let mut from = held.rev + 1;
    loop {
        let lost = async {
            let mut watch = inner.watches.watch_delete(held.key.clone(), from);
            match watch.ended().await {
                Outcome::Deleted => true,
                Outcome::Broken => false,
                Outcome::Canceled => {
                    // Compacted past our revision: look at the key itself.
                    Counters::bump(&inner.counters.range);
                    let Ok(now) = error::request(
                        inner.timeout(),
                        inner.client.kv_client().get(held.key.clone(), None),
                    )
                    .await
                    else {
                        return false;
                    };
                    if now
                        .kvs()
                        .first()
                        .is_none_or(|kv| kv.create_revision() != held.rev)
                    {
                        return true;
                    }
                    from = now.header().map_or(from, |h| h.revision() + 1);
                    false
                }
            }
        };
        let deleted = tokio::select! {
            biased;
            () = held.gone.cancelled() => return LossReason::Revoked,
            deleted = lost => deleted,
        };
        if deleted {
            held.gone.cancel();
            return LossReason::Revoked;
        }
        tokio::select! {
            () = held.gone.cancelled() => return LossReason::Revoked,
            () = sleep(backoff.next_delay()) => {}
        }
    }
}

impl fmt::Debug for EtcdLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdLock")
            .field("endpoints", &self.inner.config.endpoints)
            .field("prefix", &self.inner.config.prefix)
            .field("sessions", &self.session_count())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    /// Review L1 at the level of the requests: a withdrawal of an attempt whose put is still on
    /// its way makes that put harmless whenever it lands (after: it fails; before: the
    /// withdrawal deleted it), so no ghost entry can be left on the shared lease.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_withdrawn_put_never_applies_late() {
        let Some(url) = conformance::backend_url("DISTLOCK_TEST_ETCD_URL") else {
            return;
        };
        let lock = EtcdLock::connect_url(&url).await.unwrap();
        let ttl = Duration::from_secs(20);
        let anchor = lock
            .try_acquire(
                &LockKey::new(format!("l1-anchor-{:x}", rand::random::<u64>())).unwrap(),
                ttl,
            )
            .await
            .unwrap()
            .unwrap();
        let inner = &lock.inner;
        let session = anchor.backend_state::<Arc<Held>>().unwrap().session.clone();
        let kv = inner.client.kv_client();
        for late in [true, false] {
            let key = LockKey::new(format!("l1-late-{:x}", rand::random::<u64>())).unwrap();
            let name = keys::name_prefix(&inner.config.prefix, &key);
            let token = OwnershipToken::generate();
            assert!(session.try_add_user(&name));
            let mut entry = Entry {
                inner: inner.clone(),
                session: session.clone(),
                key: keys::entry_key(&name, session.id),
                name: name.clone(),
                token,
                rev: 0,
                marker: keys::attempt_marker(&inner.config.prefix, rand::random()),
                armed: false,
                ahead: None,
            };
            let put = entry.put_txn();
            if !late {
                // The put lands first, then the withdrawal runs.
                assert!(kv.clone().txn(put.clone()).await.unwrap().succeeded());
            }
            let target = Target::of(&entry);
            inner
                .remove_entry(&target, Instant::now() + Duration::from_secs(5))
                .await
                .unwrap();
            if late {
                // The put lands after the withdrawal.
                assert!(
                    !kv.clone().txn(put).await.unwrap().succeeded(),
                    "a put that arrived after its withdrawal applied"
                );
            }
            let left = kv.clone().get(entry.key.clone(), None).await.unwrap();
            assert!(
                left.kvs().is_empty(),
                "late = {late}: a ghost entry is left"
            );
            entry.armed = false;
        }
        assert!(lock.release(&anchor).await.unwrap());
    }
}
