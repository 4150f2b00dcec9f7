//! One persistent recursive watch on the lock root for a session's many held locks, instead of
//! a node watch each (issue 24: a node watch costs ~1 KiB of client memory per held lock).
//!
//! # When
//! A renewal-group member joins this watch (its loss is then pushed to lock-core, which keeps
//! no `watch_lost` future for it) once its session already holds
//! [`ZkLockConfig::session_watch_from`](crate::ZkLockConfig::session_watch_from) group members;
//! the ones before keep their node watch. The watch exists while it has members: it costs
//! every create and delete under the root, by anyone, an event to this session, which is why
//! a client holding a few locks does not use it.
//!
//! # Why it stands in for each node's watch
//! A persistent recursive watch, once the server has processed its `AddWatch`, sends the
//! session an event for every later deletion under the root, before the reply to any request
//! of the session that the server processes after it, on the same connection (as a node watch
//! does, see `crate::wake`), and zookeeper-client hands both out from one task in arrival
//! order. So a member is *covered* on a connection when the server had processed the watch's
//! registration there while the member's node existed:
//!
//! * its node was created by a request sent after the registration's reply arrived, on the same
//!   connection (the create records the registration's epoch, [`RootWatch::epoch`]); or
//! * a read sent after the registration's reply, on the same connection, found the node (same
//!   czxid, our session as its owner), or a listing of the session's ephemeral nodes sent then
//!   included it: [`RootWatch::establish`] checks every member that is not covered.
//!
//! A group renewal ([`RootWatch::settle`], after its `sync` was answered) applies every event
//! already delivered, so a deletion the server applied before that `sync` is pushed before the
//! renewal answers, and it answers only while every member is covered on the current connection.
//!
//! A change of connection ends every member's cover: the server does not replay a persistent
//! watch's events missed while disconnected (ZOOKEEPER-4698), and zookeeper-client 0.11.2 does
//! not register persistent watches again on a new connection (`resend_watches` only ever sends
//! the one-shot kinds). After one, the watch is registered again and every member checked again:
//! by one listing of the session's ephemeral nodes under the root when there are many
//! (`LIST_FROM`), by a read each otherwise.
//! A node path is never reused (a fresh token and a sequence number), so a read that finds it
//! means the same node.

use std::{
    collections::{HashMap, HashSet},
    future::{Future, poll_fn},
    pin::pin,
    sync::{
        Arc, Mutex, MutexGuard, PoisonError, Weak,
        atomic::{AtomicU32, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use futures::{FutureExt, StreamExt, stream};
use lock_core::raw::{Backoff, LossReason, LostSink};
use tokio::time::{Instant, sleep};
use zookeeper_client as zk;

use crate::{
    client::{Session, ZkResult, call_until, session_gone},
    queue::spawn_removal,
};

/// How many reads of members [`RootWatch::establish`] keeps in flight.
const READS_IN_FLIGHT: usize = 256;

/// From how many members to check at once on, [`RootWatch::establish`] lists the session's
/// ephemeral nodes instead of reading each.
const LIST_FROM: usize = 64;

/// How long the task pauses after applying events before it waits for more: every create and
/// delete under the root, by anyone, is an event to this session, and a wake-up per event cost
/// ~80 µs of CPU each on the project machine. An event that comes after a quiet spell is applied
/// at once; under a stream of them, a member's loss is pushed up to this much later (a group
/// renewal applies every delivered event anyway before it answers).
const COALESCE: Duration = Duration::from_millis(20);

/// The session's watch on the lock root and the members it covers (see the module docs).
pub(crate) struct RootWatch {
    /// The lock root (relative to the chroot).
    root: String,
    /// Each request's bound in the background task.
    limit: Duration,
    state: Mutex<State>,
    /// The live registration's epoch (0: none), read without the lock before a create is sent.
    epoch: AtomicU32,
    /// One registration and one round of reads at a time (the task's or a renewal's).
    establishing: tokio::sync::Mutex<()>,
    /// Wakes the task: a member joined that is not covered yet.
    wake: tokio::sync::Notify,
    /// Tests: the task applies no event and reads no member (so that what a renewal does is
    /// seen alone).
    #[cfg(test)]
    paused: std::sync::atomic::AtomicBool,
    /// Tests: the next [`RootWatch::read_uncovered`] says it has read (the first sender) and
    /// waits for the second before it applies what it read.
    #[cfg(test)]
    hold_after_read: Mutex<
        Option<(
            tokio::sync::oneshot::Sender<()>,
            tokio::sync::oneshot::Receiver<()>,
        )>,
    >,
}

#[derive(Default)]
struct State {
    watcher: Option<zk::PersistentWatcher>,
    /// The live registration: its epoch and the session connection it was made on.
    live: Option<(u32, u64)>,
    last_epoch: u32,
    members: HashMap<Arc<str>, Member>,
    /// Members whose `covered` is 0.
    uncovered: usize,
    /// A task runs for this watch.
    task: bool,
    /// The server refused `AddWatch` (before ZooKeeper 3.6): no member joins from then on.
    unsupported: bool,
}

struct Member {
    czxid: i64,
    sink: LostSink,
    /// The epoch of the live registration that covers it, 0 when none does.
    covered: u32,
}

impl RootWatch {
    pub(crate) fn new(root: &str, limit: Duration) -> Self {
        Self {
            root: root.to_owned(),
            limit,
            state: Mutex::new(State::default()),
            epoch: AtomicU32::new(0),
            establishing: tokio::sync::Mutex::new(()),
            wake: tokio::sync::Notify::new(),
            #[cfg(test)]
            paused: std::sync::atomic::AtomicBool::new(false),
            #[cfg(test)]
            hold_after_read: Mutex::new(None),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// What a create about to be sent records: the live registration's epoch (0: none). A
    /// member whose create recorded the epoch still live on the same connection when it joins
    /// is covered from its creation.
    pub(crate) fn epoch(&self) -> u32 {
        self.epoch.load(Ordering::Acquire)
    }

    /// `path` (our node, created with `czxid` by a create that recorded `created`) joins; its
    /// loss goes to `sink`. `false` when the server cannot hold the watch (the caller keeps
    /// the node's own watch). Never waits: called under lock-core's scheduler lock.
    pub(crate) fn join(
        self: &Arc<Self>,
        session: &Arc<Session>,
        path: Arc<str>,
        czxid: i64,
        created: u32,
        sink: &LostSink,
    ) -> bool {
        let connection = session.connection();
        let mut state = self.state();
        if state.unsupported {
            return false;
        }
        self.refresh(&mut state, connection);
        let covered = match state.live {
            Some((epoch, _)) if epoch == created => epoch,
            _ => 0,
        };
        let member = Member {
            czxid,
            sink: sink.clone(),
            covered,
        };
        if covered == 0 {
            state.uncovered += 1;
        }
        if let Some(old) = state.members.insert(path, member)
            && old.covered == 0
        {
            state.uncovered -= 1;
        }
        if !state.task {
            state.task = true;
            tokio::spawn(run(self.clone(), Arc::downgrade(session)));
        }
        drop(state);
        if covered == 0 {
            self.wake.notify_one();
        }
        true
    }

    /// `path` leaves: `true` when it was a member not known to be gone.
    pub(crate) fn leave(&self, path: &str) -> bool {
        let mut state = self.state();
        let Some(member) = state.members.remove(path) else {
            return false;
        };
        if member.covered == 0 {
            state.uncovered -= 1;
        }
        true
    }

    /// Forgets the registration when the session's connection changed since it was made.
    fn refresh(&self, state: &mut State, connection: u64) {
        if state.live.is_some_and(|(_, made_on)| made_on != connection) {
            self.unlive(state);
        }
    }

    /// No registration covers anything any more: every member must be read again.
    fn unlive(&self, state: &mut State) {
        state.live = None;
        self.epoch.store(0, Ordering::Release);
        for member in state.members.values_mut() {
            member.covered = 0;
        }
        state.uncovered = state.members.len();
    }

    /// The session ended: every member went with it. The watcher goes too (it must not be polled
    /// after its session's end: it panics).
    fn end(&self, state: &mut State) {
        state.watcher = None;
        state.live = None;
        self.epoch.store(0, Ordering::Release);
        state.uncovered = 0;
        for (_, member) in state.members.drain() {
            member.sink.lost(LossReason::SessionExpired);
        }
    }

    /// Applies every event already delivered, without waiting. The watcher's channel keeps
    /// only the last poller's waker, which this poll replaced with a no-op one: the task is
    /// woken to poll again (and register its own).
    fn drain(&self, state: &mut State) {
        self.apply_delivered(state);
        if state.watcher.is_some() {
            self.wake.notify_one();
        }
    }

    /// [`RootWatch::drain`] without waking the task.
    fn apply_delivered(&self, state: &mut State) {
        while let Some(event) = state
            .watcher
            .as_mut()
            .and_then(|w| w.changed().now_or_never())
        {
            self.apply(state, event);
        }
    }

    fn apply(&self, state: &mut State, event: zk::WatchedEvent) {
        match event.event_type {
            zk::EventType::NodeDeleted => {
                if let Some(member) = state.members.remove(event.path.as_str()) {
                    if member.covered == 0 {
                        state.uncovered -= 1;
                    }
                    member.sink.lost(LossReason::Revoked);
                }
            }
            zk::EventType::Session if event.session_state.is_terminated() => self.end(state),
            // A disconnection or a reconnection: see the module docs.
            zk::EventType::Session => self.unlive(state),
            _ => {}
        }
    }

    /// Polls the watcher for its next event and applies it (and any after it).
    fn poll_event(&self, cx: &mut Context<'_>) -> Poll<()> {
        #[cfg(test)]
        if self.paused.load(Ordering::SeqCst) {
            return Poll::Pending;
        }
        let mut state = self.state();
        let Some(watcher) = state.watcher.as_mut() else {
            return Poll::Pending;
        };
        // The receiver keeps the waker; the future holds nothing else.
        let Poll::Ready(event) = pin!(watcher.changed()).poll(cx) else {
            return Poll::Pending;
        };
        self.apply(&mut state, event);
        // The rest without the task's waker: events that come while the task pauses (see
        // `COALESCE`) do not wake it.
        self.apply_delivered(&mut state);
        Poll::Ready(())
    }

    /// Registers the watch on the current connection when it is not live there, then reads
    /// every member it does not cover yet (pushing the ones found gone). Each request ends by
    /// `until`. An error leaves the members not read uncovered.
    pub(crate) async fn establish(&self, session: &Session, until: Instant) -> ZkResult<()> {
        let Ok(_one) = tokio::time::timeout_at(until, self.establishing.lock()).await else {
            return Err(zk::Error::Timeout);
        };
        let connection = session.connection();
        let register = {
            let mut state = self.state();
            self.refresh(&mut state, connection);
            self.drain(&mut state);
            state.live.is_none() && !state.unsupported
        };
        if register {
            let made = call_until(
                until,
                session
                    .client
                    .watch(&self.root, zk::AddWatchMode::PersistentRecursive),
            )
            .await;
            let watcher = match made {
                Ok(watcher) => watcher,
                Err(zk::Error::Unimplemented) => {
                    tracing::warn!(
                        "the ZooKeeper server has no persistent watches (before 3.6): every held lock keeps a watch of its own"
                    );
                    self.state().unsupported = true;
                    return Ok(());
                }
                Err(e) => return Err(e),
            };
            let made_on = session.connection();
            let mut state = self.state();
            // The old watcher's events are applied before it goes; dropped after the new
            // one is in the client's table, it is only forgotten locally.
            self.drain(&mut state);
            let _old = state.watcher.replace(watcher);
            if made_on != connection {
                self.unlive(&mut state);
                return Err(zk::Error::ConnectionLoss);
            }
            state.last_epoch = state.last_epoch.wrapping_add(1).max(1);
            state.live = Some((state.last_epoch, made_on));
            self.epoch.store(state.last_epoch, Ordering::Release);
        }
        self.read_uncovered(session, until).await
    }

    /// Reads every member no registration covers: found, it is covered by the live one (read
    /// after it, on its connection); gone, it is pushed. Without persistent watches (an old
    /// server) every member is read, every time.
    async fn read_uncovered(&self, session: &Session, until: Instant) -> ZkResult<()> {
        let (epoch, targets): (u32, Vec<(Arc<str>, i64)>) = {
            let state = self.state();
            let epoch = match state.live {
                Some((epoch, _)) => epoch,
                None if state.unsupported => 0,
                None => return Err(zk::Error::ConnectionLoss),
            };
            let targets = state
                .members
                .iter()
                .filter(|(_, m)| m.covered == 0 || epoch == 0)
                .map(|(path, m)| (path.clone(), m.czxid))
                .collect();
            (epoch, targets)
        };
        if targets.is_empty() {
            return Ok(());
        }
        let read = if targets.len() >= LIST_FROM && epoch != 0 {
            self.list(session, until, targets).await?
        } else {
            read_each(session, until, targets).await
        };
        #[cfg(test)]
        {
            let hold = self
                .hold_after_read
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            if let Some((read_done, go_on)) = hold {
                let _ = read_done.send(());
                let _ = go_on.await;
            }
        }
        let connection = session.connection();
        let mut state = self.state();
        self.refresh(&mut state, connection);
        self.drain(&mut state);
        let still_live = epoch != 0 && state.live.is_some_and(|(live, _)| live == epoch);
        let mut failed = None;
        for (path, found) in read {
            match found {
                Ok(true) => {
                    if still_live
                        && let Some(member) = state.members.get_mut(&*path)
                        && member.covered == 0
                    {
                        member.covered = epoch;
                        state.uncovered -= 1;
                    }
                }
                // Gone (node paths are never reused): pushed, whatever the connection.
                Ok(false) => {
                    if let Some(member) = state.members.remove(&*path) {
                        if member.covered == 0 {
                            state.uncovered -= 1;
                        }
                        member.sink.lost(LossReason::Revoked);
                    }
                }
                Err(e) => failed = Some(e),
            }
        }
        match failed {
            Some(e) => Err(e),
            None if epoch != 0 && !still_live => Err(zk::Error::ConnectionLoss),
            None => Ok(()),
        }
    }

    /// Whether each of `targets` is still one of our session's nodes, from one listing of the
    /// session's ephemeral nodes under the root (ZooKeeper 3.6's `getEphemerals`): after a
    /// reconnection, 100,000 members are checked in 60–230 ms instead of 5.2–5.6 s of one
    /// `exists` each on the project machine. An older server refuses it: then one read each.
    async fn list(
        &self,
        session: &Session,
        until: Instant,
        targets: Vec<(Arc<str>, i64)>,
    ) -> ZkResult<Vec<(Arc<str>, ZkResult<bool>)>> {
        match call_until(until, session.client.list_ephemerals(&self.root)).await {
            Ok(ours) => {
                let ours: HashSet<String> = ours.into_iter().collect();
                Ok(targets
                    .into_iter()
                    .map(|(path, _)| {
                        let found = ours.contains(&*path);
                        (path, Ok(found))
                    })
                    .collect())
            }
            Err(zk::Error::Unimplemented) => Ok(read_each(session, until, targets).await),
            Err(e) => Err(e),
        }
    }

    /// A group renewal's last step, once its `sync` was answered: applies every event already
    /// delivered (so a deletion the server applied before that `sync` is pushed before the
    /// renewal answers), and returns only once every member is covered on the current
    /// connection (registering and reading as needed, by `until`).
    pub(crate) async fn settle(&self, session: &Session, until: Instant) -> ZkResult<()> {
        loop {
            let connection = session.connection();
            let unsupported = {
                let mut state = self.state();
                self.refresh(&mut state, connection);
                self.drain(&mut state);
                // `uncovered` is kept as a count so that this check costs the same however many
                // members there are; debug builds (every test) recount it.
                debug_assert_eq!(
                    state.uncovered,
                    state.members.values().filter(|m| m.covered == 0).count(),
                    "the session watch's count of uncovered members"
                );
                if state.members.is_empty() || (state.live.is_some() && state.uncovered == 0) {
                    return Ok(());
                }
                state.unsupported
            };
            if unsupported {
                return self.read_uncovered(session, until).await;
            }
            if Instant::now() >= until {
                return Err(zk::Error::Timeout);
            }
            self.establish(session, until).await?;
        }
    }
}

/// Whether each of `targets` (path, czxid) is still our node: one `exists` each,
/// [`READS_IN_FLIGHT`] at a time.
async fn read_each(
    session: &Session,
    until: Instant,
    targets: Vec<(Arc<str>, i64)>,
) -> Vec<(Arc<str>, ZkResult<bool>)> {
    stream::iter(targets)
        .map(|(path, czxid)| async move {
            let found = call_until(until, session.client.check_stat(&path))
                .await
                .map(|stat| {
                    stat.is_some_and(|stat| {
                        stat.czxid == czxid && stat.ephemeral_owner == session.id
                    })
                });
            (path, found)
        })
        .buffer_unordered(READS_IN_FLIGHT)
        .collect()
        .await
}

/// The watch's task: keeps the registration live and every member covered, and applies events
/// as they come. Ends (dropping the registration) when no member is left or the session ended.
async fn run(watch: Arc<RootWatch>, session: Weak<Session>) {
    let mut backoff = None::<Backoff>;
    loop {
        let Some(live) = session.upgrade() else {
            break;
        };
        if live.is_ended() {
            break;
        }
        let wanted = {
            let mut state = watch.state();
            if state.members.is_empty() {
                // The last member left: the registration goes with the task.
                state.task = false;
                watch.end(&mut state);
                return;
            }
            !state.unsupported && (state.live.is_none() || state.uncovered > 0)
        };
        #[cfg(test)]
        let wanted = wanted && !watch.paused.load(Ordering::SeqCst);
        if wanted {
            match watch.establish(&live, Instant::now() + watch.limit).await {
                Ok(()) => backoff = None,
                Err(e) if session_gone(&e) => break,
                Err(e) => {
                    let delay = backoff
                        .get_or_insert_with(|| {
                            Backoff::new(Duration::from_millis(50), Duration::from_secs(1))
                        })
                        .next_delay();
                    tracing::debug!(error = %e, ?delay, "session watch: registering or reading members failed; trying again");
                    let ended = live.ended.clone();
                    drop(live);
                    tokio::select! {
                        () = ended.cancelled() => {}
                        () = sleep(delay) => {}
                    }
                    continue;
                }
            }
        }
        let ended = live.ended.clone();
        drop(live);
        // `ended` first: it is cancelled before the client's last handle goes, and the
        // watcher must not be polled once its channel is closed (it panics).
        let applied = tokio::select! {
            biased;
            () = ended.cancelled() => false,
            () = watch.wake.notified() => false,
            () = poll_fn(|cx| watch.poll_event(cx)) => true,
        };
        if applied {
            tokio::select! {
                biased;
                () = ended.cancelled() => {}
                () = sleep(COALESCE) => {}
            }
        }
    }
    let mut state = watch.state();
    state.task = false;
    watch.end(&mut state);
}

/// What [`crate::renew::SessionGroup::leave`] does for a member of the watch: a lease lost to a
/// lapsed window must not leave its node behind if the session survives (as `watch_lost`'s
/// guard does for a node with its own watch, see `crate::wake`).
pub(crate) fn left(session: &Arc<Session>, path: Arc<str>, czxid: i64, limit: Duration) {
    if !session.is_ended() && session.vouched_until() <= Instant::now() {
        spawn_removal(session.clone(), path, czxid, limit);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use std::{sync::atomic::Ordering, time::Duration};

    use lock_core::raw::{Driver, Lease, LockKey, LossReason, LostSink, PushedLosses};
    use tokio::time::{Instant, timeout};
    use zookeeper_client as zk;

    use crate::{ZkLock, ZkLockConfig, lock::ZkLease};

    /// A client whose every held lock joins the session watch, and a key of its own.
    async fn client(url: &str) -> (ZkLock, LockKey) {
        let mut config = ZkLockConfig::from_url(url).unwrap();
        config.session_watch_from = Some(0);
        config.root = "/distlock-test-members".into();
        let lock = ZkLock::connect(config).await.unwrap();
        let key = LockKey::new(format!("members-{:x}", rand::random::<u64>())).unwrap();
        (lock, key)
    }

    /// Takes `key` and makes it a member of its session's group, covered by the watch (one
    /// group renewal answered).
    async fn member(
        lock: &ZkLock,
        key: &LockKey,
    ) -> (Lease, lock_core::raw::SharedGroup, PushedLosses) {
        let ttl = Driver::capabilities(lock).min_ttl;
        let lease = lock
            .try_acquire(key, ttl)
            .await
            .unwrap()
            .expect("a fresh key is free");
        let group = lock.renewal_group(&lease).expect("a session's group");
        let (sink, pushed) = LostSink::detached();
        assert!(
            group.join(&lease, &sink),
            "a member past session_watch_from joins the watch"
        );
        renew(lock, &group)
            .await
            .expect("the first renewal covers it");
        (lease, group, pushed)
    }

    /// Deletes the lease's node from outside and waits for its loss to be pushed.
    async fn deletion_is_pushed(url: &str, lease: &Lease, pushed: &PushedLosses) {
        delete_node(url, lease).await;
        let reason = timeout(Duration::from_secs(10), pushed.next())
            .await
            .expect("the deletion is pushed");
        assert_eq!(reason, LossReason::Revoked);
    }

    /// One renewal of the group (the session's smallest TTL, 10 s to answer).
    async fn renew(
        lock: &ZkLock,
        group: &lock_core::raw::SharedGroup,
    ) -> Result<Instant, lock_core::raw::GroupRenewError> {
        let ttl = Driver::capabilities(lock).min_ttl;
        group
            .renew(ttl, Instant::now() + Duration::from_secs(10))
            .await
    }

    /// Deletes the lease's node from outside (what an operator's force-release does).
    async fn delete_node(url: &str, lease: &Lease) {
        let hosts = ZkLockConfig::from_url(url).unwrap().hosts;
        let raw = zk::Client::connector()
            .with_session_timeout(Duration::from_secs(5))
            .connect(&hosts)
            .await
            .unwrap();
        let path = lease.backend_state::<ZkLease>().unwrap().path.clone();
        raw.delete(&path, None).await.unwrap();
    }

    /// The watch pushes a member's deletion with no renewal, and a node it covers keeps no
    /// watch of its own.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_member_s_deletion_is_pushed_by_the_session_watch() {
        let Some(url) = conformance::backend_url("DISTLOCK_TEST_ZK_URL") else {
            return;
        };
        let (lock, key) = client(&url).await;
        let (lease, group, pushed) = member(&lock, &key).await;
        let state = lease.backend_state::<ZkLease>().unwrap();
        assert_eq!(
            state.watch.check(),
            crate::wake::Check::Unreliable,
            "no node watch armed"
        );
        deletion_is_pushed(&url, &lease, &pushed).await;
        group.leave(&lease);
    }

    /// A deletion the server applied before a group renewal's `sync` is pushed before that
    /// renewal answers, even when the watch's task has not looked at its events.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_deletion_before_a_renewal_is_pushed_before_it_answers() {
        let Some(url) = conformance::backend_url("DISTLOCK_TEST_ZK_URL") else {
            return;
        };
        let (lock, key) = client(&url).await;
        let (lease, group, pushed) = member(&lock, &key).await;
        let session = lock
            .session_of(lease.backend_state::<ZkLease>().unwrap())
            .unwrap();
        session.root_watch.paused.store(true, Ordering::SeqCst);
        delete_node(&url, &lease).await;
        renew(&lock, &group).await.expect("the session is fine");
        assert_eq!(
            pushed.take(),
            vec![LossReason::Revoked],
            "pushed by the time the renewal answered"
        );
        group.leave(&lease);
    }

    /// A member on a client that goes through a proxy, after the proxy reset the connection and
    /// the client connected again (same session); with `paused`, the watch's task applies no
    /// event from before the reset on.
    async fn reconnected_member(
        url: &str,
        paused: bool,
    ) -> (
        conformance::drill::Proxy,
        ZkLock,
        Lease,
        lock_core::raw::SharedGroup,
        PushedLosses,
    ) {
        let (proxy, proxied) = conformance::drill::Proxy::start_for_url(url).await.unwrap();
        let (lock, key) = client(&proxied).await;
        let (lease, group, pushed) = member(&lock, &key).await;
        reconnect(&proxy, &lock, &lease, paused).await;
        (proxy, lock, lease, group, pushed)
    }

    /// Resets `proxy`'s connections and waits until `lease`'s session is connected again.
    async fn reconnect(
        proxy: &conformance::drill::Proxy,
        lock: &ZkLock,
        lease: &Lease,
        paused: bool,
    ) {
        let session = lock
            .session_of(lease.backend_state::<ZkLease>().unwrap())
            .unwrap();
        session.root_watch.paused.store(paused, Ordering::SeqCst);
        let mut states = session.client.state_watcher();
        proxy.reset();
        // Disconnected, then connected again.
        while !matches!(
            timeout(Duration::from_secs(10), states.changed())
                .await
                .expect("reconnects"),
            zk::SessionState::SyncConnected
        ) {}
    }

    /// After a reconnection (zookeeper-client does not register a persistent watch again, and
    /// the server would not replay what it missed) a renewal registers the watch again and
    /// reads every member: one deleted meanwhile is pushed before it answers.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_renewal_after_a_reconnection_reads_every_member_again() {
        let Some(url) = conformance::backend_url("DISTLOCK_TEST_ZK_URL") else {
            return;
        };
        let (_proxy, lock, lease, group, pushed) = reconnected_member(&url, true).await;
        delete_node(&url, &lease).await;
        renew(&lock, &group).await.expect("the session survived");
        assert_eq!(pushed.take(), vec![LossReason::Revoked]);
        group.leave(&lease);
    }

    /// The watch's task notices a reconnection by itself: it registers the watch again, so a
    /// deletion after it is pushed with no renewal.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_watch_is_made_again_after_a_reconnection() {
        let Some(url) = conformance::backend_url("DISTLOCK_TEST_ZK_URL") else {
            return;
        };
        let (_proxy, _lock, lease, group, pushed) = reconnected_member(&url, false).await;
        deletion_is_pushed(&url, &lease, &pushed).await;
        group.leave(&lease);
    }

    /// A lock whose node was created, then deleted, before the session watch's registration
    /// (which no event reports), joining the group of a member covered by the watch: the
    /// client, that lock, the member, the group and where the lock's loss is pushed.
    ///
    /// `quiet_task`: the watch's task does nothing until the lock joins (so that it is idle
    /// then, and only the join's wake-up can make it read).
    async fn joins_gone_unread(
        url: &str,
        quiet_task: bool,
    ) -> (
        ZkLock,
        Lease,
        Lease,
        lock_core::raw::SharedGroup,
        PushedLosses,
    ) {
        let (lock, key) = client(url).await;
        let ttl = Driver::capabilities(&lock).min_ttl;
        let other = LockKey::new(format!("{}-b", key.as_str())).unwrap();
        let early = lock.try_acquire(&other, ttl).await.unwrap().expect("free");
        let session = lock
            .session_of(early.backend_state::<ZkLease>().unwrap())
            .unwrap();
        session
            .root_watch
            .paused
            .store(quiet_task, Ordering::SeqCst);
        delete_node(url, &early).await;
        let (lease, group, _pushed) = member(&lock, &key).await;
        session.root_watch.paused.store(false, Ordering::SeqCst);
        let (sink, pushed) = LostSink::detached();
        assert!(group.join(&early, &sink));
        (lock, early, lease, group, pushed)
    }

    /// A member whose node was created before the watch's registration is read when it joins:
    /// deleted before the registration (which no event reports), it is pushed before the next
    /// renewal answers.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_member_created_before_the_watch_is_read_when_it_joins() {
        let Some(url) = conformance::backend_url("DISTLOCK_TEST_ZK_URL") else {
            return;
        };
        let (lock, early, lease, group, pushed) = joins_gone_unread(&url, false).await;
        renew(&lock, &group).await.expect("the session is fine");
        assert_eq!(pushed.take(), vec![LossReason::Revoked]);
        group.leave(&early);
        group.leave(&lease);
    }

    /// The watch's task, idle, reads a member that joins uncovered by itself: one whose node
    /// was deleted before the watch's registration is pushed with no renewal.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_task_reads_a_member_that_joins_uncovered() {
        let Some(url) = conformance::backend_url("DISTLOCK_TEST_ZK_URL") else {
            return;
        };
        let (_lock, early, lease, group, pushed) = joins_gone_unread(&url, true).await;
        let reason = timeout(Duration::from_secs(10), pushed.next())
            .await
            .expect("the task reads it and pushes its loss");
        assert_eq!(reason, LossReason::Revoked);
        group.leave(&early);
        group.leave(&lease);
    }

    /// The watch counts its uncovered members, and a renewal answers at once when none is
    /// left: members that leave, or whose node goes, before anything read them must leave
    /// that count (else every later renewal reads and registers until its deadline).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn uncovered_members_that_leave_or_go_leave_no_renewal_waiting() {
        let Some(url) = conformance::backend_url("DISTLOCK_TEST_ZK_URL") else {
            return;
        };
        let (lock, key) = client(&url).await;
        let ttl = Driver::capabilities(&lock).min_ttl;
        // Created before the watch exists: each joins uncovered.
        let mut early = Vec::new();
        for name in ["a", "b"] {
            let other = LockKey::new(format!("{}-{name}", key.as_str())).unwrap();
            early.push(lock.try_acquire(&other, ttl).await.unwrap().expect("free"));
        }
        let (lease, group, _pushed) = member(&lock, &key).await;
        let session = lock
            .session_of(lease.backend_state::<ZkLease>().unwrap())
            .unwrap();
        // Nothing reads them in the background.
        session.root_watch.paused.store(true, Ordering::SeqCst);
        let mut pushed = Vec::new();
        for lease in &early {
            let (sink, p) = LostSink::detached();
            assert!(group.join(lease, &sink));
            pushed.push(p);
        }
        assert_eq!(session.root_watch.state().uncovered, 2);
        // One leaves unread; the other's node goes (its event is applied by the renewal).
        group.leave(&early[0]);
        assert!(lock.release(&early[0]).await.unwrap());
        delete_node(&url, &early[1]).await;
        for _ in 0..2 {
            let started = Instant::now();
            renew(&lock, &group).await.expect("nothing is left to read");
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "the renewal read until its deadline: {:?}",
                started.elapsed()
            );
        }
        assert_eq!(pushed[1].take(), vec![LossReason::Revoked]);
        assert!(pushed[0].take().is_empty(), "it left: nothing to push");
        {
            let state = session.root_watch.state();
            assert_eq!((state.uncovered, state.members.len()), (0, 1));
        }
        group.leave(&lease);
    }

    /// A read of the members covers them only for the registration it was sent under: when
    /// the connection changes between the read and its answer being applied, a member it found
    /// is still uncovered, so a deletion after the read (which the new connection's watch never
    /// reports) is found by the next read before any renewal answers.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_read_overtaken_by_a_reconnection_covers_nothing() {
        let Some(url) = conformance::backend_url("DISTLOCK_TEST_ZK_URL") else {
            return;
        };
        let (proxy, lock, lease, group, pushed) = reconnected_member(&url, true).await;
        let session = lock
            .session_of(lease.backend_state::<ZkLease>().unwrap())
            .unwrap();
        let (read_done_tx, read_done) = tokio::sync::oneshot::channel();
        let (go_on, go_on_rx) = tokio::sync::oneshot::channel();
        *session.root_watch.hold_after_read.lock().unwrap() = Some((read_done_tx, go_on_rx));
        let ttl = Driver::capabilities(&lock).min_ttl;
        let renewal = {
            let group = group.clone();
            tokio::spawn(async move {
                group
                    .renew(ttl, Instant::now() + Duration::from_secs(20))
                    .await
            })
        };
        // The renewal registered the watch again and read the member (found): before it
        // applies that, the connection changes and the node goes.
        timeout(Duration::from_secs(10), read_done)
            .await
            .expect("the renewal reads the member")
            .unwrap();
        reconnect(&proxy, &lock, &lease, true).await;
        delete_node(&url, &lease).await;
        go_on.send(()).unwrap();
        let first = renewal.await.unwrap();
        if first.is_ok() {
            assert_eq!(
                pushed.take(),
                vec![LossReason::Revoked],
                "a renewal answered with the member's node gone"
            );
        } else {
            renew(&lock, &group).await.expect("the session survived");
            assert_eq!(pushed.take(), vec![LossReason::Revoked]);
        }
        group.leave(&lease);
    }

    /// With many members to check after a reconnection, one listing of the session's nodes
    /// stands in for a read each: the members deleted meanwhile, and only they, are pushed
    /// before the renewal answers.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn after_a_reconnection_many_members_are_checked_by_one_listing() {
        let Some(url) = conformance::backend_url("DISTLOCK_TEST_ZK_URL") else {
            return;
        };
        let (proxy, proxied) = conformance::drill::Proxy::start_for_url(&url)
            .await
            .unwrap();
        let (lock, key) = client(&proxied).await;
        let (first, group, _pushed) = member(&lock, &key).await;
        let ttl = Driver::capabilities(&lock).min_ttl;
        let mut members = Vec::new();
        for i in 0..super::LIST_FROM {
            let other = LockKey::new(format!("{}-{i}", key.as_str())).unwrap();
            let lease = lock.try_acquire(&other, ttl).await.unwrap().expect("free");
            let (sink, pushed) = LostSink::detached();
            assert!(group.join(&lease, &sink));
            members.push((lease, pushed));
        }
        renew(&lock, &group).await.expect("covers them all");
        reconnect(&proxy, &lock, &first, true).await;
        for (lease, _) in &members[..2] {
            delete_node(&url, lease).await;
        }
        renew(&lock, &group).await.expect("the session survived");
        let pushed: Vec<_> = members.iter().map(|(_, p)| p.take()).collect();
        assert_eq!(
            pushed[..2],
            [vec![LossReason::Revoked], vec![LossReason::Revoked]]
        );
        assert!(
            pushed[2..].iter().all(Vec::is_empty),
            "only the deleted ones: {pushed:?}"
        );
        for (lease, _) in &members {
            group.leave(lease);
        }
        group.leave(&first);
    }
}
