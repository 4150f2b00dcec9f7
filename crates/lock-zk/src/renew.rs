//! Renewal and the local-deadline accounting behind it: how far the session's *vouched window*
//! (the time until which the leader cannot have expired the session) reaches, the batched
//! `sync` that proves it for every renewal in flight, its lapse signal, and `renew` itself.
//!
//! # What extends trust
//!
//! Only the leader expires sessions. A member we are connected to touches our session when it
//! receives a request, and a follower tells the leader about those touches only in its replies to
//! the leader's pings (sent every tickTime / 2). A follower cut off from the leader keeps
//! answering reads for up to syncLimit × tickTime while the leader expires the session, so an
//! answered read proves nothing about the leader. A `sync`, though, is forwarded to the leader
//! and answered only after the leader processed it, on the same follower→leader stream that
//! carries the ping replies: when a `sync` sent at `s` is answered, the leader had received every
//! ping reply the follower sent before forwarding it — including, once a ping has come and gone
//! in between, the touch of every request of ours that had been *answered* by `s - lag`. So the
//! session lives at the leader until at least the send time of the newest such request plus the
//! session timeout ([`Session::synced`]). `lag` is a quarter of the session timeout: ZooKeeper
//! negotiates timeouts of at least 2 × tickTime (its default `minSessionTimeout`), so a ping
//! comes at least every timeout / 4. Requests answered on an earlier connection (another member)
//! never count, and neither does a sync whose connection changed while it was in flight.

use std::{
    collections::VecDeque,
    sync::{Arc, Mutex, PoisonError, atomic::Ordering},
    time::Duration,
};

use futures::future::BoxFuture;
use lock_core::raw::{
    Error, GroupRenewError, Lease, LossReason, RenewalGroup, Result, drift_margin,
};
use tokio::{
    sync::watch,
    time::{Instant, sleep_until},
};
use tokio_util::sync::CancellationToken;
use zookeeper_client as zk;

use crate::{
    BACKEND, ZkLock,
    client::{Probe, Session, ZkResult, call_until, outcome_unknown, session_gone, to_error},
    lock::ZkLease,
    path::{KeepMarker, dir_of, keep_path, keep_pin},
    wake::Check,
};

/// The leader-proved base and the requests that may become it.
pub(crate) struct Trust {
    base: Instant,
    answered: VecDeque<Answered>,
    /// Candidates are kept at least this far apart in send time (see [`Trust::record`]).
    granule: Duration,
}

#[derive(Clone, Copy)]
pub(crate) struct Answered {
    sent: Instant,
    at: Instant,
    connection: u64,
}

/// How many answered requests are kept as candidates (the oldest are dropped first, which only
/// makes a promotion more conservative). With candidates a granule (lag / 64) apart, a lag's
/// worth takes about 64 of them, so this bound is never what drops a useful one.
const MAX_CANDIDATES: usize = 1024;

/// Candidates per lag: a promotion's base is at most lag / this older than it could be.
const CANDIDATES_PER_LAG: u32 = 64;

impl Trust {
    /// No candidates yet; `base` is a send time the leader is known to have heard of; `lag` as
    /// [`lag`] of the session's timeout.
    pub(crate) fn new(base: Instant, lag: Duration) -> Self {
        Self {
            base,
            answered: VecDeque::new(),
            granule: lag / CANDIDATES_PER_LAG,
        }
    }

    /// A request answered by the member we are connected to: a candidate, nothing more.
    ///
    /// One whose send time is within a granule of the newest candidate's (same connection) is
    /// not kept: the newest one stands for it, and promoting that one instead only makes the base
    /// up to a granule older (conservative). Without this, a busy session (thousands of requests
    /// answered per lag, as when a client takes tens of thousands of locks) would push every
    /// candidate answered a lag ago out of the bounded list, no `sync` could promote any, and the
    /// vouched window would lapse with every lock of the session.
    fn record(&mut self, answered: Answered) {
        if let Some(newest) = self.answered.back()
            && newest.connection == answered.connection
            && answered.sent < newest.sent + self.granule
        {
            return;
        }
        if self.answered.len() >= MAX_CANDIDATES {
            self.answered.pop_front();
        }
        self.answered.push_back(answered);
    }

    /// A `sync` (sent at `sync.sent`, answered at `sync.at`) went through the leader: the
    /// newest candidate of the same connection answered by `sync.sent - lag` becomes the base
    /// (candidates of other connections are dropped); the sync itself becomes a candidate.
    /// Returns the base.
    fn promote(&mut self, sync: Answered, lag: Duration) -> Instant {
        if let Some(cutoff) = sync.sent.checked_sub(lag) {
            let mut newest = None::<Instant>;
            self.answered.retain(|a| {
                if a.connection != sync.connection {
                    return false;
                }
                if a.at <= cutoff {
                    newest = Some(newest.map_or(a.sent, |n| n.max(a.sent)));
                    return false;
                }
                true
            });
            if let Some(newest) = newest {
                self.base = self.base.max(newest);
            }
        }
        self.record(sync);
        self.base
    }
}

impl Session {
    /// A request sent at `probe` was answered by the member we are connected to. That alone
    /// extends no trust (a follower cut off from the leader still answers); it becomes a
    /// candidate for the next [`Session::synced`].
    pub(crate) fn answered(&self, probe: Probe) {
        let at = Instant::now();
        if self.connection() != probe.connection {
            return;
        }
        self.trust
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .record(Answered {
                sent: probe.sent,
                at,
                connection: probe.connection,
            });
    }

    /// The time a ping from the leader can take to come round (see the type's docs).
    fn lag(&self) -> Duration {
        lag(self.timeout)
    }

    /// A `sync` sent at `probe` was answered: every request of ours answered on the same
    /// connection at least [`Session::lag`] before `probe.sent` was reported to the leader, so
    /// the newest of them moves the vouched window (see the type's docs).
    pub(crate) fn synced(&self, probe: Probe) {
        let at = Instant::now();
        let connection = self.connection();
        if connection != probe.connection {
            return;
        }
        let base = self
            .trust
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .promote(
                Answered {
                    sent: probe.sent,
                    at,
                    connection,
                },
                self.lag(),
            );
        let until = base + self.timeout - drift_margin(self.timeout);
        self.vouched.send_if_modified(|v| {
            let newer = until > *v;
            if newer {
                *v = until;
            }
            newer
        });
    }

    /// Until when the session is vouched for (see [`Session::synced`]).
    pub(crate) fn vouched_until(&self) -> Instant {
        *self.vouched.borrow()
    }

    /// The newest send time the leader is known to have heard of: the session (and every
    /// ephemeral node it owns) lives at least until this plus the timeout.
    pub(crate) fn vouched_base(&self) -> Instant {
        self.trust
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .base
    }

    /// Waits until the session is vouched for beyond now (`true`), or it ended (`false`).
    pub(crate) async fn wait_vouched(&self) -> bool {
        let mut rx = self.vouched.subscribe();
        loop {
            if self.is_ended() {
                return false;
            }
            if *rx.borrow_and_update() > Instant::now() {
                return true;
            }
            tokio::select! {
                () = self.ended.cancelled() => return false,
                changed = rx.changed() => if changed.is_err() { return false },
            }
        }
    }

    /// The lapse token current now: cancelled as soon as the vouched instant passes without a
    /// newer confirmation. Take it *before* checking [`Session::vouched_until`], so a lapse
    /// between the two cannot be missed.
    pub(crate) fn lapse_token(&self) -> CancellationToken {
        self.lapse
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// One round trip that proves the session alive now, shared by every caller that arrives while
    /// one is in flight ([`Batcher`](lock_core::raw::Batcher)): a tick of any number of renewals
    /// costs a handful of requests. `Ok` means a `sync` sent after this call began was answered on
    /// this session (so it went through the leader, and [`Session::synced`] moved the vouched
    /// window as far as that proves); every watch armed before the call that fired by then has
    /// already been delivered to its receiver (the member sends a watch event before the reply to
    /// any later request of the session — for a sync, it applies everything the leader had
    /// committed before replying — and the client dispatches both from one task in arrival order).
    pub(crate) async fn check_in(
        self: &Arc<Self>,
        limit: Duration,
    ) -> std::result::Result<(), zk::Error> {
        let session = Arc::downgrade(self);
        let run = move |items: Vec<()>| {
            let session = session.clone();
            async move {
                let answer = match session.upgrade() {
                    Some(s) => s.sync(limit).await,
                    None => Err(zk::Error::ClientClosed),
                };
                vec![answer; items.len()]
            }
        };
        // No answer: the batch task died (runtime shutdown); its outcome is unknown.
        self.check_ins
            .submit((), run)
            .await
            .unwrap_or(Err(zk::Error::ConnectionLoss))
    }
}

/// A quarter of the session timeout: how long a ping from the leader can take to come round
/// (ZooKeeper negotiates at least 2 × tickTime and the leader pings every tickTime / 2).
pub(crate) fn lag(timeout: Duration) -> Duration {
    timeout / 4
}

/// How many renewals one batched session check answers at most (they all share its one read).
pub(crate) const MAX_CHECK_IN_BATCH: usize = 100_000;

/// Cancels the current lapse token whenever the vouched instant passes without a newer
/// confirmation (and installs a fresh one for later leases). One task per session, woken only
/// when the vouched instant moves or passes, however many locks are held.
pub(crate) async fn watch_lapse(
    mut vouched: watch::Receiver<Instant>,
    lapse: Arc<Mutex<CancellationToken>>,
    ended: CancellationToken,
) {
    loop {
        let until = *vouched.borrow_and_update();
        tokio::select! {
            () = ended.cancelled() => return,
            () = sleep_until(until) => {
                if *vouched.borrow() <= Instant::now() {
                    let old = std::mem::replace(
                        &mut *lapse.lock().unwrap_or_else(PoisonError::into_inner),
                        ended.child_token(),
                    );
                    old.cancel();
                    // Wait for a newer confirmation before looking at the deadline again.
                    tokio::select! {
                        () = ended.cancelled() => return,
                        changed = vouched.changed() => if changed.is_err() { return },
                    }
                }
            }
            changed = vouched.changed() => if changed.is_err() { return },
        }
    }
}

/// A lease's TTL: the requested one, capped at the negotiated session timeout. The lease counts
/// from a leader-proved send time ([`Session::vouched_base`]), so its local deadline is never
/// later than the session's vouched window, however long the TTL asked for: a bare `Lease` never
/// claims more than the session can vouch for.
pub(crate) fn lease_ttl(ttl: Duration, session: &Session) -> Duration {
    ttl.min(session.timeout)
}

impl ZkLock {
    // Confirms that our node still exists under the live session, and moves the lease's
    // deadline to the session's vouched window (never further: the TTL is capped at the
    // session timeout and counts from a leader-proved send time, see `Session::synced`).
    //
    // Always one batched `sync` (`Session::check_in`, shared by every renewal in flight) sent
    // after this call began: it goes through the leader, which is what moves the window. With
    // the deletion watch on our node armed and reliable (see `crate::wake`), that is all: a
    // look at the watch after the sync's reply — a deletion before the member processed it
    // would have been delivered first. Otherwise (no watch yet, a data-change event consumed
    // it, a reconnection since it was armed) one `exists` on the node, which re-arms the watch.
    pub(crate) async fn renew_lease(&self, lease: &mut Lease, ttl: Duration) -> Result<()> {
        let not_held = || Error::not_held(lease.key());
        let session = lease
            .backend_state::<ZkLease>()
            .and_then(|state| self.session_of(state));
        // The check layer accepted `ttl`: within the capabilities, or at least this lease's
        // own TTL — the negotiated session timeout when the server lowered it (`lease_ttl`).
        let (Some(state), Some(session)) = (lease.backend_state::<ZkLease>(), session) else {
            return Err(not_held());
        };
        let (watch, path, czxid) = (&state.watch, &*state.path, state.czxid);
        let before = watch.check();
        if let Check::Lost(_) = before {
            return Err(not_held());
        }
        match session.check_in(self.inner.config.timeout).await {
            Ok(()) => {}
            Err(e) if session_gone(&e) => return Err(not_held()),
            Err(e) => return Err(to_error("renew", e)),
        }
        match (before, watch.check()) {
            (_, Check::Lost(_)) => return Err(not_held()),
            (Check::Reliable(armed), Check::Reliable(still)) if still == armed => {}
            // Not armed, re-armed or consumed meanwhile: read the node. Boxed: a renewal in
            // flight (thousands at once per client) keeps only the common path in its state.
            _ => {
                let read = Box::pin(async {
                    let states = session.client.state_watcher();
                    let probe = session.probe();
                    match self.call(session.client.check_and_watch_stat(path)).await {
                        Ok((Some(stat), watcher))
                            if stat.czxid == czxid && stat.ephemeral_owner == session.id =>
                        {
                            session.answered(probe);
                            watch.install(watcher, states);
                            Ok(())
                        }
                        Ok(_) => {
                            watch.set_lost(LossReason::Revoked);
                            Err(not_held())
                        }
                        Err(e) if session_gone(&e) => Err(not_held()),
                        Err(e) => Err(to_error("renew", e)),
                    }
                });
                read.await?;
            }
        }
        let ttl = lease_ttl(ttl, &session);
        let base = session.vouched_base();
        // The window only moves forward; a renewal never shortens the lease.
        let mut renewed = lease.clone();
        renewed.renewed(ttl, base);
        if renewed.local_deadline() >= lease.local_deadline() {
            *lease = renewed;
        }
        if !lease.is_locally_valid() {
            return Err(unvouched());
        }
        Ok(())
    }
}

/// A renewal answered, but not (yet) provably through the leader (e.g. the first sync after a
/// reconnection): temporary, the next one can prove it.
fn unvouched() -> Error {
    Error::Unavailable {
        backend: BACKEND,
        op: "renew",
        message: "the session cannot be vouched for by the leader right now".into(),
        source: None,
    }
}

/// A session's renewal group (lock-core's [`RenewalGroup`]): every guard whose node belongs to
/// this session is renewed by one batched `sync` of it ([`Session::check_in`]), with no work per
/// lock.
///
/// How it keeps the lease invariant: the session — and every ephemeral node it owns — lives
/// until at least its vouched base plus the session timeout by the leader's clock (see
/// [`Session::synced`]); the group answers that base, and lock-core counts every member's
/// deadline from it with a TTL capped at the session timeout (`lease_ttl`), as `renew` does. A
/// member's node deleted while the session lives (an operator's `release --force`) is pushed by
/// its node's watch, which its `watch_lost` keeps armed (arming it again after a data change or
/// a failure, with an `exists` that reports a node already gone): a deletion the server applied
/// before the group's `sync` reaches the watcher before that sync's reply, as it does for
/// `renew` (see `crate::wake`), and the client re-registers armed watches on a reconnection
/// before any later request of the session. What the group leaves out is `renew`'s `exists` on
/// a node whose watch is not armed at that moment: such a deletion is pushed once the watch is
/// armed again, not at the tick.
pub(crate) struct SessionGroup {
    pub(crate) session: Arc<Session>,
    /// Each `sync`'s budget.
    pub(crate) limit: Duration,
    /// [`crate::ZkLockConfig::session_watch_from`].
    pub(crate) watch_from: Option<usize>,
}

impl std::fmt::Debug for SessionGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionGroup")
            .field("session", &zk::SessionId(self.session.id))
            .finish_non_exhaustive()
    }
}

impl RenewalGroup for SessionGroup {
    fn id(&self) -> usize {
        Arc::as_ptr(&self.session) as usize
    }

    /// A member joins the session's watch on the lock root (which pushes its loss to `lost`)
    /// once the session already has `watch_from` members; before, its node's deletion is
    /// pushed by its `watch_lost` (its node watch), which lock-core keeps.
    fn join(&self, lease: &Lease, lost: &lock_core::raw::LostSink) -> bool {
        let before = self.session.members.fetch_add(1, Ordering::Relaxed);
        let Some(state) = lease.backend_state::<ZkLease>() else {
            return false;
        };
        if self.watch_from.is_none_or(|from| before < from) || state.session_id != self.session.id {
            return false;
        }
        let joined = self.session.root_watch.join(
            &self.session,
            state.path.clone(),
            state.czxid,
            state.epoch,
            lost,
        );
        if joined {
            // Its own watch (armed while it waited) is not needed any more.
            state.watch.disarm();
        }
        joined
    }

    fn leave(&self, lease: &Lease) {
        self.session.members.fetch_sub(1, Ordering::Relaxed);
        if let Some(state) = lease.backend_state::<ZkLease>()
            && self.session.root_watch.leave(&state.path)
        {
            crate::members::left(&self.session, state.path.clone(), state.czxid, self.limit);
        }
    }

    /// A lost member's node goes once nobody could trust it any more and the session is
    /// vouched for: at the lease's deadline (the group's, which its loss may have come a little
    /// before, while the session was still trusted), then as soon as the session is vouched for
    /// again — unless it was deleted meanwhile (its watch says so: a release, an operator's
    /// delete) or the session ended (which took it). Whether it was a member of the session's
    /// watch or kept a node watch of its own.
    fn leave_lost(&self, lease: &Lease) {
        self.session.members.fetch_sub(1, Ordering::Relaxed);
        let Some(state) = lease.backend_state::<ZkLease>() else {
            return;
        };
        self.session.root_watch.leave(&state.path);
        if self.session.is_ended() {
            return;
        }
        let (session, watch, path, czxid) = (
            self.session.clone(),
            state.watch.clone(),
            state.path.clone(),
            state.czxid,
        );
        let (limit, deadline) = (self.limit, lease.local_deadline());
        tokio::spawn(async move {
            tokio::time::sleep_until(deadline).await;
            if !session.is_ended() && !watch.is_lost() {
                crate::queue::spawn_removal(session, path, czxid, limit);
            }
        });
    }

    fn renew(
        &self,
        ttl: Duration,
        until: Instant,
    ) -> BoxFuture<'static, std::result::Result<Instant, GroupRenewError>> {
        let (session, limit) = (self.session.clone(), self.limit);
        Box::pin(async move {
            // The session watch's members: every deletion applied before the `sync` pushed,
            // every member covered on the current connection (see `crate::members`).
            let checked = match session.check_in(limit).await {
                Ok(()) => session.root_watch.settle(&session, until).await,
                Err(e) => Err(e),
            };
            match checked {
                Ok(()) => {}
                // Every node went with the session (each `watch_lost` reports it too).
                Err(e) if session_gone(&e) => {
                    return Err(GroupRenewError::Lost(LossReason::NotHeld));
                }
                Err(e) => return Err(GroupRenewError::Failed(to_error("renew", e))),
            }
            let ttl = lease_ttl(ttl, &session);
            let base = session.vouched_base();
            if base + ttl - drift_margin(ttl) <= Instant::now() {
                return Err(GroupRenewError::Failed(unvouched()));
            }
            Ok(base)
        })
    }
}

/// Job mode's `at_least` where the lease is the session (which lives as long as the client, and
/// dies with it sooner than `at_least` may have passed): a *keep marker* ([`KeepMarker`], the
/// child [`crate::path::KEEP_NODE`] of the lock directory) says "held until `hold` after my last
/// write", by the leader's clock (the marker's `mtime`). It is written right after the grant,
/// before the job starts (`hold_at_least`), and outlives both the holder's node and its session:
/// an acquirer that is first in line waits until the leader's clock has passed it
/// (`Contender::clear_keep`) and deletes it. Where the server allows TTL nodes
/// (`zookeeper.extendedTypesEnabled=true`) the marker is one, with `hold` as its TTL, so the
/// server deletes it by itself once nobody takes the lock again; elsewhere it is a persistent
/// node, deleted by the next acquirer.
///
/// A TTL marker is created with a *pin* ([`keep_pin`]: a TTL child of its own, named after the
/// grant) in one transaction, and deleted with it in one. The server's sweep lists the TTL nodes
/// that have passed and posts their deletes one by one behind every emptied lock directory of
/// the same pass, seconds later on a busy server; such a delete checks only that the path holds
/// a childless TTL node. Without the pin, the delete meant for the previous grant's marker
/// (passed, then replaced by the next acquirer at the same path) removed the new marker at once,
/// and the lock went to the next contender long before `at_least` (`same_job_every_backend`'s
/// periodic check on ZooKeeper ran a period's job twice). A pinned marker has a child until its
/// own pin has passed, and no pin's path is ever used twice.
pub(crate) struct KeptMarker {
    version: i32,
    /// Until when, on our clock, the marker holds the lock at least: the create's send time plus
    /// `hold` (the leader stamped it later than that).
    covers_until: Instant,
}

impl ZkLock {
    /// Writes the keep marker of `lease`'s grant (replacing any earlier one: acquirers delete a
    /// live marker only after it passed, so one still there when we were granted had passed)
    /// and records it in the lease. `NotHeld` once our session (with our node) is gone.
    pub(crate) async fn write_keep(
        &self,
        lease: &Lease,
        hold: Duration,
        op: &'static str,
    ) -> Result<()> {
        let not_held = || Error::not_held(lease.key());
        let state = lease.backend_state::<ZkLease>().ok_or_else(not_held)?;
        let session = self.session_of(state).ok_or_else(not_held)?;
        let client = &session.client;
        let path = keep_path(dir_of(&state.path));
        let data = KeepMarker {
            hold,
            fence: state.czxid,
            holder: self.inner.identity.as_str().to_owned(),
        }
        .encode();
        for _ in 0..6 {
            let ttl_nodes = self.inner.ttl_markers.load(Ordering::Relaxed);
            let mut options = zk::CreateMode::Persistent.with_acls(self.acls());
            if ttl_nodes {
                options = options.with_ttl(hold.max(Duration::from_millis(1)));
            }
            let sent = Instant::now();
            let created = if ttl_nodes {
                // The marker and its pin in one transaction: never unpinned.
                let mut both = client.new_multi_writer();
                let added = both
                    .add_create(&path, &data, &options)
                    .and_then(|()| both.add_create(&keep_pin(&path, state.czxid), &[], &options));
                match added {
                    // A node just created is at version 0 (the multi's Stat may be unset on
                    // some servers: ZOOKEEPER-4026).
                    Ok(()) => {
                        self.call(async { both.commit().await.map(|_| 0).map_err(zk::Error::from) })
                            .await
                    }
                    Err(e) => Err(e),
                }
            } else {
                self.call(client.create(&path, &data, &options))
                    .await
                    .map(|(stat, _)| stat.version)
            };
            match created {
                Ok(version) => {
                    *state.kept.lock().unwrap_or_else(PoisonError::into_inner) = Some(KeptMarker {
                        version,
                        covers_until: sent + hold,
                    });
                    return Ok(());
                }
                Err(zk::Error::Unimplemented) if ttl_nodes => {
                    tracing::debug!("the server has no TTL nodes; keep markers are persistent");
                    self.inner.ttl_markers.store(false, Ordering::Relaxed);
                }
                // An earlier grant's marker that had passed, or ours from a create whose reply
                // was lost: replaced, so that its mtime and TTL are this write's.
                Err(zk::Error::NodeExists) => {
                    match delete_keep(client, &path, None, None, self.op_deadline()).await {
                        Ok(()) | Err(zk::Error::NoNode) => {}
                        Err(e) if session_gone(&e) => return Err(not_held()),
                        Err(e) if outcome_unknown(&e) => {}
                        Err(e) => return Err(to_error(op, e)),
                    }
                }
                Err(e) if session_gone(&e) => return Err(not_held()),
                // Sent again: a create applied without our hearing of it is found as NodeExists.
                Err(e) if outcome_unknown(&e) => {}
                Err(e) => return Err(to_error(op, e)),
            }
        }
        Err(Error::Unavailable {
            backend: BACKEND,
            op,
            message: "the keep marker could not be written".into(),
            source: None,
        })
    }

    /// Job mode's early end: our node is deleted and the keep marker left to hold the lock for
    /// `left` more. The marker written at the grant does when it covers that long (it always
    /// does for the guard, whose `left` ends at grant + `at_least`); otherwise one for `left`
    /// is written first. `Ok(false)`: the grant was already lost.
    pub(crate) async fn keep_lease(&self, lease: &Lease, left: Duration) -> Result<bool> {
        let Some(state) = lease.backend_state::<ZkLease>() else {
            return Ok(false);
        };
        let covered = state
            .kept
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .is_some_and(|k| Instant::now() + left <= k.covers_until);
        if !covered {
            match self.write_keep(lease, left, "keep").await {
                Ok(()) => {}
                Err(Error::NotHeld { .. }) => return Ok(false),
                Err(e) => return Err(e),
            }
        }
        self.delete_own(lease, "keep").await
    }

    /// The marker this grant wrote (if any), deleted before its release: the lock is free at
    /// once rather than when the next acquirer looks. Best effort — one left behind has passed
    /// (the release comes after `at_least`) and the next acquirer deletes it.
    pub(crate) async fn drop_keep(&self, state: &ZkLease, session: &Session) {
        let kept = state
            .kept
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(kept) = kept {
            let path = keep_path(dir_of(&state.path));
            if let Err(e) = delete_keep(
                &session.client,
                &path,
                Some(state.czxid),
                Some(kept.version),
                self.op_deadline(),
            )
            .await
            {
                tracing::debug!(error = %e, "the keep marker was left to the next acquirer");
            }
        }
    }
}

/// Deletes the keep marker at `path` (compare on `version` when given) with its pins, in one
/// transaction; each request bounded by `until`. `fence`: the grant the marker was written for
/// (its pin is tried first), when known. Answers as a `delete` of the marker alone: `NoNode`,
/// `BadVersion`, … A marker without a pin (a persistent one, one of an older client, or one
/// whose pin the server swept after it passed) is deleted alone.
pub(crate) async fn delete_keep(
    client: &zk::Client,
    path: &str,
    fence: Option<i64>,
    version: Option<i32>,
    until: Instant,
) -> ZkResult<()> {
    let mut pins = fence.map(|f| vec![keep_pin(path, f)]).unwrap_or_default();
    for _ in 0..4 {
        if !pins.is_empty() {
            let mut all = client.new_multi_writer();
            for pin in &pins {
                all.add_delete(pin, None)?;
            }
            all.add_delete(path, version)?;
            let n = pins.len();
            let deleted = call_until(until, async {
                match all.commit().await {
                    Ok(_) => Ok(true),
                    // A pin that is not there (never written, or swept once it passed), or a
                    // pin we did not name: look again.
                    Err(zk::MultiWriteError::OperationFailed {
                        index,
                        source: zk::Error::NoNode,
                    }) if index < n => Ok(false),
                    Err(zk::MultiWriteError::OperationFailed {
                        index,
                        source: zk::Error::NotEmpty,
                    }) if index == n => Ok(false),
                    Err(e) => Err(zk::Error::from(e)),
                }
            })
            .await?;
            if deleted {
                return Ok(());
            }
        }
        match call_until(until, client.delete(path, version)).await {
            Err(zk::Error::NotEmpty) => {}
            done => return done,
        }
        // Pinned: its children (only ever pins) go with it.
        pins = call_until(until, client.list_children(path))
            .await?
            .into_iter()
            .map(|pin| format!("{path}/{pin}"))
            .collect();
    }
    Err(zk::Error::NotEmpty)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn at(t0: Instant, sent: u64, answered: u64, connection: u64) -> Answered {
        Answered {
            sent: t0 + MS * u32::try_from(sent).unwrap(),
            at: t0 + MS * u32::try_from(answered).unwrap(),
            connection,
        }
    }

    /// With a 1 s session the lag is 250 ms.
    const LAG: Duration = Duration::from_millis(250);

    fn trust(t0: Instant) -> Trust {
        Trust::new(t0, LAG)
    }

    /// The bench's 30,000 held locks on ZooKeeper lost every one: thousands of requests answered
    /// per lag had pushed every candidate old enough out of the list, so no sync promoted any.
    #[test]
    fn a_busy_session_is_still_vouched_for() {
        let t0 = Instant::now();
        let mut t = trust(t0);
        // A request answered every 50 µs (20,000 per second), each taking 200 µs.
        let busy = |t: &mut Trust, requests: std::ops::Range<u64>| {
            for i in requests {
                let sent = t0 + Duration::from_micros(i * 50);
                t.record(Answered {
                    sent,
                    at: sent + Duration::from_micros(200),
                    connection: 0,
                });
            }
        };
        // For 1.5 s.
        busy(&mut t, 0..30_000);
        assert!(t.answered.len() <= MAX_CANDIDATES);
        // A sync sent at 1.5 s proves what was answered by 1.25 s, to within one granule.
        let base = t.promote(at(t0, 1500, 1501, 0), LAG);
        assert!(base <= t0 + MS * 1250, "{:?}", base - t0);
        assert!(
            base + LAG / CANDIDATES_PER_LAG + MS >= t0 + MS * 1250,
            "the base lags the cutoff by {:?}",
            (t0 + MS * 1250) - base
        );
        // And the next sync, a lag later, moves it on again.
        busy(&mut t, 30_000..35_000);
        assert!(t.promote(at(t0, 1750, 1751, 0), LAG) >= t0 + MS * 1490);
    }

    #[test]
    fn answered_reads_alone_never_move_the_base() {
        let t0 = Instant::now();
        let mut t = trust(t0);
        for i in 1..100 {
            t.record(at(t0, i * 10, i * 10 + 1, 0));
        }
        assert_eq!(t.base, t0);
    }

    #[test]
    fn a_sync_proves_only_what_was_answered_a_lag_before_it_was_sent() {
        let t0 = Instant::now();
        let mut t = trust(t0);
        t.record(at(t0, 100, 110, 0));
        t.record(at(t0, 300, 310, 0));
        // Sent at 500: only the request answered by 250 counts.
        assert_eq!(t.promote(at(t0, 500, 510, 0), LAG), t0 + MS * 100);
        // Sent at 700: the one answered at 310 (and not the sync answered at 510).
        assert_eq!(t.promote(at(t0, 700, 705, 0), LAG), t0 + MS * 300);
        // Sent at 800: the sync answered at 510 now counts; its send time is the base.
        assert_eq!(t.promote(at(t0, 800, 805, 0), LAG), t0 + MS * 500);
        // Never backwards.
        assert_eq!(t.promote(at(t0, 801, 802, 0), LAG), t0 + MS * 500);
    }

    #[test]
    fn requests_of_another_connection_never_count() {
        let t0 = Instant::now();
        let mut t = trust(t0);
        t.record(at(t0, 100, 110, 0));
        // A sync on the next connection (another member, perhaps) proves nothing about them.
        assert_eq!(t.promote(at(t0, 1000, 1010, 1), LAG), t0);
        assert!(t.answered.iter().all(|a| a.connection == 1));
        // Its own requests count once a later sync of that connection proves them.
        assert_eq!(t.promote(at(t0, 1300, 1310, 1), LAG), t0 + MS * 1000);
    }
}
