//! `EtcdLock` and its `Driver` impl: the coordinator's algorithm — acquire (put the entry, wait
//! for one's turn, hold), try_acquire, release, inspect and force_release.

use std::{
    fmt,
    sync::{Arc, Mutex, Weak},
    time::Duration,
};

use async_trait::async_trait;
use etcd_client::{
    Client, Compare, CompareOp, GetOptions, KeyValue, PutOptions, SortOrder, SortTarget, Txn,
    TxnOp, WatchOptions,
};
use futures::{StreamExt, future::BoxFuture, stream::BoxStream};
use lock_core::raw::{
    AcquireWait, Backoff, Batcher, Capabilities, Driver, Effect, Error, FencingGuarantee,
    FencingToken, HolderIdentity, HolderInfo, Lease, LockKey, LossReason, OwnershipToken, Result,
};
use tokio::time::Instant;

use crate::{
    EtcdLockConfig, EtcdRequestCounts,
    client::{
        self, BACKEND, Classified, Counters, Failure, RequestFailure, first_create, lock, protocol,
        txn_get,
    },
    keys,
    queue::{Entry, LEAVE_GRACE, Target, ahead_of, queue_entry_lost, spawn_cleanup},
    renew::{self, Held, KeepAliveError, MAX_TXN_OPS, Phase, Session},
    wake::{self, WatchMux},
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
/// Go's `concurrency.Election` uses the same layout, so an election (`lock_core::Election`,
/// the lock `election/NAME`) is the election `etcdctl elect <prefix>election/NAME` campaigns in
/// (`/` and `%` in NAME percent-escaped): each side waits for the other, and
/// [`inspect`](lock_core::raw::Driver::inspect) reports a Go leader's proclaimed value as its
/// holder and its key's create revision (its `Rev()`) as its fencing token.
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
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    /// This client itself, for the idle-lease reapers it spawns.
    pub(crate) me: Weak<Inner>,
    pub(crate) client: Client,
    pub(crate) config: EtcdLockConfig,
    pub(crate) caps: Capabilities,
    pub(crate) sessions: Mutex<Vec<Arc<Session>>>,
    /// Serializes lease grants (see `session_for`).
    pub(crate) granting: tokio::sync::Mutex<()>,
    /// The deletion watches of held locks, on one stream.
    pub(crate) watches: WatchMux,
    /// Queue watches kept for this client's next wait on the same lock.
    pub(crate) parked: crate::queue::ParkedWatches,
    /// Renewals' proofs that their entries still exist, batched into one read-only txn.
    pub(crate) checks: Batcher<renew::Check, renew::CheckAnswer>,
    /// Deletes held entries nobody renewed by their local deadline (one task for all).
    pub(crate) reaper: Arc<renew::Reaper>,
    pub(crate) counters: Arc<Counters>,
    /// Who this client is, written next to each of its entries' tokens (see
    /// [`keys::entry_value`]).
    pub(crate) identity: HolderIdentity,
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
        let client = client::connect(&config).await?;
        let counters = Arc::new(Counters::default());
        let min_ttl = match config.min_ttl {
            Some(t) => t,
            None => client::probe_min_ttl(&client, &config, &counters).await?,
        };
        let caps = Capabilities {
            lease_ttl: true,
            renew: true,
            fencing: FencingGuarantee::Quorum,
            wait_notify: true,
            fair_queue: true,
            lost_notify: true,
            force_release: true,
            // Job mode's at_least: the session lease is granted for at least at_least and kept
            // alive once more when the job ends (README, "How this driver keeps the invariant").
            keep_until: true,
            relabel: true,
            min_ttl,
            max_ttl: Duration::from_secs(MAX_LEASE_TTL_SECS),
            ttl_granularity: Duration::from_secs(1),
            ..Default::default()
        };
        Ok(Self {
            inner: Arc::new_cyclic(|me| Inner {
                me: me.clone(),
                watches: WatchMux::new(client.clone(), counters.clone(), me.clone()),
                client,
                config,
                caps,
                sessions: Mutex::new(Vec::new()),
                granting: tokio::sync::Mutex::new(()),
                parked: crate::queue::ParkedWatches::default(),
                checks: Batcher::new(MAX_TXN_OPS),
                reaper: Arc::default(),
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
        lease.backend_state::<Held>().map(|h| h.session.id)
    }

    /// The etcd key of `lease`'s entry (`<prefix><name>/<lease id hex>`).
    pub fn entry_key(lease: &Lease) -> Option<Vec<u8>> {
        lease.backend_state::<Held>().map(|h| h.key.clone())
    }

    /// Whether a deletion watch of `lease`'s entry is in place on the server (made by a polled
    /// [`watch_lost`](lock_core::raw::Driver::watch_lost) future, as every guard's is): its
    /// renewals then send one shared keepalive and no read of their own.
    pub fn is_entry_watched(lease: &Lease) -> bool {
        lease
            .backend_state::<Held>()
            .is_some_and(|h| h.is_watched())
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

/// A grant whose local deadline had passed by the time it was confirmed.
fn expired_on_arrival(op: &'static str) -> Error {
    Error::Unavailable {
        backend: BACKEND,
        op,
        message: "etcd answered too late: the lease's local deadline had already passed, so the grant was withdrawn".into(),
        source: None,
    }
}

impl Inner {
    pub(crate) fn timeout(&self) -> Duration {
        self.config.timeout
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
        let resp = client::request(
            self.timeout(),
            self.client
                .kv_client()
                .get(name.clone(), Some(first_create())),
        )
        .await
        .map_err(|e| e.into_read_error(op))?;
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
                    .map_err(|e| e.into_read_error(op))?;
                let waiters = entries.len().saturating_sub(1);
                Ok(entries.into_iter().next().map(|kv| (kv, waiters)))
            }
        }
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
            match client::request_until(self.timeout(), until, self.client.kv_client().txn(txn))
                .await
            {
                Ok(resp) if resp.succeeded() => {
                    let rev = resp.header().map_or(0, |h| h.revision());
                    // The newest keys of the range, ours first (nothing else was created at or
                    // after the put's revision).
                    let newest = txn_get(&resp, 1).filter(|g| {
                        rev > 0
                            && g.kvs().first().is_some_and(|kv| {
                                kv.key() == entry.key.as_slice() && kv.create_revision() == rev
                            })
                    });
                    let Some(newest) = newest else {
                        // Applied, but unreadable: ours to remove (the marker makes sure).
                        entry.discard(until).await;
                        return Err(protocol(
                            op,
                            "etcd's txn reply lacks a revision or our entry",
                        ));
                    };
                    entry.rev = rev;
                    let earlier = newest.kvs().iter().any(|kv| {
                        kv.create_revision() < rev && keys::is_entry(&name, kv.key(), kv.lease())
                    });
                    entry.ahead = ahead_of(&name, rev, newest.kvs(), newest.more(), rev + 1);
                    let owned = if earlier {
                        // An older entry exists at the put's revision: it or one older still
                        // owns the lock.
                        false
                    } else if !newest.more() {
                        // Every key of the range, and none an entry older than ours.
                        true
                    } else {
                        // Only keys that are no contender among the newest (rare): read the
                        // entries.
                        match self.entries_of(&name, Some(rev), until).await {
                            Ok(entries) => {
                                entries.first().map(KeyValue::create_revision) == Some(rev)
                            }
                            Err(e) => {
                                entry.discard(until).await;
                                return Err(e.into_read_error(op));
                            }
                        }
                    };
                    return Ok((entry, owned, base));
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
                            value: entry.proof(),
                            marker: None,
                        };
                        if let Err(e) = self.remove_entry(&target, until).await {
                            spawn_cleanup(Arc::downgrade(self), target);
                            return Err(e.into_read_error(op));
                        }
                    } else {
                        self.drop_user(&entry.session, &name).await;
                    }
                }
                Err(e) if e.lease_not_found() => {
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
                    return Err(e.into_read_error(op));
                }
            }
        }
        Err(Error::unavailable(
            BACKEND,
            op,
            "the session lease kept vanishing or a leftover entry kept coming back",
        ))
    }

    /// Every contender entry under `name` (created at or before `max_rev`), oldest first.
    pub(crate) async fn entries_of(
        &self,
        name: &[u8],
        max_rev: Option<i64>,
        until: Instant,
    ) -> Result<Vec<KeyValue>, RequestFailure> {
        let mut opts = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend);
        if let Some(rev) = max_rev {
            opts = opts.with_max_create_revision(rev);
        }
        Counters::bump(&self.counters.range);
        let resp = client::request_until(
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
        err: RequestFailure,
        base: Instant,
        op: &'static str,
        until: Instant,
    ) -> Result<(Entry, bool, Instant)> {
        Counters::bump(&self.counters.range);
        let found = client::request_until(
            self.timeout(),
            until,
            self.client.kv_client().get(entry.key.clone(), None),
        )
        .await;
        if let Ok(resp) = found
            && let Some(kv) = resp.kvs().first()
            && kv.lease() == entry.session.id
            && self.proves_ours(&entry, kv, until).await
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
                // The put's reply was lost (`err` is Unknown): it may still apply.
                Err(err.into_error(BACKEND, op, key, Effect::Write))
            }
        }
    }

    /// Whether `kv`, the entry's key read back, is this attempt's: its value carries our token
    /// ([`Entry::proof`]), or for an election's entry its sidecar's does (read here).
    async fn proves_ours(&self, entry: &Entry, kv: &KeyValue, until: Instant) -> bool {
        let proof = entry.proof();
        let Some(sidecar) = entry.sidecar() else {
            return kv.value() == proof.as_bytes();
        };
        Counters::bump(&self.counters.range);
        let found = client::request_until(
            self.timeout(),
            until,
            self.client.kv_client().get(sidecar, None),
        )
        .await;
        found.is_ok_and(|resp| {
            resp.kvs()
                .first()
                .is_some_and(|side| side.value() == proof.as_bytes())
        })
    }

    /// An election owner's token and identity from its sidecar ([`keys::sidecar_of`]); `None`
    /// when it has none (a Go candidate's) or it cannot be read. A sidecar last written before
    /// the entry was created is an earlier entry's leftover on the same key (the reaper deletes
    /// an unrenewed entry alone), never shown: the entry's put rewrites it at the entry's
    /// create revision, a relabel later.
    async fn sidecar_of(
        &self,
        owner: &KeyValue,
    ) -> Option<(Option<OwnershipToken>, Option<HolderIdentity>)> {
        let sidecar = keys::sidecar_of(&self.config.prefix, owner.key())?;
        Counters::bump(&self.counters.range);
        let resp = client::request(self.timeout(), self.client.kv_client().get(sidecar, None))
            .await
            .ok()?;
        let side = resp.kvs().first()?;
        (side.mod_revision() >= owner.create_revision())
            .then(|| keys::parse_entry_value(side.value()))
    }

    /// Turns an owning entry into a lease, and queues it in the client's reaper. Hands the entry back when the
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
        let held = Arc::new(Held::new(
            entry.session.clone(),
            std::mem::take(&mut entry.key),
            entry.rev,
            Phase::new(base, base),
        ));
        let lease = lease.with_shared_backend_state(held.clone());
        lock(&held.phase).deadline = lease.local_deadline();
        // No task per held lock: the client's one reaper watches its deadline.
        self.reap_later(held);
        Ok(lease)
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
        renew::renew(&self.inner, lease, ttl).await
    }

    async fn keep(&self, lease: &mut Lease, left: Duration) -> Result<bool> {
        renew::keep(&self.inner, lease, left).await
    }

    async fn release(&self, lease: &Lease) -> Result<bool> {
        let Some(held) = lease.shared_backend_state::<Held>() else {
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
            .and_then(deletes_of(inner, &held.key));
        let deleted = delete_if_created_at(inner, txn, "release", lease.key()).await?;
        if inner.finish(&held, true) {
            inner.drop_user(&held.session, held.name()).await;
        }
        Ok(deleted)
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        let inner = &self.inner;
        let Some((kv, waiters)) = inner.read_owner(key, "inspect").await? else {
            return Ok(None);
        };
        // The owner entry's own value: its identity was written with it, so it can never be a
        // previous holder's. A Go election's leader: the value it proclaimed. One of our
        // election entries: its value is the leader's value, its token and identity (whose
        // label is that value) are in its sidecar, written and rewritten with it; without a
        // sidecar only the value is shown (never read as a token: it is a Go candidate's).
        let (token, holder) = match inner.sidecar_of(&kv).await {
            Some(ours) => ours,
            None if keys::sidecar_of(&inner.config.prefix, kv.key()).is_some() => {
                (None, HolderIdentity::from_stored(kv.value()))
            }
            None => keys::parse_entry_value(kv.value()),
        };
        let token_digest = token.map(|t| t.digest());
        let ttl_remaining = if kv.lease() != 0 {
            Counters::bump(&inner.counters.range);
            client::request(
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

    /// Go's `Proclaim`: a txn that puts the entry's new value — for an election's entry the new
    /// value alone (what `etcdctl elect -l` prints, `keys::candidate_value`) and
    /// `<token hex> <identity>` in its sidecar; for any other lock `<token hex> <identity>` —
    /// keeping its lease, iff the entry still has the create revision of this grant (so it
    /// still holds the lock: every other entry is younger).
    async fn relabel(&self, lease: &Lease, holder: &HolderIdentity) -> Result<()> {
        let not_held = || Error::not_held(lease.key());
        let Some(held) = lease.shared_backend_state::<Held>() else {
            return Err(not_held());
        };
        if held.is_finished() {
            return Err(not_held());
        }
        let inner = &self.inner;
        let txn = Txn::new()
            .when([Compare::create_revision(
                held.key.clone(),
                CompareOp::Equal,
                held.rev,
            )])
            .and_then(relabel_ops(inner, &held, lease, holder));
        Counters::bump(&inner.counters.txn);
        match client::request(inner.timeout(), inner.client.kv_client().txn(txn)).await {
            Ok(resp) if resp.succeeded() => Ok(()),
            Ok(_) => Err(not_held()),
            // The session's lease is gone, so is the entry.
            Err(e) if e.lease_not_found() => Err(not_held()),
            Err(e) => Err(e.into_error(BACKEND, "relabel", lease.key(), Effect::Write)),
        }
    }

    /// A watch on the lock's range (`<prefix><name>/`, every contender's entry): an item per
    /// response with events (a grant's put, a release's or expiry's delete, a relabel), after
    /// the first one, which says the watch is created on the server.
    fn watch_holder(&self, key: &LockKey) -> Option<BoxStream<'static, ()>> {
        let name = keys::name_prefix(&self.inner.config.prefix, key);
        let client = self.inner.client.clone();
        let counters = self.inner.counters.clone();
        let timeout = self.inner.timeout();
        let start = async move {
            Counters::bump(&counters.watch);
            let opts = WatchOptions::new().with_prefix();
            let mut stream =
                client::request(timeout, client.watch_client().watch(name, Some(opts)))
                    .await
                    .ok()?;
            // The server's first answer: created (or refused).
            match tokio::time::timeout(timeout, stream.message()).await {
                Ok(Ok(Some(resp))) if resp.created() && !resp.canceled() => Some(((), stream)),
                _ => None,
            }
        };
        let armed = futures::stream::once(start).filter_map(std::future::ready);
        Some(Box::pin(armed.flat_map(|((), stream)| {
            let pushes = futures::stream::unfold(stream, |mut stream| async move {
                loop {
                    match stream.message().await {
                        Ok(Some(resp)) if resp.canceled() => return None,
                        Ok(Some(resp)) if !resp.events().is_empty() => return Some(((), stream)),
                        Ok(Some(_)) => {} // progress, no change
                        Ok(None) | Err(_) => return None,
                    }
                }
            });
            futures::stream::once(std::future::ready(())).chain(pushes)
        })))
    }

    /// The lease's session: one keepalive renews every guard on it (see
    /// `SessionGroup` in `renew.rs`).
    fn renewal_group(&self, lease: &Lease) -> Option<lock_core::raw::SharedGroup> {
        let held = lease.shared_backend_state::<Held>()?;
        Some(Arc::new(crate::renew::SessionGroup::new(
            held.session.clone(),
            Arc::downgrade(&self.inner),
        )))
    }

    fn watch_lost(&self, lease: &Lease) -> BoxFuture<'static, LossReason> {
        let Some(held) = lease.shared_backend_state::<Held>() else {
            return Box::pin(std::future::pending());
        };
        let inner = self.inner.clone();
        Box::pin(async move {
            // The session's `gone` ends the watch too (watched by the routing task, once per
            // session).
            let reason = wake::watch_entry(&inner, &held).await;
            if held.is_released() {
                // Our own release deleted it.
                return std::future::pending().await;
            }
            // Boxed: it runs once, at the end, and its state need not be kept all along.
            Box::pin(inner.entry_gone(&held)).await;
            reason
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
        .and_then(deletes_of(inner, owner.key()));
    let deleted = delete_if_created_at(inner, txn, "force_release", key).await?;
    tracing::warn!(%key, fencing = owner.create_revision(), "lock force-released by an operator");
    Ok(deleted)
}

/// The deletes of entry `key`: the key, and an election entry's sidecar with it.
fn deletes_of(inner: &Inner, key: &[u8]) -> Vec<TxnOp> {
    std::iter::once(key.to_vec())
        .chain(keys::sidecar_of(&inner.config.prefix, key))
        .map(|key| TxnOp::delete(key, None))
        .collect()
}

/// The puts of a relabel to `holder` (see [`EtcdLock`]'s `relabel`). The entry keeps its lease
/// (`ignore_lease`: the session's, or the one job mode's keep moved it onto); the sidecar is
/// put on the session's, where the entry's put wrote it.
fn relabel_ops(inner: &Inner, held: &Held, lease: &Lease, holder: &HolderIdentity) -> Vec<TxnOp> {
    let proof = keys::entry_value(lease.token(), holder);
    match keys::sidecar_of(&inner.config.prefix, &held.key) {
        None => vec![TxnOp::put(
            held.key.clone(),
            proof,
            Some(PutOptions::new().with_ignore_lease()),
        )],
        Some(sidecar) => vec![
            TxnOp::put(
                held.key.clone(),
                keys::candidate_value(holder),
                Some(PutOptions::new().with_ignore_lease()),
            ),
            TxnOp::put(
                sidecar,
                proof,
                Some(PutOptions::new().with_lease(held.session.id)),
            ),
        ],
    }
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
    // timeout is at most an hour (config), so this cannot overflow the clock.
    let until = Instant::now() + inner.timeout().saturating_mul(2);
    let mut backoff = Backoff::new(Duration::from_millis(25), Duration::from_millis(400));
    let mut maybe_applied = false;
    let mut not_sent_left = 2;
    let indeterminate = |message: String| {
        RequestFailure::unknown(message).into_error(BACKEND, op, key, Effect::Write)
    };
    loop {
        match client::request_until(
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
                    // No send can have applied: not sent (Unavailable) or refused (Backend).
                    return Err(e.into_error(BACKEND, op, key, Effect::Write));
                }
                tracing::debug!(%key, op, error = %e.source, "delete not answered; sending it again");
                tokio::time::sleep(pause).await;
            }
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
