//! Release notifications for waiting `acquire`s.
//!
//! The client's one RESP3 connection carries the subscriptions too (push messages), so waiting
//! costs no extra connection. Each channel is subscribed once per client however many tasks
//! wait on it (reference counted; SUBSCRIBE/UNSUBSCRIBE are serialized so a leaving waiter can
//! never unsubscribe a newer one). A disconnect wakes every waiter so it retries at once; the
//! connection manager re-subscribes after reconnecting.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex, MutexGuard, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
};

use redis::{PushInfo, PushKind, Value, aio::ConnectionManager};
use tokio::sync::Notify;

/// The waiters of each channel: (waiter id, its wake-up).
type Waiters = HashMap<Vec<u8>, Vec<(u64, Arc<Notify>)>>;

/// Who waits on which channel. Fed by the connection's push messages.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    waiters: Mutex<Waiters>,
    subscriptions: tokio::sync::Mutex<HashMap<Vec<u8>, usize>>,
    next_id: AtomicU64,
}

impl Registry {
    fn waiters(&self) -> MutexGuard<'_, Waiters> {
        self.waiters.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn dispatch(&self, info: PushInfo) {
        match info.kind {
            PushKind::Message => {
                if let Some(Value::BulkString(channel)) = info.data.first()
                    && let Some(list) = self.waiters().get(channel)
                {
                    list.iter().for_each(|(_, n)| n.notify_one());
                }
            }
            PushKind::Disconnection => {
                for list in self.waiters().values() {
                    list.iter().for_each(|(_, n)| n.notify_one());
                }
            }
            _ => {}
        }
    }

    /// Starts listening on `channel`: returns once the server has confirmed the subscription,
    /// so a release published afterwards is seen.
    pub(crate) async fn watch(
        self: &Arc<Self>,
        conn: &ConnectionManager,
        channel: &[u8],
    ) -> redis::RedisResult<Watch> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let notify = Arc::new(Notify::new());
        self.waiters()
            .entry(channel.to_vec())
            .or_default()
            .push((id, notify.clone()));
        let mut watch = Watch {
            registry: self.clone(),
            conn: conn.clone(),
            channel: channel.to_vec(),
            id,
            notify,
            subscribed: false,
        };
        let mut subs = self.subscriptions.lock().await;
        let count = subs.entry(channel.to_vec()).or_insert(0);
        if *count == 0 {
            let mut conn = conn.clone();
            if let Err(e) = conn.subscribe(channel).await {
                subs.remove(channel);
                return Err(e);
            }
        }
        *count += 1;
        watch.subscribed = true;
        Ok(watch)
    }
}

impl redis::aio::AsyncPushSender for Registry {
    fn send(&self, info: PushInfo) -> Result<(), redis::aio::SendError> {
        self.dispatch(info);
        Ok(())
    }
}

/// One waiter's subscription; dropping it unsubscribes (in the background) when it was the
/// channel's last waiter.
#[derive(Debug)]
pub(crate) struct Watch {
    registry: Arc<Registry>,
    conn: ConnectionManager,
    channel: Vec<u8>,
    id: u64,
    notify: Arc<Notify>,
    subscribed: bool,
}

impl Watch {
    /// Completes when a release was published on the channel (or the connection dropped) since
    /// the last call; a notification that arrived meanwhile is kept, never lost.
    pub(crate) async fn woken(&self) {
        self.notify.notified().await;
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        {
            let mut waiters = self.registry.waiters();
            if let Some(list) = waiters.get_mut(&self.channel) {
                list.retain(|(id, _)| *id != self.id);
                if list.is_empty() {
                    waiters.remove(&self.channel);
                }
            }
        }
        if !self.subscribed {
            return;
        }
        let registry = self.registry.clone();
        let mut conn = self.conn.clone();
        let channel = std::mem::take(&mut self.channel);
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        rt.spawn(async move {
            let mut subs = registry.subscriptions.lock().await;
            let Some(count) = subs.get_mut(&channel) else {
                return;
            };
            *count = count.saturating_sub(1);
            if *count == 0 {
                subs.remove(&channel);
                if let Err(e) = conn.unsubscribe(&channel).await {
                    tracing::debug!(error = %e, "unsubscribe of a lock release channel failed");
                }
            }
        });
    }
}
