//! `ZkLock`: the Curator-compatible ZooKeeper mutex.

use std::{
    fmt,
    future::{Future, poll_fn},
    sync::{Arc, Mutex, PoisonError},
    task::Poll,
    time::Duration,
};

use futures::{StreamExt, future::BoxFuture, stream::FuturesUnordered};
use lock_core::{
    AcquireWait, Backoff, Capabilities, DistributedLock, Error, FencingGuarantee, FencingToken,
    HolderInfo, Lease, LockKey, LossReason, OwnershipToken, Result, async_trait,
};
use tokio::time::{Instant, sleep, timeout};
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
        Ok(Self {
            inner: Arc::new(Inner {
                config,
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

    fn contender(&self, session: Arc<Session>, key: &LockKey) -> Contender {
        let token = OwnershipToken::generate();
        Contender {
            lock: self.clone(),
            session,
            dir: lock_dir(self.inner.config.root(), key),
            token,
            node: None,
            watch: Arc::new(NodeWatch::new()),
            done: false,
        }
    }
}

/// `fut` bounded by `limit`; running out is reported as [`zk::Error::Timeout`] (outcome unknown).
async fn call<T>(limit: Duration, fut: impl Future<Output = ZkResult<T>>) -> ZkResult<T> {
    timeout(limit, fut).await.unwrap_or(Err(zk::Error::Timeout))
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
    /// Ours is the first contender: we hold the lock (as of a list sent at this instant).
    First(Instant),
    /// Behind these contenders (full paths, in lock order: the holder first, our predecessor
    /// last), as of one listing.
    Behind(Vec<String>),
    /// Our node no longer exists (deleted from outside, or the session expired).
    Gone,
}

/// What waiting in the queue ended with.
enum Waited {
    /// We hold the lock: every contender that was ahead of us is gone, and our node exists
    /// (see [`Contender::wait_behind`]). The lease counts from this instant (a request sent
    /// then was answered on the session).
    Granted(Instant),
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
    done: bool,
}

impl Contender {
    fn path(&self) -> Option<String> {
        self.node.as_ref().map(|(n, _)| format!("{}/{n}", self.dir))
    }

    /// Creates our ephemeral sequential node (and the container parents when missing). After a
    /// ConnectionLoss, looks for our node by its token before creating again.
    async fn create(&mut self, op: &'static str) -> Result<()> {
        let prefix = format!("{}/{}", self.dir, node_prefix(&self.token));
        let acls = self.lock.acls();
        let options = zk::CreateMode::EphemeralSequential.with_acls(acls);
        let mut last = None;
        for _ in 0..CREATE_ATTEMPTS {
            let client = &self.session.client;
            let sent = Instant::now();
            match self.lock.call(client.create(&prefix, &[], &options)).await {
                Ok((stat, seq)) => {
                    self.session.confirm(sent);
                    self.node = Some((format!("{}{seq}", node_prefix(&self.token)), stat));
                    return Ok(());
                }
                Err(zk::Error::NoNode) => {
                    // With acl=creator the lock directories (and a missing root) belong to our
                    // digest identity too: other credentials can neither queue nor look in.
                    let parents = zk::CreateMode::Container.with_acls(self.lock.acls());
                    match self.lock.call(client.mkdir(&self.dir, &parents)).await {
                        Ok(()) => {}
                        Err(e) if outcome_unknown(&e) => last = Some(e),
                        Err(e) => return Err(to_error(op, e)),
                    }
                }
                Err(e) if outcome_unknown(&e) => {
                    // The create may have been applied: find our node by its token.
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
    async fn find(&mut self) -> ZkResult<bool> {
        let marker = protected_marker(&self.token);
        let children = match self
            .lock
            .call(self.session.client.list_children(&self.dir))
            .await
        {
            Ok(c) => c,
            Err(zk::Error::NoNode) => return Ok(false),
            Err(e) => return Err(e),
        };
        let Some(name) = children.into_iter().find(|c| c.starts_with(&marker)) else {
            return Ok(false);
        };
        let path = format!("{}/{name}", self.dir);
        match self
            .lock
            .call(self.session.client.check_stat(&path))
            .await?
        {
            Some(stat) if stat.ephemeral_owner == self.session.id => {
                self.node = Some((name, stat));
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    async fn position(&self, op: &'static str) -> Result<Position> {
        let Some((name, _)) = &self.node else {
            return Ok(Position::Gone);
        };
        let sent = Instant::now();
        let children = match self
            .lock
            .call(self.session.client.list_children(&self.dir))
            .await
        {
            Ok(c) => c,
            Err(zk::Error::NoNode) => return Ok(Position::Gone),
            Err(e) => return Err(to_error(op, e)),
        };
        self.session.confirm(sent);
        let sorted = sorted_contenders(children);
        Ok(match sorted.iter().position(|c| c == name) {
            None => Position::Gone,
            Some(0) => Position::First(sent),
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
        let limit = self.lock.inner.config.op_timeout;
        // Every request is queued on the connection when created, ours first.
        let states = client.state_watcher();
        let sent = Instant::now();
        let arm_own = matches!(self.watch.check(), Check::Unreliable)
            .then(|| client.check_and_watch_stat(&own));
        let arm_ahead: Vec<_> = watched
            .iter()
            .map(|path| client.check_and_watch_stat(path))
            .collect();
        if let Some(arm_own) = arm_own {
            match call(limit, arm_own).await {
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
            match call(limit, arm).await {
                // Already gone.
                Ok((None, _)) => {}
                Ok((Some(_), watcher)) => events.push(watcher.changed()),
                Err(e) => return Err(to_error("acquire", e)),
            }
        }
        session.confirm(sent);
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
        let now = Instant::now();
        if self.session.vouched_until() <= now {
            return Waited::Relist;
        }
        Waited::Granted(self.session.last_confirmed_send().min(now))
    }

    fn into_lease(mut self, key: &LockKey, ttl: Duration, sent: Instant) -> Option<Lease> {
        let (name, stat) = self.node.take()?;
        self.done = true;
        let state = ZkLease {
            session_id: self.session.id,
            path: format!("{}/{name}", self.dir),
            czxid: stat.czxid,
            version: stat.version,
            watch: self.watch.clone(),
        };
        let fencing = u64::try_from(stat.czxid).ok().map(FencingToken);
        Some(Lease::new(key.clone(), self.token, fencing, ttl, sent).with_backend_state(state))
    }

    /// Deletes our node now (in the foreground), leaving a background cleanup if that fails.
    async fn remove(mut self) {
        if let Some(path) = self.path()
            && delete_node(&self.session, &path, self.lock.inner.config.op_timeout)
                .await
                .is_ok()
        {
            self.done = true;
        }
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
        lock_core::cleanup::spawn(async move {
            // Until the session ends (which deletes the node anyway) or the node is gone.
            let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
            while !session.is_ended() {
                let name = match &node {
                    Some(n) => Some(n.clone()),
                    None => match call(limit, session.client.list_children(&dir)).await {
                        Ok(children) => children.into_iter().find(|c| c.starts_with(&marker)),
                        Err(zk::Error::NoNode) => None,
                        Err(_) => {
                            sleep(backoff.next_delay()).await;
                            continue;
                        }
                    },
                };
                let Some(name) = name else { return };
                match delete_node(&session, &format!("{dir}/{name}"), limit).await {
                    Ok(_) => return,
                    Err(_) => sleep(backoff.next_delay()).await,
                }
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
            match self.call(session.client.check_stat(&path)).await {
                Ok(Some(stat)) => {
                    return Ok(Some(HolderNode {
                        digest: path::token_digest_of(first),
                        fence: u64::try_from(stat.czxid).ok().map(FencingToken),
                        queued: sorted.len() - 1,
                        path,
                    }));
                }
                Ok(None) => continue, // released meanwhile: look again
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
    digest: Option<lock_core::TokenDigest>,
    fence: Option<FencingToken>,
    queued: usize,
}

#[async_trait]
impl DistributedLock for ZkLock {
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
            ..Default::default()
        }
    }

    async fn try_acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>> {
        self.capabilities().check_ttl(ttl)?;
        let session = self.session().await?;
        let mut c = self.contender(session, key);
        let sent = Instant::now();
        c.create("try_acquire").await?;
        match c.position("try_acquire").await? {
            Position::First(_) => Ok(c.into_lease(key, ttl, sent)),
            Position::Behind { .. } => {
                c.remove().await;
                Ok(None)
            }
            Position::Gone => Err(Error::Unavailable {
                backend: BACKEND,
                op: "try_acquire",
                message: "our contender node vanished (session expired or deleted)".into(),
                source: None,
            }),
        }
    }

    async fn acquire(&self, key: &LockKey, ttl: Duration, deadline: Instant) -> Result<Lease> {
        self.capabilities().check_ttl(ttl)?;
        // The watch on the predecessor wakes us; the backoff is only a slow safety re-check.
        let backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(5));
        let mut wait = AcquireWait::new(key, deadline, backoff)?;
        loop {
            let session = match self.session().await {
                Ok(s) => s,
                Err(e) => {
                    wait.retry_after(e).await?;
                    continue;
                }
            };
            let mut c = self.contender(session.clone(), key);
            if let Err(e) = c.create("acquire").await {
                drop(c);
                wait.retry_after(e).await?;
                continue;
            }
            loop {
                let step = match c.position("acquire").await {
                    Ok(Position::First(sent)) => {
                        if let Some(lease) = c.into_lease(key, ttl, sent) {
                            return Ok(lease);
                        }
                        break;
                    }
                    Ok(Position::Gone) => break,
                    Ok(Position::Behind(ahead)) => match c.wait_behind(&ahead, &mut wait).await {
                        Ok(Waited::Granted(sent)) => {
                            if let Some(lease) = c.into_lease(key, ttl, sent) {
                                return Ok(lease);
                            }
                            break;
                        }
                        Ok(Waited::Relist) => Ok(()),
                        Err(e) => Err(e),
                    },
                    Err(e) => Err(e),
                };
                if let Err(e) = step {
                    if matches!(e, Error::Timeout { .. }) {
                        c.remove().await;
                        return Err(e);
                    }
                    if session.is_ended() {
                        break;
                    }
                    if let Err(e) = wait.retry_after(e).await {
                        c.remove().await;
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

    // Confirms that our node still exists under the live session.
    //
    // With the deletion watch on our node armed and reliable (see `crate::watch`), that
    // takes no request of its own: one batched read of the session (`Session::check_in`,
    // shared by every renewal in flight) sent after this call began, and a look at the watch
    // after its reply — a deletion before the server processed that read would have been
    // delivered first. Otherwise (no watch yet, a data-change event consumed it, a
    // reconnection since it was armed) one `exists` on the node, which re-arms the watch.
    async fn renew(&self, lease: &mut Lease, ttl: Duration) -> Result<()> {
        self.capabilities().check_ttl(ttl)?;
        let not_held = || Error::not_held(lease.key());
        let Some(state) = lease.backend_state::<ZkLease>() else {
            return Err(not_held());
        };
        let Some(session) = self.session_of(state) else {
            return Err(not_held());
        };
        let (watch, path, czxid) = (state.watch.clone(), state.path.clone(), state.czxid);
        let sent = Instant::now();
        match watch.check() {
            Check::Lost(_) => return Err(not_held()),
            Check::Reliable(armed) => match session.check_in(self.inner.config.op_timeout).await {
                Ok(()) => match watch.check() {
                    Check::Reliable(still) if still == armed => {
                        lease.renewed(ttl, sent);
                        return Ok(());
                    }
                    Check::Lost(_) => return Err(not_held()),
                    // Re-armed or consumed meanwhile: read the node.
                    _ => {}
                },
                Err(e) if session_gone(&e) => return Err(not_held()),
                Err(e) => return Err(to_error("renew", e)),
            },
            Check::Unreliable => {}
        }
        let states = session.client.state_watcher();
        let sent = Instant::now();
        match self.call(session.client.check_and_watch_stat(&path)).await {
            Ok((Some(stat), watcher))
                if stat.czxid == czxid && stat.ephemeral_owner == session.id =>
            {
                session.confirm(sent);
                watch.install(watcher, states);
                lease.renewed(ttl, sent);
                Ok(())
            }
            Ok(_) => {
                watch.set_lost(LossReason::Revoked);
                Err(not_held())
            }
            Err(e) if session_gone(&e) => Err(not_held()),
            Err(e) => Err(to_error("renew", e)),
        }
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
        Err(Error::Unavailable {
            backend: BACKEND,
            op: "release",
            message: "no reply to the delete; the node stays until the session ends".into(),
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
        if session.vouched_until() <= Instant::now() {
            // The session can no longer be vouched for: it may have expired on the server.
            return Box::pin(std::future::ready(LossReason::DeadlinePassed));
        }
        let (watch, path, czxid) = (state.watch.clone(), state.path.clone(), state.czxid);
        let limit = self.inner.config.op_timeout;
        Box::pin(async move {
            let node_gone = async {
                let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
                loop {
                    match poll_fn(|cx| watch.poll_changed(cx)).await {
                        Change::Lost(reason) => return reason,
                        Change::Unarmed => {}
                    }
                    let states = session.client.state_watcher();
                    let sent = Instant::now();
                    match call(limit, session.client.check_and_watch_stat(&path)).await {
                        Ok((Some(stat), watcher))
                            if stat.czxid == czxid && stat.ephemeral_owner == session.id =>
                        {
                            session.confirm(sent);
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
