//! The coordinator's push channel: grant messages and wake-ups for waiting `acquire`s, one
//! waiter per release, not a herd.
//!
//! Each client has a random id and subscribes (once, on its first wait) to its own wake channel
//! `distlock\x1fwake:<client id>` on its one RESP3 connection (push messages, no extra
//! connection). A waiting `acquire` gets a waiter id; its attempts register it in the lock's
//! waiter queue (see the scripts for the member's form). A release pops the oldest live
//! registration, hands it the lock and publishes `<waiter id>:<seq>:<fence>` on that client's
//! channel (an old-form registration gets `<waiter id>`, a bare wake-up). A disconnect wakes
//! every waiter of the client so each retries at once (an attempt also finds a grant whose
//! message was lost); the connection manager re-subscribes after reconnecting.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex, MutexGuard, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
};

use lock_core::raw::handoff::{Grant, Message};
use redis::{PushInfo, PushKind, Value};
use tokio::sync::Notify;

use crate::client::Conn;

/// The prefix of every client's wake channel (the release script builds the same name).
pub(crate) const WAKE_CHANNEL_PREFIX: &[u8] = b"distlock\x1fwake:";

/// Who waits in this client. Fed by the connection's push messages.
#[derive(Debug)]
pub(crate) struct Registry {
    /// 16 lowercase hex digits, random per client.
    client_id: String,
    channel: Vec<u8>,
    waiters: Mutex<HashMap<u64, Arc<Slot>>>,
    /// Whether the wake channel subscription was confirmed (serialized: one SUBSCRIBE).
    subscribed: tokio::sync::Mutex<bool>,
    next_id: AtomicU64,
}

impl Default for Registry {
    fn default() -> Self {
        let client_id = lock_core::raw::OwnershipToken::generate().expose_hex()[..16].to_owned();
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
    fn waiters(&self) -> MutexGuard<'_, HashMap<u64, Arc<Slot>>> {
        self.waiters.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn dispatch(&self, info: PushInfo) {
        match info.kind {
            PushKind::Message => {
                if let [Value::BulkString(channel), Value::BulkString(payload), ..] = &info.data[..]
                    && *channel == self.channel
                    && let Some(message) = Message::parse(payload)
                    && let Some(slot) = self.waiters().get(&message.waiter())
                {
                    if let Message::Granted(_, grant) = message {
                        *slot.grant() = Some(grant);
                    }
                    slot.notify.notify_one();
                }
            }
            PushKind::Disconnection => self.wake_all(),
            _ => {}
        }
    }

    /// Wakes every waiter, so each tries again at once (after a disconnect or a new master:
    /// a grant message may have been lost).
    pub(crate) fn wake_all(&self) {
        self.waiters().values().for_each(|s| s.notify.notify_one());
    }

    /// Registers a waiter and makes sure the client's wake channel is subscribed: returns once
    /// the server has confirmed the subscription, so a wake-up published afterwards is seen.
    pub(crate) async fn watch(self: &Arc<Self>, conn: &Conn) -> redis::RedisResult<Watch> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let slot = Arc::new(Slot::default());
        self.waiters().insert(id, slot.clone());
        let watch = Watch {
            registry: self.clone(),
            id,
            slot,
        };
        let mut subscribed = self.subscribed.lock().await;
        if !*subscribed {
            conn.subscribe(&self.channel).await?;
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

/// What the connection delivers to one waiter.
#[derive(Debug, Default)]
struct Slot {
    notify: Notify,
    /// The latest grant message (a later one replaces an earlier).
    grant: Mutex<Option<Grant>>,
}

impl Slot {
    fn grant(&self) -> MutexGuard<'_, Option<Grant>> {
        self.grant.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One waiting `acquire`; dropping it stops its wake-ups (its queue registration is removed by
/// the caller, see `queue.rs`).
#[derive(Debug)]
pub(crate) struct Watch {
    registry: Arc<Registry>,
    id: u64,
    slot: Arc<Slot>,
}

impl Watch {
    /// Completes when a release woke this waiter or granted it the lock (or the connection
    /// dropped) since the last call; a wake-up that arrived meanwhile is kept, never lost.
    pub(crate) async fn woken(&self) {
        self.slot.notify.notified().await;
    }

    /// Takes the latest grant message, if one came.
    pub(crate) fn take_grant(&self) -> Option<Grant> {
        self.slot.grant().take()
    }

    /// This waiter's queue member for attempt `seq`:
    /// `<client id>:<waiter id>:<seq>:<ttl ms>:<grant token hex>:<holder identity>` (the
    /// identity is what a release that grants to this member records next to the grant).
    pub(crate) fn member(
        &self,
        seq: u64,
        ttl_ms: u64,
        grant_hex: &str,
        identity: &lock_core::raw::HolderIdentity,
    ) -> String {
        format!(
            "{}:{}:{seq}:{ttl_ms}:{grant_hex}:{}",
            self.registry.client_id,
            self.id,
            identity.as_str()
        )
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.registry.waiters().remove(&self.id);
    }
}
