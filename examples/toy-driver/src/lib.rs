#![doc = include_str!("../README.md")]
#![deny(missing_docs)]
#![forbid(unsafe_code)]

use std::{
    collections::{BTreeMap, HashMap},
    fmt,
    path::{Path, PathBuf},
    sync::{Arc, LazyLock, Mutex, PoisonError},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use lock_core::raw::{
    Capabilities, Driver, Error, FencingGuarantee, FencingToken, HolderIdentity, HolderInfo, Lease,
    LockKey, OwnershipToken, Result, async_trait,
};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

const BACKEND: &str = "toy";

/// The whole store: one JSON file.
#[derive(Debug, Default, Serialize, Deserialize)]
struct State {
    keys: BTreeMap<String, Entry>,
}

/// One key: its fence counter (kept after release: fences never repeat) and its holder.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Entry {
    fence: u64,
    holder: Option<Holder>,
}

#[derive(Debug, Serialize, Deserialize)]
struct Holder {
    owner: String,
    fence: u64,
    /// Wall-clock expiry, in ms since the epoch: the store's own notion of the lease's end.
    expires_ms: u64,
    identity: String,
}

impl Holder {
    fn live(&self, now_ms: u64) -> bool {
        self.expires_ms > now_ms
    }
}

/// One lock per store file in this process: every read-modify-write of a file happens under it,
/// so operations are atomic (a toy: another process writing the same file is not excluded).
static FILE_LOCKS: LazyLock<Mutex<HashMap<PathBuf, Arc<Mutex<()>>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn ttl_ms(ttl: Duration) -> u64 {
    u64::try_from(ttl.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX)
}

/// A toy lock backend: leases in one JSON file, written atomically (temporary file + rename)
/// under a process-wide mutex. Every operation finishes in one poll (the file I/O is small and
/// synchronous), so dropping a future can never leave half an operation behind.
#[derive(Clone)]
pub struct ToyLock {
    path: PathBuf,
    guard: Arc<Mutex<()>>,
    identity: HolderIdentity,
}

impl fmt::Debug for ToyLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ToyLock")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl ToyLock {
    /// A client of the store file at `path` (created on first write).
    ///
    /// # Errors
    /// [`Error::Config`] when the holder identity cannot be built.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let guard = FILE_LOCKS
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(path.clone())
            .or_default()
            .clone();
        Ok(Self {
            path,
            guard,
            identity: HolderIdentity::process(None)?,
        })
    }

    /// Runs `f` on the store's state under the file's lock, writing it back when `f` says so.
    fn with_state<T>(
        &self,
        op: &'static str,
        f: impl FnOnce(&mut State) -> (T, bool),
    ) -> Result<T> {
        let _held = self.guard.lock().unwrap_or_else(PoisonError::into_inner);
        let mut state = match std::fs::read(&self.path) {
            Ok(bytes) => {
                serde_json::from_slice(&bytes).map_err(|e| Error::backend(BACKEND, op, e))?
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => State::default(),
            Err(e) => return Err(Error::unavailable(BACKEND, op, e)),
        };
        let (out, changed) = f(&mut state);
        if changed {
            let bytes = serde_json::to_vec(&state).map_err(|e| Error::backend(BACKEND, op, e))?;
            let tmp = self.path.with_extension("tmp");
            std::fs::write(&tmp, bytes).map_err(|e| Error::unavailable(BACKEND, op, e))?;
            std::fs::rename(&tmp, &self.path).map_err(|e| Error::unavailable(BACKEND, op, e))?;
        }
        Ok(out)
    }

    /// Test support: the store ends `key`'s lease now, as if its TTL had run out (the holder
    /// is not told).
    ///
    /// # Errors
    /// When the store file cannot be read or written.
    pub fn expire_now(&self, key: &LockKey) -> Result<()> {
        self.with_state("expire", |state| {
            let changed = match state
                .keys
                .get_mut(key.as_str())
                .and_then(|e| e.holder.as_mut())
            {
                Some(holder) => {
                    holder.expires_ms = 0;
                    true
                }
                None => false,
            };
            ((), changed)
        })
    }

    /// Test support: sets `key`'s fence counter, so the next grant gets `value + 1`.
    ///
    /// # Errors
    /// When the store file cannot be read or written.
    pub fn set_fence_counter(&self, key: &LockKey, value: u64) -> Result<()> {
        self.with_state("set_fence", |state| {
            state.keys.entry(key.as_str().to_owned()).or_default().fence = value;
            ((), true)
        })
    }
}

#[async_trait]
impl Driver for ToyLock {
    fn backend_name(&self) -> &'static str {
        BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            lease_ttl: true,
            renew: true,
            fencing: FencingGuarantee::SingleNode,
            // Loss shows through renewals only (the default `watch_lost` never completes).
            lost_notify: true,
            force_release: true,
            // A renewal sets the expiry to now + any TTL; a lease nobody renews expires in the
            // store by its own time, so job mode's `at_least` holds without this process.
            keep_until: true,
            min_ttl: Duration::from_millis(50),
            ..Default::default()
        }
    }

    async fn try_acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>> {
        // The lease counts from before the store's clock is read, so its local deadline is
        // never later than the store's expiry.
        let sent_at = Instant::now();
        let token = OwnershipToken::generate();
        let identity = self.identity.as_str().to_owned();
        let fence = self.with_state("try_acquire", |state| {
            let now = now_ms();
            let entry = state.keys.entry(key.as_str().to_owned()).or_default();
            if entry.holder.as_ref().is_some_and(|h| h.live(now)) {
                return (Ok(None), false);
            }
            let Some(fence) = entry.fence.checked_add(1).filter(|&f| f <= i64::MAX as u64) else {
                return (
                    Err(Error::backend(
                        BACKEND,
                        "try_acquire",
                        "the fence counter is exhausted",
                    )),
                    false,
                );
            };
            entry.fence = fence;
            entry.holder = Some(Holder {
                owner: token.expose_hex(),
                fence,
                expires_ms: now.saturating_add(ttl_ms(ttl)),
                identity,
            });
            (Ok(Some(fence)), true)
        })??;
        Ok(fence
            .map(|fence| Lease::new(key.clone(), token, Some(FencingToken(fence)), ttl, sent_at)))
    }

    async fn renew(&self, lease: &mut Lease, ttl: Duration) -> Result<()> {
        let sent_at = Instant::now();
        let owner = lease.token().expose_hex();
        let key = lease.key().clone();
        let renewed = self.with_state("renew", |state| {
            let now = now_ms();
            match state
                .keys
                .get_mut(key.as_str())
                .and_then(|e| e.holder.as_mut())
            {
                Some(h) if h.owner == owner && h.live(now) => {
                    h.expires_ms = now.saturating_add(ttl_ms(ttl));
                    (true, true)
                }
                _ => (false, false),
            }
        })?;
        if !renewed {
            return Err(Error::not_held(&key));
        }
        lease.renewed(ttl, sent_at);
        Ok(())
    }

    async fn release(&self, lease: &Lease) -> Result<bool> {
        let owner = lease.token().expose_hex();
        self.with_state("release", |state| {
            let now = now_ms();
            match state.keys.get_mut(lease.key().as_str()) {
                Some(entry) if entry.holder.as_ref().is_some_and(|h| h.owner == owner) => {
                    let live = entry.holder.as_ref().is_some_and(|h| h.live(now));
                    entry.holder = None;
                    (live, true)
                }
                _ => (false, false),
            }
        })
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        self.with_state("inspect", |state| {
            let now = now_ms();
            let info = state
                .keys
                .get(key.as_str())
                .and_then(|e| e.holder.as_ref())
                .filter(|h| h.live(now))
                .map(|h| HolderInfo {
                    token_digest: OwnershipToken::from_hex(&h.owner).ok().map(|t| t.digest()),
                    fencing_token: Some(FencingToken(h.fence)),
                    ttl_remaining: Some(Duration::from_millis(h.expires_ms - now)),
                    waiters: None,
                    holder: HolderIdentity::from_stored(h.identity.as_bytes()),
                });
            (info, false)
        })
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        self.with_state("force_release", |state| {
            let now = now_ms();
            match state.keys.get_mut(key.as_str()) {
                Some(entry) if entry.holder.as_ref().is_some_and(|h| h.live(now)) => {
                    entry.holder = None;
                    (true, true)
                }
                _ => (false, false),
            }
        })
    }

    async fn force_release_grant(&self, key: &LockKey, holder: FencingToken) -> Result<bool> {
        self.with_state("force_release", |state| {
            let now = now_ms();
            match state.keys.get_mut(key.as_str()) {
                Some(entry)
                    if entry
                        .holder
                        .as_ref()
                        .is_some_and(|h| h.live(now) && h.fence == holder.get()) =>
                {
                    entry.holder = None;
                    (true, true)
                }
                _ => (false, false),
            }
        })
    }
}
