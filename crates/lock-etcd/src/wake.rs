//! The push channel: a held lock's loss is pushed by a watch of its entry's deletion, all of a
//! client's deletion watches sharing one watch stream. (A waiter's watches of the queue ahead
//! of it are the queue's own, in `queue.rs`.)
//!
//! Opening a gRPC stream per held lock cost ≈ 34 KiB of memory per lock (10,000 locks: ≈ 330
//! MiB); here all of a client's deletion watches share one stream, and a task routes each
//! response to its watch by watch id. A watch tells its end in one of two ways: a held lock's
//! `watch_lost` future waits on a [`Signal`]; a member of its session's renewal group has no
//! future at all — its loss is pushed to the lock-core sink its entry keeps
//! ([`Held::entry_gone_now`]), which saves the future, its signal and its waker per held lock.
//!
//! etcd answers the create requests of one stream in the order they were sent, so the n-th
//! "created" response belongs to the n-th pending create. From its "created" response until it
//! ends, a watch *covers* its entry ([`Held::is_watched`]): while covered, the entry's deletion
//! is pushed to its holder, and `renew` (or a group renewal) leaves out the per-entry read that
//! is otherwise its only way to notice one (see [`crate::renew::renew`]). A watcher that goes
//! away cancels its watch on the server. The routing task keeps every watch until it ends: when
//! the stream breaks, it creates them all again, from the revision each knows, after a backoff
//! (the next open is a task of its own, so the routing task goes on meanwhile); when the server
//! cancels one (its start revision compacted), it reads the entry and watches again from the
//! revision read — or ends the watch if the entry is gone. A session's end is watched once per
//! session and ends every watch on it.

use std::{
    collections::{HashMap, VecDeque},
    future::poll_fn,
    sync::{Arc, Weak},
    task::Poll,
    time::Duration,
};

use etcd_client::{Client, EventType, WatchOptions, WatchRequestSender, WatchResponse};
use futures::task::AtomicWaker;
use lock_core::raw::{Backoff, LossReason};
use tokio::{
    sync::mpsc,
    task::AbortHandle,
    time::{Instant, sleep_until},
};

use crate::{
    client::{self, Counters},
    lock::Inner,
    renew::Held,
};

/// Where the routing task tells a waiter that its watch ended (the entry deleted, moved to
/// another lease, found gone by a read, or its session gone — a broken stream or a cancelled
/// watch is made again, not told) and wakes it: a set-once flag and a waker, not a channel.
#[derive(Default)]
struct Signal {
    ended: std::sync::atomic::AtomicBool,
    waker: AtomicWaker,
}

impl Signal {
    fn tell(&self) {
        self.ended.store(true, std::sync::atomic::Ordering::Release);
        self.waker.wake();
    }

    fn told(&self) -> bool {
        self.ended.load(std::sync::atomic::Ordering::Acquire)
    }
}

enum Command {
    Watch {
        id: u64,
        held: Arc<Held>,
        /// `None`: a renewal group's member, whose loss is pushed to its entry's sink.
        signal: Option<Arc<Signal>>,
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
    /// What the read of a cancelled watch's entry found.
    Read {
        id: u64,
        entry: Entry,
    },
}

/// The client's shared deletion-watch stream (the routing task starts with the client and
/// ends when the client and every watcher are gone).
#[derive(Debug)]
pub(crate) struct WatchMux {
    commands: mpsc::UnboundedSender<Command>,
    next_id: std::sync::atomic::AtomicU64,
}

/// One registered deletion watch with a waiter; dropping it cancels the watch.
pub(crate) struct DeleteWatch {
    id: u64,
    commands: mpsc::UnboundedSender<Command>,
    signal: Arc<Signal>,
}

impl DeleteWatch {
    /// Waits until the watch ends. Should the routing task be gone (runtime shutting down),
    /// it does not end.
    pub(crate) async fn ended(&self) {
        poll_fn(|cx| {
            if self.signal.told() {
                return Poll::Ready(());
            }
            self.signal.waker.register(cx.waker());
            // Told between the first look and the registration.
            if self.signal.told() {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await;
    }
}

impl Drop for DeleteWatch {
    fn drop(&mut self) {
        let _ = self.commands.send(Command::Forget { id: self.id });
    }
}

/// Marks the id of a renewal group member's watch: its entry's address with the top bit set.
/// Unique among live watches (the watch keeps its entry alive, so no other entry has that
/// address meanwhile) and apart from the counter's ids (which never reach 2⁶³); the member's
/// `forget` is sent before its entry can be freed, in the same channel, so it never reaches a
/// later entry at the same address.
const MEMBER: u64 = 1 << 63;

fn member_id(held: &Arc<Held>) -> u64 {
    // A pointer fits in 64 bits on every target this crate builds for.
    Arc::as_ptr(held) as usize as u64 | MEMBER
}

impl WatchMux {
    pub(crate) fn new(client: Client, counters: Arc<Counters>, inner: Weak<Inner>) -> Self {
        let (commands, rx) = mpsc::unbounded_channel();
        let router = Router::new(client, counters, inner, commands.downgrade());
        tokio::spawn(router.run(rx));
        Self {
            commands,
            next_id: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Watches `held`'s entry for a deletion after its creation (covering it while the watch is
    /// in place on the server), for a waiter.
    pub(crate) fn watch_delete(&self, held: &Arc<Held>) -> DeleteWatch {
        let id = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let signal = Arc::new(Signal::default());
        // Should the routing task be gone (the runtime shutting down), the watch never ends.
        let _ = self.commands.send(Command::Watch {
            id,
            held: held.clone(),
            signal: Some(signal.clone()),
        });
        DeleteWatch {
            id,
            commands: self.commands.clone(),
            signal,
        }
    }

    /// Watches a renewal group member's entry: its end is pushed to the entry's sink.
    pub(crate) fn watch_member(&self, held: &Arc<Held>) {
        let _ = self.commands.send(Command::Watch {
            id: member_id(held),
            held: held.clone(),
            signal: None,
        });
    }

    /// The member left its group: its watch is cancelled.
    pub(crate) fn forget_member(&self, held: &Arc<Held>) {
        let _ = self.commands.send(Command::Forget {
            id: member_id(held),
        });
    }
}

/// Where a watch stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// Its create is sent and not yet answered (it is in `Routes::pending`).
    Creating,
    /// In place on the server, with this watch id.
    Created(i64),
    /// The server cancelled it: its entry is being read.
    Reading,
    /// Its stream broke (or a read failed): created again at the next retry.
    Idle,
}

struct Watcher {
    /// Where the end is told; `None`: a renewal group's member, pushed through its entry.
    signal: Option<Arc<Signal>>,
    /// The entry watched.
    held: Arc<Held>,
    /// The revision its next create starts from.
    from: i64,
    stage: Stage,
    /// Whether this watch counts as covering its entry ([`Held::is_watched`]): from its
    /// "created" response until it ends, is forgotten, its stream breaks or it is cancelled —
    /// or the routing task itself goes away (`Drop`), so that no entry stays covered by a
    /// watch that is gone.
    covering: bool,
}

impl Watcher {
    fn new(signal: Option<Arc<Signal>>, held: Arc<Held>) -> Self {
        Self {
            signal,
            from: held.rev + 1,
            held,
            stage: Stage::Idle,
            covering: false,
        }
    }

    /// The server created the watch: it covers its entry from now on.
    fn created(&mut self, server_id: i64) {
        self.stage = Stage::Created(server_id);
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

    /// Ends the watch and tells its waiter how — or, for a member, marks its entry gone, which
    /// pushes its loss, and unregisters it (unless released through this client meanwhile:
    /// its own release deleted it).
    fn tell(mut self, inner: &Weak<Inner>) {
        self.end();
        match &self.signal {
            Some(signal) => signal.tell(),
            None if !self.held.is_released() => {
                if let Some(inner) = inner.upgrade() {
                    inner.entry_gone_then(self.held.clone());
                }
            }
            None => {}
        }
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
    inner: Weak<Inner>,
}

/// The watch of one session's `gone` token, for as long as an entry on it is watched.
struct SessionWatch {
    watchers: usize,
    task: AbortHandle,
}

/// What a response asks of the routing task.
enum Routed {
    Nothing,
    /// Cancel this server watch (its watcher ended or was forgotten).
    Cancel(i64),
    /// The server cancelled this watch: read its entry.
    Read(u64),
}

impl Routes {
    fn new(commands: mpsc::WeakUnboundedSender<Command>, inner: Weak<Inner>) -> Self {
        Self {
            watchers: HashMap::new(),
            pending: VecDeque::new(),
            by_server_id: HashMap::new(),
            sessions: HashMap::new(),
            commands,
            inner,
        }
    }

    /// Keeps `watcher` (not yet created) and watches its session's end.
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
        if let Some(old) = self.watchers.insert(id, watcher) {
            // One id is never watched twice at once; were it, the older watch goes.
            self.forget_session(old.held.session.id);
        }
    }

    /// Takes `id`'s watcher out of every map; its server watch id, if created.
    fn remove(&mut self, id: u64) -> Option<(Watcher, Option<i64>)> {
        let w = self.watchers.remove(&id)?;
        let server_id = match w.stage {
            Stage::Created(server_id) => {
                self.by_server_id.remove(&server_id);
                Some(server_id)
            }
            Stage::Creating => {
                for p in &mut self.pending {
                    if *p == Some(id) {
                        *p = None;
                    }
                }
                None
            }
            Stage::Reading | Stage::Idle => None,
        };
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

    /// Ends `id`'s watch; its server watch id to cancel, if created.
    fn finish(&mut self, id: u64) -> Option<i64> {
        let (w, server_id) = self.remove(id)?;
        w.tell(&self.inner);
        server_id
    }

    /// Ends every watch of an entry on `session`; the server watch ids to cancel.
    fn session_gone(&mut self, session: i64) -> Vec<i64> {
        let ids: Vec<u64> = self
            .watchers
            .iter()
            .filter(|(_, w)| w.held.session.id == session)
            .map(|(id, _)| *id)
            .collect();
        ids.into_iter().filter_map(|id| self.finish(id)).collect()
    }

    /// The stream broke: no watch is in place any more; each is created again at the next
    /// retry (one being read waits for its read).
    fn break_all(&mut self) {
        for w in self.watchers.values_mut() {
            w.end();
            if matches!(w.stage, Stage::Creating | Stage::Created(_)) {
                w.stage = Stage::Idle;
            }
        }
        self.pending.clear();
        self.by_server_id.clear();
    }

    /// The watches waiting for the next retry.
    fn idle(&self) -> Vec<u64> {
        self.watchers
            .iter()
            .filter(|(_, w)| w.stage == Stage::Idle)
            .map(|(id, _)| *id)
            .collect()
    }

    /// Routes one response.
    fn route(&mut self, resp: &WatchResponse) -> Routed {
        let server_id = resp.watch_id();
        if resp.created() {
            let Some(ours) = self.pending.pop_front() else {
                return Routed::Nothing;
            };
            let Some(id) = ours.filter(|id| self.watchers.contains_key(id)) else {
                // Forgotten while its create was in flight.
                return if server_id >= 0 && !resp.canceled() {
                    Routed::Cancel(server_id)
                } else {
                    Routed::Nothing
                };
            };
            if resp.canceled() || server_id < 0 {
                // Refused (its start revision compacted, say).
                return Routed::Read(id);
            }
            if let Some(w) = self.watchers.get_mut(&id) {
                w.created(server_id);
            }
            self.by_server_id.insert(server_id, id);
            // A create can carry events too only in later responses; fall through for them.
        }
        let Some(&id) = self.by_server_id.get(&server_id) else {
            return Routed::Nothing;
        };
        if resp.canceled() {
            self.by_server_id.remove(&server_id);
            return Routed::Read(id);
        }
        let gone = self.watchers.get(&id).is_some_and(|w| {
            resp.events()
                .iter()
                .any(|event| !still_ours(event, &w.held))
        });
        if gone {
            return self.finish(id).map_or(Routed::Nothing, Routed::Cancel);
        }
        Routed::Nothing
    }
}

/// Whether `event` on a held entry leaves it ours: a put on our lease (a relabel, by this
/// client) or onto the lease job mode's keep moved it to does; a delete, or a put that moved the
/// key to any other lease (or none), which detaches it from our renewals, does not.
fn still_ours(event: &etcd_client::Event, held: &Held) -> bool {
    event.event_type() == EventType::Put
        && event.kv().is_some_and(|kv| held.is_own_lease(kv.lease()))
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

/// The routing task: one per client, for the client's deletion watches.
struct Router {
    client: Client,
    counters: Arc<Counters>,
    routes: Routes,
    /// From the open's start: requests sent before the stream is open wait in the channel.
    writer: Option<mpsc::UnboundedSender<Request>>,
    responses: Option<etcd_client::WatchResponseStream>,
    /// Which open an `Opened` answers (a stale one is dropped).
    generation: u64,
    /// When the idle watches are created again (after a broken stream or a failed read).
    retry_at: Option<Instant>,
    /// The pauses between retries, from the first break until a watch is created again.
    backoff: Backoff,
}

impl Router {
    fn new(
        client: Client,
        counters: Arc<Counters>,
        inner: Weak<Inner>,
        commands: mpsc::WeakUnboundedSender<Command>,
    ) -> Self {
        Self {
            client,
            counters,
            routes: Routes::new(commands, inner),
            writer: None,
            responses: None,
            generation: 0,
            retry_at: None,
            backoff: retry_backoff(),
        }
    }

    async fn run(mut self, mut commands: mpsc::UnboundedReceiver<Command>) {
        loop {
            let retry_at = self.retry_at;
            let responses = &mut self.responses;
            let message = async {
                match responses.as_mut() {
                    Some(r) => r.message().await,
                    None => std::future::pending().await,
                }
            };
            let retry = async {
                match retry_at {
                    Some(at) => sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                command = commands.recv() => {
                    let Some(command) = command else { return };
                    self.command(command);
                }
                message = message => match message {
                    Ok(Some(resp)) => self.response(&resp),
                    Ok(None) | Err(_) => self.broken(),
                },
                () = retry => self.retry(),
            }
        }
    }

    fn command(&mut self, command: Command) {
        match command {
            Command::Watch { id, held, signal } => {
                self.routes.add(id, Watcher::new(signal, held));
                self.create(id);
            }
            Command::Forget { id } => {
                // Dropping the watcher ends its cover of the entry.
                if let Some((_, Some(server_id))) = self.routes.remove(id) {
                    self.cancel(server_id);
                }
            }
            Command::SessionGone(session) => {
                for server_id in self.routes.session_gone(session) {
                    self.cancel(server_id);
                }
            }
            Command::Opened {
                generation,
                responses,
            } => {
                if generation != self.generation {
                    return;
                }
                match responses {
                    Some(r) => self.responses = Some(*r),
                    None => self.broken(),
                }
            }
            Command::Read { id, entry } => {
                let Some(w) = self.routes.watchers.get_mut(&id) else {
                    return;
                };
                if w.stage != Stage::Reading {
                    return;
                }
                match entry {
                    Entry::Gone => {
                        self.routes.finish(id);
                    }
                    Entry::Ours(Some(revision)) => {
                        w.from = revision + 1;
                        self.create(id);
                    }
                    // Unread (or read without a revision to start from): again later.
                    Entry::Ours(None) | Entry::Unread => {
                        w.stage = Stage::Idle;
                        self.retry_later();
                    }
                }
            }
        }
    }

    fn response(&mut self, resp: &WatchResponse) {
        if resp.created() && !resp.canceled() {
            // The stream works: the next break starts its pauses afresh.
            self.backoff.reset();
        }
        match self.routes.route(resp) {
            Routed::Nothing => {}
            Routed::Cancel(server_id) => self.cancel(server_id),
            Routed::Read(id) => self.read(id),
        }
    }

    /// Sends `id`'s create on the stream, opening one if there is none.
    fn create(&mut self, id: u64) {
        let Some(w) = self.routes.watchers.get_mut(&id) else {
            return;
        };
        // Puts too: one that moves the key to another lease ends the watch as a deletion does
        // (see `still_ours`).
        let opts = WatchOptions::new().with_start_revision(w.from);
        let key = w.held.key.clone();
        Counters::bump(&self.counters.watch);
        let sent = match self.writer.as_ref() {
            Some(writer) => writer.send(Request::Watch(key, opts)).is_ok(),
            None => {
                let (writer, requests) = mpsc::unbounded_channel();
                self.generation += 1;
                let router = self.routes.commands.clone();
                let open = open(
                    self.client.clone(),
                    (key, opts),
                    requests,
                    router,
                    self.generation,
                );
                tokio::spawn(open);
                self.writer = Some(writer);
                true
            }
        };
        if sent {
            w.stage = Stage::Creating;
            self.routes.pending.push_back(Some(id));
        } else {
            // The writer is gone: the stream broke (this watch is idle, with the rest).
            self.broken();
        }
    }

    fn cancel(&self, server_id: i64) {
        if let Some(writer) = self.writer.as_ref() {
            let _ = writer.send(Request::Cancel(server_id));
        }
    }

    /// The stream broke or could not be opened: every watch is made again after a pause.
    fn broken(&mut self) {
        self.routes.break_all();
        self.writer = None;
        self.responses = None;
        self.retry_later();
    }

    fn retry_later(&mut self) {
        if self.retry_at.is_none() {
            self.retry_at = Some(Instant::now() + self.backoff.next_delay());
        }
    }

    /// Creates every idle watch again.
    fn retry(&mut self) {
        self.retry_at = None;
        for id in self.routes.idle() {
            self.create(id);
        }
    }

    /// Reads the entry of `id`, whose watch the server cancelled (a task of its own: rare, and
    /// its state is large); the answer comes back as [`Command::Read`].
    fn read(&mut self, id: u64) {
        let Some(w) = self.routes.watchers.get_mut(&id) else {
            return;
        };
        w.end();
        w.stage = Stage::Reading;
        let (held, inner, router) = (
            w.held.clone(),
            self.routes.inner.clone(),
            self.routes.commands.clone(),
        );
        tokio::spawn(async move {
            let entry = match inner.upgrade() {
                Some(inner) => read_entry(&inner, &held).await,
                None => Entry::Unread,
            };
            if let Some(router) = router.upgrade() {
                let _ = router.send(Command::Read { id, entry });
            }
        });
    }
}

fn retry_backoff() -> Backoff {
    Backoff::new(Duration::from_millis(50), Duration::from_secs(2))
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

/// Completes when `held`'s entry is deleted (lease expired or revoked, key deleted) or its
/// session's lease is known to be gone. What it keeps while it waits is its watch's
/// registration (an id, a sender, the shared signal): the routing task makes the watch again
/// after a broken stream or a cancelled watch, and watches the session's end once per session.
pub(crate) async fn watch_entry(inner: &Inner, held: &Arc<Held>) -> LossReason {
    if !held.is_gone() {
        inner.watches.watch_delete(held).ended().await;
    }
    LossReason::Revoked
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use std::{sync::Arc, time::Duration};

    use lock_core::raw::{Driver, LockKey, LossReason, LostSink};

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
        let (proxy, lock, _key, lease) = proxied_lease(&url, "reopen-gone").await;
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
        // The routing task has asked for the watch again: it is opening a stream for it (on
        // the silent link).
        watch_asked_again(&lock, watches).await;
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

    /// A lease on a fresh key (`label`-…), taken through a proxy in front of `url`'s etcd: the
    /// proxy, the proxied client, the key and the lease.
    async fn proxied_lease(
        url: &str,
        label: &str,
    ) -> (
        conformance::drill::Proxy,
        EtcdLock,
        LockKey,
        lock_core::raw::Lease,
    ) {
        let (proxy, proxied) = conformance::drill::Proxy::start_for_url(url).await.unwrap();
        let lock = EtcdLock::connect_url(&proxied).await.unwrap();
        let key = LockKey::new(format!("{label}-{:x}", rand::random::<u32>())).unwrap();
        let lease = lock
            .try_acquire(&key, Duration::from_secs(10))
            .await
            .unwrap()
            .unwrap();
        (proxy, lock, key, lease)
    }

    /// Nothing was pushed while `key` was held; an operator's force-release of it is pushed to
    /// the member's sink (10 s at most), as `Revoked`.
    async fn deletion_is_pushed(
        operator: &EtcdLock,
        key: &LockKey,
        pushed: &lock_core::raw::PushedLosses,
    ) {
        assert!(
            pushed.take().is_empty(),
            "a loss pushed for a lock still held"
        );
        assert!(operator.force_release(key).await.unwrap());
        let reason = tokio::time::timeout(Duration::from_secs(10), pushed.next())
            .await
            .expect("the deletion was not pushed to the member's sink");
        assert_eq!(reason, LossReason::Revoked);
    }

    /// Waits (10 s at most) until `lock` has asked for more deletion watches than `before`.
    async fn watch_asked_again(lock: &EtcdLock, before: u64) {
        tokio::time::timeout(Duration::from_secs(10), async {
            while lock.request_counts().watch <= before {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the watch was not asked for again");
    }

    /// Waits (10 s at most) until a watch covers `held`'s entry, or until none does.
    async fn wait_covered(held: &crate::renew::Held, want: bool) {
        tokio::time::timeout(Duration::from_secs(10), async {
            while held.is_watched() != want {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("the entry's cover did not become {want}"));
    }

    fn held_of(lease: &lock_core::raw::Lease) -> Arc<crate::renew::Held> {
        lease.shared_backend_state::<crate::renew::Held>().unwrap()
    }

    /// Issue 24: a renewal group's member has no `watch_lost` future; the routing task watches
    /// its entry itself and pushes its loss to the member's sink. When the stream breaks, the
    /// routing task makes the member's watch again on a new stream (nobody else would: no
    /// future waits on it), and a deletion after that still reaches the sink — and nothing is
    /// pushed before it.
    #[tokio::test]
    async fn a_member_s_watch_outlives_a_broken_stream_and_pushes_its_deletion() {
        let Some(url) = conformance::backend_url("DISTLOCK_TEST_ETCD_URL") else {
            return;
        };
        let (proxy, lock, key, lease) = proxied_lease(&url, "member-rewatch").await;
        let operator = EtcdLock::connect_url(&url).await.unwrap();
        let held = held_of(&lease);
        let group = lock.renewal_group(&lease).unwrap();
        let (sink, pushed) = LostSink::detached();
        assert!(group.join(&lease, &sink), "etcd pushes a member's loss");
        wait_covered(&held, true).await;
        let watches = lock.request_counts().watch;
        // Every connection reset: the stream breaks; the routing task makes the watch again.
        proxy.reset();
        // (Not waited for uncovered: the window before the new watch is ~50 ms, which a loaded
        // machine could let pass unseen. The new create comes after the break cleared the
        // cover, so once it is sent, a cover is the new watch's.)
        watch_asked_again(&lock, watches).await;
        wait_covered(&held, true).await;
        deletion_is_pushed(&operator, &key, &pushed).await;
        assert!(held.is_gone());
        group.leave(&lease);
    }

    /// Issue 24: a member's watch whose start revision was compacted away while its stream was
    /// down is refused by the server; the routing task reads the entry, finds it still ours,
    /// and watches again from the revision read — covering the entry again, and pushing its
    /// later deletion. (A private etcd: compacting the shared one would upset other tests.)
    #[tokio::test]
    async fn a_member_s_watch_refused_as_compacted_is_read_and_made_again() {
        use conformance::servers::{PrivateServer, ServerKind, free_port};
        if conformance::backend_url("DISTLOCK_TEST_ETCD_URL").is_none() {
            return;
        }
        let server = PrivateServer::start(ServerKind::Etcd, free_port()).await;
        let (proxy, lock, key, lease) = proxied_lease(&server.url(), "member-compacted").await;
        let operator = EtcdLock::connect_url(&server.url()).await.unwrap();
        let held = held_of(&lease);
        let group = lock.renewal_group(&lease).unwrap();
        let (sink, pushed) = LostSink::detached();
        assert!(group.join(&lease, &sink));
        wait_covered(&held, true).await;
        // The link goes silent: the stream breaks and stays down while history is compacted.
        proxy.blackhole();
        proxy.reset();
        wait_covered(&held, false).await;
        let endpoint = server.url().replacen("etcd://", "http://", 1);
        let mut admin = etcd_client::Client::connect([endpoint], None)
            .await
            .unwrap();
        let mut revision = 0;
        for i in 0..3 {
            let put = admin
                .put(format!("compact-filler-{i}"), "x", None)
                .await
                .unwrap();
            revision = put.header().unwrap().revision();
        }
        assert!(revision > held.rev + 1);
        admin.compact(revision, None).await.unwrap();
        let reads = lock.request_counts().range;
        proxy.pass();
        // (etcd may answer "created" before it cancels the watch: the read comes after.)
        tokio::time::timeout(Duration::from_secs(10), async {
            while lock.request_counts().range <= reads {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the refused watch's entry was not read");
        wait_covered(&held, true).await;
        deletion_is_pushed(&operator, &key, &pushed).await;
        group.leave(&lease);
    }

    /// Issue 24: a group member no deletion watch covers (its watch forgotten, as between two
    /// streams) is read by the group's renewal, as `renew` reads an uncovered entry: an
    /// operator's deletion is found, the member's loss is pushed to its sink before the
    /// renewal answers, and the entry is unregistered (its `renew` then says `NotHeld` without
    /// a request), while a neighbour stays held. After leaving, a member is the reaper's again:
    /// unrenewed, it is deleted at the deadline the group gave it.
    #[tokio::test]
    async fn a_group_reads_the_members_no_watch_covers() {
        let Some(url) = conformance::backend_url("DISTLOCK_TEST_ETCD_URL") else {
            return;
        };
        let lock = EtcdLock::connect_url(&url).await.unwrap();
        let operator = EtcdLock::connect_url(&url).await.unwrap();
        let ttl = Duration::from_secs(3);
        let tag = rand::random::<u32>();
        let (gone, kept) = (
            LockKey::new(format!("uncovered-gone-{tag:x}")).unwrap(),
            LockKey::new(format!("uncovered-kept-{tag:x}")).unwrap(),
        );
        let mut deleted = lock.try_acquire(&gone, ttl).await.unwrap().unwrap();
        let neighbour = lock.try_acquire(&kept, ttl).await.unwrap().unwrap();
        let group = lock.renewal_group(&deleted).unwrap();
        let same = lock.renewal_group(&neighbour).unwrap();
        assert_eq!(group.id(), same.id(), "one session, one group");
        let (sink, pushed) = LostSink::detached();
        let (neighbour_sink, neighbour_pushed) = LostSink::detached();
        assert!(group.join(&deleted, &sink));
        assert!(group.join(&neighbour, &neighbour_sink));
        for lease in [&deleted, &neighbour] {
            let held = held_of(lease);
            lock.inner.watches.forget_member(&held);
            wait_covered(&held, false).await;
        }
        assert!(operator.force_release(&gone).await.unwrap());

        let before = lock.request_counts();
        group
            .renew(ttl, tokio::time::Instant::now() + Duration::from_secs(30))
            .await
            .expect("the group renews");
        assert!(
            lock.request_counts().txn > before.txn,
            "the uncovered members were not read"
        );
        assert_eq!(
            pushed.take(),
            vec![LossReason::Revoked],
            "the member found gone was not pushed before the renewal answered"
        );
        assert!(neighbour_pushed.take().is_empty());
        let before = lock.request_counts();
        let renewed = lock.renew(&mut deleted, ttl).await;
        assert!(
            matches!(renewed, Err(lock_core::Error::NotHeld { .. })),
            "renew of the member found gone: {renewed:?}"
        );
        assert_eq!(lock.request_counts(), before, "not known gone already");

        // The neighbour leaves without a release: the reaper deletes it at its deadline.
        group.leave(&neighbour);
        group.leave(&deleted);
        let until = tokio::time::Instant::now() + ttl + Duration::from_secs(5);
        while operator.inspect(&kept).await.unwrap().is_some() {
            assert!(
                tokio::time::Instant::now() < until,
                "an unrenewed ex-member was never reaped"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
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
