//! The waiter queue: a contender's entry (how it queues), waiting for its turn behind the
//! entries created before it (and the watches that wake it), and leaving the queue — the
//! compare-and-delete of an entry, in the foreground or retried in the background.

use std::{
    collections::{HashSet, VecDeque},
    sync::{Arc, PoisonError, Weak},
    time::Duration,
};

use etcd_client::{
    Compare, CompareOp, EventType, GetOptions, KeyValue, PutOptions, SortOrder, SortTarget, Txn,
    TxnOp, WatchFilterType, WatchOptions, WatchResponse, WatchStream,
};
use lock_core::raw::{
    AcquireWait, Backoff, Error, LockKey, OwnershipToken, Result, cleanup::Retries,
};
use tokio::{
    sync::oneshot,
    task::JoinHandle,
    time::{Instant, sleep, sleep_until},
};

use crate::{
    client::{self, BACKEND, Classified, Counters, RequestFailure, protocol, txn_get},
    keys,
    lock::Inner,
    renew::{KeepAliveError, Session},
};

/// How long past its deadline an `acquire` may spend leaving the queue in the foreground.
pub(crate) const LEAVE_GRACE: Duration = Duration::from_millis(150);

/// A waiter behind at most this many entries watches the whole queue and needs no read when
/// its turn comes ([`Inner::wait_turn`]); behind more it watches its predecessor only, so a
/// release wakes at most this many waiters.
pub(crate) const QUEUE_WATCH_MAX: usize = 32;

/// Who a waiter waits for, from one read of the queue.
pub(crate) enum Ahead {
    /// Every earlier entry (newest first), watched through the queue prefix from `from`.
    All { keys: Vec<Vec<u8>>, from: i64 },
    /// Only the newest earlier entry, watched from `from`; the queue is read again when it goes.
    Predecessor { key: Vec<u8>, from: i64 },
}

/// A watch stream, with the responses read off it while it was parked.
pub(crate) struct QueueWatch {
    stream: WatchStream,
    read: VecDeque<WatchResponse>,
    /// The stream ended (or failed) while parked: nothing comes after `read`.
    ended: bool,
}

impl QueueWatch {
    fn new(stream: WatchStream) -> Self {
        Self {
            stream,
            read: VecDeque::new(),
            ended: false,
        }
    }

    /// The next response: those read while parked first, in order. Cancel safe, as
    /// [`WatchStream::message`] is.
    async fn message(&mut self) -> Result<Option<WatchResponse>, etcd_client::Error> {
        if let Some(resp) = self.read.pop_front() {
            return Ok(Some(resp));
        }
        if self.ended {
            return Ok(None);
        }
        self.stream.message().await
    }
}

/// How long a queue watch stays parked for this client's next wait on the same lock.
const PARK_LINGER: Duration = Duration::from_secs(2);
/// Queue watches parked at once per client (the oldest goes first).
const PARK_MAX: usize = 32;
/// Responses a parked watch keeps; past that it is closed (a lock that busy would not have
/// waited long for another wait of ours anyway).
const PARK_MAX_READ: usize = 4096;

/// Queue watches kept between one wait and this client's next wait on the same lock (see
/// [`Inner::wait_turn`]). A parked watch is read continuously by a task of its own — an unread
/// stream would hold the connection's HTTP/2 flow-control window, which this client's renewals
/// share — and closed after [`PARK_LINGER`]. Taking it back hands over the stream with what was
/// read meanwhile: the same continuous watch, so it still reports every deletion after the
/// revision it was parked with.
#[derive(Default)]
pub(crate) struct ParkedWatches {
    slots: std::sync::Mutex<Vec<Parked>>,
}

struct Parked {
    name: Vec<u8>,
    /// Sent (or dropped) to take the watch back (or close it).
    stop: oneshot::Sender<()>,
    task: JoinHandle<Option<(QueueWatch, i64)>>,
}

impl ParkedWatches {
    fn slots(&self) -> std::sync::MutexGuard<'_, Vec<Parked>> {
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Parks `watch` of the queue `name`, which has reported every deletion after `start`.
    fn park(&self, name: &[u8], mut watch: QueueWatch, start: i64) {
        let (stop, mut stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let linger = sleep(PARK_LINGER);
            tokio::pin!(linger);
            loop {
                tokio::select! {
                    biased;
                    _ = &mut stopped => return Some((watch, start)),
                    () = &mut linger => return None,
                    msg = watch.stream.message(), if !watch.ended => match msg {
                        Ok(Some(_)) if watch.read.len() >= PARK_MAX_READ => return None,
                        Ok(Some(resp)) => watch.read.push_back(resp),
                        Ok(None) | Err(_) => watch.ended = true,
                    },
                }
            }
        });
        let mut slots = self.slots();
        // Closed ones go, and an older watch of the same queue (dropping a slot's sender
        // closes its watch).
        slots.retain(|p| !p.task.is_finished() && p.name != name);
        if slots.len() >= PARK_MAX {
            slots.remove(0);
        }
        slots.push(Parked {
            name: name.to_vec(),
            stop,
            task,
        });
    }

    /// The parked watch of the queue `name` and the revision it has reported every deletion
    /// after, if one is parked and still open.
    async fn take(&self, name: &[u8]) -> Option<(QueueWatch, i64)> {
        let parked = {
            let mut slots = self.slots();
            let i = slots.iter().position(|p| p.name == name)?;
            slots.swap_remove(i)
        };
        let _ = parked.stop.send(());
        parked.task.await.ok().flatten()
    }
}

/// A contender's key in the queue, owned until it becomes a held lease or is discarded. Dropped
/// while armed (a cancelled acquire, an error), it deletes itself in the background.
pub(crate) struct Entry {
    pub(crate) inner: Arc<Inner>,
    pub(crate) session: Arc<Session>,
    pub(crate) name: Vec<u8>,
    pub(crate) key: Vec<u8>,
    pub(crate) token: OwnershipToken,
    /// Create revision; 0 while unknown (then the key is matched by its value).
    pub(crate) rev: i64,
    /// This attempt's abandonment marker (see [`keys::attempt_marker`]).
    pub(crate) marker: Vec<u8>,
    pub(crate) armed: bool,
    /// Who was ahead in the queue when the put applied (read by the put itself), so a waiter
    /// starts watching without reading the queue first.
    pub(crate) ahead: Option<Ahead>,
}

impl Entry {
    /// The entry's value: token and this client's holder identity ([`keys::entry_value`]); for
    /// an election's entry the leader's value alone ([`keys::candidate_value`]), what Go's
    /// election peers read, with token and identity in its [`Entry::sidecar`]. The identity
    /// rides in the put that creates the entry: no extra request, and it is deleted with the
    /// entry (lease expiry, release, force-release).
    pub(crate) fn value(&self) -> String {
        if self.sidecar().is_some() {
            keys::candidate_value(&self.inner.identity)
        } else {
            self.proof()
        }
    }

    /// What proves an entry this attempt's: token and identity, the entry's value or its
    /// sidecar's.
    pub(crate) fn proof(&self) -> String {
        keys::entry_value(&self.token, &self.inner.identity)
    }

    /// An election entry's sidecar key ([`keys::sidecar_of`]), which holds [`Entry::proof`].
    pub(crate) fn sidecar(&self) -> Option<Vec<u8>> {
        keys::sidecar_of(&self.inner.config.prefix, &self.key)
    }

    /// The attempt's put (Go's `tryAcquire` txn): put our key if it does not exist and read the
    /// newest [`QUEUE_WATCH_MAX`] + 1 keys of the range (ours and who is ahead of it: when that
    /// is all of them, the oldest entry among them owns the lock), else read our key.
    /// Conditional on the attempt's marker too: once a withdrawal wrote it, this put can never
    /// apply, however late it arrives (review L1).
    ///
    /// The reads are keys only: who is ahead is told by keys, leases and create revisions, and
    /// the values (token and identity, ~100 bytes each) would only make every put's reply —
    /// read by etcd, encoded, sent and decoded once per contender — larger. One read, not a
    /// second one for the oldest key: etcd reads and sorts the whole range for each sorted read
    /// (it cannot stop at a limit when sorting), and every contended acquisition has a put.
    ///
    /// An election's entry puts its sidecar too, on the same lease, after the read (so the
    /// replies' indices are the same for every lock).
    pub(crate) fn put_txn(&self) -> Txn {
        let on_lease = || Some(PutOptions::new().with_lease(self.session.id));
        let sidecar = self
            .sidecar()
            .map(|sidecar| TxnOp::put(sidecar, self.proof(), on_lease()));
        Txn::new()
            .when([
                Compare::create_revision(self.key.clone(), CompareOp::Equal, 0),
                Compare::create_revision(self.marker.clone(), CompareOp::Equal, 0),
            ])
            .and_then(
                [
                    TxnOp::put(self.key.clone(), self.value(), on_lease()),
                    TxnOp::get(
                        self.name.clone(),
                        Some(
                            GetOptions::new()
                                .with_prefix()
                                .with_sort(SortTarget::Create, SortOrder::Descend)
                                .with_limit(QUEUE_WATCH_MAX as i64 + 1)
                                .with_keys_only(),
                        ),
                    ),
                ]
                .into_iter()
                .chain(sidecar)
                .collect::<Vec<_>>(),
            )
            .or_else([TxnOp::get(
                self.key.clone(),
                Some(GetOptions::new().with_keys_only()),
            )])
    }

    /// Deletes the entry now, bounded by `until` (falling back to background retries when that
    /// fails).
    pub(crate) async fn discard(mut self, until: Instant) {
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
pub(crate) struct Target {
    pub(crate) session: Arc<Session>,
    pub(crate) name: Vec<u8>,
    pub(crate) key: Vec<u8>,
    pub(crate) rev: i64,
    /// The entry's token and identity ([`Entry::proof`]), matched when the create revision is
    /// unknown: the entry's value, or an election entry's sidecar's.
    pub(crate) value: String,
    /// Set when the create revision is unknown (a put whose outcome is unknown may still be
    /// applied later): removing it also puts this marker, which the put requires absent.
    pub(crate) marker: Option<Vec<u8>>,
}

impl Target {
    pub(crate) fn of(e: &Entry) -> Self {
        Self {
            session: e.session.clone(),
            name: e.name.clone(),
            key: e.key.clone(),
            rev: e.rev,
            value: e.proof(),
            marker: (e.rev <= 0).then(|| e.marker.clone()),
        }
    }

    /// The compare-and-delete of this entry. With an unknown create revision it matches the
    /// token, and also puts the attempt's marker in the same txn whatever the compare says:
    /// from then on the original put (conditional on the marker's absence) can never apply, so
    /// a put still in flight cannot leave a ghost entry behind (review L1).
    ///
    /// An election entry's sidecar ([`keys::sidecar_of`] under `prefix`) goes in the same txn,
    /// and with an unknown create revision it is the sidecar that is matched on the token.
    pub(crate) fn removal(&self, prefix: &str) -> Txn {
        let sidecar = keys::sidecar_of(prefix, &self.key);
        let deletes = || {
            std::iter::once(self.key.clone())
                .chain(sidecar.clone())
                .map(|key| TxnOp::delete(key, None))
        };
        match &self.marker {
            None => Txn::new()
                .when([Compare::create_revision(
                    self.key.clone(),
                    CompareOp::Equal,
                    self.rev,
                )])
                .and_then(deletes().collect::<Vec<_>>()),
            Some(marker) => {
                let put_marker = TxnOp::put(
                    marker.clone(),
                    "",
                    Some(PutOptions::new().with_lease(self.session.id)),
                );
                Txn::new()
                    .when([Compare::value(
                        sidecar.clone().unwrap_or_else(|| self.key.clone()),
                        CompareOp::Equal,
                        self.value.clone(),
                    )])
                    .and_then(deletes().chain([put_marker.clone()]).collect::<Vec<_>>())
                    .or_else([put_marker])
            }
        }
    }
}

pub(crate) fn spawn_cleanup(inner: Weak<Inner>, target: Target) {
    let spawned = lock_core::raw::cleanup::spawn(async move {
        // Until the entry is deleted or its session ends (which deletes it with the lease).
        let mut retries = Retries::unbounded();
        while retries.next_or(target.session.gone.cancelled()).await {
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
        }
    });
    if !spawned {
        tracing::warn!("lock entry abandoned outside a runtime; it expires with its lease");
    }
}

/// Our queue entry is gone while we waited: its lease expired (keepalives did not get through
/// in time, e.g. while the cluster elected a leader) or was revoked, or the entry was deleted
/// from outside. Temporary: `acquire` queues again with a live lease while its deadline allows
/// (as lock-zk re-queues a contender whose node vanished) — the attempt that lost its entry
/// never grants, so this costs the waiter its place in line and nothing else.
pub(crate) fn queue_entry_lost(key: &LockKey) -> Error {
    Error::Unavailable {
        backend: BACKEND,
        op: "acquire",
        message: format!(
            "the queue entry for lock {:?} was deleted while waiting (its lease expired or was revoked); queueing again",
            key.as_str()
        ),
        source: None,
    }
}

/// Whom to wait for, from a read of the queue at `revision` (`from` − 1) holding the newest
/// keys of `name` (newest first; keys created at or after `own_rev` are skipped), `more` when
/// the read was cut by its limit. `None`: nobody contends ahead of us, or the read says too
/// little (the waiter then reads the queue itself).
pub(crate) fn ahead_of(
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

impl Inner {
    /// Compare-and-delete of one entry; revokes the session instead when it was its last user.
    pub(crate) async fn remove_entry(
        &self,
        t: &Target,
        until: Instant,
    ) -> Result<(), RequestFailure> {
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
        match client::request_until(
            self.timeout(),
            until,
            self.client.kv_client().txn(t.removal(&self.config.prefix)),
        )
        .await
        {
            Ok(_) => {}
            Err(e) if e.lease_not_found() => {
                // The lease is gone, and every key on it; a late put on it fails.
                t.session.mark_gone();
                self.forget(&t.session);
            }
            Err(e) => return Err(e),
        }
        self.drop_user(&t.session, &t.name).await;
        Ok(())
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
    ///
    /// The queue watch a successful wait ends with is parked ([`ParkedWatches`]) for this
    /// client's next wait on the same lock, instead of a new watch each time.
    pub(crate) async fn wait_turn(
        &self,
        entry: &Entry,
        first: Option<Ahead>,
        key: &LockKey,
        ttl: Duration,
        wait: &AcquireWait,
    ) -> Result<()> {
        let mut carried = None;
        let result = self
            .wait_turn_with(entry, first, key, ttl, wait, &mut carried)
            .await;
        if result.is_ok()
            && let Some((watch, start)) = carried
        {
            self.parked.park(&entry.name, watch, start);
        }
        result
    }

    /// [`Inner::wait_turn`]; on `Ok`, `carried` holds the queue watch (and a revision it has
    /// reported every deletion after), if there was one.
    async fn wait_turn_with(
        &self,
        entry: &Entry,
        mut first: Option<Ahead>,
        key: &LockKey,
        ttl: Duration,
        wait: &AcquireWait,
        carried: &mut Option<(QueueWatch, i64)>,
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
        // `carried`: a queue watch kept across a read of the queue. It reports every deletion
        // after the revision it started at, so a read at that revision or later can go on with
        // it.
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
                    .with_limit(QUEUE_WATCH_MAX as i64)
                    .with_keys_only();
                let read = Txn::new().and_then([
                    TxnOp::get(entry.name.clone(), Some(opts)),
                    TxnOp::get(entry.key.clone(), Some(GetOptions::new().with_keys_only())),
                ]);
                let read =
                    client::request_until(self.timeout(), until, self.client.kv_client().txn(read))
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
                            *carried = Some(started);
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
                    client::request_until(
                        self.timeout(),
                        until,
                        self.client.watch_client().watch(pred_key, Some(opts)),
                    )
                    .await
                    .ok()
                    .map(QueueWatch::new)
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
                            *carried = Some((s, min_rev - 1));
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
                                        // It has reported every deletion up to this one.
                                        if let Some(s) = stream.take() {
                                            *carried = Some((s, kv.mod_revision()));
                                        }
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
    ///
    /// A watch parked by this client's last wait on the lock is taken first: created afresh
    /// while other writes land, a watch can be registered at etcd as *unsynced* — the server
    /// reads the current revision, a write lands, then it registers the watch from just after
    /// the revision it read, now in the past — and its events then wait for etcd's
    /// unsynced-watcher loop, every 100 ms. Measured on the contention probe: 2–3 % of
    /// hand-offs stalled 10–100 ms (evenly spread), a third of the run's time; a raw etcd-client
    /// probe shows the same stalls only while another client writes.
    async fn queue_watch(&self, name: &[u8], until: Instant) -> Option<(QueueWatch, i64)> {
        if let Some(parked) = self.parked.take(name).await {
            return Some(parked);
        }
        Counters::bump(&self.counters.watch);
        let opts = WatchOptions::new()
            .with_prefix()
            .with_filters([WatchFilterType::NoPut]);
        let mut stream = client::request_until(
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
                Some((QueueWatch::new(stream), start))
            }
            _ => None,
        }
    }

    /// Whether `entry`'s own key still exists with its create revision.
    async fn own_entry_exists(&self, entry: &Entry, until: Instant) -> Result<bool> {
        Counters::bump(&self.counters.range);
        let resp = client::request_until(
            self.timeout(),
            until,
            self.client.kv_client().get(entry.key.clone(), None),
        )
        .await
        .map_err(|e| e.into_read_error("acquire"))?;
        Ok(resp
            .kvs()
            .first()
            .is_some_and(|kv| kv.create_revision() == entry.rev))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use lock_core::raw::Driver;

    use crate::{EtcdLock, renew::Held};

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
        let session = anchor.backend_state::<Held>().unwrap().session.clone();
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
