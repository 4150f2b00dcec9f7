//! The push channel: a held lock's loss is pushed by a watch of its entry's deletion, all of a
//! client's deletion watches sharing one watch stream. (A waiter's watches of the queue ahead
//! of it are the queue's own, in `queue.rs`.)
//!
//! A held lock's `watch_lost` waits for its entry's deletion. Opening a gRPC stream per held lock
//! cost ≈ 34 KiB of memory per lock (10,000 locks: ≈ 330 MiB); here all of a client's deletion
//! watches share one stream, and a task routes each response to its watcher by watch id.
//!
//! etcd answers the create requests of one stream in the order they were sent, so the n-th
//! "created" response belongs to the n-th pending create. From its "created" response until it
//! ends, a watch *covers* its entry ([`Held::is_watched`]): while covered, the entry's deletion is pushed
//! to its holder, and `renew` leaves out the per-entry read that is otherwise its only way to
//! notice one (see [`crate::renew::renew`]). A watcher that goes away cancels its
//! watch on the server. When the stream breaks, every watcher is told ([`Outcome::Broken`]) and
//! watches again from the revision it knows; the next watch opens a new stream, in a task of
//! its own (the routing task goes on meanwhile). A session's end is watched once per session
//! and ends every watch on it; a watch between two streams waits for the same end itself.

use std::{
    collections::{HashMap, VecDeque},
    future::poll_fn,
    sync::{Arc, OnceLock},
    task::Poll,
    time::Duration,
};

use etcd_client::{Client, EventType, WatchOptions, WatchRequestSender, WatchResponse};
use futures::task::AtomicWaker;
use lock_core::raw::{Backoff, LossReason};
use tokio::{sync::mpsc, task::AbortHandle, time::sleep};

use crate::{
    client::{self, Counters},
    lock::Inner,
    renew::Held,
};

/// How a deletion watch ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// The key was deleted, or moved to another lease (an event at or after the start
    /// revision).
    Deleted,
    /// The entry's session lease is known to be gone (its `gone` token was cancelled): every
    /// key on it is.
    SessionGone,
    /// The server cancelled the watch (e.g. the start revision was compacted): look at the key.
    Canceled,
    /// The stream failed or could not be opened: watch again later.
    Broken,
}

/// Where the routing task tells one watch how it ended, and wakes its waiter: a set-once
/// value and a waker, not a channel — a held lock keeps one for its whole life.
#[derive(Default)]
struct Signal {
    /// Set once, when the watch ends (a watch ends once).
    outcome: OnceLock<Outcome>,
    waker: AtomicWaker,
}

impl Signal {
    fn tell(&self, outcome: Outcome) {
        let _ = self.outcome.set(outcome);
        self.waker.wake();
    }

    fn told(&self) -> Option<Outcome> {
        self.outcome.get().copied()
    }
}

enum Command {
    Watch {
        id: u64,
        held: Arc<Held>,
        from: i64,
        signal: Arc<Signal>,
    },
    Forget {
        id: u64,
    },
    /// The session lease with this id is gone: every watch of an entry on it ends.
    SessionGone(i64),
    /// The stream of this generation opened (its responses), or could not be opened.
    Opened {
        generation: u64,
        /// Boxed: the stream is large and the other commands are many.
        responses: Option<Box<etcd_client::WatchResponseStream>>,
    },
}

/// The client's shared deletion-watch stream (the routing task starts with the first watch and
/// ends when the client and every watcher are gone).
#[derive(Debug)]
pub(crate) struct WatchMux {
    commands: mpsc::UnboundedSender<Command>,
    next_id: std::sync::atomic::AtomicU64,
}

/// One registered deletion watch; dropping it cancels the watch.
pub(crate) struct DeleteWatch {
    id: u64,
    commands: mpsc::UnboundedSender<Command>,
    signal: Arc<Signal>,
}

impl DeleteWatch {
    /// Waits until the watch ends. Should the routing task be gone (runtime shutting down),
    /// it does not end.
    pub(crate) async fn ended(&self) -> Outcome {
        poll_fn(|cx| {
            if let Some(outcome) = self.signal.told() {
                return Poll::Ready(outcome);
            }
            self.signal.waker.register(cx.waker());
            // Told between the first look and the registration.
            self.signal.told().map_or(Poll::Pending, Poll::Ready)
        })
        .await
    }
}

impl Drop for DeleteWatch {
    fn drop(&mut self) {
        let _ = self.commands.send(Command::Forget { id: self.id });
    }
}

impl WatchMux {
    pub(crate) fn new(client: Client, counters: std::sync::Arc<Counters>) -> Self {
        let (commands, rx) = mpsc::unbounded_channel();
        tokio::spawn(route(client, counters, commands.downgrade(), rx));
        Self {
            commands,
            next_id: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Watches `held`'s entry for a deletion at revision `from` or later (covering it while the
    /// watch is in place on the server).
    pub(crate) fn watch_delete(&self, held: &Arc<Held>, from: i64) -> DeleteWatch {
        let id = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let signal = Arc::new(Signal::default());
        if self
            .commands
            .send(Command::Watch {
                id,
                held: held.clone(),
                from,
                signal: signal.clone(),
            })
            .is_err()
        {
            // The routing task is gone (the runtime is shutting down): watch again later.
            signal.tell(Outcome::Broken);
        }
        DeleteWatch {
            id,
            commands: self.commands.clone(),
            signal,
        }
    }
}

struct Watcher {
    /// Where the outcome is told.
    signal: Arc<Signal>,
    /// The entry watched.
    held: Arc<Held>,
    /// The server's watch id, once created.
    server_id: Option<i64>,
    /// Whether this watch counts as covering its entry ([`Held::is_watched`]): from its
    /// "created" response until it ends, is forgotten, its stream breaks — or the routing
    /// task itself goes away (`Drop`), so that no entry stays covered by a watch that is gone.
    covering: bool,
}

impl Watcher {
    fn new(signal: Arc<Signal>, held: Arc<Held>) -> Self {
        Self {
            signal,
            held,
            server_id: None,
            covering: false,
        }
    }

    /// The server created the watch: it covers its entry from now on.
    fn created(&mut self, server_id: i64) {
        self.server_id = Some(server_id);
        if !std::mem::replace(&mut self.covering, true) {
            self.held.watch_started();
        }
    }

    /// The watch no longer covers its entry.
    fn end(&mut self) {
        if std::mem::take(&mut self.covering) {
            self.held.watch_ended();
        }
    }

    /// Ends the watch and tells its waiter how.
    fn tell(mut self, outcome: Outcome) {
        self.end();
        self.signal.tell(outcome);
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.end();
    }
}

struct Routes {
    watchers: HashMap<u64, Watcher>,
    /// Our ids of the creates sent and not yet answered, oldest first (`None`: forgotten).
    pending: VecDeque<Option<u64>>,
    by_server_id: HashMap<i64, u64>,
    /// The session leases the watched entries are on: a task per session (not per lock)
    /// waits for its `gone` token and ends every watch of an entry on it.
    sessions: HashMap<i64, SessionWatch>,
    /// How those tasks reach the routing task (weak: they do not keep it alive).
    commands: mpsc::WeakUnboundedSender<Command>,
}

/// The watch of one session's `gone` token, for as long as an entry on it is watched.
struct SessionWatch {
    watchers: usize,
    task: AbortHandle,
}

impl Routes {
    fn new(commands: mpsc::WeakUnboundedSender<Command>) -> Self {
        Self {
            watchers: HashMap::new(),
            pending: VecDeque::new(),
            by_server_id: HashMap::new(),
            sessions: HashMap::new(),
            commands,
        }
    }

    /// Routes `watcher` (its create is sent) and watches its session's end.
    fn add(&mut self, id: u64, watcher: Watcher) {
        let session = &watcher.held.session;
        let watch = self.sessions.entry(session.id).or_insert_with(|| {
            let (gone, id, commands) = (session.gone.clone(), session.id, self.commands.clone());
            let task = tokio::spawn(async move {
                gone.cancelled().await;
                if let Some(commands) = commands.upgrade() {
                    let _ = commands.send(Command::SessionGone(id));
                }
            });
            SessionWatch {
                watchers: 0,
                task: task.abort_handle(),
            }
        });
        watch.watchers += 1;
        self.watchers.insert(id, watcher);
        self.pending.push_back(Some(id));
    }

    /// Takes `id`'s watcher out of every map; its server watch id, if created.
    fn remove(&mut self, id: u64) -> Option<(Watcher, Option<i64>)> {
        let w = self.watchers.remove(&id)?;
        let server_id = w.server_id;
        if let Some(server_id) = server_id {
            self.by_server_id.remove(&server_id);
        }
        self.forget_session(w.held.session.id);
        Some((w, server_id))
    }

    fn forget_session(&mut self, session: i64) {
        if let Some(watch) = self.sessions.get_mut(&session) {
            watch.watchers = watch.watchers.saturating_sub(1);
            if watch.watchers == 0 {
                watch.task.abort();
                self.sessions.remove(&session);
            }
        }
    }

    fn finish(&mut self, id: u64, outcome: Outcome) {
        if let Some((w, _)) = self.remove(id) {
            w.tell(outcome);
        }
    }

    /// Ends every watch of an entry on `session`; the server watch ids to cancel.
    fn session_gone(&mut self, session: i64) -> Vec<i64> {
        let ids: Vec<u64> = self
            .watchers
            .iter()
            .filter(|(_, w)| w.held.session.id == session)
            .map(|(id, _)| *id)
            .collect();
        let mut cancel = Vec::new();
        for id in ids {
            if let Some((w, server_id)) = self.remove(id) {
                cancel.extend(server_id);
                w.tell(Outcome::SessionGone);
            }
        }
        cancel
    }

    fn break_all(&mut self) {
        for (_, w) in self.watchers.drain() {
            w.tell(Outcome::Broken);
        }
        for (_, watch) in self.sessions.drain() {
            watch.task.abort();
        }
        self.pending.clear();
        self.by_server_id.clear();
    }

    /// Routes one response; returns server watch ids to cancel.
    fn route(&mut self, resp: &WatchResponse) -> Option<i64> {
        let server_id = resp.watch_id();
        if resp.created() {
            let ours = self.pending.pop_front()?;
            let Some(id) = ours.filter(|id| self.watchers.contains_key(id)) else {
                // Forgotten while its create was in flight.
                return (server_id >= 0 && !resp.canceled()).then_some(server_id);
            };
            if resp.canceled() || server_id < 0 {
                self.finish(id, Outcome::Canceled);
                return None;
            }
            if let Some(w) = self.watchers.get_mut(&id) {
                w.created(server_id);
            }
            self.by_server_id.insert(server_id, id);
            // A create can carry events too only in later responses; fall through for them.
        }
        let id = *self.by_server_id.get(&server_id)?;
        if resp.canceled() {
            self.finish(id, Outcome::Canceled);
            return None;
        }
        let gone = self.watchers.get(&id).is_some_and(|w| {
            resp.events()
                .iter()
                .any(|event| !still_ours(event, w.held.session.id))
        });
        if gone {
            self.finish(id, Outcome::Deleted);
            return Some(server_id);
        }
        None
    }
}

/// Whether `event` on a held entry leaves it ours: a put on our lease (a relabel, by this
/// client) does; a delete, or a put that moved the key to another lease (or none), which
/// detaches it from our renewals, does not.
fn still_ours(event: &etcd_client::Event, lease: i64) -> bool {
    event.event_type() == EventType::Put && event.kv().is_some_and(|kv| kv.lease() == lease)
}

/// A request for the stream's writer task.
enum Request {
    Watch(Vec<u8>, WatchOptions),
    Cancel(i64),
}

/// Sends requests on the stream in order. A separate task, so the routing loop never waits on
/// a full request channel while responses are unread (the server stops reading requests when
/// its responses are not consumed).
async fn write(mut sender: WatchRequestSender, mut requests: mpsc::UnboundedReceiver<Request>) {
    while let Some(request) = requests.recv().await {
        let sent = match request {
            Request::Watch(key, opts) => sender.watch(key, Some(opts)).await,
            Request::Cancel(server_id) => sender.cancel(server_id).await,
        };
        if sent.is_err() {
            // The response side sees the broken stream and tells every watcher.
            return;
        }
    }
}

/// Opens a stream with its first watch, then sends the requests queued meanwhile, in order.
/// A task of its own: the routing task goes on meanwhile (forgetting watches, ending those of a
/// session that is gone) however long the open takes on a link that does not answer.
async fn open(
    client: Client,
    first: (Vec<u8>, WatchOptions),
    requests: mpsc::UnboundedReceiver<Request>,
    router: mpsc::WeakUnboundedSender<Command>,
    generation: u64,
) {
    let opened = client.watch_client().watch(first.0, Some(first.1)).await;
    let Some(tell) = router.upgrade() else { return };
    match opened {
        Ok(stream) => {
            let (sender, responses) = stream.split();
            let told = tell.send(Command::Opened {
                generation,
                responses: Some(Box::new(responses)),
            });
            // Not keeping the routing task alive while writing.
            drop(tell);
            if told.is_ok() {
                write(sender, requests).await;
            }
        }
        Err(_) => {
            let _ = tell.send(Command::Opened {
                generation,
                responses: None,
            });
        }
    }
}

async fn route(
    client: Client,
    counters: std::sync::Arc<Counters>,
    me: mpsc::WeakUnboundedSender<Command>,
    mut commands: mpsc::UnboundedReceiver<Command>,
) {
    let mut routes = Routes::new(me);
    // From the open's start: requests sent before the stream is open wait in the channel.
    let mut writer: Option<mpsc::UnboundedSender<Request>> = None;
    let mut responses: Option<etcd_client::WatchResponseStream> = None;
    // Which open an `Opened` answers (a stale one is dropped).
    let mut generation = 0_u64;
    loop {
        let message = async {
            match responses.as_mut() {
                Some(r) => r.message().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            command = commands.recv() => {
                let Some(command) = command else { return };
                match command {
                    Command::Watch { id, held, from, signal } => {
                        // Puts too: one that moves the key to another lease ends the watch
                        // as a deletion does (see `still_ours`).
                        let opts = WatchOptions::new().with_start_revision(from);
                        Counters::bump(&counters.watch);
                        let sent = match writer.as_ref() {
                            Some(w) => w.send(Request::Watch(held.key.clone(), opts)).is_ok(),
                            None => {
                                let (w, requests) = mpsc::unbounded_channel();
                                generation += 1;
                                let first = (held.key.clone(), opts);
                                let router = routes.commands.clone();
                                tokio::spawn(open(client.clone(), first, requests, router, generation));
                                writer = Some(w);
                                true
                            }
                        };
                        if sent {
                            routes.add(id, Watcher::new(signal, held));
                        } else {
                            signal.tell(Outcome::Broken);
                            routes.break_all();
                            writer = None;
                            responses = None;
                        }
                    }
                    Command::Forget { id } => {
                        // Dropping the watcher ends its cover of the entry.
                        if let Some((_, server_id)) = routes.remove(id) {
                            match server_id {
                                Some(server_id) => {
                                    if let Some(w) = writer.as_ref() {
                                        let _ = w.send(Request::Cancel(server_id));
                                    }
                                }
                                None => {
                                    for p in &mut routes.pending {
                                        if *p == Some(id) {
                                            *p = None;
                                        }
                                    }
                                }
                            }
                        }
                    }
                    Command::SessionGone(session) => {
                        for server_id in routes.session_gone(session) {
                            if let Some(w) = writer.as_ref() {
                                let _ = w.send(Request::Cancel(server_id));
                            }
                        }
                    }
                    Command::Opened { generation: of, responses: opened } => {
                        if of != generation {
                            continue;
                        }
                        match opened {
                            Some(r) => responses = Some(*r),
                            None => {
                                routes.break_all();
                                writer = None;
                                responses = None;
                            }
                        }
                    }
                }
            }
            message = message => match message {
                Ok(Some(resp)) => {
                    if let Some(server_id) = routes.route(&resp)
                        && let Some(w) = writer.as_ref()
                    {
                        let _ = w.send(Request::Cancel(server_id));
                    }
                }
                Ok(None) | Err(_) => {
                    routes.break_all();
                    writer = None;
                    responses = None;
                }
            },
        }
    }
}

/// What a read of a held entry found.
enum Entry {
    /// Gone, or another entry now.
    Gone,
    /// Still ours, at this revision (when the reply said).
    Ours(Option<i64>),
    /// The read failed.
    Unread,
}

/// Reads `held`'s entry after its deletion watch was cancelled.
async fn read_entry(inner: &Inner, held: &Held) -> Entry {
    Counters::bump(&inner.counters.range);
    let Ok(now) = client::request(
        inner.timeout(),
        inner.client.kv_client().get(held.key.clone(), None),
    )
    .await
    else {
        return Entry::Unread;
    };
    if now
        .kvs()
        .first()
        .is_none_or(|kv| kv.create_revision() != held.rev)
    {
        return Entry::Gone;
    }
    Entry::Ours(now.header().map(|h| h.revision()))
}

/// Completes when `held`'s entry is deleted (lease expired or revoked, key deleted), its
/// session's lease is known to be gone, or it is found gone by a renewal. What it keeps while
/// it waits is its watch's registration (an id, a sender, the shared signal): the rare paths
/// (a read after a cancelled watch, the pause after a broken stream) are boxed, and the
/// session's end is watched once per session by the routing task, not once per lock.
pub(crate) async fn watch_entry(inner: &Inner, held: &Arc<Held>) -> LossReason {
    let mut backoff = None::<Box<Backoff>>;
    let mut from = held.rev + 1;
    loop {
        if held.is_gone() {
            return LossReason::Revoked;
        }
        let watch = inner.watches.watch_delete(held, from);
        let deleted = match watch.ended().await {
            Outcome::Deleted | Outcome::SessionGone => true,
            Outcome::Broken => false,
            Outcome::Canceled => {
                // Compacted past our revision: look at the key itself (the read's state,
                // ≈ 2.7 KiB, is boxed by `or_gone`).
                match or_gone(held, read_entry(inner, held)).await {
                    None | Some(Entry::Gone) => true,
                    Some(Entry::Ours(revision)) => {
                        from = revision.map_or(from, |r| r + 1);
                        false
                    }
                    Some(Entry::Unread) => false,
                }
            }
        };
        drop(watch);
        if deleted {
            return LossReason::Revoked;
        }
        // The rare path's pause, and its backoff made only when needed.
        let backoff = backoff.get_or_insert_with(|| {
            Box::new(Backoff::new(
                Duration::from_millis(50),
                Duration::from_secs(2),
            ))
        });
        if or_gone(held, sleep(backoff.next_delay())).await.is_none() {
            return LossReason::Revoked;
        }
    }
}

/// Runs a step of `watch_entry`'s rare path — between two watches, when no watch of the
/// routing task covers the entry — unless the session's lease is known gone first (`None`).
/// Boxed here, not in an `async fn`: the future every held lock keeps for its whole life then
/// holds none of this state (the step moves straight into the box).
fn or_gone<'a, T: 'a>(
    held: &'a Held,
    step: impl Future<Output = T> + Send + 'a,
) -> futures::future::BoxFuture<'a, Option<T>> {
    Box::pin(async move {
        tokio::select! {
            biased;
            () = held.session.gone.cancelled() => None,
            out = step => Some(out),
        }
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use std::{sync::Arc, time::Duration};

    use lock_core::raw::{Driver, LockKey};

    use crate::EtcdLock;

    /// The session's end reaches every held lock on it through the routing task's one watch
    /// of the session (no token waiter per lock), even with no deletion event: here the
    /// session is only marked gone, on this client, and its entries stay on the server.
    #[tokio::test(flavor = "current_thread")]
    async fn a_session_known_gone_ends_every_watch_on_it() {
        let Some(url) = conformance::backend_url("DISTLOCK_TEST_ETCD_URL") else {
            return;
        };
        let lock = EtcdLock::connect_url(&url).await.unwrap();
        let ttl = Duration::from_secs(10);
        let tag = rand::random::<u32>();
        let key = |i: usize| LockKey::new(format!("session-gone-{tag:x}-{i}")).unwrap();
        let mut leases = Vec::new();
        for i in 0..3 {
            leases.push(lock.try_acquire(&key(i), ttl).await.unwrap().unwrap());
        }
        let held: Vec<_> = leases
            .iter()
            .map(|l| l.shared_backend_state::<crate::renew::Held>().unwrap())
            .collect();
        assert!(
            held.windows(2)
                .all(|w| Arc::ptr_eq(&w[0].session, &w[1].session)),
            "one session for the three locks"
        );
        let mut watches: Vec<_> = leases.iter().map(|l| lock.watch_lost(l)).collect();
        // A watch is registered at its first poll.
        for w in &mut watches {
            assert!(futures::poll!(w.as_mut()).is_pending());
        }
        // Every watch is in place on the server before the session is marked gone.
        tokio::time::timeout(Duration::from_secs(10), async {
            while !held.iter().all(|h| h.is_watched()) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the watches were created");
        for w in &mut watches {
            assert!(
                futures::poll!(w.as_mut()).is_pending(),
                "nothing is lost yet"
            );
        }
        held[0].session.mark_gone();
        for w in watches {
            let reason = tokio::time::timeout(Duration::from_secs(5), w)
                .await
                .expect("a held lock on a gone session is told so");
            assert_eq!(reason, lock_core::raw::LossReason::Revoked);
        }
        // The entries are still on the server: only the client knew. Clean up.
        drop(held);
        for lease in &leases {
            let _ = lock.force_release(lease.key()).await;
        }
    }

    /// The session's end reaches a held lock even while its watch stream cannot be opened
    /// again (the link answers nothing): opening a stream is a task of its own, so the routing
    /// task still ends the watches of a session that is gone, at once — not when the
    /// connection's keepalive gives up on the link (~15 s).
    #[tokio::test]
    async fn a_session_gone_while_the_stream_cannot_reopen_still_ends_the_watch() {
        let Some(url) = conformance::backend_url("DISTLOCK_TEST_ETCD_URL") else {
            return;
        };
        let (proxy, proxied) = conformance::drill::Proxy::start_for_url(&url)
            .await
            .unwrap();
        let lock = EtcdLock::connect_url(&proxied).await.unwrap();
        let key = LockKey::new(format!("reopen-gone-{:x}", rand::random::<u32>())).unwrap();
        let lease = lock
            .try_acquire(&key, Duration::from_secs(10))
            .await
            .unwrap()
            .unwrap();
        let held = lease.shared_backend_state::<crate::renew::Held>().unwrap();
        let mut watch = lock.watch_lost(&lease);
        assert!(futures::poll!(watch.as_mut()).is_pending());
        let covered = |want: bool| {
            let held = held.clone();
            async move {
                tokio::time::timeout(Duration::from_secs(10), async {
                    while held.is_watched() != want {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                })
                .await
                .expect("the watch's cover did not change");
            }
        };
        covered(true).await;
        // The link goes silent and its connections are reset: the stream breaks, and the
        // watch's next stream cannot open.
        proxy.blackhole();
        proxy.reset();
        let watches = lock.request_counts().watch;
        let task = tokio::spawn(watch);
        covered(false).await;
        // The watch has paused and asked for its watch again: the routing task is opening a
        // stream for it (on the silent link).
        tokio::time::timeout(Duration::from_secs(10), async {
            while lock.request_counts().watch <= watches {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the watch was not asked for again");
        assert!(
            !task.is_finished(),
            "the watch ended before its session did"
        );
        held.session.mark_gone();
        let reason = tokio::time::timeout(Duration::from_secs(3), task)
            .await
            .expect("the session's end waited for the stream to open")
            .unwrap();
        assert_eq!(reason, lock_core::raw::LossReason::Revoked);
        proxy.pass();
    }

    /// Issue 24: what a held lock keeps for its whole life is its `watch_lost` future (polled by
    /// lock-core's scheduler) and its place in the client's one reaper queue: no task of its own
    /// (each held lock had a reaper task, 504 B, woken at every local deadline, and two
    /// cancellation tokens); and that future and a renewal in flight (up to 4,096 per client at
    /// once) stay small. Each was 6–7 KiB while the requests they send only on a rare path (a
    /// read after a cancelled watch, the reaper's delete) were part of their state.
    #[tokio::test(flavor = "current_thread")]
    async fn a_held_lock_keeps_small_futures_and_no_task() {
        let Some(url) = conformance::backend_url("DISTLOCK_TEST_ETCD_URL") else {
            return;
        };
        let lock = EtcdLock::connect_url(&url).await.unwrap();
        let ttl = Duration::from_secs(10);
        let tag = rand::random::<u32>();
        let key = |i: usize| LockKey::new(format!("small-futures-{tag:x}-{i}")).unwrap();
        // The first lock starts what the client shares (its watch stream, its reaper).
        let first = lock.try_acquire(&key(0), ttl).await.unwrap().unwrap();
        let metrics = tokio::runtime::Handle::current().metrics();
        // Let the first acquisition's keepalive task end.
        tokio::task::yield_now().await;
        let tasks = metrics.num_alive_tasks();
        let mut leases = Vec::new();
        let mut watches = Vec::new();
        for i in 1..=16 {
            let lease = lock.try_acquire(&key(i), ttl).await.unwrap().unwrap();
            watches.push(lock.watch_lost(&lease));
            leases.push(lease);
        }
        tokio::task::yield_now().await;
        let spawned = metrics.num_alive_tasks().saturating_sub(tasks);
        let watch_size = std::mem::size_of_val(&*watches[0]);
        // A renewal in flight (up to 4,096 per client at once, lock-core's scheduler).
        let mut renewing = first.clone();
        let renew = lock.renew(&mut renewing, ttl);
        let renew_size = std::mem::size_of_val(&*renew);
        drop(renew);
        drop(watches);
        for lease in leases.iter().chain([&first]) {
            assert!(lock.release(lease).await.unwrap());
        }
        eprintln!(
            "watch_lost future {watch_size} B, renewal {renew_size} B, {spawned} tasks for 16 held locks"
        );
        assert!(
            spawned <= 2,
            "{spawned} tasks alive more after 16 more locks were taken: a task per held lock"
        );
        assert!(
            watch_size <= 160,
            "a held lock's watch_lost future takes {watch_size} B"
        );
        assert!(
            renew_size <= 1024,
            "a renewal's future takes {renew_size} B"
        );
    }
}
