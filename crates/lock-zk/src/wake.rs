//! The deletion watch on one of our lock nodes, shared by the lease's renewals, its
//! `watch_lost` future and the waiter that owns the node.
//!
//! # Why a watch can stand in for a read of the node
//!
//! ZooKeeper sends a client the event of a watch it set *before* the reply to any request of
//! the same session that the server processes after the change (watch events and replies leave
//! the server in the order the changes were applied, on the session's one connection), and
//! zookeeper-client dispatches events and replies from one task in the order they arrive: the
//! event lands in the watcher's channel before the reply is handed to the caller. So if
//!
//! 1. an `exists` with a watch on our node returned our node (same czxid, our session as its
//!    ephemeral owner): the server had the node and registered the watch when it processed it;
//! 2. a later request of the session was sent after that `exists` was answered, and answered;
//! 3. the watcher's channel, polled synchronously after that reply arrived, holds no event;
//! 4. the connection did not change between sending 1 and receiving 2's reply (no reconnection,
//!    hence no re-registration of the watch through `SetWatches`, whose re-fired events are not
//!    ordered among themselves);
//!
//! then the node still existed when the server processed request 2 — exactly what an `exists` on
//! the node sent at the same moment would have told us, without sending it. Node paths are never
//! reused (the name carries a fresh uuid and a sequence number), so "exists" cannot mean "was
//! recreated". When any of 1–4 does not hold, the caller falls back to an `exists` on the node
//! (which re-arms the watch).

use std::{
    future::{Future, poll_fn},
    pin::Pin,
    sync::{Arc, Mutex, PoisonError},
    task::{Context, Poll, Waker},
    time::Duration,
};

use futures::{
    FutureExt,
    future::BoxFuture,
    task::{ArcWake, waker_ref},
};
use lock_core::raw::{Backoff, Lease, LossReason};
use tokio::time::{Instant, sleep};
use tokio_util::sync::CancellationToken;
use zookeeper_client as zk;

use crate::{
    ZkLock,
    client::{Session, call, session_gone},
    lock::ZkLease,
    queue::spawn_removal,
};

type EventFuture = Pin<Box<dyn Future<Output = zk::WatchedEvent> + Send>>;

/// The watch on one of our nodes (see the module documentation).
pub(crate) struct NodeWatch {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// The armed watch, if any.
    armed: Option<Armed>,
    /// Set once the node is known to be gone (deleted, or the session ended): final.
    lost: Option<LossReason>,
    /// Bumped whenever a watch is installed or consumed, so a caller can tell that the watch it
    /// checked before a request is the one it checks after.
    generation: u64,
    /// The tasks waiting in [`NodeWatch::poll_changed`] (a lease's `watch_lost` futures, a
    /// waiter), all woken when the state changes. Made when the first one registers: a held
    /// lock on its session's watch (`crate::members`) never has one.
    waiters: Option<Arc<Wakers>>,
}

/// Every registered waker; the armed event is polled with a waker that wakes them all, so no
/// waiting task depends on another one still being polled. A held lock has one (its
/// `watch_lost` future's), kept inline: a `Vec` for it took 80 B of heap per held lock.
#[derive(Default)]
struct Wakers(Mutex<WakerList>);

#[derive(Default)]
struct WakerList {
    first: Option<Waker>,
    more: Vec<Waker>,
}

impl Wakers {
    fn register(&self, waker: &Waker) {
        let mut list = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let WakerList { first, more } = &mut *list;
        match first {
            None => *first = Some(waker.clone()),
            Some(w) if w.will_wake(waker) => {}
            Some(_) => {
                if !more.iter().any(|w| w.will_wake(waker)) {
                    more.push(waker.clone());
                }
            }
        }
    }
}

impl ArcWake for Wakers {
    fn wake_by_ref(arc_self: &Arc<Self>) {
        let WakerList { first, more } =
            std::mem::take(&mut *arc_self.0.lock().unwrap_or_else(PoisonError::into_inner));
        for waker in first.into_iter().chain(more) {
            waker.wake();
        }
    }
}

struct Armed {
    event: EventFuture,
    /// The session's state as of just before the arming request was sent: any change since
    /// (a disconnection, a reconnection) makes the watch unreliable for ordering arguments.
    states: zk::StateWatcher,
    /// A change of `states` was seen.
    reconnected: bool,
}

/// What a synchronous look at the watch says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Check {
    /// Armed on the node, no event received, no reconnection since it was armed: the node
    /// existed when the server processed any request whose reply has arrived (conditions 1, 3
    /// and 4 of the module documentation). The number identifies the armed watch.
    Reliable(u64),
    /// No usable watch: read the node instead.
    Unreliable,
    /// The node is gone (deleted from outside or by our release), or the session ended.
    Lost(LossReason),
}

/// What [`NodeWatch::poll_changed`] wakes its waiter for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Change {
    /// No watch is armed (never armed, or the last one fired for a data change): arm one.
    Unarmed,
    /// The node is gone, or the session ended.
    Lost(LossReason),
}

impl NodeWatch {
    pub(crate) fn new() -> Self {
        Self {
            state: Mutex::new(State::default()),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Looks at the watch now, without waiting: consumes an event already delivered to the
    /// watcher's channel.
    pub(crate) fn check(&self) -> Check {
        let mut guard = self.state();
        let state = &mut *guard;
        state.poll(None);
        if let Some(reason) = state.lost {
            return Check::Lost(reason);
        }
        match &mut state.armed {
            Some(armed) if !armed.reconnected => {
                if armed.states.changed().now_or_never().is_some() {
                    armed.reconnected = true;
                    Check::Unreliable
                } else {
                    Check::Reliable(state.generation)
                }
            }
            _ => Check::Unreliable,
        }
    }

    /// Installs a watch set by an `exists` that found our node. `states` must have been taken
    /// (`Client::state_watcher`) before that request was sent.
    pub(crate) fn install(&self, watcher: zk::OneshotWatcher, states: zk::StateWatcher) {
        let mut state = self.state();
        if state.lost.is_some() {
            return;
        }
        // Replacing an older watch drops it, which only unregisters that watcher locally.
        state.armed = Some(Armed {
            event: Box::pin(watcher.changed()),
            states,
            reconnected: false,
        });
        state.generation += 1;
        state.wake();
    }

    /// Records that the node is gone (a read found it missing or replaced, or we deleted it).
    pub(crate) fn set_lost(&self, reason: LossReason) {
        let mut state = self.state();
        if state.lost.is_none() {
            state.lost = Some(reason);
        }
        state.armed = None;
        state.generation += 1;
        state.wake();
    }

    /// Drops the armed watch (zookeeper-client then forgets it locally): the node is covered by
    /// the session's watch from now on (see `crate::members`).
    pub(crate) fn disarm(&self) {
        let mut state = self.state();
        if state.armed.take().is_some() {
            state.generation += 1;
            state.wake();
        }
    }

    /// Whether the node is known to be gone (or the session ended).
    pub(crate) fn is_lost(&self) -> bool {
        self.state().lost.is_some()
    }

    /// Ready when the watch needs arming or the node is gone; registers `cx` to be woken then.
    pub(crate) fn poll_changed(&self, cx: &mut Context<'_>) -> Poll<Change> {
        let mut state = self.state();
        state.poll(Some(cx));
        if let Some(reason) = state.lost {
            return Poll::Ready(Change::Lost(reason));
        }
        if state.armed.is_none() {
            return Poll::Ready(Change::Unarmed);
        }
        Poll::Pending
    }
}

impl State {
    /// Polls the armed watch's event with a waker that wakes every registered waiter (so they
    /// stay registered however the poll was triggered), and records what fired.
    fn poll(&mut self, cx: Option<&mut Context<'_>>) {
        if let Some(cx) = cx {
            self.waiters
                .get_or_insert_with(Arc::default)
                .register(cx.waker());
        }
        let Some(armed) = &mut self.armed else {
            return;
        };
        let polled = match &self.waiters {
            Some(waiters) => armed
                .event
                .as_mut()
                .poll(&mut Context::from_waker(&waker_ref(waiters))),
            // Nobody to wake: the first waiter to register polls it again.
            None => armed
                .event
                .as_mut()
                .poll(&mut Context::from_waker(futures::task::noop_waker_ref())),
        };
        let Poll::Ready(event) = polled else {
            return;
        };
        self.armed = None;
        self.generation += 1;
        match event.event_type {
            zk::EventType::NodeDeleted => self.lost = Some(LossReason::Revoked),
            zk::EventType::Session if event.session_state.is_terminated() => {
                self.lost = Some(LossReason::SessionExpired);
            }
            // A data change consumed the watch; the node is still there (for now): re-arm.
            _ => {}
        }
        // Every waiter looks again (the one polling now gets a harmless spurious wake-up).
        self.wake();
    }

    fn wake(&self) {
        if let Some(waiters) = &self.waiters {
            ArcWake::wake_by_ref(waiters);
        }
    }
}

impl ZkLock {
    /// What [`Driver::watch_lost`](lock_core::raw::Driver::watch_lost) returns: resolves when
    /// the lease's node is gone, the session ended, or the vouched window lapsed.
    pub(crate) fn lost_signal(&self, lease: &Lease) -> BoxFuture<'static, LossReason> {
        let Some(state) = lease.backend_state::<ZkLease>() else {
            return Box::pin(std::future::pending());
        };
        let Some(session) = self.session_of(state) else {
            return Box::pin(std::future::ready(LossReason::SessionExpired));
        };
        // The session-level lapse signal: one task watches the vouched instant for every held
        // lock (taken before the check below, so a lapse in between cancels it). The path is
        // shared with the lease (`Arc<str>`), not copied.
        let lapse = session.lapse_token();
        let (watch, path, czxid) = (state.watch.clone(), state.path.clone(), state.czxid);
        let limit = self.inner.config.timeout;
        if session.vouched_until() <= Instant::now() {
            // The session can no longer be vouched for: it may have expired on the server.
            // If it did not, our node must not outlive the loss (see `spawn_removal`).
            spawn_removal(session, path, czxid, limit);
            return Box::pin(std::future::ready(LossReason::DeadlinePassed));
        }
        // A lapse makes the lease lost for good; if the session then survives, the node must go.
        // No task per held lock for that: the future carries a guard that starts the removal
        // when the future ends or is dropped once the session is no longer vouched for (the
        // scheduler drops it as soon as the lease's deadline passes, which is the same
        // instant: the lease counts from the session's vouched base).
        let guard = RemoveOnLapse {
            session,
            watch,
            path,
            czxid,
            limit,
            lapse,
        };
        Box::pin(async move {
            let guard = guard;
            let node_gone = async {
                // Boxed: made only on the rare path, and not kept in every held lock's future.
                let mut backoff = None::<Box<Backoff>>;
                loop {
                    match poll_fn(|cx| guard.watch.poll_changed(cx)).await {
                        Change::Lost(reason) => return reason,
                        Change::Unarmed => {}
                    }
                    // The rare path (arming the watch, or arming it again after a data change
                    // or a failure) is boxed, so that the future every held lock keeps for its
                    // whole life is small.
                    match Box::pin(guard.arm()).await {
                        Ok(()) => backoff = None,
                        Err(Some(reason)) => return reason,
                        Err(None) => {
                            let backoff = backoff.get_or_insert_with(|| {
                                Box::new(Backoff::new(
                                    Duration::from_millis(50),
                                    Duration::from_secs(1),
                                ))
                            });
                            Box::pin(sleep(backoff.next_delay())).await;
                        }
                    }
                }
            };
            // The lapse token is a child of the session's `ended`: one wait for both.
            tokio::select! {
                biased;
                () = guard.lapse.cancelled() => if guard.session.is_ended() {
                    LossReason::SessionExpired
                } else {
                    LossReason::DeadlinePassed
                },
                reason = node_gone => reason,
            }
        })
    }
}

/// What a held lock's `watch_lost` future keeps, and its clean-up: dropped (the future ended,
/// or the scheduler dropped it) while the session is no longer vouched for and the node is not
/// known to be gone, it starts the node's removal (`spawn_removal`), as a lost lease's node
/// must not outlive the loss if the session survives.
struct RemoveOnLapse {
    session: Arc<Session>,
    watch: Arc<NodeWatch>,
    path: Arc<str>,
    czxid: i64,
    limit: Duration,
    lapse: CancellationToken,
}

impl RemoveOnLapse {
    /// Arms the watch with an `exists` on the node: `Ok` armed (the node is ours), `Err(Some)`
    /// the node or the session is gone, `Err(None)` a failure to retry after a pause.
    async fn arm(&self) -> Result<(), Option<LossReason>> {
        let session = &self.session;
        let states = session.client.state_watcher();
        let probe = session.probe();
        match call(self.limit, session.client.check_and_watch_stat(&self.path)).await {
            Ok((Some(stat), watcher))
                if stat.czxid == self.czxid && stat.ephemeral_owner == session.id =>
            {
                session.answered(probe);
                self.watch.install(watcher, states);
                Ok(())
            }
            Ok(_) => {
                self.watch.set_lost(LossReason::Revoked);
                Err(Some(LossReason::Revoked))
            }
            Err(e) if session_gone(&e) => Err(Some(LossReason::SessionExpired)),
            Err(_) => Err(None),
        }
    }
}

impl Drop for RemoveOnLapse {
    fn drop(&mut self) {
        if self.session.is_ended() || self.watch.is_lost() {
            return;
        }
        if self.lapse.is_cancelled() || self.session.vouched_until() <= Instant::now() {
            spawn_removal(
                self.session.clone(),
                self.path.clone(),
                self.czxid,
                self.limit,
            );
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use lock_core::raw::{Driver, LockKey};

    use std::{
        sync::{
            Arc,
            atomic::{AtomicUsize, Ordering},
        },
        task::{Wake, Waker},
    };

    use futures::task::ArcWake;

    use super::Wakers;
    use crate::ZkLock;

    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// The first waiter is kept inline, the others in a list: every distinct waiter is woken
    /// once per change, a waiter registered twice once, and a wake-up empties the list.
    #[test]
    fn every_registered_waiter_is_woken_once() {
        let counts: Vec<_> = (0..3)
            .map(|_| Arc::new(Count(AtomicUsize::new(0))))
            .collect();
        let wakers: Vec<Waker> = counts.iter().map(|c| Waker::from(c.clone())).collect();
        let list = Arc::new(Wakers::default());
        for w in wakers.iter().chain(&wakers) {
            list.register(w);
        }
        ArcWake::wake_by_ref(&list);
        ArcWake::wake_by_ref(&list);
        let woken: Vec<_> = counts.iter().map(|c| c.0.load(Ordering::SeqCst)).collect();
        assert_eq!(woken, [1, 1, 1]);
        list.register(&wakers[2]);
        ArcWake::wake_by_ref(&list);
        assert_eq!(counts[2].0.load(Ordering::SeqCst), 2);
    }

    /// Issue 24: what a held lock keeps for its whole life is its `watch_lost` future (polled by
    /// lock-core's scheduler) and nothing else: no task of its own; and a renewal in flight (up
    /// to 4,096 per client at once) stays small. The `watch_lost` future was 944 B (release
    /// build) with the re-arming request and its backoff sleep in its state, every held lock
    /// had a removal task besides (384 B), and a renewal kept its rare `exists` in its state
    /// (880 B in a debug build): ≈ 4.4 KiB per held lock at 10,000.
    #[tokio::test(flavor = "current_thread")]
    async fn a_held_lock_keeps_a_small_future_and_no_task() {
        let Some(url) = conformance::backend_url("DISTLOCK_TEST_ZK_URL") else {
            return;
        };
        let lock = ZkLock::connect_url(&url).await.unwrap();
        let key = LockKey::new(format!("small-futures-{:x}", rand::random::<u32>())).unwrap();
        let ttl = Driver::capabilities(&lock).min_ttl;
        let lease = lock
            .try_acquire(&key, ttl)
            .await
            .unwrap()
            .expect("a fresh key is free");
        let metrics = tokio::runtime::Handle::current().metrics();
        let tasks = metrics.num_alive_tasks();
        let watch = lock.watch_lost(&lease);
        let spawned = metrics.num_alive_tasks() - tasks;
        let watch_size = std::mem::size_of_val(&*watch);
        drop(watch);
        let mut renewing = lease.clone();
        let renew = lock.renew(&mut renewing, ttl);
        let renew_size = std::mem::size_of_val(&*renew);
        drop(renew);
        assert!(lock.release(&lease).await.unwrap());
        eprintln!("watch_lost future {watch_size} B, renewal {renew_size} B, {spawned} tasks");
        assert_eq!(spawned, 0, "watch_lost spawned a task per held lock");
        assert!(
            watch_size <= 272,
            "a held lock's watch_lost future takes {watch_size} B"
        );
        assert!(renew_size <= 400, "a renewal's future takes {renew_size} B");
    }
}
