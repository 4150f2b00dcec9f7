//! Release notifications: one shared `LISTEN` connection per client.
//!
//! Waiters subscribe to the channel of their key; a background task owns a [`PgListener`] on its
//! own one-connection pool, `LISTEN`s to every channel somebody waits on and bumps the channel's
//! generation when a notification arrives. When the listening connection breaks, every waiter
//! is woken (a notification may have been missed) and the task reconnects with backoff;
//! waiters keep their own bounded fallback poll, so a broken listener only slows them down.

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use lock_core::{Backoff, LockKey};
use sha2::{Digest, Sha256};
use sqlx::{
    PgPool,
    postgres::{PgListener, PgPoolOptions},
};
use tokio::{
    sync::{mpsc, oneshot, watch},
    time::{Instant, sleep_until, timeout},
};

use crate::{PgLockConfig, TableName};

/// The notification channel of a key: a fixed-length hash, so any key (quotes, unicode, 512
/// bytes) maps to a valid identifier of at most 63 bytes. A collision only wakes a waiter
/// needlessly.
pub(crate) fn channel_name(table: &TableName, key: &LockKey) -> String {
    let mut h = Sha256::new();
    h.update(table.quoted().as_bytes());
    h.update([0]);
    h.update(key.as_str().as_bytes());
    let digest = h.finalize();
    let mut name = String::with_capacity(9 + 32);
    name.push_str("distlock_");
    for b in &digest[..16] {
        name.push_str(&format!("{b:02x}"));
    }
    name
}

type Channels = Arc<Mutex<HashMap<String, Channel>>>;

struct Channel {
    subscribers: usize,
    generation: watch::Sender<u64>,
}

enum Command {
    Listen(String, oneshot::Sender<bool>),
    Unlisten(String),
}

/// The client side of the listener task. Dropping it (with every subscription) ends the task.
#[derive(Debug)]
pub(crate) struct Notifier {
    channels: Channels,
    commands: mpsc::UnboundedSender<Command>,
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Channel")
            .field("subscribers", &self.subscribers)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Command::Listen(c, _) => write!(f, "Listen({c})"),
            Command::Unlisten(c) => write!(f, "Unlisten({c})"),
        }
    }
}

fn lock(channels: &Channels) -> MutexGuard<'_, HashMap<String, Channel>> {
    channels.lock().unwrap_or_else(PoisonError::into_inner)
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
        let channels: Channels = Arc::default();
        let (tx, rx) = mpsc::unbounded_channel();
        let task = ListenerTask {
            pool,
            channels: channels.clone(),
            commands: rx,
            op_timeout: config.op_timeout,
            listener: None,
            listening: HashSet::new(),
            backoff: Backoff::new(Duration::from_millis(50), Duration::from_secs(2)),
            retry_at: None,
        };
        tokio::spawn(task.run());
        Self {
            channels,
            commands: tx,
        }
    }

    /// Subscribes to `channel` and waits until the `LISTEN` is active (or failed: the
    /// subscription then still wakes on reconnect, and the waiter polls meanwhile).
    pub(crate) async fn subscribe(&self, channel: String) -> Subscription {
        let receiver = {
            let mut map = lock(&self.channels);
            let entry = map.entry(channel.clone()).or_insert_with(|| Channel {
                subscribers: 0,
                generation: watch::channel(0).0,
            });
            entry.subscribers += 1;
            entry.generation.subscribe()
        };
        let subscription = Subscription {
            channels: self.channels.clone(),
            commands: self.commands.clone(),
            channel: channel.clone(),
            receiver,
        };
        let (ack, acked) = oneshot::channel();
        if self.commands.send(Command::Listen(channel, ack)).is_ok() && acked.await != Ok(true) {
            tracing::debug!("LISTEN is not active; waiting by polling until it is");
        }
        subscription
    }
}

/// Interest in one channel; wakes when a release on it is notified.
#[derive(Debug)]
pub(crate) struct Subscription {
    channels: Channels,
    commands: mpsc::UnboundedSender<Command>,
    channel: String,
    receiver: watch::Receiver<u64>,
}

impl Subscription {
    /// Marks everything notified so far as seen (call before each attempt).
    pub(crate) fn mark_seen(&mut self) {
        self.receiver.borrow_and_update();
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
        let mut map = lock(&self.channels);
        let last = match map.get_mut(&self.channel) {
            Some(entry) => {
                entry.subscribers = entry.subscribers.saturating_sub(1);
                entry.subscribers == 0
            }
            None => false,
        };
        if last {
            map.remove(&self.channel);
            let _ = self
                .commands
                .send(Command::Unlisten(std::mem::take(&mut self.channel)));
        }
    }
}

struct ListenerTask {
    pool: PgPool,
    channels: Channels,
    commands: mpsc::UnboundedReceiver<Command>,
    op_timeout: Duration,
    listener: Option<PgListener>,
    /// What the current listener connection is subscribed to.
    listening: HashSet<String>,
    backoff: Backoff,
    /// While set, do not reconnect before this instant.
    retry_at: Option<Instant>,
}

enum Event {
    Command(Option<Command>),
    Notified(Result<Option<String>, sqlx::Error>),
    Retry,
}

impl ListenerTask {
    async fn run(mut self) {
        loop {
            let event = match self.listener.as_mut() {
                Some(listener) => tokio::select! {
                    biased;
                    cmd = self.commands.recv() => Event::Command(cmd),
                    // Cancel-safe: sqlx reads whole messages only.
                    n = listener.try_recv() => Event::Notified(n.map(|n| n.map(|n| n.channel().to_owned()))),
                },
                None => {
                    let retry = self.retry_at.filter(|_| !lock(&self.channels).is_empty());
                    tokio::select! {
                        cmd = self.commands.recv() => Event::Command(cmd),
                        () = sleep_until(retry.unwrap_or_else(far_future)), if retry.is_some() => Event::Retry,
                    }
                }
            };
            match event {
                Event::Command(None) => return,
                Event::Command(Some(Command::Listen(channel, ack))) => {
                    let ok = self.listen(channel).await;
                    let _ = ack.send(ok);
                }
                Event::Command(Some(Command::Unlisten(channel))) => {
                    let wanted = lock(&self.channels).contains_key(&channel);
                    if !wanted
                        && self.listening.remove(&channel)
                        && let Some(listener) = self.listener.as_mut()
                    {
                        let done = timeout(self.op_timeout, listener.unlisten(&channel)).await;
                        if !matches!(done, Ok(Ok(()))) {
                            self.broken();
                        }
                    }
                }
                Event::Notified(Ok(Some(channel))) => {
                    if let Some(entry) = lock(&self.channels).get(&channel) {
                        entry.generation.send_modify(|g| *g += 1);
                    }
                }
                // The connection was lost and re-established: notifications may be lost.
                Event::Notified(Ok(None)) => self.wake_all(),
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

    /// LISTENs to `channel` on the current connection, connecting first when needed.
    async fn listen(&mut self, channel: String) -> bool {
        match self.listener.as_mut() {
            Some(_) if self.listening.contains(&channel) => true,
            Some(listener) => match timeout(self.op_timeout, listener.listen(&channel)).await {
                Ok(Ok(())) => {
                    self.listening.insert(channel);
                    true
                }
                _ => {
                    self.broken();
                    false
                }
            },
            None if self.retry_at.is_some_and(|t| Instant::now() < t) => false,
            // The channel is in the shared map already, so reconnecting listens to it.
            None => self.reconnect().await && self.listening.contains(&channel),
        }
    }

    /// Connects and LISTENs to every wanted channel; wakes everyone on success.
    async fn reconnect(&mut self) -> bool {
        let wanted: Vec<String> = lock(&self.channels).keys().cloned().collect();
        if wanted.is_empty() {
            self.retry_at = None;
            return false;
        }
        let connect = async {
            let mut listener = PgListener::connect_with(&self.pool).await?;
            listener.ignore_pool_close_event(true);
            listener
                .listen_all(wanted.iter().map(String::as_str))
                .await?;
            Ok::<_, sqlx::Error>(listener)
        };
        match timeout(self.op_timeout, connect).await {
            Ok(Ok(listener)) => {
                self.listener = Some(listener);
                self.listening = wanted.into_iter().collect();
                self.retry_at = None;
                self.backoff.reset();
                self.wake_all();
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
        self.listening.clear();
        self.retry_at = Some(Instant::now() + self.backoff.next_delay());
        self.wake_all();
    }

    fn wake_all(&self) {
        for entry in lock(&self.channels).values() {
            entry.generation.send_modify(|g| *g += 1);
        }
    }
}

fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(86_400)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channel_names_are_short_identifiers_and_distinct() {
        let t = TableName::default();
        let names: Vec<String> = ["a", "a/b", "\"; DROP TABLE x; --", &"ü".repeat(256)]
            .iter()
            .map(|k| channel_name(&t, &LockKey::new(k).unwrap()))
            .collect();
        for n in &names {
            assert!(n.len() <= 63, "{n}");
            assert!(n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'));
        }
        let unique: HashSet<_> = names.iter().collect();
        assert_eq!(unique.len(), names.len());
        let other = TableName::new("other").unwrap();
        assert_ne!(channel_name(&other, &LockKey::new("a").unwrap()), names[0]);
    }
}
