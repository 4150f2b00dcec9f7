//! The coordinator's push channel: grant messages and wake-ups for waiting `acquire`s, one
//! waiter per release, not a herd; and, on the same connection, [`LOST_CHANNEL`], where a
//! force-release announces the grant it removed to every holding client (a held lease's
//! `watch_lost` listens for its lock and fence, see `lock.rs`).
//!
//! Each client has a random id. On one server or a Sentinel-managed master it subscribes (once,
//! on its first wait) to its own wake channel `distlock\x1fwake:<client id>` on its one RESP3
//! connection (push messages, no extra connection). On a Cluster the channel is the lock's:
//! `<the lock's wake prefix><client id>` (e.g. `{distlock:orders}\x1fwake:<client id>`, see
//! [`crate::keys::KeyNames::wake_prefix`]), in the lock key's hash slot, subscribed with
//! sharded pub/sub (`SSUBSCRIBE`, Redis 7) on the node serving that slot while the client has a
//! waiter of that lock, and unsubscribed (`SUNSUBSCRIBE`) when its last one ends; the release
//! scripts `SPUBLISH` to it, so a wake-up travels only within the slot's shard instead of
//! across the whole cluster bus.
//!
//! A waiting `acquire` gets a waiter id; its attempts register it in the lock's waiter queue
//! (see the scripts for the member's form). A release pops the oldest live registration, hands
//! it the lock and publishes `<waiter id>:<seq>:<fence>` on that client's channel (an old-form
//! registration gets `<waiter id>`, a bare wake-up). A disconnect wakes every waiter of the
//! client so each retries at once (an attempt also finds a grant whose message was lost); the
//! connection manager (on a Cluster: the cluster client, on the slot's new master) subscribes
//! again after reconnecting. A shard channel the server unsubscribed by itself (its slot moved
//! to another node, a master demoted) wakes its waiters and is subscribed again, on the slot's
//! current node, before their next attempt.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex, MutexGuard, PoisonError,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
};

use lock_core::raw::handoff::{Grant, Message};
use redis::{PushInfo, PushKind, Value};
use tokio::sync::Notify;

use crate::{client::Conn, keys::KeyNames};

/// The prefix of every client's wake channel (the release script builds the same name).
pub(crate) const WAKE_CHANNEL_PREFIX: &[u8] = b"distlock\x1fwake:";

/// The channel a force-release announces the grant it removed on: `<fence>:<lock key>` (see
/// the force-release script). One per server, not per client: the server does not know which
/// client holds a grant (the lock's value is `<token hex>:<fence>`, which any client may read and
/// other libraries must be able to contend with), and a force-release is an operator's rare act,
/// so every holding client hearing each one costs nothing. A client subscribes to it once, on its
/// first held lock, on the same RESP3 connection as its wake channel.
pub(crate) const LOST_CHANNEL: &[u8] = b"distlock\x1flost";

/// Who waits in this client. Fed by the connection's push messages.
#[derive(Debug)]
pub(crate) struct Registry {
    /// 16 lowercase hex digits, random per client.
    client_id: String,
    channel: Vec<u8>,
    waiters: Mutex<HashMap<u64, Arc<Slot>>>,
    /// Whether the wake channel subscription was confirmed (serialized: one SUBSCRIBE).
    subscribed: tokio::sync::Mutex<bool>,
    /// On a Cluster: the shard channels of the locks this client waits for.
    shards: Mutex<HashMap<Vec<u8>, Shard>>,
    /// Serializes `SSUBSCRIBE` and `SUNSUBSCRIBE`, so that an unsubscription of a channel
    /// whose last waiter left never overtakes the subscription of a new waiter.
    shard_requests: tokio::sync::Mutex<()>,
    next_id: AtomicU64,
    /// Held locks whose force-release is watched (`watch_lost`), by watch number.
    holders: Mutex<HashMap<u64, Arc<LostSlot>>>,
    /// Whether the subscription to [`LOST_CHANNEL`] was confirmed.
    lost_subscribed: tokio::sync::Mutex<bool>,
}

/// One held grant whose removal is watched: the lock's key, the grant's fence, and the wake-up
/// of its watcher. A message naming both is a reason to look, not yet a loss (see
/// [`LostWatch::announced`]).
#[derive(Debug)]
struct LostSlot {
    lock: Vec<u8>,
    fence: u64,
    notify: Notify,
}

/// One shard channel of a Cluster client.
#[derive(Debug, Default)]
struct Shard {
    /// The waiters of this lock in this client.
    waiters: usize,
    /// The server confirmed the subscription and has not unsubscribed it since.
    subscribed: bool,
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
            shards: Mutex::default(),
            shard_requests: tokio::sync::Mutex::new(()),
            next_id: AtomicU64::new(1),
            holders: Mutex::default(),
            lost_subscribed: tokio::sync::Mutex::new(false),
        }
    }
}

impl Registry {
    fn waiters(&self) -> MutexGuard<'_, HashMap<u64, Arc<Slot>>> {
        self.waiters.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn shards(&self) -> MutexGuard<'_, HashMap<Vec<u8>, Shard>> {
        self.shards.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn holders(&self) -> MutexGuard<'_, HashMap<u64, Arc<LostSlot>>> {
        self.holders.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A force-release announced `<fence>:<lock key>`: wakes the watchers of that grant (a
    /// scan: such messages are rare, holders many).
    fn announce_lost(&self, payload: &[u8]) {
        let Some(at) = payload.iter().position(|&b| b == b':') else {
            return;
        };
        let Some(fence) = std::str::from_utf8(&payload[..at])
            .ok()
            .and_then(|f| f.parse::<u64>().ok())
        else {
            return;
        };
        let lock = &payload[at + 1..];
        self.holders()
            .values()
            .filter(|s| s.fence == fence && s.lock == lock)
            .for_each(|s| s.notify.notify_one());
    }

    /// Watches the grant with `fence` of the lock named `lock` for a force-release's message,
    /// and makes sure [`LOST_CHANNEL`] is subscribed: returns once the server confirmed the
    /// subscription, so a message published afterwards is heard.
    pub(crate) async fn watch_lost(
        self: &Arc<Self>,
        conn: &Conn,
        lock: Vec<u8>,
        fence: u64,
    ) -> redis::RedisResult<LostWatch> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let slot = Arc::new(LostSlot {
            lock,
            fence,
            notify: Notify::new(),
        });
        self.holders().insert(id, slot.clone());
        // From here on, dropping the watch takes the slot out again.
        let watch = LostWatch {
            registry: self.clone(),
            id,
            slot,
        };
        let mut subscribed = self.lost_subscribed.lock().await;
        if !*subscribed {
            conn.subscribe(LOST_CHANNEL).await?;
            *subscribed = true;
        }
        Ok(watch)
    }

    fn dispatch(&self, info: PushInfo) {
        match info.kind {
            PushKind::Message if matches!(info.data.first(), Some(Value::BulkString(c)) if c == LOST_CHANNEL) => {
                if let Some(Value::BulkString(payload)) = info.data.get(1) {
                    self.announce_lost(payload);
                }
            }
            PushKind::Message | PushKind::SMessage => {
                if let [Value::BulkString(channel), Value::BulkString(payload), ..] = &info.data[..]
                    && (if info.kind == PushKind::Message {
                        *channel == self.channel
                    } else {
                        self.shards().contains_key(channel)
                    })
                    && let Some(message) = Message::parse(payload)
                    && let Some(slot) = self.waiters().get(&message.waiter())
                {
                    if let Message::Granted(_, grant) = message {
                        *slot.grant() = Some(grant);
                    }
                    slot.notify.notify_one();
                }
            }
            // The server dropped a shard subscription (the slot moved, the node was demoted),
            // or confirmed our own unsubscription: its waiters (if any) subscribe again on the
            // slot's current node and try at once (a grant message may have been missed).
            PushKind::SUnsubscribe => {
                if let Some(Value::BulkString(channel)) = info.data.first() {
                    let lost = match self.shards().get_mut(channel) {
                        Some(shard) if shard.waiters > 0 => {
                            shard.subscribed = false;
                            true
                        }
                        _ => false,
                    };
                    if lost {
                        tracing::debug!("a wake-up shard channel was unsubscribed by the server");
                        self.waiters()
                            .values()
                            .filter(|s| s.shard.as_deref() == Some(channel.as_slice()))
                            .for_each(|s| {
                                s.dropped.store(true, Ordering::Release);
                                s.notify.notify_one();
                            });
                    }
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

    /// Registers a waiter of the lock `names` and makes sure its wake channel is subscribed
    /// (on a Cluster, the lock's shard channel): returns once the server has confirmed the
    /// subscription, so a wake-up published afterwards is seen.
    pub(crate) async fn watch(
        self: &Arc<Self>,
        conn: &Conn,
        names: &KeyNames,
    ) -> redis::RedisResult<Watch> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let shard = conn.is_cluster().then(|| {
            let mut channel = names.wake_prefix();
            channel.extend_from_slice(self.client_id.as_bytes());
            self.shards().entry(channel.clone()).or_default().waiters += 1;
            channel
        });
        let slot = Arc::new(Slot {
            shard: shard.clone(),
            ..Slot::default()
        });
        self.waiters().insert(id, slot.clone());
        // From here on, dropping the watch undoes the registration (and the shard's count).
        let watch = Watch {
            registry: self.clone(),
            id,
            slot,
            conn: conn.clone(),
        };
        if shard.is_some() {
            watch.subscribe_shard(false).await?;
        } else {
            let mut subscribed = self.subscribed.lock().await;
            if !*subscribed {
                conn.subscribe(&self.channel).await?;
                *subscribed = true;
            }
        }
        Ok(watch)
    }

    /// Subscribes `channel` unless it is (`again`: even then; serialized with
    /// unsubscriptions).
    async fn subscribe_shard(
        &self,
        conn: &Conn,
        channel: &[u8],
        again: bool,
    ) -> redis::RedisResult<()> {
        let _one = self.shard_requests.lock().await;
        if !again && self.shards().get(channel).is_some_and(|s| s.subscribed) {
            return Ok(());
        }
        conn.ssubscribe(channel).await?;
        if let Some(shard) = self.shards().get_mut(channel) {
            shard.subscribed = true;
        }
        Ok(())
    }

    /// A waiter of `channel` left: once it was the last one, unsubscribes in the background
    /// (unless a new waiter came meanwhile).
    fn leave_shard(self: &Arc<Self>, conn: &Conn, channel: &[u8]) {
        {
            let mut shards = self.shards();
            let Some(shard) = shards.get_mut(channel) else {
                return;
            };
            shard.waiters = shard.waiters.saturating_sub(1);
            if shard.waiters > 0 {
                return;
            }
            if !shard.subscribed {
                shards.remove(channel);
                return;
            }
        }
        // Outside a runtime (a drop at shutdown) the subscription ends with the connection.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (registry, conn, channel) = (self.clone(), conn.clone(), channel.to_vec());
        runtime.spawn(async move {
            let _one = registry.shard_requests.lock().await;
            let idle = {
                let mut shards = registry.shards();
                match shards.get(&channel) {
                    Some(shard) if shard.waiters == 0 => {
                        shards.remove(&channel);
                        true
                    }
                    _ => false,
                }
            };
            if idle && let Err(e) = conn.sunsubscribe(&channel).await {
                // The subscription then lingers until the connection drops; a message on it
                // names no waiter and is ignored.
                tracing::debug!(error = %e, "cannot unsubscribe a wake-up shard channel");
            }
        });
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
    /// On a Cluster: the lock's shard channel this waiter listens on.
    shard: Option<Vec<u8>>,
    /// The server dropped that subscription since the waiter last asked.
    dropped: AtomicBool,
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
pub(crate) struct Watch {
    registry: Arc<Registry>,
    id: u64,
    slot: Arc<Slot>,
    conn: Conn,
}

impl std::fmt::Debug for Watch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watch")
            .field("id", &self.id)
            .field("sharded", &self.slot.shard.is_some())
            .finish_non_exhaustive()
    }
}

impl Watch {
    /// On a Cluster, subscribes the lock's shard channel again when the server dropped it (see
    /// [`Registry::dispatch`]), or in any case with `again` (`SSUBSCRIBE` is idempotent; the
    /// cluster client routes it by its current slot map, which catches up with a failover);
    /// a no-op elsewhere. Called before each attempt, so that a release after the attempt is
    /// heard.
    pub(crate) async fn subscribe_shard(&self, again: bool) -> redis::RedisResult<()> {
        match &self.slot.shard {
            Some(channel) => {
                self.registry
                    .subscribe_shard(&self.conn, channel, again)
                    .await
            }
            None => Ok(()),
        }
    }

    /// Whether the server dropped this waiter's shard subscription since the last call. Its
    /// new subscription may have gone to the slot's previous node (the cluster client's slot
    /// map lags a failover), where it can end without notice, so the waiter then polls quickly
    /// for a while and subscribes again before each attempt.
    pub(crate) fn take_dropped(&self) -> bool {
        self.slot.dropped.swap(false, Ordering::AcqRel)
    }

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

/// One held grant's watch for a force-release's message; dropping it ends the watch.
pub(crate) struct LostWatch {
    registry: Arc<Registry>,
    id: u64,
    slot: Arc<LostSlot>,
}

impl LostWatch {
    /// Completes when a message named this grant (its lock and fence) since the watch began or
    /// since the last call: the grant *may* be gone. The caller reads the lock before it
    /// believes it (anyone allowed to `PUBLISH` could have sent the message).
    pub(crate) async fn announced(&self) {
        self.slot.notify.notified().await;
    }
}

impl Drop for LostWatch {
    fn drop(&mut self) {
        self.registry.holders().remove(&self.id);
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.registry.waiters().remove(&self.id);
        if let Some(channel) = &self.slot.shard {
            self.registry.leave_shard(&self.conn, channel);
        }
    }
}
