//! Wake-ups for waiting `acquire`s: one waiter per release, not a herd.
//!
//! Each client has a random id and subscribes (once, on its first wait) to its own wake channel
//! `distlock\x1fwake:<client id>` on its one RESP3 connection (push messages, no extra
//! connection). A waiting `acquire` gets a waiter id; its member `<client id>:<waiter id>` is
//! registered in the lock's waiter queue by its attempts (see the scripts). A release pops the
//! oldest live registration and publishes the waiter id on that client's channel, which wakes
//! exactly that waiter. A disconnect wakes every waiter of the client so each retries at once;
//! the connection manager re-subscribes after reconnecting.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex, MutexGuard, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
};

use redis::{PushInfo, PushKind, Value, aio::ConnectionManager};
use tokio::sync::Notify;

/// The prefix of every client's wake channel (the release script builds the same name).
pub(crate) const WAKE_CHANNEL_PREFIX: &[u8] = b"distlock\x1fwake:";

/// Who waits in this client. Fed by the connection's push messages.
#[derive(Debug)]
pub(crate) struct Registry {
    /// 16 lowercase hex digits, random per client.
    client_id: String,
    channel: Vec<u8>,
    waiters: Mutex<HashMap<u64, Arc<Notify>>>,
    /// Whether the wake channel subscription was confirmed (serialized: one SUBSCRIBE).
    subscribed: tokio::sync::Mutex<bool>,
    next_id: AtomicU64,
}

impl Default for Registry {
    fn default() -> Self {
        let client_id = lock_core::OwnershipToken::generate().expose_hex()[..16].to_owned();
        let mut channel = WAKE_CHANNEL_PREFIX.to_vec();
        channel.extend_from_slice(client_id.as_bytes());
        Self {
            client_id,
            channel,
            waiters: Mutex::default(),
            subscribed: tokio::sync::Mutex::new(false),
            next_id: AtomicU64::new(1),
        }
    }
}

impl Registry {
    fn waiters(&self) -> MutexGuard<'_, HashMap<u64, Arc<Notify>>> {
        self.waiters.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn dispatch(&self, info: PushInfo) {
        match info.kind {
            PushKind::Message => {
                if let [Value::BulkString(channel), Value::BulkString(id), ..] = &info.data[..]
                    && *channel == self.channel
                    && let Some(id) = std::str::from_utf8(id)
                        .ok()
                        .and_then(|id| id.parse::<u64>().ok())
                    && let Some(notify) = self.waiters().get(&id)
                {
                    notify.notify_one();
                }
            }
            PushKind::Disconnection => {
                self.waiters().values().for_each(|n| n.notify_one());
            }
            _ => {}
        }
    }

    /// Registers a waiter and makes sure the client's wake channel is subscribed: returns once
    /// the server has confirmed the subscription, so a wake-up published afterwards is seen.
    pub(crate) async fn watch(
        self: &Arc<Self>,
        conn: &ConnectionManager,
    ) -> redis::RedisResult<Watch> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let notify = Arc::new(Notify::new());
        self.waiters().insert(id, notify.clone());
        let watch = Watch {
            registry: self.clone(),
            member: format!("{}:{id}", self.client_id),
            id,
            notify,
        };
        let mut subscribed = self.subscribed.lock().await;
        if !*subscribed {
            conn.clone().subscribe(&self.channel).await?;
            *subscribed = true;
        }
        Ok(watch)
    }
}

impl redis::aio::AsyncPushSender for Registry {
    fn send(&self, info: PushInfo) -> Result<(), redis::aio::SendError> {
        self.dispatch(info);
        Ok(())
    }
}

/// One waiting `acquire`; dropping it stops its wake-ups (its queue registration is removed by
/// the caller, see `lock.rs`).
#[derive(Debug)]
pub(crate) struct Watch {
    registry: Arc<Registry>,
    member: String,
    id: u64,
    notify: Arc<Notify>,
}

impl Watch {
    /// Completes when a release woke this waiter (or the connection dropped) since the last
    /// call; a wake-up that arrived meanwhile is kept, never lost.
    pub(crate) async fn woken(&self) {
        self.notify.notified().await;
    }

    /// This waiter's member in a lock's waiter queue: `<client id>:<waiter id>`.
    pub(crate) fn member(&self) -> &str {
        &self.member
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.registry.waiters().remove(&self.id);
    }
}
