//! The waiter queue: how an acquisition queues (its ephemeral sequential node, found again after a
//! lost reply), waits for its turn behind the contenders ahead of it, takes the grant when first,
//! and leaves (its node deleted in the foreground or, failing that, in the background).

use std::{
    future::poll_fn,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    task::Poll,
    time::Duration,
};

use futures::{StreamExt, stream::FuturesUnordered};
use lock_core::raw::{
    AcquireWait, Error, FencingToken, Lease, LockKey, LossReason, OwnershipToken, Result,
    cleanup::Retries,
};
use tokio::time::{Instant, sleep_until, timeout};
use zookeeper_client as zk;

use crate::{
    BACKEND, ZkLock, ZkLockConfig,
    client::{Session, ZkResult, call, call_until, outcome_unknown, session_gone, to_error},
    lock::ZkLease,
    path::{
        KEEP_NODE, KeepMarker, keep_path, lock_dir, node_prefix, protected_marker,
        sorted_contenders,
    },
    renew::{delete_keep, lease_ttl},
    wake::{Change, Check, NodeWatch},
};

/// How many times one attempt re-creates its node after a container was reaped or the
/// connection was lost mid-create.
const CREATE_ATTEMPTS: usize = 5;

/// A waiter watches every contender ahead of it when there are at most this many (and knows
/// without a read when the last one is gone); behind a longer queue it watches only its
/// predecessor and lists again when that is deleted.
const MAX_WATCHED_AHEAD: usize = 16;

/// How long a waiter that gave up (or whose grant came too late) tries to delete its node in
/// the foreground after its deadline before leaving that to the background clean-up: the
/// bound by which `acquire` may return after its deadline.
const REMOVE_GRACE: Duration = Duration::from_millis(100);

/// Where our node stands in the queue.
pub(crate) enum Position {
    /// Ours is the first contender: we hold the lock.
    First,
    /// Behind these contenders (full paths, in lock order: the holder first, our predecessor
    /// last), as of one listing.
    Behind(Vec<String>),
    /// Our node no longer exists (deleted from outside, or the session expired).
    Gone,
}

/// What waiting in the queue ended with.
pub(crate) enum Waited {
    /// We hold the lock: every contender that was ahead of us is gone, and our node exists
    /// (see [`Contender::wait_behind`]).
    Granted,
    /// Something changed (or a safety re-check is due): list the contenders again.
    Relist,
}

/// One acquisition attempt's node. Dropped without `done`, it deletes the node (or, when the
/// create's outcome is unknown, any node carrying its token) in the background, so a cancelled or
/// failed attempt never leaves an orphan contender that would block everyone until the session
/// ends.
pub(crate) struct Contender {
    lock: ZkLock,
    session: Arc<Session>,
    dir: String,
    token: OwnershipToken,
    /// Our node's name and the Stat of its creation, once known.
    node: Option<(String, zk::Stat)>,
    /// The deletion watch on our node, armed while we wait in the queue; handed to the lease.
    watch: Arc<NodeWatch>,
    /// The session watch's epoch when our create was first sent (see `crate::members`).
    epoch: u32,
    /// The deadline of the `acquire` (or the bound of the `try_acquire`) this contender
    /// belongs to: no request gets more than what is left of it (`None`: each request gets
    /// `timeout`).
    deadline: Option<Instant>,
    /// The last listing (or watch) showed a keep marker in the directory: see
    /// [`Contender::clear_keep`].
    keep_seen: AtomicBool,
    done: bool,
}

/// What a keep marker in our way came to (see [`Contender::clear_keep`]).
pub(crate) enum Kept {
    /// No marker holds the lock any more (none was left, or it had passed and was deleted).
    Free,
    /// A marker still holds it (only without a wait: `try_acquire`).
    Held,
    /// Our node is gone.
    Gone,
}

/// What taking the lease for a node that is first in line gave.
pub(crate) enum Grant {
    Lease(Lease),
    /// The session's vouched window had already passed: the lease would be born expired.
    Late,
    /// We have no node.
    Gone,
}

impl Contender {
    pub(crate) fn path(&self) -> Option<String> {
        self.node.as_ref().map(|(n, _)| format!("{}/{n}", self.dir))
    }

    /// When the next request must be answered by: `timeout` from now, and never after the
    /// acquire's deadline.
    fn until(&self) -> Instant {
        let now = Instant::now();
        // `timeout` is validated, but never let a sum panic.
        let by_op = now
            .checked_add(self.lock.inner.config.timeout)
            .unwrap_or(now + ZkLockConfig::MAX_TIMEOUT);
        self.deadline.map_or(by_op, |d| d.min(by_op))
    }

    /// The same as a duration from now (zero once the deadline has passed).
    fn limit(&self) -> Duration {
        self.until().saturating_duration_since(Instant::now())
    }

    async fn call<T>(&self, fut: impl Future<Output = ZkResult<T>>) -> ZkResult<T> {
        call_until(self.until(), fut).await
    }

    /// Creates our ephemeral sequential node (and the container parents when missing). After a
    /// ConnectionLoss, looks for our node by its token before creating again.
    pub(crate) async fn create(&mut self, op: &'static str) -> Result<()> {
        let prefix = format!("{}/{}", self.dir, node_prefix(&self.token));
        let acls = self.lock.acls();
        let options = zk::CreateMode::EphemeralSequential.with_acls(acls);
        // The identity goes in the create itself: no extra request, and it lives and dies
        // with the node (the grant). In an election's directory the value alone (what
        // Curator's peers read), the identity in the session's holder node, written first.
        let lock = self.lock.clone();
        if lock.is_election_dir(&self.dir) {
            lock.publish_holder(&self.session, self.until()).await;
        }
        let data = lock.node_data(&self.dir).as_bytes();
        let mut last = None;
        // A create of ours may have been applied without our hearing of it.
        let mut uncertain = false;
        // Before the first attempt: whichever attempt created the node was sent after this.
        self.epoch = self.session.root_watch.epoch();
        for _ in 0..CREATE_ATTEMPTS {
            let client = &self.session.client;
            let probe = self.session.probe();
            match self.call(client.create(&prefix, data, &options)).await {
                Ok((stat, seq)) => {
                    self.session.answered(probe);
                    self.node = Some((format!("{}{seq}", node_prefix(&self.token)), stat));
                    if uncertain {
                        // An earlier create may be applied on the leader yet not on our member:
                        // a sync makes the next listing show it, and `position` deletes it.
                        let _ = self.session.sync(self.limit()).await;
                    }
                    return Ok(());
                }
                Err(zk::Error::NoNode) => {
                    // With acl=creator the lock directories (and a missing root) belong to our
                    // digest identity too: other credentials can neither queue nor look in.
                    let parents = zk::CreateMode::Container.with_acls(self.lock.acls());
                    match self.call(client.mkdir(&self.dir, &parents)).await {
                        Ok(()) => {}
                        Err(e) if outcome_unknown(&e) => last = Some(e),
                        Err(e) => return Err(to_error(op, e)),
                    }
                }
                Err(e) if outcome_unknown(&e) => {
                    // The create may have been applied: find our node by its token.
                    uncertain = true;
                    match self.find().await {
                        Ok(true) => return Ok(()),
                        Ok(false) => last = Some(e),
                        Err(e) => {
                            return Err(Error::Indeterminate {
                                backend: BACKEND,
                                op,
                                key: self.dir.clone(),
                                message: format!(
                                    "creating the contender node: {e}; it is removed in the background"
                                ),
                            });
                        }
                    }
                }
                Err(e) => return Err(to_error(op, e)),
            }
        }
        Err(to_error(op, last.unwrap_or(zk::Error::ConnectionLoss)))
    }

    /// Looks for a child carrying our token; records it. `Ok(false)`: there is none.
    ///
    /// A `sync` first: the member we are (re)connected to may not have applied a create the
    /// leader already committed, and listing there would miss it (Curator's protected-mode
    /// race); a second create would then queue behind its own orphan. When more than one child
    /// carries our token the first is adopted and `position` deletes the others.
    async fn find(&mut self) -> ZkResult<bool> {
        let marker = protected_marker(&self.token);
        self.session.sync(self.limit()).await?;
        let children = match self
            .call(self.session.client.list_children(&self.dir))
            .await
        {
            Ok(c) => c,
            Err(zk::Error::NoNode) => return Ok(false),
            Err(e) => return Err(e),
        };
        // The first (in queue order) that is ephemeral to our session.
        for name in sorted_contenders(children)
            .into_iter()
            .filter(|c| c.starts_with(&marker))
        {
            let path = format!("{}/{name}", self.dir);
            if let Some(stat) = self.call(self.session.client.check_stat(&path)).await?
                && stat.ephemeral_owner == self.session.id
            {
                self.node = Some((name, stat));
                return Ok(true);
            }
        }
        Ok(false)
    }

    pub(crate) async fn position(&self, op: &'static str) -> Result<Position> {
        let Some((name, _)) = &self.node else {
            return Ok(Position::Gone);
        };
        let probe = self.session.probe();
        let children = match self
            .call(self.session.client.list_children(&self.dir))
            .await
        {
            Ok(c) => c,
            Err(zk::Error::NoNode) => return Ok(Position::Gone),
            Err(e) => return Err(to_error(op, e)),
        };
        self.session.answered(probe);
        self.keep_seen
            .store(children.iter().any(|c| c == KEEP_NODE), Ordering::Relaxed);
        // Any other child with our token is an orphan of a create whose reply we lost: ours
        // (the uuid is this contender's), and it must not stay queued ahead of us or behind.
        let marker = protected_marker(&self.token);
        let (orphans, children): (Vec<String>, Vec<String>) = children
            .into_iter()
            .partition(|c| c.starts_with(&marker) && c != name);
        for orphan in orphans {
            let path = format!("{}/{orphan}", self.dir);
            tracing::debug!(%path, "deleting an orphan of a create whose reply was lost");
            if let Err(e) = delete_node(&self.session, &path, self.limit()).await {
                return Err(to_error(op, e));
            }
        }
        let sorted = sorted_contenders(children);
        Ok(match sorted.iter().position(|c| c == name) {
            None => Position::Gone,
            Some(0) => Position::First,
            Some(i) => Position::Behind(
                sorted[..i]
                    .iter()
                    .map(|c| format!("{}/{c}", self.dir))
                    .collect(),
            ),
        })
    }

    /// Waits until the contenders `ahead` of us (as of one listing) are gone, our own node is
    /// deleted, or the backoff asks for a safety re-check.
    ///
    /// When at most [`MAX_WATCHED_AHEAD`] contenders are ahead, all of them are watched (one
    /// `exists` each, pipelined with one arming the watch on our own node when that is not armed
    /// yet). Once all are deleted we hold the lock without listing again: no contender can sort
    /// before ours any more — every node created after that listing has a larger sequence
    /// number (the directory's counter only grows while it has children, and ours keeps it
    /// alive), and the listing showed every node that sorted before ours — *provided our own
    /// node still exists*. That is what the watch on our node establishes (see
    /// [`crate::wake`]): armed before the others on the same connection, without an event
    /// and without a reconnection since, our node was not deleted before the last of them
    /// was (the server sends the events of one session in the order of the changes, and the
    /// client hands them over in that order). Otherwise (a longer queue: only the predecessor
    /// is watched, as in Curator; a data-change event; a reconnection; the session no longer
    /// vouched for) we list again. Each deletion wakes at most `MAX_WATCHED_AHEAD` waiters,
    /// and none of them sends a request unless it becomes the holder.
    pub(crate) async fn wait_behind(
        &self,
        ahead: &[String],
        wait: &mut AcquireWait,
    ) -> Result<Waited> {
        let (Some(own), Some((_, created))) = (self.path(), &self.node) else {
            return Ok(Waited::Relist);
        };
        let exact = ahead.len() <= MAX_WATCHED_AHEAD;
        let watched = if exact {
            ahead
        } else {
            &ahead[ahead.len() - 1..]
        };
        let session = &self.session;
        let client = &session.client;
        // One bound for the whole pipelined batch (not one timeout per request).
        let until = self.until();
        // Every request is queued on the connection when created, ours first.
        let states = client.state_watcher();
        let probe = session.probe();
        let arm_own = matches!(self.watch.check(), Check::Unreliable)
            .then(|| client.check_and_watch_stat(&own));
        let arm_ahead: Vec<_> = watched
            .iter()
            .map(|path| client.check_and_watch_stat(path))
            .collect();
        // A keep marker is written by a holder just after its grant and outlives its node: one
        // that exists now, or is created while we wait, sends us back to a listing instead of
        // the shortcut (which would not see it).
        let arm_keep = exact.then(|| client.check_and_watch_stat(&keep_path(&self.dir)));
        if let Some(arm_own) = arm_own {
            match call_until(until, arm_own).await {
                Ok((Some(stat), watcher))
                    if stat.czxid == created.czxid && stat.ephemeral_owner == session.id =>
                {
                    self.watch.install(watcher, states);
                }
                // Our node is gone: the listing will say so.
                Ok(_) => self.watch.set_lost(LossReason::Revoked),
                // No watch on our node: no shortcut this time.
                Err(_) => {}
            }
        }
        let mut keep_event = None;
        let mut keep_present = false;
        let mut events = FuturesUnordered::new();
        for arm in arm_ahead {
            match call_until(until, arm).await {
                // Already gone.
                Ok((None, _)) => {}
                Ok((Some(_), watcher)) => events.push(watcher.changed()),
                Err(e) => return Err(to_error("acquire", e)),
            }
        }
        if let Some(arm) = arm_keep {
            match call_until(until, arm).await {
                Ok((Some(_), _)) => keep_present = true,
                Ok((None, watcher)) => keep_event = Some(watcher.changed()),
                Err(e) => return Err(to_error("acquire", e)),
            }
        }
        session.answered(probe);
        let all_gone = if events.is_empty() {
            true
        } else {
            let mut all_gone = false;
            let own_lost = poll_fn(|cx| match self.watch.poll_changed(cx) {
                Poll::Ready(Change::Lost(_)) => Poll::Ready(()),
                // Not armed (a data change consumed it): nothing to wait for on our node.
                Poll::Ready(Change::Unarmed) | Poll::Pending => Poll::Pending,
            });
            let ahead_gone = async {
                while let Some(event) = events.next().await {
                    if event.event_type != zk::EventType::NodeDeleted {
                        return false;
                    }
                }
                true
            };
            let keep_created = async {
                match keep_event {
                    Some(event) => {
                        event.await;
                    }
                    None => std::future::pending().await,
                }
            };
            wait.wait(async {
                tokio::select! {
                    biased;
                    gone = ahead_gone => all_gone = gone,
                    () = own_lost => {}
                    () = keep_created => keep_present = true,
                }
            })
            .await?;
            all_gone
        };
        Ok(if exact && all_gone && !keep_present {
            self.granted_when_first()
        } else {
            Waited::Relist
        })
    }

    /// The last listing showed a keep marker (job mode's `at_least`, see
    /// [`crate::renew::KeptMarker`]).
    pub(crate) fn keep_seen(&self) -> bool {
        self.keep_seen.load(Ordering::Relaxed)
    }

    /// Our node is first in line and a keep marker was listed: the lock is ours only once the
    /// leader's clock has passed the marker. The leader's "now" is the `mtime` of a write of
    /// ours (our own node's data written again), compared with the marker's `mtime` plus its
    /// hold: one clock on both sides, never ours. A marker that passed is deleted (compare on
    /// its version); one that holds is waited out — until the deadline of `wait`, or not at
    /// all without one (`Kept::Held`).
    pub(crate) async fn clear_keep(&mut self, mut wait: Option<&mut AcquireWait>) -> Result<Kept> {
        const OP: &str = "acquire";
        let path = keep_path(&self.dir);
        let session = self.session.clone();
        let client = &session.client;
        loop {
            let (data, stat) = match self.call(client.get_data(&path)).await {
                Ok(read) => read,
                Err(zk::Error::NoNode) => {
                    self.keep_seen.store(false, Ordering::Relaxed);
                    return Ok(Kept::Free);
                }
                Err(e) if session_gone(&e) => return Ok(Kept::Gone),
                Err(e) => return Err(to_error(OP, e)),
            };
            let Some(marker) = KeepMarker::decode(&data) else {
                return Err(Error::Backend {
                    backend: BACKEND,
                    op: OP,
                    message: format!(
                        "{path} is not a distlock keep marker; delete it by hand if nothing of yours wrote it"
                    ),
                    source: None,
                });
            };
            let Some(now) = self.touch().await.map_err(|e| to_error(OP, e))? else {
                return Ok(Kept::Gone);
            };
            let expires = marker.expires_at(stat.mtime);
            if now >= expires {
                let deleted = delete_keep(
                    client,
                    &path,
                    Some(marker.fence),
                    Some(stat.version),
                    self.until(),
                )
                .await;
                match deleted {
                    Ok(()) | Err(zk::Error::NoNode) => {
                        self.keep_seen.store(false, Ordering::Relaxed);
                        return Ok(Kept::Free);
                    }
                    // Rewritten (or our delete's reply was lost): look again.
                    Err(zk::Error::BadVersion) => continue,
                    Err(e) if outcome_unknown(&e) => continue,
                    Err(e) if session_gone(&e) => return Ok(Kept::Gone),
                    Err(e) => return Err(to_error(OP, e)),
                }
            }
            let Some(wait) = wait.as_deref_mut() else {
                return Ok(Kept::Held);
            };
            let left = Duration::from_millis(u64::try_from(expires - now).unwrap_or(u64::MAX));
            tracing::debug!(dir = %self.dir, ?left, "first in line behind a keep marker; waiting it out");
            let until = Instant::now()
                .checked_add(left)
                .map_or(wait.deadline(), |t| t.min(wait.deadline()));
            sleep_until(until).await;
            if Instant::now() >= wait.deadline() {
                return Err(wait.timeout());
            }
        }
    }

    /// Writes our node's data again (unchanged): the leader's clock, as the write's `mtime`.
    /// `None` when our node or session is gone. The node's new Stat is kept (its version is the
    /// lease's).
    async fn touch(&mut self) -> ZkResult<Option<i64>> {
        let Some(own) = self.path() else {
            return Ok(None);
        };
        // Not yet granted, so never proclaimed: the data it was created with.
        let data = self.lock.node_data(&self.dir).as_bytes();
        let probe = self.session.probe();
        match self
            .call(self.session.client.set_data(&own, data, None))
            .await
        {
            Ok(stat) => {
                self.session.answered(probe);
                let mtime = stat.mtime;
                if let Some((_, node)) = &mut self.node {
                    *node = stat;
                }
                Ok(Some(mtime))
            }
            Err(zk::Error::NoNode) => Ok(None),
            Err(e) if session_gone(&e) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Once every contender that was ahead of us is known to be gone: do we hold the lock
    /// without listing again? Only if our node's watch is reliable and silent (our node
    /// exists) and the session is alive and vouched for.
    fn granted_when_first(&self) -> Waited {
        if self.session.is_ended() {
            return Waited::Relist;
        }
        let Check::Reliable(_) = self.watch.check() else {
            return Waited::Relist;
        };
        if self.session.vouched_until() <= Instant::now() {
            return Waited::Relist;
        }
        Waited::Granted
    }

    /// The lease for our node (first in line). It counts from the newest send time the leader
    /// is known to have heard of ([`Session::vouched_base`]) with a TTL capped at the session
    /// timeout, so its deadline is the session's vouched window at the latest; when that has
    /// already passed the lease would be born expired ([`Grant::Late`], the node is kept for
    /// the caller to remove).
    pub(crate) fn grant(&mut self, key: &LockKey, ttl: Duration) -> Grant {
        let Some((name, stat)) = &self.node else {
            return Grant::Gone;
        };
        let state = ZkLease {
            session_id: self.session.id,
            path: format!("{}/{name}", self.dir).into(),
            czxid: stat.czxid,
            version: stat.version,
            epoch: self.epoch,
            watch: self.watch.clone(),
            kept: std::sync::Mutex::new(None),
        };
        let fencing = u64::try_from(stat.czxid).ok().map(FencingToken);
        let lease = Lease::new(
            key.clone(),
            self.token,
            fencing,
            lease_ttl(ttl, &self.session),
            self.session.vouched_base(),
        )
        .with_backend_state(state);
        if !lease.is_locally_valid() {
            return Grant::Late;
        }
        self.done = true;
        Grant::Lease(lease)
    }

    /// Deletes our node now (in the foreground, each request bounded by `limit`), leaving a
    /// background cleanup if that fails.
    pub(crate) async fn remove(mut self, limit: Duration) {
        if let Some(path) = self.path()
            && delete_node(&self.session, &path, limit).await.is_ok()
        {
            self.done = true;
        }
    }

    /// [`Contender::remove`] within what is left of the deadline (at least [`REMOVE_GRACE`]).
    pub(crate) async fn remove_in_time(self) {
        let limit = self.limit().max(REMOVE_GRACE);
        // One bound for the whole removal (its retries included); cut short, the contender is
        // dropped undone and its Drop leaves the removal to the background.
        let _ = timeout(limit, self.remove(limit)).await;
    }
}

/// Deletes `path` (any version), retrying while the outcome is unknown. `Ok(true)` deleted,
/// `Ok(false)` it was already gone (or the session is gone, which deletes it).
pub(crate) async fn delete_node(session: &Session, path: &str, limit: Duration) -> ZkResult<bool> {
    let mut lost_once = false;
    for _ in 0..3 {
        match call(limit, session.client.delete(path, None)).await {
            Ok(()) => return Ok(true),
            Err(zk::Error::NoNode) => return Ok(lost_once),
            Err(e) if session_gone(&e) => return Ok(false),
            Err(e) if outcome_unknown(&e) => lost_once = true,
            Err(e) => return Err(e),
        }
    }
    Err(zk::Error::ConnectionLoss)
}

/// Deletes our node `path` (created as `czxid`) in the background once the session is vouched
/// for again, unless the session ends first (which deletes it anyway). For a lease lost because
/// its trust window lapsed, or whose release went unanswered: if the session survives (a healed
/// partition), its node would otherwise keep the lock held by nobody for as long as the process
/// lives.
pub(crate) fn spawn_removal(session: Arc<Session>, path: Arc<str>, czxid: i64, limit: Duration) {
    lock_core::raw::cleanup::spawn(async move {
        // Until the node is gone or the session ends (which deletes it).
        let mut retries = Retries::unbounded();
        while retries.next().await && session.wait_vouched().await {
            match call(limit, session.client.check_stat(&path)).await {
                Ok(Some(stat)) if stat.czxid == czxid && stat.ephemeral_owner == session.id => {
                    if delete_node(&session, &path, limit).await.is_ok() {
                        tracing::debug!(%path, "removed the node of a lost lease");
                        return;
                    }
                }
                Ok(_) => return,
                Err(e) if session_gone(&e) => return,
                Err(_) => {}
            }
        }
    });
}

impl Drop for Contender {
    fn drop(&mut self) {
        if self.done || self.session.is_ended() {
            return;
        }
        let session = self.session.clone();
        let dir = self.dir.clone();
        let marker = protected_marker(&self.token);
        let node = self.node.as_ref().map(|(n, _)| n.clone());
        let limit = self.lock.inner.config.timeout;
        lock_core::raw::cleanup::spawn(async move {
            // Until the session ends (which deletes the node anyway) or the node is gone.
            let mut retries = Retries::unbounded();
            while retries.next().await && !session.is_ended() {
                let names = match &node {
                    Some(n) => vec![n.clone()],
                    // Every child with our token is ours (a create may have been applied more
                    // than once without our hearing of it); sync first, so the member we list
                    // on has applied what the leader committed.
                    None => match session.sync(limit).await {
                        Ok(()) => match call(limit, session.client.list_children(&dir)).await {
                            Ok(children) => children
                                .into_iter()
                                .filter(|c| c.starts_with(&marker))
                                .collect(),
                            Err(zk::Error::NoNode) => Vec::new(),
                            Err(_) => continue,
                        },
                        Err(_) => continue,
                    },
                };
                let mut failed = false;
                for name in names {
                    failed |= delete_node(&session, &format!("{dir}/{name}"), limit)
                        .await
                        .is_err();
                }
                if !failed {
                    return;
                }
            }
        });
    }
}

impl ZkLock {
    /// A new contender for `key` in `session` (no request yet).
    pub(crate) fn contender(
        &self,
        session: Arc<Session>,
        key: &LockKey,
        deadline: Option<Instant>,
    ) -> Contender {
        let token = OwnershipToken::generate();
        Contender {
            lock: self.clone(),
            session,
            dir: lock_dir(self.inner.config.root(), key),
            token,
            node: None,
            watch: Arc::new(NodeWatch::new()),
            epoch: 0,
            deadline,
            keep_seen: AtomicBool::new(false),
            done: false,
        }
    }
}
