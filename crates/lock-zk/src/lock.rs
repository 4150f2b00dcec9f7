//! `ZkLock`: the Curator-compatible ZooKeeper mutex.

use std::{
    fmt,
    future::{Future, poll_fn},
    sync::{Arc, Mutex, PoisonError},
    task::Poll,
    time::Duration,
};

use futures::{StreamExt, future::BoxFuture, stream::FuturesUnordered};
use lock_core::raw::{
    AcquireWait, Backoff, Capabilities, Driver, Error, FencingGuarantee, FencingToken,
    HolderIdentity, HolderInfo, Lease, LockKey, LossReason, OwnershipToken, Result, async_trait,
};
use tokio::time::{Instant, sleep, timeout, timeout_at};
use tokio_util::sync::CancellationToken;
use zookeeper_client as zk;

use crate::{
    BACKEND, ZkAcl, ZkLockConfig,
    path::{self, lock_dir, node_prefix, protected_marker, sorted_contenders},
    session::Session,
    watch::{Change, Check, NodeWatch},
};

type ZkResult<T> = std::result::Result<T, zk::Error>;

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

/// A ZooKeeper lock client: one session shared by every lock it takes.
///
/// See the crate documentation for the recipe, the TTL rules and the failure semantics.
/// Cloning is cheap; clones share the session.
#[derive(Clone)]
pub struct ZkLock {
    inner: Arc<Inner>,
}

struct Inner {
    config: ZkLockConfig,
    /// Who we are, written as the data of every contender node we create: the node that holds
    /// the lock carries its own holder's identity, so `inspect` can never pair a grant with
    /// another client's identity.
    identity: HolderIdentity,
    current: Mutex<Option<Arc<Session>>>,
    connecting: tokio::sync::Mutex<()>,
    /// Cancelled when the last clone is dropped: stops the session's heartbeat.
    stop: CancellationToken,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Driver state carried by each lease.
struct ZkLease {
    session_id: i64,
    /// Our node's path (relative to the chroot).
    path: String,
    czxid: i64,
    version: i32,
    /// The deletion watch on our node, shared by renewals and `watch_lost` (and armed while
    /// waiting, when the lock was waited for).
    watch: Arc<NodeWatch>,
}

impl ZkLock {
    /// A client for `config` that connects lazily, on its first request (no I/O here).
    ///
    /// # Errors
    /// [`Error::Config`] when the configuration is invalid.
    pub fn new(config: ZkLockConfig) -> Result<Self> {
        config.validate()?;
        let identity = HolderIdentity::process(config.label.as_deref())?;
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                identity,
                current: Mutex::new(None),
                connecting: tokio::sync::Mutex::new(()),
                stop: CancellationToken::new(),
            }),
        })
    }

    /// Connects: establishes the session now.
    ///
    /// # Errors
    /// [`Error::Config`] for a bad configuration or a server that raises the session timeout;
    /// [`Error::Unavailable`] when no server answers.
    pub async fn connect(config: ZkLockConfig) -> Result<Self> {
        let this = Self::new(config)?;
        this.session().await?;
        Ok(this)
    }

    /// [`ZkLock::connect`] with [`ZkLockConfig::from_url`].
    ///
    /// # Errors
    /// As [`ZkLockConfig::from_url`] and [`ZkLock::connect`].
    pub async fn connect_url(url: &str) -> Result<Self> {
        Self::connect(ZkLockConfig::from_url(url)?).await
    }

    /// The configuration.
    pub fn config(&self) -> &ZkLockConfig {
        &self.inner.config
    }

    /// The underlying `zookeeper-client` session (connecting if needed), e.g. to read its session
    /// id or to share it. Lock nodes are ephemeral to this session: closing it releases them.
    ///
    /// # Errors
    /// As [`ZkLock::connect`].
    pub async fn zk_client(&self) -> Result<zk::Client> {
        Ok(self.session().await?.client.clone())
    }

    fn current(&self) -> Option<Arc<Session>> {
        self.inner
            .current
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The live session, establishing a new one when there is none or the last one ended.
    async fn session(&self) -> Result<Arc<Session>> {
        if let Some(s) = self.current().filter(|s| !s.is_ended()) {
            return Ok(s);
        }
        let _connecting = self.inner.connecting.lock().await;
        if let Some(s) = self.current().filter(|s| !s.is_ended()) {
            return Ok(s);
        }
        let session = Session::open(&self.inner.config, self.inner.stop.child_token()).await?;
        *self
            .inner
            .current
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(session.clone());
        Ok(session)
    }

    /// The session `lease` was granted in, if it is still the live one.
    fn session_of(&self, state: &ZkLease) -> Option<Arc<Session>> {
        self.current()
            .filter(|s| s.id == state.session_id && !s.is_ended())
    }

    fn acls(&self) -> zk::Acls<'static> {
        match self.inner.config.acl {
            ZkAcl::Open => zk::Acls::anyone_all(),
            ZkAcl::Creator => zk::Acls::creator_all(),
        }
    }

    async fn call<T>(&self, fut: impl Future<Output = ZkResult<T>>) -> ZkResult<T> {
        call(self.inner.config.op_timeout, fut).await
    }

    fn contender(
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
            deadline,
            done: false,
        }
    }
}

/// A lease's TTL: the requested one, capped at the negotiated session timeout. The lease counts
/// from a leader-proved send time ([`Session::vouched_base`]), so its local deadline is never
/// later than the session's vouched window, however long the TTL asked for: a bare `Lease` never
/// claims more than the session can vouch for.
fn lease_ttl(ttl: Duration, session: &Session) -> Duration {
    ttl.min(session.timeout)
}

/// The error of a grant that came after its local deadline (its node is removed).
fn vanished(op: &'static str) -> Error {
    Error::Unavailable {
        backend: BACKEND,
        op,
        message: "our contender node vanished (session expired or deleted)".into(),
        source: None,
    }
}

fn late_grant(op: &'static str) -> Error {
    Error::Unavailable {
        backend: BACKEND,
        op,
        message: "the lock was ours only after the session could no longer be vouched for \
                  (the leader may already have expired it); our node was removed"
            .into(),
        source: None,
    }
}

impl ZkLock {}

/// `fut` bounded by `limit`; running out is reported as [`zk::Error::Timeout`] (outcome unknown).
async fn call<T>(limit: Duration, fut: impl Future<Output = ZkResult<T>>) -> ZkResult<T> {
    timeout(limit, fut).await.unwrap_or(Err(zk::Error::Timeout))
}

/// `fut` bounded by the instant `until`, like [`call`].
async fn call_until<T>(until: Instant, fut: impl Future<Output = ZkResult<T>>) -> ZkResult<T> {
    timeout_at(until, fut)
        .await
        .unwrap_or(Err(zk::Error::Timeout))
}

/// The request may or may not have been applied. zookeeper-client fails in-flight requests with
/// a custom error ("no response from connection in …ms", I/O errors) when it gives up on a
/// connection: the request may have reached the server, so that is an unknown outcome too.
fn outcome_unknown(e: &zk::Error) -> bool {
    matches!(
        e,
        zk::Error::ConnectionLoss | zk::Error::Timeout | zk::Error::Custom(_)
    )
}

/// The session is gone, and with it every ephemeral node it owned.
fn session_gone(e: &zk::Error) -> bool {
    matches!(
        e,
        zk::Error::SessionExpired | zk::Error::ClientClosed | zk::Error::SessionMoved
    )
}

fn to_error(op: &'static str, e: zk::Error) -> Error {
    if outcome_unknown(&e) || session_gone(&e) || matches!(e, zk::Error::NoHosts) {
        Error::unavailable(BACKEND, op, e)
    } else {
        Error::backend(BACKEND, op, e)
    }
}

/// Where our node stands in the queue.
enum Position {
    /// Ours is the first contender: we hold the lock.
    First,
    /// Behind these contenders (full paths, in lock order: the holder first, our predecessor
    /// last), as of one listing.
    Behind(Vec<String>),
    /// Our node no longer exists (deleted from outside, or the session expired).
    Gone,
}

/// What waiting in the queue ended with.
enum Waited {
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
struct Contender {
    lock: ZkLock,
    session: Arc<Session>,
    dir: String,
    token: OwnershipToken,
    /// Our node's name and the Stat of its creation, once known.
    node: Option<(String, zk::Stat)>,
    /// The deletion watch on our node, armed while we wait in the queue; handed to the lease.
    watch: Arc<NodeWatch>,
    /// The deadline of the `acquire` (or the bound of the `try_acquire`) this contender
    /// belongs to: no request gets more than what is left of it (`None`: each request gets
    /// `op_timeout`).
    deadline: Option<Instant>,
    done: bool,
}

/// What taking the lease for a node that is first in line gave.
enum Grant {
    Lease(Lease),
    /// The session's vouched window had already passed: the lease would be born expired.
    Late,
    /// We have no node.
    Gone,
}

impl Contender {
    fn path(&self) -> Option<String> {
        self.node.as_ref().map(|(n, _)| format!("{}/{n}", self.dir))
    }

    /// When the next request must be answered by: `op_timeout` from now, and never after the
    /// acquire's deadline.
    fn until(&self) -> Instant {
        let now = Instant::now();
        // `op_timeout` is validated, but never let a sum panic.
        let by_op = now
            .checked_add(self.lock.inner.config.op_timeout)
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
    async fn create(&mut self, op: &'static str) -> Result<()> {
        let prefix = format!("{}/{}", self.dir, node_prefix(&self.token));
        let acls = self.lock.acls();
        let options = zk::CreateMode::EphemeralSequential.with_acls(acls);
        // The identity goes in the create itself: no extra request, and it lives and dies
        // with the node (the grant).
        let lock = self.lock.clone();
        let data = lock.inner.identity.as_str().as_bytes();
        let mut last = None;
        // A create of ours may have been applied without our hearing of it.
        let mut uncertain = false;
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

    async fn position(&self, op: &'static str) -> Result<Position> {
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
    /// [`crate::watch`]): armed before the others on the same connection, without an event
    /// and without a reconnection since, our node was not deleted before the last of them
    /// was (the server sends the events of one session in the order of the changes, and the
    /// client hands them over in that order). Otherwise (a longer queue: only the predecessor
    /// is watched, as in Curator; a data-change event; a reconnection; the session no longer
    /// vouched for) we list again. Each deletion wakes at most `MAX_WATCHED_AHEAD` waiters,
    /// and none of them sends a request unless it becomes the holder.
    async fn wait_behind(&self, ahead: &[String], wait: &mut AcquireWait) -> Result<Waited> {
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
        // One bound for the whole pipelined batch (not one op_timeout per request).
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
        let mut events = FuturesUnordered::new();
        for arm in arm_ahead {
            match call_until(until, arm).await {
                // Already gone.
                Ok((None, _)) => {}
                Ok((Some(_), watcher)) => events.push(watcher.changed()),
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
            wait.wait(async {
                tokio::select! {
                    biased;
                    gone = ahead_gone => all_gone = gone,
                    () = own_lost => {}
                }
            })
            .await?;
            all_gone
        };
        Ok(if exact && all_gone {
            self.granted_when_first()
        } else {
            Waited::Relist
        })
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
    fn grant(&mut self, key: &LockKey, ttl: Duration) -> Grant {
        let Some((name, stat)) = &self.node else {
            return Grant::Gone;
        };
        let state = ZkLease {
            session_id: self.session.id,
            path: format!("{}/{name}", self.dir),
            czxid: stat.czxid,
            version: stat.version,
            watch: self.watch.clone(),
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
    async fn remove(mut self, limit: Duration) {
        if let Some(path) = self.path()
            && delete_node(&self.session, &path, limit).await.is_ok()
        {
            self.done = true;
        }
    }

    /// [`Contender::remove`] within what is left of the deadline (at least [`REMOVE_GRACE`]).
    async fn remove_in_time(self) {
        let limit = self.limit().max(REMOVE_GRACE);
        // One bound for the whole removal (its retries included); cut short, the contender is
        // dropped undone and its Drop leaves the removal to the background.
        let _ = timeout(limit, self.remove(limit)).await;
    }
}

/// Deletes `path` (any version), retrying while the outcome is unknown. `Ok(true)` deleted,
/// `Ok(false)` it was already gone (or the session is gone, which deletes it).
async fn delete_node(session: &Session, path: &str, limit: Duration) -> ZkResult<bool> {
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
fn spawn_removal(session: Arc<Session>, path: String, czxid: i64, limit: Duration) {
    lock_core::raw::cleanup::spawn(async move {
        let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
        while session.wait_vouched().await {
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
            sleep(backoff.next_delay()).await;
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
        let limit = self.lock.inner.config.op_timeout;
        lock_core::raw::cleanup::spawn(async move {
            // Until the session ends (which deletes the node anyway) or the node is gone.
            let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
            while !session.is_ended() {
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
                            Err(_) => {
                                sleep(backoff.next_delay()).await;
                                continue;
                            }
                        },
                        Err(_) => {
                            sleep(backoff.next_delay()).await;
                            continue;
                        }
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
                sleep(backoff.next_delay()).await;
            }
        });
    }
}

impl ZkLock {
    /// The operator override: removes the holder of `key` (any holder, or only the grant whose
    /// fencing token — its node's czxid — is `holder`).
    async fn force_release_if(&self, key: &LockKey, holder: Option<FencingToken>) -> Result<bool> {
        const OP: &str = "force_release";
        let session = self.session().await?;
        let dir = lock_dir(self.inner.config.root(), key);
        for _ in 0..5 {
            let Some(current) = self.holder_node(&session, &dir, OP).await? else {
                return Ok(false);
            };
            // Node paths are never reused, so the grant confirmed by its czxid is removed by
            // deleting exactly this path.
            if holder.is_some_and(|h| current.fence != Some(h)) {
                return Ok(false);
            }
            match self.call(session.client.delete(&current.path, None)).await {
                Ok(()) => {
                    tracing::warn!(%key, digest = ?current.digest, "lock holder removed by force_release");
                    return Ok(true);
                }
                Err(zk::Error::NoNode) => continue, // released meanwhile: look again
                Err(e) => return Err(to_error(OP, e)),
            }
        }
        Ok(false)
    }

    /// The first contender of lock directory `dir` (the holder): its node, fencing token
    /// (czxid) and the number of contenders queued behind it; `None` when nobody holds. Looks
    /// again when the holder goes between listing and reading its node.
    async fn holder_node(
        &self,
        session: &Session,
        dir: &str,
        op: &'static str,
    ) -> Result<Option<HolderNode>> {
        for _ in 0..5 {
            let children = match self.call(session.client.list_children(dir)).await {
                Ok(c) => c,
                Err(zk::Error::NoNode) => return Ok(None),
                Err(e) => return Err(to_error(op, e)),
            };
            let sorted = sorted_contenders(children);
            let Some(first) = sorted.first() else {
                return Ok(None);
            };
            let path = format!("{dir}/{first}");
            // Data and Stat come from one read of the same node: the identity is the one its
            // creator wrote, whatever happened to the lock since. Curator writes its IP there
            // and older distlock versions nothing (`from_stored` sanitises; empty is None).
            let read = match self.call(session.client.get_data(&path)).await {
                Ok((data, stat)) => Ok((HolderIdentity::from_stored(&data), stat)),
                // A foreign node we may see but not read (a Curator client with its own ACL):
                // the holder is still shown, without an identity, as before node data was read.
                Err(zk::Error::NoAuth) => self
                    .call(session.client.check_stat(&path))
                    .await
                    .and_then(|stat| stat.ok_or(zk::Error::NoNode))
                    .map(|stat| (None, stat)),
                Err(e) => Err(e),
            };
            match read {
                Ok((identity, stat)) => {
                    return Ok(Some(HolderNode {
                        digest: path::token_digest_of(first),
                        fence: u64::try_from(stat.czxid).ok().map(FencingToken),
                        queued: sorted.len() - 1,
                        identity,
                        path,
                    }));
                }
                Err(zk::Error::NoNode) => continue, // released meanwhile: look again
                Err(e) => return Err(to_error(op, e)),
            }
        }
        Err(Error::Unavailable {
            backend: BACKEND,
            op,
            message: "the holder kept changing".into(),
            source: None,
        })
    }
}

/// What [`ZkLock::holder_node`] found.
struct HolderNode {
    path: String,
    digest: Option<lock_core::raw::TokenDigest>,
    fence: Option<FencingToken>,
    queued: usize,
    identity: Option<HolderIdentity>,
}

#[async_trait]
impl Driver for ZkLock {
    fn backend_name(&self) -> &'static str {
        BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            renew: true,
            session_bound: true,
            fencing: FencingGuarantee::Quorum,
            wait_notify: true,
            fair_queue: true,
            lost_notify: true,
            force_release: true,
            min_ttl: self.inner.config.session_timeout,
            // `check_ttl` caps every TTL at this anyway; saying so lets callers (`distlock
            // check`) show the real limit instead of "none".
            max_ttl: Capabilities::MAX_TTL,
            ..Default::default()
        }
    }

    // Bounded as a whole: twice `op_timeout` (a create and a listing) for everything after the
    // session, however many times the create is retried or looked for.
    async fn try_acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>> {
        let session = self.session().await?;
        let now = Instant::now();
        let budget = self.inner.config.op_timeout.saturating_mul(2);
        let until = now
            .checked_add(budget)
            .unwrap_or(now + ZkLockConfig::MAX_TIMEOUT);
        let mut c = self.contender(session, key, Some(until));
        c.create("try_acquire").await?;
        match c.position("try_acquire").await? {
            Position::First => match c.grant(key, ttl) {
                Grant::Lease(lease) => Ok(Some(lease)),
                Grant::Late => {
                    c.remove(self.inner.config.op_timeout).await;
                    Err(late_grant("try_acquire"))
                }
                Grant::Gone => Err(vanished("try_acquire")),
            },
            Position::Behind { .. } => {
                c.remove(self.inner.config.op_timeout).await;
                Ok(None)
            }
            Position::Gone => Err(vanished("try_acquire")),
        }
    }

    // Every request gets at most what is left of the deadline; a waiter that gives up deletes
    // its node within `REMOVE_GRACE` or leaves that to the background clean-up.
    async fn acquire(&self, key: &LockKey, ttl: Duration, deadline: Instant) -> Result<Lease> {
        // The watch on the predecessor wakes us; the backoff is only a slow safety re-check.
        let backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(5));
        let mut wait = AcquireWait::new(key, deadline, backoff)?;
        // Past the deadline every error is a timeout: that is what the caller waited for.
        let timed_out = |wait: &AcquireWait, e: Error| {
            if Instant::now() >= deadline {
                wait.timeout()
            } else {
                e
            }
        };
        loop {
            let session = match timeout_at(deadline, self.session()).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    wait.retry_after(e).await.map_err(|e| timed_out(&wait, e))?;
                    continue;
                }
                Err(_) => return Err(wait.timeout()),
            };
            let mut c = self.contender(session.clone(), key, Some(deadline));
            if let Err(e) = c.create("acquire").await {
                drop(c);
                wait.retry_after(e).await.map_err(|e| timed_out(&wait, e))?;
                continue;
            }
            loop {
                let step = match c.position("acquire").await {
                    Ok(Position::First) => Ok(true),
                    Ok(Position::Gone) => break,
                    Ok(Position::Behind(ahead)) => match c.wait_behind(&ahead, &mut wait).await {
                        Ok(Waited::Granted) => Ok(true),
                        Ok(Waited::Relist) => Ok(false),
                        Err(e) => Err(e),
                    },
                    Err(e) => Err(e),
                };
                let step = match step {
                    Ok(true) => match c.grant(key, ttl) {
                        Grant::Lease(lease) => return Ok(lease),
                        Grant::Gone => break,
                        Grant::Late => Err(late_grant("acquire")),
                    },
                    Ok(false) => Ok(()),
                    Err(e) => Err(e),
                };
                if let Err(e) = step {
                    if matches!(e, Error::Timeout { .. }) || Instant::now() >= deadline {
                        c.remove_in_time().await;
                        return Err(wait.timeout());
                    }
                    if session.is_ended() {
                        break;
                    }
                    if let Err(e) = wait.retry_after(e).await {
                        let e = timed_out(&wait, e);
                        c.remove_in_time().await;
                        return Err(e);
                    }
                }
            }
            // Our node is gone (session expired or deleted from outside): start over.
            tracing::debug!(%key, "contender node vanished while waiting; re-queueing");
            if Instant::now() >= wait.deadline() {
                return Err(wait.timeout());
            }
        }
    }

    // Confirms that our node still exists under the live session, and moves the lease's
    // deadline to the session's vouched window (never further: the TTL is capped at the
    // session timeout and counts from a leader-proved send time, see `Session::synced`).
    //
    // Always one batched `sync` (`Session::check_in`, shared by every renewal in flight) sent
    // after this call began: it goes through the leader, which is what moves the window. With
    // the deletion watch on our node armed and reliable (see `crate::watch`), that is all: a
    // look at the watch after the sync's reply — a deletion before the member processed it
    // would have been delivered first. Otherwise (no watch yet, a data-change event consumed
    // it, a reconnection since it was armed) one `exists` on the node, which re-arms the watch.
    async fn renew(&self, lease: &mut Lease, ttl: Duration) -> Result<()> {
        let not_held = || Error::not_held(lease.key());
        let session = lease
            .backend_state::<ZkLease>()
            .and_then(|state| self.session_of(state));
        // The check layer accepted `ttl`: within the capabilities, or at least this lease's
        // own TTL — the negotiated session timeout when the server lowered it (`lease_ttl`).
        let (Some(state), Some(session)) = (lease.backend_state::<ZkLease>(), session) else {
            return Err(not_held());
        };
        let (watch, path, czxid) = (state.watch.clone(), state.path.clone(), state.czxid);
        let before = watch.check();
        if let Check::Lost(_) = before {
            return Err(not_held());
        }
        match session.check_in(self.inner.config.op_timeout).await {
            Ok(()) => {}
            Err(e) if session_gone(&e) => return Err(not_held()),
            Err(e) => return Err(to_error("renew", e)),
        }
        match (before, watch.check()) {
            (_, Check::Lost(_)) => return Err(not_held()),
            (Check::Reliable(armed), Check::Reliable(still)) if still == armed => {}
            // Not armed, re-armed or consumed meanwhile: read the node.
            _ => {
                let states = session.client.state_watcher();
                let probe = session.probe();
                match self.call(session.client.check_and_watch_stat(&path)).await {
                    Ok((Some(stat), watcher))
                        if stat.czxid == czxid && stat.ephemeral_owner == session.id =>
                    {
                        session.answered(probe);
                        watch.install(watcher, states);
                    }
                    Ok(_) => {
                        watch.set_lost(LossReason::Revoked);
                        return Err(not_held());
                    }
                    Err(e) if session_gone(&e) => return Err(not_held()),
                    Err(e) => return Err(to_error("renew", e)),
                }
            }
        }
        let ttl = lease_ttl(ttl, &session);
        let base = session.vouched_base();
        // The window only moves forward; a renewal never shortens the lease.
        let mut renewed = lease.clone();
        renewed.renewed(ttl, base);
        if renewed.local_deadline() >= lease.local_deadline() {
            *lease = renewed;
        }
        if !lease.is_locally_valid() {
            // Answered, but not (yet) provably through the leader: e.g. the first sync after a
            // reconnection. Temporary: the next one can prove it.
            return Err(Error::Unavailable {
                backend: BACKEND,
                op: "renew",
                message: "the session cannot be vouched for by the leader right now".into(),
                source: None,
            });
        }
        Ok(())
    }

    async fn release(&self, lease: &Lease) -> Result<bool> {
        let Some(state) = lease.backend_state::<ZkLease>() else {
            return Ok(false);
        };
        let Some(session) = self.session_of(state) else {
            return Ok(false);
        };
        let client = &session.client;
        let mut version = state.version;
        let mut lost_once = false;
        for _ in 0..4 {
            match self.call(client.delete(&state.path, Some(version))).await {
                Ok(()) => {
                    state.watch.set_lost(LossReason::Revoked);
                    return Ok(true);
                }
                // After a lost reply, NoNode most likely means our own delete was applied.
                Err(zk::Error::NoNode) => return Ok(lost_once),
                // The session ended, taking our ephemeral node with it. If a delete of ours went
                // unanswered first, we cannot tell whether it or the session end released it.
                Err(e) if session_gone(&e) && lost_once => {
                    return Err(Error::Indeterminate {
                        backend: BACKEND,
                        op: "release",
                        key: lease.key().as_str().to_owned(),
                        message: format!(
                            "the delete went unanswered and then the session ended ({e}); the node is gone with the session"
                        ),
                    });
                }
                Err(e) if session_gone(&e) => return Ok(false),
                Err(zk::Error::BadVersion) => {
                    // Somebody wrote to our node; it is still ours if it is the same node.
                    match self.call(client.check_stat(&state.path)).await {
                        Ok(Some(stat))
                            if stat.czxid == state.czxid && stat.ephemeral_owner == session.id =>
                        {
                            version = stat.version;
                        }
                        Ok(_) => return Ok(false),
                        Err(e) => return Err(to_error("release", e)),
                    }
                }
                Err(e) if outcome_unknown(&e) => lost_once = true,
                Err(e) => return Err(to_error("release", e)),
            }
        }
        // Unreachable for now (a partition, a lapsed trust window): keep trying in the
        // background, so the node does not block everyone once the session is back.
        spawn_removal(
            session.clone(),
            state.path.clone(),
            state.czxid,
            self.inner.config.op_timeout,
        );
        Err(Error::Unavailable {
            backend: BACKEND,
            op: "release",
            message: "no reply to the delete; it is retried in the background until the node \
                      or the session is gone"
                .into(),
            source: None,
        })
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        let session = self.session().await?;
        let dir = lock_dir(self.inner.config.root(), key);
        let holder = self.holder_node(&session, &dir, "inspect").await?;
        Ok(holder.map(|h| HolderInfo {
            token_digest: h.digest,
            fencing_token: h.fence,
            ttl_remaining: None,
            waiters: Some(h.queued),
            holder: h.identity,
        }))
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        self.force_release_if(key, None).await
    }

    async fn force_release_grant(&self, key: &LockKey, holder: FencingToken) -> Result<bool> {
        self.force_release_if(key, Some(holder)).await
    }

    fn watch_lost(&self, lease: &Lease) -> BoxFuture<'static, LossReason> {
        let Some(state) = lease.backend_state::<ZkLease>() else {
            return Box::pin(std::future::pending());
        };
        let Some(session) = self.session_of(state) else {
            return Box::pin(std::future::ready(LossReason::SessionExpired));
        };
        // The session-level lapse signal: one task watches the vouched instant for every held
        // lock (taken before the check below, so a lapse in between cancels it).
        let lapse = session.lapse_token();
        let (watch, path, czxid) = (state.watch.clone(), state.path.clone(), state.czxid);
        let limit = self.inner.config.op_timeout;
        if session.vouched_until() <= Instant::now() {
            // The session can no longer be vouched for: it may have expired on the server.
            // If it did not, our node must not outlive the loss (see `spawn_removal`).
            spawn_removal(session, path, czxid, limit);
            return Box::pin(std::future::ready(LossReason::DeadlinePassed));
        }
        // A lapse makes the lease lost for good; if the session then survives, the node must go.
        // Its own task: the caller drops this future as soon as its own deadline passes, which
        // is the same instant (the lease counts from the session's vouched base).
        let removal = {
            let (session, watch, path, lapse) =
                (session.clone(), watch.clone(), path.clone(), lapse.clone());
            async move {
                let released = poll_fn(|cx| match watch.poll_changed(cx) {
                    Poll::Ready(Change::Lost(_)) => Poll::Ready(()),
                    Poll::Ready(Change::Unarmed) | Poll::Pending => Poll::Pending,
                });
                tokio::select! {
                    biased;
                    () = session.ended.cancelled() => {}
                    () = released => {}
                    () = lapse.cancelled() => spawn_removal(session.clone(), path, czxid, limit),
                }
            }
        };
        // Outside a runtime nothing could run it (the lapse still shows in the future below).
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            drop(rt.spawn(removal));
        }
        Box::pin(async move {
            let node_gone = async {
                let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
                loop {
                    match poll_fn(|cx| watch.poll_changed(cx)).await {
                        Change::Lost(reason) => return reason,
                        Change::Unarmed => {}
                    }
                    let states = session.client.state_watcher();
                    let probe = session.probe();
                    match call(limit, session.client.check_and_watch_stat(&path)).await {
                        Ok((Some(stat), watcher))
                            if stat.czxid == czxid && stat.ephemeral_owner == session.id =>
                        {
                            session.answered(probe);
                            watch.install(watcher, states);
                        }
                        Ok(_) => {
                            watch.set_lost(LossReason::Revoked);
                            return LossReason::Revoked;
                        }
                        Err(e) if session_gone(&e) => return LossReason::SessionExpired,
                        Err(_) => sleep(backoff.next_delay()).await,
                    }
                }
            };
            tokio::select! {
                biased;
                () = session.ended.cancelled() => LossReason::SessionExpired,
                () = lapse.cancelled() => LossReason::DeadlinePassed,
                reason = node_gone => reason,
            }
        })
    }
}

impl fmt::Debug for ZkLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZkLock")
            .field("config", &self.inner.config)
            .field("session", &self.current().map(|s| zk::SessionId(s.id)))
            .finish_non_exhaustive()
    }
}
