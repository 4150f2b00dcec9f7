//! Renewal: the etcd leases (sessions) a client's locks share — granted, kept alive on demand
//! by one shared keepalive, revoked once idle — the batched proof that a renewed entry is still
//! on its lease, and each held lock's local deadline (and the client's one reaper that deletes
//! an entry nobody renewed by it).
//!
//! One etcd lease is shared by every lock entry a client holds with the same TTL. A session's
//! lease is kept alive only on demand — by `renew` of any lock on it, by waiters, and by
//! acquisitions — and concurrent demands share one keepalive round trip: a keepalive
//! acknowledged recently enough answers every caller. Renewing N locks therefore costs about
//! one keepalive per freshness window, not N.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    sync::{
        Arc, Mutex, Weak,
        atomic::{AtomicBool, AtomicI64, AtomicU32, Ordering},
    },
    time::Duration,
};

use etcd_client::{
    Compare, CompareOp, GetOptions, LeaseClient, LeaseKeepAliveStream, LeaseKeeper, PutOptions,
    Txn, TxnOp,
};
use futures::future::BoxFuture;
use lock_core::raw::{Error, GroupRenewError, Lease, LossReason, LostSink, RenewalGroup, Result};
use tokio::{
    sync::{Notify, watch},
    time::{Instant, sleep, sleep_until},
};
use tokio_util::sync::CancellationToken;

use crate::{
    client::{
        self, BACKEND, Classified, Counters, Failure, RequestFailure, lock, protocol, txn_get,
    },
    lock::Inner,
    queue::{Target, spawn_cleanup},
};

/// Why a keepalive failed.
#[derive(Debug)]
pub(crate) enum KeepAliveError {
    /// The lease no longer exists: every key attached to it is gone.
    Gone,
    /// The keepalive did not complete; the lease may still be alive.
    Failed(RequestFailure),
}

#[derive(Debug)]
struct Users {
    /// Name ranges with an entry (held or queued) on this lease, by their keyed hash (8 bytes
    /// per held lock, not a copy of the name: issue 24). One entry per name per lease: the
    /// entry key is `<name range><lease hex>`. Two names with one hash (one chance in 2⁶⁴ per
    /// pair, with a key of this session's own) are taken as one: the second lock's entry then
    /// goes on another session, which is only a session more. A name is removed only by the
    /// entry that added it.
    names: HashSet<u64>,
    /// The key of `names`' hashes.
    keyed: std::hash::RandomState,
    /// No longer handed out (empty and being revoked, or dead).
    retired: bool,
    /// Bumped whenever the session goes idle (its last user leaves), so a grace-period reaper
    /// retires it only if it stayed idle since then.
    idle_since: u64,
}

impl Users {
    fn new(first_user: &[u8]) -> Self {
        let mut users = Self {
            names: HashSet::new(),
            keyed: std::hash::RandomState::new(),
            retired: false,
            idle_since: 0,
        };
        let first = users.hash(first_user);
        users.names.insert(first);
        users
    }

    fn hash(&self, name: &[u8]) -> u64 {
        std::hash::BuildHasher::hash_one(&self.keyed, name)
    }
}

/// What a `LeaseGrant` returned.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Grant {
    pub(crate) id: i64,
    /// The TTL asked for, in whole seconds.
    pub(crate) requested_secs: i64,
    /// The TTL the server granted.
    pub(crate) granted: Duration,
    /// When the grant request was sent.
    pub(crate) sent_at: Instant,
}

pub(crate) struct Session {
    pub(crate) id: i64,
    /// The TTL asked for, in whole seconds (the pool key).
    pub(crate) requested_secs: i64,
    /// The TTL the server granted.
    pub(crate) granted: Duration,
    lease: LeaseClient,
    timeout: Duration,
    counters: Arc<Counters>,
    /// The keepalive stream, taken out by the one keepalive in flight.
    stream: Mutex<Option<(LeaseKeeper, LeaseKeepAliveStream)>>,
    /// The answer channel of the keepalive in flight, if any.
    inflight: Mutex<Option<watch::Receiver<Option<Answer>>>>,
    /// When the last acknowledged grant/keepalive was sent: the lease lives at least until
    /// `ack + granted`.
    ack: Mutex<Instant>,
    /// Cancelled once the lease is known to be gone.
    pub(crate) gone: CancellationToken,
    users: Mutex<Users>,
    /// The entries of a renewal group ([`SessionGroup`]) that no deletion watch covers right
    /// now (by [`Held::reap_key`]): the group's renewal reads them, as `renew` reads an
    /// uncovered entry. Empty while every member's watch is in place.
    uncovered: Mutex<HashMap<usize, Weak<Held>>>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("lease", &format_args!("{:x}", self.id))
            .field("granted", &self.granted)
            .field("gone", &self.gone.is_cancelled())
            .finish_non_exhaustive()
    }
}

impl Session {
    pub(crate) fn new(
        grant: Grant,
        first_user: &[u8],
        lease: LeaseClient,
        timeout: Duration,
        counters: Arc<Counters>,
    ) -> Self {
        Self {
            id: grant.id,
            requested_secs: grant.requested_secs,
            granted: grant.granted,
            ack: Mutex::new(grant.sent_at),
            lease,
            timeout,
            counters,
            stream: Mutex::new(None),
            inflight: Mutex::new(None),
            gone: CancellationToken::new(),
            users: Mutex::new(Users::new(first_user)),
            uncovered: Mutex::new(HashMap::new()),
        }
    }

    pub(crate) fn ack(&self) -> Instant {
        *lock(&self.ack)
    }

    /// A renewal may ask for at most the lease's own TTL: a keepalive keeps it that long.
    fn check_renew_ttl(&self, ttl: Duration) -> Result<()> {
        if ttl > self.granted {
            return Err(Error::InvalidTtl {
                ttl,
                reason: format!(
                    "this lock's etcd lease has a ttl of {:?}; renew with at most that, or acquire again with the longer ttl",
                    self.granted
                ),
            });
        }
        Ok(())
    }

    /// Registers an entry for `name` unless this session already has one or is retired.
    pub(crate) fn try_add_user(&self, name: &[u8]) -> bool {
        let mut users = lock(&self.users);
        let name = users.hash(name);
        if users.retired || self.gone.is_cancelled() || users.names.contains(&name) {
            return false;
        }
        users.names.insert(name)
    }

    /// Unregisters `name`. When that left the session empty, returns the idle period it began
    /// (for [`Session::retire_if_idle`]); the session stays usable until retired.
    pub(crate) fn remove_user(&self, name: &[u8]) -> Option<u64> {
        let mut users = lock(&self.users);
        let name = users.hash(name);
        if !users.names.remove(&name) || !users.names.is_empty() || users.retired {
            return None;
        }
        users.idle_since += 1;
        Some(users.idle_since)
    }

    /// Retires the session if it has been idle since the idle period `since` began (returns
    /// `true`; the caller revokes the lease). A session used again in between is left alone,
    /// even if it is idle again now (that idle period has a reaper of its own).
    pub(crate) fn retire_if_idle(&self, since: u64) -> bool {
        let mut users = lock(&self.users);
        if users.retired || !users.names.is_empty() || users.idle_since != since {
            return false;
        }
        users.retired = true;
        true
    }

    /// If `name` is the only user, unregisters it and retires the session (returns `true`; the
    /// caller revokes the lease, which deletes the entry with it).
    pub(crate) fn take_last_user(&self, name: &[u8]) -> bool {
        let mut users = lock(&self.users);
        let name = users.hash(name);
        if !users.retired && users.names.len() == 1 && users.names.contains(&name) {
            users.names.clear();
            users.retired = true;
            return true;
        }
        false
    }

    pub(crate) fn mark_gone(&self) {
        lock(&self.users).retired = true;
        self.gone.cancel();
    }

    /// Makes sure the lease was confirmed alive by a request sent no longer than `max_age` ago
    /// and after `newer_than`, sending one keepalive if needed (shared with concurrent callers).
    /// Returns when that confirming request was sent. Gives up at `until` (the caller's budget)
    /// with a temporary failure; the keepalive itself goes on and answers whoever waits for it.
    ///
    /// A renewal passes its lease's previous base as `newer_than`: every renewal is confirmed by
    /// a keepalive sent after the one that confirmed its predecessor (so a revoked lease is
    /// noticed), while one keepalive still answers every lock whose base is older — about one
    /// keepalive per renewal interval for any number of locks.
    ///
    /// Each keepalive runs in a task of its own that owns the session's stream while its request
    /// is out and always reads its answer (or discards the stream), so a caller that gives up or
    /// is dropped never leaves an unread answer behind for the next one (review S1). Callers
    /// that join a keepalive in flight all get its answer at once, success or failure (L3).
    pub(crate) async fn keep_alive(
        self: &Arc<Self>,
        max_age: Duration,
        newer_than: Option<Instant>,
        until: Instant,
    ) -> Result<Instant, KeepAliveError> {
        let fresh = |ack: Instant| {
            Instant::now().saturating_duration_since(ack) <= max_age
                && newer_than.is_none_or(|t| ack > t)
        };
        loop {
            if self.gone.is_cancelled() {
                return Err(KeepAliveError::Gone);
            }
            let ack = self.ack();
            if fresh(ack) {
                return Ok(ack);
            }
            if Instant::now() >= until {
                return Err(KeepAliveError::Failed(out_of_budget()));
            }
            let mut answer = self.join_or_send();
            let answer = tokio::select! {
                biased;
                changed = answer.wait_for(Option::is_some) => match changed {
                    Ok(a) => a.clone(),
                    Err(_) => None,
                },
                () = tokio::time::sleep_until(until) => {
                    return Err(KeepAliveError::Failed(out_of_budget()));
                }
            };
            match answer {
                Some(Answer::Alive(sent)) => {
                    if newer_than.is_none_or(|t| sent > t) {
                        return Ok(self.ack().max(sent));
                    }
                    // An older keepalive than we need (only possible right after a new
                    // base): send the next one.
                }
                Some(Answer::Gone) => return Err(KeepAliveError::Gone),
                Some(Answer::Failed { failure, message }) => {
                    return Err(KeepAliveError::Failed(RequestFailure {
                        failure,
                        source: message.to_string().into(),
                    }));
                }
                None => {
                    return Err(KeepAliveError::Failed(RequestFailure {
                        failure: Failure::Unknown,
                        source: "the keepalive task ended without an answer".into(),
                    }));
                }
            }
        }
    }

    /// The answer channel of the keepalive in flight, starting one if there is none.
    fn join_or_send(self: &Arc<Self>) -> watch::Receiver<Option<Answer>> {
        let mut inflight = lock(&self.inflight);
        if let Some(rx) = inflight.as_ref() {
            return rx.clone();
        }
        let (tx, rx) = watch::channel(None);
        *inflight = Some(rx.clone());
        let sent = Instant::now();
        Counters::bump(&self.counters.lease_keepalive);
        tokio::spawn(self.clone().send_keepalive(sent, tx));
        rx
    }

    /// One keepalive round trip on the session's stream, answered to every caller waiting.
    async fn send_keepalive(self: Arc<Self>, sent: Instant, tx: watch::Sender<Option<Answer>>) {
        // The stream is out of the slot while this request is: nobody else can read its answer.
        let taken = lock(&self.stream).take();
        let lease = self.lease.clone();
        let id = self.id;
        let outcome = client::request(self.timeout, async move {
            match taken {
                None => {
                    // Opening the stream sends the first keepalive and waits for its answer
                    // (an error when the lease is gone).
                    let pair = lease.clone().keep_alive(id).await?;
                    Ok((pair, true))
                }
                Some((mut keeper, mut stream)) => {
                    keeper.keep_alive().await?;
                    match stream.message().await? {
                        Some(resp) => Ok(((keeper, stream), resp.ttl() > 0)),
                        None => Err(etcd_client::Error::LeaseKeepAliveError(
                            "keepalive stream closed".into(),
                        )),
                    }
                }
            }
        })
        .await;
        // On any failure the stream stays out of the slot (dropped): a late answer on it can
        // never be read as the next request's.
        let answer = match outcome {
            Ok((pair, true)) => {
                *lock(&self.stream) = Some(pair);
                let mut ack = lock(&self.ack);
                *ack = (*ack).max(sent);
                Answer::Alive(sent)
            }
            Ok((_, false)) => {
                self.mark_gone();
                Answer::Gone
            }
            Err(e) if e.lease_not_found() => {
                self.mark_gone();
                Answer::Gone
            }
            Err(e) => Answer::Failed {
                failure: e.failure,
                message: e.source.to_string().into(),
            },
        };
        *lock(&self.inflight) = None;
        let _ = tx.send(Some(answer));
    }
}

/// What one keepalive round trip found, for every caller that waited for it.
#[derive(Clone, Debug)]
enum Answer {
    /// The lease was alive when the keepalive sent at this instant reached the leader.
    Alive(Instant),
    /// The lease does not exist any more.
    Gone,
    /// No answer; the lease may still be alive.
    Failed { failure: Failure, message: Arc<str> },
}

fn out_of_budget() -> RequestFailure {
    RequestFailure {
        failure: Failure::Unknown,
        source: "no keepalive answer within the caller's deadline".into(),
    }
}

/// An entry a renewal must find: key, create revision, lease.
pub(crate) type Check = (Vec<u8>, i64, i64);

/// Whether it was found as it should be, or why the read failed.
pub(crate) type CheckAnswer = std::result::Result<bool, (Failure, Arc<str>)>;

/// The most operations etcd accepts in one txn by default (`--max-txn-ops`).
pub(crate) const MAX_TXN_OPS: usize = 128;

/// Driver state carried by each lease: no task, timer or cancellation token of its own. Its
/// local deadline is watched by the client's one [`Reaper`]; its loss is pushed by its entry's
/// deletion watch and its session's `gone` token (shared by every lock on the session).
pub(crate) struct Held {
    pub(crate) session: Arc<Session>,
    /// `<name range><lease id hex>` ([`crate::keys::entry_key`]): the name range is its
    /// beginning ([`Held::name`]), not a copy of its own.
    pub(crate) key: Vec<u8>,
    pub(crate) rev: i64,
    pub(crate) phase: Mutex<Phase>,
    /// Deletion watches of the entry in place on the server (created and not ended): while
    /// there is one, a deletion is pushed to the holder and `renew` need not read the entry.
    watches: AtomicU32,
    /// A member of its session's renewal group ([`SessionGroup`]): renewed by the group, so
    /// out of the reaper's queue.
    grouped: AtomicBool,
    /// The lease job mode's `keep` moved the entry onto ([`keep`]), 0 before: a put that
    /// attaches the entry to it leaves the entry ours.
    kept_on: AtomicI64,
}

pub(crate) struct Phase {
    /// When the keepalive (or grant) behind the current local deadline was sent.
    pub(crate) base: Instant,
    pub(crate) deadline: Instant,
    /// Released, reaped or gone: the session user was (or is being) removed.
    pub(crate) finished: bool,
    /// Released through this client (its `watch_lost` then never fires).
    pub(crate) released: bool,
    /// The entry is known to be gone (deleted, or its lease is).
    pub(crate) gone: bool,
    /// Where the entry waits in the reaper's queue, if it does.
    pub(crate) reap_at: Option<Instant>,
    /// Where the entry's loss is pushed while it is a member of its session's renewal group
    /// (lock-core then keeps no `watch_lost` future for it).
    pub(crate) sink: Option<LostSink>,
}

impl Phase {
    pub(crate) fn new(base: Instant, deadline: Instant) -> Self {
        Self {
            base,
            deadline,
            finished: false,
            released: false,
            gone: false,
            reap_at: None,
            sink: None,
        }
    }

    /// When the reaper deletes the entry unless it is renewed or released before: a little
    /// after the local deadline. The holder's `lost()` fires at the deadline, and the next
    /// contender is only granted once this delete lands, so the two never meet within a round
    /// trip (safe either way: deleting later only delays the next grant).
    fn reap_time(&self) -> Instant {
        let ttl = self.deadline.saturating_duration_since(self.base);
        self.deadline + (ttl / 20).clamp(Duration::from_millis(5), Duration::from_millis(250))
    }
}

impl Held {
    pub(crate) fn new(session: Arc<Session>, key: Vec<u8>, rev: i64, phase: Phase) -> Self {
        Self {
            session,
            key,
            rev,
            phase: Mutex::new(phase),
            watches: AtomicU32::new(0),
            grouped: AtomicBool::new(false),
            kept_on: AtomicI64::new(0),
        }
    }

    /// Whether an entry attached to etcd lease `lease` is still ours: our session's lease, or
    /// the one [`keep`] moved it onto.
    pub(crate) fn is_own_lease(&self, lease: i64) -> bool {
        lease != 0 && (lease == self.session.id || lease == self.kept_on.load(Ordering::Acquire))
    }

    /// A deletion watch of the entry was created on the server (see [`crate::wake`]).
    pub(crate) fn watch_started(self: &Arc<Self>) {
        let mut uncovered = lock(&self.session.uncovered);
        if self.watches.fetch_add(1, Ordering::AcqRel) == 0 {
            uncovered.remove(&self.reap_key());
        }
    }

    /// A deletion watch [`Held::watch_started`] counted is over.
    pub(crate) fn watch_ended(self: &Arc<Self>) {
        let mut uncovered = lock(&self.session.uncovered);
        if self.watches.fetch_sub(1, Ordering::AcqRel) == 1 && self.grouped.load(Ordering::Acquire)
        {
            uncovered.insert(self.reap_key(), Arc::downgrade(self));
        }
    }

    /// Joins (or leaves) its session's renewal group; an uncovered member is read by the
    /// group's renewals. (Under the lock the watch counts change under.)
    fn set_grouped(self: &Arc<Self>, grouped: bool) {
        let mut uncovered = lock(&self.session.uncovered);
        self.grouped.store(grouped, Ordering::Release);
        if grouped && !self.is_watched() {
            uncovered.insert(self.reap_key(), Arc::downgrade(self));
        } else {
            uncovered.remove(&self.reap_key());
        }
    }

    /// Whether a deletion watch of the entry is in place on the server: its deletion is then
    /// pushed to the holder.
    pub(crate) fn is_watched(&self) -> bool {
        self.watches.load(Ordering::Acquire) > 0
    }

    /// The lock's name range (`<prefix><name>/`): the entry key without its lease's hex id.
    pub(crate) fn name(&self) -> &[u8] {
        crate::keys::entry_name(&self.key, self.session.id)
    }

    pub(crate) fn is_finished(&self) -> bool {
        lock(&self.phase).finished
    }

    /// The entry is known to be gone: marks it so and, while it is a renewal group's member,
    /// pushes its loss to the group's sink (once: the sink is taken). Synchronous, so that a
    /// group renewal that found it gone answers only after the push.
    pub(crate) fn entry_gone_now(&self) {
        let sink = {
            let mut phase = lock(&self.phase);
            phase.gone = true;
            phase.sink.take()
        };
        if let Some(sink) = sink {
            sink.lost(LossReason::Revoked);
        }
    }

    /// Whether the entry is known to be gone (deleted, or its session's lease is).
    pub(crate) fn is_gone(&self) -> bool {
        lock(&self.phase).gone || self.session.gone.is_cancelled()
    }

    /// Whether it was released through this client.
    pub(crate) fn is_released(&self) -> bool {
        lock(&self.phase).released
    }

    /// The reaper's key for this entry (its place in the queue is `(reap_at, key)`).
    fn reap_key(self: &Arc<Self>) -> usize {
        Arc::as_ptr(self) as usize
    }
}

/// The client's one reaper of held entries: deletes each entry nobody renewed or released by
/// its local deadline (on a shared lease the neighbours' renewals would otherwise keep it alive
/// past its TTL), and unregisters from its session an entry found gone. One task and one timer
/// for every held lock (it holds each `Held` strongly, so a lease dropped without a release is
/// still deleted at its deadline); the task runs while anything waits in the queue. A lock is
/// looked at once per local deadline (a renewal moved it: queued again at the new one), not
/// once per renewal.
#[derive(Default)]
pub(crate) struct Reaper {
    state: Mutex<ReaperState>,
    wake: Notify,
}

#[derive(Default)]
struct ReaperState {
    due: BTreeMap<(Instant, usize), Arc<Held>>,
    running: bool,
}

impl Inner {
    /// Queues `held` at its reap time; starts the reaper's task if it is not running.
    pub(crate) fn reap_later(&self, held: Arc<Held>) {
        let mut phase = lock(&held.phase);
        if phase.finished {
            return;
        }
        let at = phase.reap_time();
        let key = held.reap_key();
        let mut state = lock(&self.reaper.state);
        if let Some(old) = phase.reap_at.replace(at) {
            state.due.remove(&(old, key));
        }
        let earliest = state.due.first_key_value().is_none_or(|(k, _)| at < k.0);
        drop(phase);
        state.due.insert((at, key), held);
        if !state.running {
            // Queued without a runtime (a guard's slot dying with its runtime): the next entry
            // queued starts the task.
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                state.running = true;
                runtime.spawn(reap(self.me.clone(), self.reaper.clone()));
            }
        } else if earliest {
            self.reaper.wake.notify_one();
        }
    }

    /// Takes `held` out of the reaper's queue (it joined a renewal group, which renews it; or
    /// it is finished).
    fn unqueue(&self, held: &Arc<Held>, phase: &mut Phase) {
        if let Some(at) = phase.reap_at.take() {
            lock(&self.reaper.state).due.remove(&(at, held.reap_key()));
        }
    }

    /// Marks `held` finished (`released`: through this client) and takes it out of the
    /// reaper's queue; `true` for the one caller that did it.
    pub(crate) fn finish(&self, held: &Arc<Held>, released: bool) -> bool {
        let mut phase = lock(&held.phase);
        if std::mem::replace(&mut phase.finished, true) {
            return false;
        }
        phase.released = released;
        self.unqueue(held, &mut phase);
        true
    }

    /// The entry is known to be gone: marks it (pushing a group member's loss at once) and
    /// unregisters it from its session (once).
    pub(crate) async fn entry_gone(&self, held: &Arc<Held>) {
        if self.mark_gone(held) {
            self.drop_user(&held.session, held.name()).await;
        }
    }

    /// [`Inner::entry_gone`] from a context that cannot wait (the routing task): the mark and
    /// the push now, the session's user dropped by a task of its own when there is one to drop.
    pub(crate) fn entry_gone_then(self: Arc<Self>, held: Arc<Held>) {
        if self.mark_gone(&held) {
            tokio::spawn(async move { self.drop_user(&held.session, held.name()).await });
        }
    }

    /// The synchronous part of [`Inner::entry_gone`]: whether the session's user is still to
    /// be dropped.
    fn mark_gone(&self, held: &Arc<Held>) -> bool {
        held.entry_gone_now();
        self.finish(held, false)
    }

    /// The reaper's look at an entry whose reap time came.
    async fn reap_due(&self, held: Arc<Held>) {
        let expired = {
            let mut phase = lock(&held.phase);
            phase.reap_at = None;
            // A renewal group's member (it joined after this look was queued) is renewed by
            // the group, which queues it again when it leaves.
            if phase.finished || held.grouped.load(Ordering::Acquire) {
                return;
            }
            if !phase.gone && !held.session.gone.is_cancelled() {
                if phase.deadline > Instant::now() {
                    // Renewed meanwhile: wait for the new deadline.
                    drop(phase);
                    self.reap_later(held);
                    return;
                }
                phase.finished = true;
                true
            } else {
                phase.finished = true;
                false
            }
        };
        if expired {
            tokio::spawn(delete_unrenewed(self.me.clone(), held));
        } else {
            self.drop_user(&held.session, held.name()).await;
        }
    }
}

/// The reaper's task: sleeps until the earliest reap time in the queue (or until an earlier
/// one is queued) and looks at every entry due; ends when the queue is empty or the client is
/// gone.
fn reap(me: Weak<Inner>, reaper: Arc<Reaper>) -> impl Future<Output = ()> {
    /// Dropped with the task's future while armed (its runtime shut down, even before the
    /// task first ran): the next entry queued starts a new task.
    struct Running(Arc<Reaper>, bool);
    impl Running {
        /// The task set `running` to false itself, under the queue's lock.
        fn disarm(&mut self) {
            self.1 = false;
        }
    }
    impl Drop for Running {
        fn drop(&mut self) {
            if self.1 {
                lock(&self.0.state).running = false;
            }
        }
    }
    // Made before the future is first polled: a task dropped unpolled says so too.
    let mut running = Running(reaper, true);
    async move {
        let reaper = running.0.clone();
        let mut due = Vec::new();
        loop {
            let next = {
                let mut state = lock(&reaper.state);
                match state.due.first_key_value() {
                    Some((k, _)) => k.0,
                    None => {
                        state.running = false;
                        running.disarm();
                        return;
                    }
                }
            };
            tokio::select! {
                () = sleep_until(next) => {}
                // An earlier entry was queued (a stored permit if it came before this wait).
                () = reaper.wake.notified() => continue,
            }
            let now = Instant::now();
            {
                let mut state = lock(&reaper.state);
                while let Some(entry) = state.due.first_entry() {
                    if entry.key().0 > now {
                        break;
                    }
                    due.push(entry.remove());
                }
            }
            let Some(inner) = me.upgrade() else {
                // The client is gone: nothing renews its leases, which expire by their TTL.
                let mut state = lock(&reaper.state);
                state.due.clear();
                state.running = false;
                running.disarm();
                return;
            };
            for held in due.drain(..) {
                inner.reap_due(held).await;
            }
        }
    }
}

fn ttl_secs(ttl: Duration) -> i64 {
    let secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
    i64::try_from(secs).unwrap_or(i64::MAX)
}

impl Inner {
    pub(crate) fn forget(&self, session: &Arc<Session>) {
        lock(&self.sessions).retain(|s| !Arc::ptr_eq(s, session));
    }

    /// Revokes a retired session's lease, bounded by `until`. On failure the lease expires by
    /// its TTL: nothing keeps a retired session alive.
    pub(crate) async fn revoke(
        &self,
        session: &Session,
        until: Instant,
    ) -> Result<(), RequestFailure> {
        Counters::bump(&self.counters.lease_revoke);
        match client::request_until(
            self.timeout(),
            until,
            self.client.lease_client().revoke(session.id),
        )
        .await
        {
            Ok(_) => {
                session.mark_gone();
                Ok(())
            }
            Err(e) if e.lease_not_found() => {
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
    pub(crate) async fn drop_user(&self, session: &Arc<Session>, name: &[u8]) {
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

    /// Proves that each entry still exists with its create revision on its lease: one
    /// linearizable read-only txn for every renewal that asks while another batch is out.
    pub(crate) async fn check_entries(&self, check: Check, until: Instant) -> CheckAnswer {
        // The batch's closure holds this client weakly, not a clone of its `etcd_client::Client`
        // (≈ 7 KiB): every renewal waiting for its check carries the closure until it is
        // answered, and only the one task running the batch needs the client.
        let me = self.me.clone();
        let run =
            move |items: Vec<Check>| -> futures::future::BoxFuture<'static, Vec<CheckAnswer>> {
                let me = me.clone();
                Box::pin(async move {
                    let Some(inner) = me.upgrade() else {
                        let why: Arc<str> = "the client was dropped".into();
                        return items
                            .iter()
                            .map(|_| Err((Failure::NotSent, why.clone())))
                            .collect();
                    };
                    let (client, counters, timeout) =
                        (&inner.client, &inner.counters, inner.timeout());
                    Counters::bump(&counters.txn);
                    let reads = items.iter().map(|(key, _, _)| {
                        TxnOp::get(key.clone(), Some(GetOptions::new().with_keys_only()))
                    });
                    let txn = Txn::new().and_then(reads.collect::<Vec<_>>());
                    match client::request(timeout, client.kv_client().txn(txn)).await {
                        Ok(resp) => items
                            .iter()
                            .enumerate()
                            .map(|(i, (_, rev, lease))| match txn_get(&resp, i) {
                                Some(get) => Ok(get.kvs().first().is_some_and(|kv| {
                                    kv.create_revision() == *rev && kv.lease() == *lease
                                })),
                                None => {
                                    Err((Failure::Refused, "etcd's txn reply lacks a read".into()))
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
                })
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
    pub(crate) async fn session_for(
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
                    return Err(e.into_read_error("acquire"));
                }
            }
        }
        let sent = Instant::now();
        Counters::bump(&self.counters.lease_grant);
        let resp = client::request_until(
            self.timeout(),
            until,
            self.client.lease_client().grant(secs, None),
        )
        .await
        .map_err(|e| e.into_read_error("acquire"))?;
        let granted = Duration::from_secs(u64::try_from(resp.ttl()).unwrap_or(0));
        let session = Arc::new(Session::new(
            Grant {
                id: resp.id(),
                requested_secs: secs,
                granted,
                sent_at: sent,
            },
            name,
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
}

/// The reaper's delete of an entry nobody renewed by its local deadline.
async fn delete_unrenewed(inner: Weak<Inner>, held: Arc<Held>) {
    tracing::debug!(lease = %format_args!("{:x}", held.session.id), "lock not renewed before its local deadline; deleting its entry");
    let target = Target {
        session: held.session.clone(),
        name: held.name().to_vec(),
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
}

/// How old a keepalive may be and still confirm a renewal to `ttl` on `session`: up to a
/// quarter TTL (a neighbour's). A shorter ttl than the session's (job mode's keep_until: hold
/// until `now + ttl` even if this process dies now) takes one sent at most `granted - ttl`
/// ago, so that etcd keeps the entry until at least its send time + `granted` >= now + ttl.
fn max_keepalive_age(session: &Session, ttl: Duration) -> Duration {
    match session.granted.checked_sub(ttl) {
        Some(spare) if !spare.is_zero() => spare.min(ttl / 4),
        _ => ttl / 4,
    }
}

/// The read that proves `held`'s entry is still on its lease (batched with every other
/// renewal's: one txn answers all that ask while another is out); an entry found gone is
/// unregistered. `Ok(false)`: gone.
async fn entry_present(
    inner: &Inner,
    held: &Arc<Held>,
    until: Instant,
) -> std::result::Result<bool, RequestFailure> {
    let check = (held.key.clone(), held.rev, held.session.id);
    match inner.check_entries(check, until).await {
        Ok(true) => Ok(true),
        Ok(false) => {
            inner.entry_gone(held).await;
            Ok(false)
        }
        Err((failure, why)) => Err(RequestFailure {
            failure,
            source: why.to_string().into(),
        }),
    }
}

/// `renew`: a keepalive of the lock's session lease (shared with every renewal that asks while
/// one is out), then the batched check that the lock's entry is still on that lease; the
/// lease's local deadline moves to the keepalive's send time plus `ttl`.
pub(crate) async fn renew(inner: &Inner, lease: &mut Lease, ttl: Duration) -> Result<()> {
    let Some(held) = lease.shared_backend_state::<Held>() else {
        return Err(Error::not_held(lease.key()));
    };
    held.session.check_renew_ttl(ttl)?;
    let previous = {
        let phase = lock(&held.phase);
        if phase.finished || phase.gone || held.session.gone.is_cancelled() {
            return Err(Error::not_held(lease.key()));
        }
        phase.base
    };
    let until = Instant::now() + inner.timeout();
    let max_age = max_keepalive_age(&held.session, ttl);
    let base = match held
        .session
        .keep_alive(max_age, Some(previous), until)
        .await
    {
        Ok(base) => base,
        Err(KeepAliveError::Gone) => {
            inner.entry_gone(&held).await;
            return Err(Error::not_held(lease.key()));
        }
        Err(KeepAliveError::Failed(e)) => return Err(e.into_read_error("renew")),
    };
    // The keepalive proves the lease. That our entry is still on it (not deleted by an
    // operator, `release --force`: `NotHeld`, review S8) is proved one of two ways:
    // - a deletion watch of the entry is in place on the server (every guard's, whose
    //   `watch_lost` the scheduler polls): a deletion is pushed to the holder, which loses the
    //   lease when it arrives; no request per lock per tick, so a tick of N guards costs one
    //   keepalive. A read would not tell the holder sooner: a deletion just after it goes
    //   unnoticed until the push (or the next tick) either way;
    // - otherwise (the raw trait without `watch_lost`, or while the watch is being made again)
    //   a read after the keepalive, batched: one txn answers every renewal that asks while
    //   another check is out.
    if !held.is_watched() {
        match entry_present(inner, &held, until).await {
            Ok(true) => {}
            Ok(false) => return Err(Error::not_held(lease.key())),
            Err(e) => return Err(e.into_read_error("renew")),
        }
    }
    let mut phase = lock(&held.phase);
    if phase.finished || phase.gone || held.session.gone.is_cancelled() {
        return Err(Error::not_held(lease.key()));
    }
    lease.renewed(ttl, base);
    phase.base = phase.base.max(base);
    phase.deadline = lease.local_deadline();
    Ok(())
}

/// Job mode's keep (`Capabilities::keep_until`): the entry stays until at least `left` from now,
/// also if this process dies now, and is free soon after.
///
/// etcd cannot shorten a lease, and a keepalive renews the session's lease to the TTL it was
/// granted — for a job lease at least `at_least`, up to the whole `ttl` — so a keepalive would
/// keep the entry that long after a job that ended at once. Instead the entry moves onto a lease
/// of its own, granted for `left` (whole seconds, rounded up, at least the server's minimum):
/// one txn that compares the entry's create revision (its fence, which a put keeps, so it keeps
/// its place at the head of the queue) and puts it with `ignore_value` on the new lease. etcd
/// then deletes it when that lease expires, at least `granted >= left` after the grant was sent,
/// so at_least holds without this process; the lease's local deadline counts from that send
/// (the invariant). While the process lives, the reaper deletes the entry once both that
/// deadline and `now + left` have passed, as for any unrenewed entry; the session keeps the name
/// registered until then, so no later acquisition on this session reuses the entry's key.
///
/// A `left` the session's own lease would not outlast by a second is kept with a keepalive, as
/// before. `Ok(false)`: the entry was already gone.
pub(crate) async fn keep(inner: &Inner, lease: &mut Lease, left: Duration) -> Result<bool> {
    let Some(held) = lease.shared_backend_state::<Held>() else {
        return Ok(false);
    };
    let kept_until = Instant::now() + left;
    let hold = left.max(inner.caps.min_ttl);
    let secs = ttl_secs(hold);
    if secs >= ttl_secs(held.session.granted) {
        return match renew(inner, lease, hold).await {
            Ok(()) => Ok(true),
            Err(Error::NotHeld { .. }) => Ok(false),
            Err(e) => Err(e),
        };
    }
    {
        let phase = lock(&held.phase);
        if phase.finished || phase.gone || held.session.gone.is_cancelled() {
            return Ok(false);
        }
    }
    let until = Instant::now() + inner.timeout();
    let sent = Instant::now();
    Counters::bump(&inner.counters.lease_grant);
    let grant = client::request_until(
        inner.timeout(),
        until,
        inner.client.lease_client().grant(secs, None),
    )
    .await
    .map_err(|e| e.into_read_error("keep"))?;
    let granted = Duration::from_secs(u64::try_from(grant.ttl()).unwrap_or(0));
    if granted.is_zero() {
        return Err(protocol("keep", "etcd granted a lease of 0 s"));
    }
    // Before the put: its own watch event must not read as the entry leaving us.
    held.kept_on.store(grant.id(), Ordering::Release);
    let txn = Txn::new()
        .when([Compare::create_revision(
            held.key.clone(),
            CompareOp::Equal,
            held.rev,
        )])
        .and_then([TxnOp::put(
            held.key.clone(),
            Vec::<u8>::new(),
            Some(PutOptions::new().with_lease(grant.id()).with_ignore_value()),
        )]);
    Counters::bump(&inner.counters.txn);
    match client::request_until(inner.timeout(), until, inner.client.kv_client().txn(txn)).await {
        Ok(resp) if resp.succeeded() => {
            lease.renewed(granted, sent);
            {
                let mut phase = lock(&held.phase);
                phase.base = sent;
                // The reaper deletes no earlier than at_least allows; the lease's own local
                // deadline stays the conservative one.
                phase.deadline = lease.local_deadline().max(kept_until);
            }
            if !held.grouped.load(Ordering::Acquire) {
                inner.reap_later(held.clone());
            }
            Ok(true)
        }
        Ok(_) => {
            // The entry is gone (deleted or expired): the new lease holds nothing.
            held.kept_on.store(0, Ordering::Release);
            let _ = client::request(
                inner.timeout(),
                inner.client.lease_client().revoke(grant.id()),
            )
            .await;
            inner.entry_gone(&held).await;
            Ok(false)
        }
        // Applied or not, the entry is held at least `left` more: on the new lease, or on the
        // session's, whose last keepalive keeps it past grant + at_least. Nothing to undo (a
        // revoke of the new lease could delete the entry before at_least).
        Err(e) => Err(e.into_read_error("keep")),
    }
}

/// A session's renewal group (lock-core's [`RenewalGroup`]): every guard whose entry is on
/// this session's etcd lease is renewed by one keepalive of it, with no work per lock.
///
/// How it keeps the lease invariant: a keepalive acknowledged for a request sent at `t` keeps
/// the etcd lease — and every entry attached to it — until at least `t + granted` by etcd's
/// clock, `granted >= ttl`; lock-core counts the members' deadline from `t` with the drift
/// margin, as `renew` does. A member's entry deleted while its lease lives (an operator's
/// `release --force`) is pushed by its deletion watch; a member no watch covers right now
/// (`Session::uncovered`) is read after the keepalive, as `renew` reads an uncovered entry, and
/// one found gone is unregistered and pushed to its sink before the renewal answers. While a member, an entry is
/// out of the reaper's queue (the group renews it); leaving puts it back at the deadline the
/// group gave it.
#[derive(Debug)]
pub(crate) struct SessionGroup {
    pub(crate) session: Arc<Session>,
    pub(crate) inner: Weak<Inner>,
    /// When the keepalive behind the group's last renewal was sent: the next one must be
    /// newer (so a revoked lease is noticed).
    last: Arc<Mutex<Option<Instant>>>,
}

impl SessionGroup {
    pub(crate) fn new(session: Arc<Session>, inner: Weak<Inner>) -> Self {
        Self {
            session,
            inner,
            last: Arc::default(),
        }
    }

    /// `lease`'s state, if it is an entry on this group's session.
    fn member(&self, lease: &Lease) -> Option<Arc<Held>> {
        lease
            .shared_backend_state::<Held>()
            .filter(|h| Arc::ptr_eq(&h.session, &self.session))
    }
}

impl RenewalGroup for SessionGroup {
    fn id(&self) -> usize {
        Arc::as_ptr(&self.session) as usize
    }

    /// Pushes the member's loss to `lost`: the client's routing task watches the entry's
    /// deletion (a watch with no waiter of its own, re-made by the routing task after a broken
    /// stream or a compacted revision), a group renewal that finds it gone pushes it before
    /// answering, and so does its session's end.
    fn join(&self, lease: &Lease, lost: &LostSink) -> bool {
        let Some(held) = self.member(lease) else {
            return false;
        };
        let Some(inner) = self.inner.upgrade() else {
            return false;
        };
        held.set_grouped(true);
        let gone = {
            let mut phase = lock(&held.phase);
            inner.unqueue(&held, &mut phase);
            phase.sink = Some(lost.clone());
            phase.gone
        };
        if gone {
            held.entry_gone_now();
        }
        inner.watches.watch_member(&held);
        true
    }

    fn leave(&self, lease: &Lease) {
        let Some(held) = self.member(lease) else {
            return;
        };
        held.set_grouped(false);
        {
            let mut phase = lock(&held.phase);
            phase.sink = None;
            phase.base = phase.base.max(self.session.ack());
            phase.deadline = phase.deadline.max(lease.local_deadline());
        }
        if let Some(inner) = self.inner.upgrade() {
            inner.watches.forget_member(&held);
            inner.reap_later(held);
        }
    }

    fn renew(
        &self,
        ttl: Duration,
        until: Instant,
    ) -> BoxFuture<'static, std::result::Result<Instant, GroupRenewError>> {
        let (session, inner, last) = (self.session.clone(), self.inner.clone(), self.last.clone());
        Box::pin(async move {
            session
                .check_renew_ttl(ttl)
                .map_err(GroupRenewError::Failed)?;
            let until = until.min(Instant::now() + session.timeout);
            let previous = *lock(&last);
            let base = match session
                .keep_alive(max_keepalive_age(&session, ttl), previous, until)
                .await
            {
                Ok(base) => base,
                // Every entry went with the lease (each `watch_lost` reports it too).
                Err(KeepAliveError::Gone) => {
                    return Err(GroupRenewError::Lost(LossReason::NotHeld));
                }
                Err(KeepAliveError::Failed(e)) => {
                    return Err(GroupRenewError::Failed(e.into_read_error("renew")));
                }
            };
            let uncovered: Vec<Arc<Held>> = lock(&session.uncovered)
                .values()
                .filter_map(Weak::upgrade)
                .collect();
            if !uncovered.is_empty() {
                let Some(inner) = inner.upgrade() else {
                    return Err(GroupRenewError::Lost(LossReason::RenewFailed));
                };
                let reads = uncovered
                    .iter()
                    .map(|held| entry_present(&inner, held, until));
                for read in futures::future::join_all(reads).await {
                    // A member found gone has been pushed to its sink (`entry_gone_now`),
                    // before this answer.
                    if let Err(e) = read {
                        return Err(GroupRenewError::Failed(e.into_read_error("renew")));
                    }
                }
            }
            let mut last = lock(&last);
            *last = Some(last.map_or(base, |l| l.max(base)));
            Ok(base)
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    async fn etcd() -> Option<etcd_client::Client> {
        let url = conformance::backend_url("DISTLOCK_TEST_ETCD_URL")?;
        let cfg = crate::EtcdLockConfig::from_url(&url).unwrap();
        let endpoints: Vec<String> = cfg
            .endpoints
            .iter()
            .map(|e| format!("http://{e}"))
            .collect();
        Some(etcd_client::Client::connect(endpoints, None).await.unwrap())
    }

    /// A fresh 30 s session lease on `client`.
    async fn session_on(client: &etcd_client::Client) -> Arc<Session> {
        let sent_at = Instant::now();
        let granted = client.lease_client().grant(30, None).await.unwrap();
        Arc::new(Session::new(
            Grant {
                id: granted.id(),
                requested_secs: 30,
                granted: Duration::from_secs(30),
                sent_at,
            },
            b"n/",
            client.lease_client(),
            Duration::from_secs(5),
            Arc::new(Counters::default()),
        ))
    }

    /// The client's reaper task ends with its runtime (a shut-down runtime drops it): it says
    /// so, so that the next held lock starts a new one instead of waiting in a queue nobody
    /// serves (its entry would then outlive its deadline on a shared lease).
    #[test]
    fn a_reaper_dropped_with_its_runtime_is_started_again() {
        let Some(url) = conformance::backend_url("DISTLOCK_TEST_ETCD_URL") else {
            return;
        };
        // A current-thread runtime drops its tasks' futures when it is dropped.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let (client, lease) = rt.block_on(async {
            let lock = crate::EtcdLock::connect_url(&url).await.unwrap();
            let key = lock_core::raw::LockKey::new(format!("reaper-{:x}", rand::random::<u32>()))
                .unwrap();
            let lease = lock_core::raw::Driver::try_acquire(&lock, &key, Duration::from_secs(5))
                .await
                .unwrap()
                .expect("a fresh key is free");
            (lock, lease)
        });
        assert!(lock(&client.inner.reaper.state).running);
        drop(rt);
        assert!(
            !lock(&client.inner.reaper.state).running,
            "the reaper's task is gone with its runtime but still counted as running"
        );
        drop((lease, client));
    }

    /// Review S1: a keepalive whose caller is dropped at any point (before its request is
    /// sent, while it is out, while its answer is being read) never leaves an answer behind
    /// that a later keepalive would read as its own: after a revoke the next one says `Gone`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dropped_keepalive_never_answers_a_later_one() {
        let Some(client) = etcd().await else { return };
        let session = session_on(&client).await;
        let far = || Instant::now() + Duration::from_secs(10);
        // Opens the stream.
        session
            .keep_alive(Duration::ZERO, None, far())
            .await
            .unwrap();
        // Cut points from "never polled" to "answer almost read".
        for cut_us in [0, 1, 10, 50, 100, 200, 400, 700, 1_000, 2_000, 5_000] {
            let base = session.ack();
            let renewal = session.keep_alive(Duration::ZERO, Some(base), far());
            let _ = tokio::time::timeout(Duration::from_micros(cut_us), renewal).await;
        }
        {
            // Polled exactly once, then dropped.
            let renewal = session.keep_alive(Duration::ZERO, Some(session.ack()), far());
            let mut renewal = std::pin::pin!(renewal);
            let _ = futures::poll!(renewal.as_mut());
        }
        // Every abandoned keepalive's answer has arrived by now (or been discarded).
        tokio::time::sleep(Duration::from_millis(300)).await;
        client.lease_client().revoke(session.id).await.unwrap();
        for _ in 0..3 {
            let next = session
                .keep_alive(Duration::ZERO, Some(session.ack()), far())
                .await;
            assert!(
                matches!(next, Err(KeepAliveError::Gone)),
                "a keepalive after the revoke answered {next:?}: it read an abandoned one's answer"
            );
        }
    }

    /// Review L3: callers that joined a keepalive that fails are all answered when it does,
    /// and a caller's own budget bounds its wait.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn callers_waiting_on_a_stalled_keepalive_get_their_answer_by_their_budget() {
        let Some(url) = conformance::backend_url("DISTLOCK_TEST_ETCD_URL") else {
            return;
        };
        let (proxy, proxied) = conformance::drill::Proxy::start_for_url(&url)
            .await
            .unwrap();
        let cfg = crate::EtcdLockConfig::from_url(&proxied).unwrap();
        let client = etcd_client::Client::connect([format!("http://{}", cfg.endpoints[0])], None)
            .await
            .unwrap();
        let session = session_on(&client).await;
        session
            .keep_alive(
                Duration::ZERO,
                None,
                Instant::now() + Duration::from_secs(5),
            )
            .await
            .unwrap();
        proxy.blackhole();
        let start = Instant::now();
        let budget = Duration::from_millis(700);
        let waits = (0..8).map(|_| {
            let session = session.clone();
            async move {
                let r = session
                    .keep_alive(Duration::ZERO, Some(session.ack()), start + budget)
                    .await;
                (r.is_err(), start.elapsed())
            }
        });
        for (failed, took) in futures::future::join_all(waits).await {
            assert!(failed, "a blackholed keepalive succeeded");
            assert!(
                took < budget + Duration::from_millis(500),
                "waited {took:?}"
            );
        }
        proxy.pass();
        let _ = client.lease_client().revoke(session.id).await;
    }
}
