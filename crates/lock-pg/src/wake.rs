//! The coordinator's push channel: wake-ups and grants, over one `LISTEN` connection per
//! client on a channel of the client's own; and on the same connection [`LOST_CHANNEL`], where a
//! force-release announces the grant it removed, so that its holder's `watch_lost` (which
//! opens the connection as a waiter does) learns of it at once.
//!
//! Each waiting `acquire` of a client gets a number and queues `<channel>:<number>` in the lock
//! row (see [`crate::sql`]); a release notifies the first live entry's channel only, so one
//! release reaches one waiter rather than every waiter of every client. The payload is a
//! [`lock_core::raw::handoff::Message`]: `<number>:<seq>:<fence>` when the release granted the lock
//! to that waiter (the attempt `seq` wrote the entry it was granted from), or `<number>` for a
//! wake-up only (the entry of an older client, or a release by one). A background task owns a
//! [`PgListener`] on its own one-connection pool and routes each payload to its waiter,
//! keeping the latest grant. While the listening connection is down every waiter is woken (a
//! notification may have been missed) and [`Subscription::listening`] is false, so waiters
//! stop queueing (a queued waiter that cannot hear would hold the others up) and poll until it
//! is back.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex, MutexGuard, PoisonError,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use lock_core::raw::{
    Backoff,
    handoff::{Grant, Message},
};
use sqlx::{
    PgPool,
    postgres::{PgListener, PgPoolOptions},
};
use tokio::{
    sync::{mpsc, oneshot, watch},
    time::{Instant, sleep_until, timeout},
};

use crate::PgLockConfig;

/// The channel a force-release announces the grant it removed on: `<fence>:<name>` (see the
/// force-release statement in [`crate::sql`]). One per database, not per client: a grant made by
/// an attempt records no channel of its holder's, and a force-release is an operator's rare act,
/// so every client that holds a lock hearing each one costs nothing. The listener task `LISTEN`s
/// to it beside the client's own channel.
pub(crate) const LOST_CHANNEL: &str = "distlock_lost";

/// One held grant whose removal is watched: its name, its fence, and its watcher's wake-up.
struct LostSlot {
    name: String,
    fence: i64,
    notify: tokio::sync::Notify,
}

/// The state shared by the client side and the listener task.
struct Shared {
    /// `distlock_w_` and 32 random hex digits: a valid identifier, unique per client.
    channel: String,
    /// Waiting `acquire`s by number, each with the latest grant announced to it. Every
    /// notification marks the value changed (`send_modify`), which is what wakes the waiter.
    waiters: Mutex<HashMap<u64, watch::Sender<Option<Grant>>>>,
    next: AtomicU64,
    /// The channel is `LISTEN`ed to on a live connection.
    listening: AtomicBool,
    /// Held grants whose force-release is watched (`watch_lost`), by watch number.
    holders: Mutex<HashMap<u64, Arc<LostSlot>>>,
}

impl Shared {
    fn waiters(&self) -> MutexGuard<'_, HashMap<u64, watch::Sender<Option<Grant>>>> {
        self.waiters.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn deliver(&self, message: Message) {
        let (id, grant) = match message {
            Message::Wake(id) => (id, None),
            Message::Granted(id, grant) => (id, Some(grant)),
        };
        if let Some(w) = self.waiters().get(&id) {
            w.send_modify(|latest| {
                // Seqs only grow; keep the grant of the latest attempt.
                if let Some(g) = grant
                    && latest.is_none_or(|old| old.seq <= g.seq)
                {
                    *latest = Some(g);
                }
            });
        }
    }

    fn wake_all(&self) {
        for w in self.waiters().values() {
            w.send_modify(|_| {});
        }
    }

    fn holders(&self) -> MutexGuard<'_, HashMap<u64, Arc<LostSlot>>> {
        self.holders.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A force-release announced `<fence>:<name>`: wakes the watchers of that grant (a scan:
    /// such notifications are rare, holders many).
    fn announce_lost(&self, payload: &str) {
        let Some((fence, name)) = payload.split_once(':') else {
            return;
        };
        let Ok(fence) = fence.parse::<i64>() else {
            return;
        };
        self.holders()
            .values()
            .filter(|s| s.fence == fence && s.name == name)
            .for_each(|s| s.notify.notify_one());
    }

    /// Whether the task has anyone to listen for.
    fn wanted(&self) -> bool {
        !self.waiters().is_empty() || !self.holders().is_empty()
    }
}

/// The client side of the listener task. Dropping it ends the task.
pub(crate) struct Notifier {
    shared: Arc<Shared>,
    /// Asks the task to make sure the channel is listened to; answers whether it is.
    commands: mpsc::UnboundedSender<oneshot::Sender<bool>>,
}

impl std::fmt::Debug for Notifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Notifier")
            .field("channel", &self.shared.channel)
            .finish_non_exhaustive()
    }
}

impl Notifier {
    /// Spawns the listener task (it connects only when somebody subscribes).
    pub(crate) fn spawn(config: &PgLockConfig) -> Self {
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .min_connections(0)
            .max_lifetime(None)
            .idle_timeout(None)
            .acquire_timeout(config.connect_timeout)
            .connect_lazy_with(config.connect_options().clone());
        let shared = Arc::new(Shared {
            channel: format!("distlock_w_{:032x}", rand::random::<u128>()),
            waiters: Mutex::default(),
            next: AtomicU64::new(1),
            listening: AtomicBool::new(false),
            holders: Mutex::default(),
        });
        let (tx, rx) = mpsc::unbounded_channel();
        let task = ListenerTask {
            pool,
            shared: shared.clone(),
            commands: rx,
            timeout: config.timeout,
            listener: None,
            backoff: Backoff::new(Duration::from_millis(50), Duration::from_secs(2)),
            retry_at: None,
        };
        tokio::spawn(task.run());
        Self {
            shared,
            commands: tx,
        }
    }

    /// A new waiter; returns once the client's channel is listened to, or listening failed
    /// (then [`Subscription::listening`] is false and the task keeps reconnecting).
    pub(crate) async fn subscribe(&self) -> Subscription {
        let id = self.shared.next.fetch_add(1, Ordering::Relaxed);
        let receiver = {
            let (tx, rx) = watch::channel(None);
            self.shared.waiters().insert(id, tx);
            rx
        };
        let subscription = Subscription {
            shared: self.shared.clone(),
            id,
            receiver,
        };
        if !self.shared.listening.load(Ordering::Acquire) {
            let (ack, acked) = oneshot::channel();
            if self.commands.send(ack).is_ok() && acked.await != Ok(true) {
                tracing::debug!("LISTEN is not active; waiting by polling until it is");
            }
        }
        subscription
    }
}

impl Notifier {
    /// Watches the grant with `fence` of lock `name` for a force-release's notification; returns
    /// once the channels are listened to, or listening failed (the task keeps reconnecting, and
    /// listens to [`LOST_CHANNEL`] whenever it listens at all).
    pub(crate) async fn watch_lost(&self, name: &str, fence: i64) -> LostWatch {
        let id = self.shared.next.fetch_add(1, Ordering::Relaxed);
        let slot = Arc::new(LostSlot {
            name: name.to_owned(),
            fence,
            notify: tokio::sync::Notify::new(),
        });
        self.shared.holders().insert(id, slot.clone());
        let watch = LostWatch {
            shared: self.shared.clone(),
            id,
            slot,
        };
        if !self.shared.listening.load(Ordering::Acquire) {
            let (ack, acked) = oneshot::channel();
            if self.commands.send(ack).is_ok() && acked.await != Ok(true) {
                tracing::debug!(
                    "LISTEN is not active; a force-release is found by renewals until it is"
                );
            }
        }
        watch
    }
}

/// One held grant's watch for a force-release's notification; dropping it ends the watch.
pub(crate) struct LostWatch {
    shared: Arc<Shared>,
    id: u64,
    slot: Arc<LostSlot>,
}

impl LostWatch {
    /// Completes when a notification named this grant (its name and fence) since the watch
    /// began or since the last call: the grant *may* be gone. The caller reads the row before
    /// it believes it (any role may `NOTIFY`).
    pub(crate) async fn announced(&self) {
        self.slot.notify.notified().await;
    }
}

impl Drop for LostWatch {
    fn drop(&mut self) {
        self.shared.holders().remove(&self.id);
    }
}

/// One waiting `acquire`: its queue entry, and the wake-ups addressed to it.
pub(crate) struct Subscription {
    shared: Arc<Shared>,
    id: u64,
    receiver: watch::Receiver<Option<Grant>>,
}

impl std::fmt::Debug for Subscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscription")
            .field("entry", &self.entry())
            .finish_non_exhaustive()
    }
}

impl Subscription {
    /// The waiter's queue entry: `<channel>:<number>`.
    pub(crate) fn entry(&self) -> String {
        format!("{}:{}", self.shared.channel, self.id)
    }

    /// Whether a notification to [`Subscription::entry`] would be heard now.
    pub(crate) fn listening(&self) -> bool {
        self.shared.listening.load(Ordering::Acquire)
    }

    /// Marks every notification so far as seen (call before each attempt), returning the
    /// latest grant announced to this waiter, if any.
    pub(crate) fn mark_seen(&mut self) -> Option<Grant> {
        *self.receiver.borrow_and_update()
    }

    /// Completes at the next notification after the last [`Subscription::mark_seen`].
    pub(crate) async fn changed(&mut self) {
        if self.receiver.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.shared.waiters().remove(&self.id);
    }
}

struct ListenerTask {
    pool: PgPool,
    shared: Arc<Shared>,
    commands: mpsc::UnboundedReceiver<oneshot::Sender<bool>>,
    timeout: Duration,
    listener: Option<PgListener>,
    backoff: Backoff,
    /// While set, do not reconnect before this instant.
    retry_at: Option<Instant>,
}

enum Event {
    Listen(Option<oneshot::Sender<bool>>),
    /// A notification: its channel and payload.
    Notified(Result<Option<(String, String)>, sqlx::Error>),
    Retry,
}

impl ListenerTask {
    async fn run(mut self) {
        loop {
            let event = match self.listener.as_mut() {
                Some(listener) => tokio::select! {
                    biased;
                    ack = self.commands.recv() => Event::Listen(ack),
                    // Cancel-safe: sqlx reads whole messages only.
                    n = listener.try_recv() => Event::Notified(n.map(|n| n.map(|n| (n.channel().to_owned(), n.payload().to_owned())))),
                },
                None => {
                    let retry = self.retry_at.filter(|_| self.shared.wanted());
                    tokio::select! {
                        ack = self.commands.recv() => Event::Listen(ack),
                        () = sleep_until(retry.unwrap_or_else(far_future)), if retry.is_some() => Event::Retry,
                    }
                }
            };
            match event {
                Event::Listen(None) => return,
                Event::Listen(Some(ack)) => {
                    let ok = match self.listener {
                        Some(_) => true,
                        None if self.retry_at.is_some_and(|t| Instant::now() < t) => false,
                        None => self.reconnect().await,
                    };
                    let _ = ack.send(ok);
                }
                Event::Notified(Ok(Some((channel, payload)))) if channel == LOST_CHANNEL => {
                    self.shared.announce_lost(&payload);
                }
                Event::Notified(Ok(Some((_, payload)))) => match Message::parse(payload.as_bytes())
                {
                    Some(message) => self.shared.deliver(message),
                    None => tracing::debug!("ignoring a notification with a foreign payload"),
                },
                // The connection was lost and re-established: notifications may be lost.
                Event::Notified(Ok(None)) => self.shared.wake_all(),
                Event::Notified(Err(e)) => {
                    tracing::debug!(error = %e, "LISTEN connection failed; reconnecting");
                    self.broken();
                }
                Event::Retry => {
                    self.reconnect().await;
                }
            }
        }
    }

    /// Connects and LISTENs to the client's channel; wakes everyone on success.
    async fn reconnect(&mut self) -> bool {
        let connect = async {
            let mut listener = PgListener::connect_with(&self.pool).await?;
            listener.ignore_pool_close_event(true);
            listener
                .listen_all([self.shared.channel.as_str(), LOST_CHANNEL])
                .await?;
            Ok::<_, sqlx::Error>(listener)
        };
        match timeout(self.timeout, connect).await {
            Ok(Ok(listener)) => {
                self.listener = Some(listener);
                self.shared.listening.store(true, Ordering::Release);
                self.retry_at = None;
                self.backoff.reset();
                self.shared.wake_all();
                true
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "cannot open the LISTEN connection; retrying");
                self.retry_at = Some(Instant::now() + self.backoff.next_delay());
                false
            }
            Err(_) => {
                tracing::debug!("opening the LISTEN connection timed out; retrying");
                self.retry_at = Some(Instant::now() + self.backoff.next_delay());
                false
            }
        }
    }

    fn broken(&mut self) {
        self.listener = None;
        self.shared.listening.store(false, Ordering::Release);
        self.retry_at = Some(Instant::now() + self.backoff.next_delay());
        self.shared.wake_all();
    }
}

fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(86_400)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Entries are `<channel>:<number>` with a channel that is a valid, short identifier.
    #[tokio::test]
    async fn entries_name_a_valid_channel_and_a_distinct_number() {
        let config =
            PgLockConfig::from_url("postgres://u@127.0.0.1:1/db?connect_timeout=200ms").unwrap();
        let notifier = Notifier::spawn(&config);
        let shared = notifier.shared.clone();
        // Not listening (the server is unreachable), so subscribe does not wait for LISTEN
        // forever: the task answers once its connection attempt fails.
        let (a, b) = (notifier.subscribe().await, notifier.subscribe().await);
        assert!(!a.listening());
        let (ca, na) = a
            .entry()
            .rsplit_once(':')
            .map(|(c, n)| (c.to_owned(), n.to_owned()))
            .unwrap();
        let (cb, nb) = b
            .entry()
            .rsplit_once(':')
            .map(|(c, n)| (c.to_owned(), n.to_owned()))
            .unwrap();
        assert_eq!(ca, cb);
        assert_ne!(na, nb);
        assert!(ca.len() <= 63 && ca.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_'));
        assert_ne!(ca, Notifier::spawn(&config).shared.channel);
        drop(a);
        assert_eq!(shared.waiters().len(), 1);
    }
}
