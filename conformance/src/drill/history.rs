//! A recorder of everything a drill does: operations (invoke, then ok / fail / unknown), losses
//! observed by holders, writes to fenced resources, faults, and the resources' final state.
//!
//! Timestamps are microseconds on the monotonic clock ([`tokio::time::Instant`]) since the
//! history was created, taken under the same lock that assigns the record's sequence number, so
//! `seq` order and time order agree. Operations link their completion to their invocation through
//! `op_id`. Tokens appear only as digests.
//!
//! ```
//! # async fn demo() -> lock_core::Result<()> {
//! use std::{sync::Arc, time::Duration};
//! use conformance::drill::{History, ResourceKind};
//! use lock_core::{DistributedLock, FencedRegister, InMemoryLock, LockKey};
//!
//! let history = History::new("doc_example");
//! let c1 = history.client("c1");
//! let lock = InMemoryLock::new();
//! let key = LockKey::new("orders")?;
//! let register = FencedRegister::new();
//!
//! let op = c1.acquire(&key, Duration::from_secs(1));
//! let lease = lock.try_acquire(&key, Duration::from_secs(1)).await?.expect("free");
//! op.granted(&lease);
//! let fencing = lease.fencing_token().expect("memory mints fencing tokens");
//! let write = c1.write(&lease, "register", "c1#1");
//! match register.write(fencing, "c1#1".to_owned()) {
//!     Ok(()) => write.ok(),
//!     Err(stale) => write.rejected(Some(stale.highest)),
//! }
//! let release = c1.release(&lease);
//! release.released(lock.release(&lease).await?);
//! history.final_state("register", ResourceKind::Register, register.value().into_iter().collect());
//! # Ok(()) }
//! ```

use std::{
    fmt,
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use lock_core::{FencingToken, Lease, LockGuard, LockKey, TokenDigest};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::checker::Violation;

/// What a record is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// An operation was started.
    Invoke,
    /// The operation completed and we know its effect.
    Ok,
    /// The operation failed and had no effect (or was refused: a stale write, an unavailable
    /// coordinator, a timeout).
    Fail,
    /// The operation may or may not have taken effect (reply lost, `Indeterminate`, dropped
    /// mid-way).
    Unknown,
    /// A holder learned that its lease is gone (guard's `lost()` fired, a renewal was refused…).
    Lost,
    /// A holder's watchdog has renewed its lease: `deadline_us` is the local deadline the
    /// holder trusts after its latest successful renewal (measured from that renewal's send
    /// time, so the coordinator keeps the grant at least that long). Recorded whenever the
    /// drill looks at the guard, so it may come later than the renewal itself; the deadline is
    /// a fact about the grant whenever it is recorded.
    Renewed,
    /// A fault began.
    FaultStart,
    /// A fault healed.
    FaultEnd,
    /// A snapshot of a resource's final state, taken after the drill.
    FinalState,
    /// Free text for the reader.
    #[default]
    Note,
}

/// Which operation an invoke / ok / fail / unknown belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    /// `try_acquire` or `acquire`.
    Acquire,
    /// A renewal.
    Renew,
    /// A compare-and-release.
    Release,
    /// A write to a fenced resource.
    Write,
    /// An operator override removing any holder.
    ForceRelease,
}

/// How a resource keeps accepted writes, for the "every acknowledged write is present" check.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResourceKind {
    /// One value, replaced by each accepted write (a [`lock_core::FencedRegister`]): an
    /// acknowledged write is present when it is the final value or was overwritten by a write
    /// with a newer fencing token.
    Register,
    /// Every accepted write is appended: each acknowledged value must be in the final state.
    Log,
}

/// One entry of a history. Fields that do not apply to a kind are `None` (and left out of the
/// JSON).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// Position in the history (0, 1, 2, …): a total order consistent with `at_us`.
    pub seq: u64,
    /// Microseconds since the history started (monotonic clock).
    pub at_us: u64,
    /// What this record is.
    pub kind: Kind,
    /// The operation (invoke / ok / fail / unknown).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub op: Option<Op>,
    /// Links an operation's completion to its invoke.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub op_id: Option<u64>,
    /// Which client (service instance) acted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client: Option<String>,
    /// The lock key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// Ownership token digest: granted (acquire ok) or presented (renew, release, write, lost).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// Fencing token: granted (acquire ok) or presented.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fencing: Option<u64>,
    /// The TTL asked for (acquire, renew).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_ms: Option<u64>,
    /// Renewed: the holder's local deadline after its latest renewal, in microseconds since the
    /// history started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_us: Option<u64>,
    /// Renewed: how many renewals had succeeded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renewals: Option<u64>,
    /// Acquire ok: `true` granted, `false` busy (`try_acquire` returned `None`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub granted: Option<bool>,
    /// Release ok: what the release returned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released: Option<bool>,
    /// Write: the resource written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource: Option<String>,
    /// Write: the value written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// Rejected write: the highest token the resource had accepted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub highest: Option<u64>,
    /// Fail / unknown: the error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Fault start / end: the fault's name ("paused", "blackholed", "killed", …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fault: Option<String>,
    /// Fault start / end: links the end to its start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fault_id: Option<u64>,
    /// Fault: what it hits (a client id, a server name); `None` = everything.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// Final state: how the resource keeps writes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_kind: Option<ResourceKind>,
    /// Final state: the values the resource holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub values: Option<Vec<String>>,
    /// Loss reason, note text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

impl Record {
    /// Milliseconds since the history started.
    pub fn at_ms(&self) -> f64 {
        self.at_us as f64 / 1000.0
    }
}

/// The JSON document a drill leaves behind: its name, its records and what the checker found.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HistoryFile {
    /// The drill's name.
    pub name: String,
    /// Every record, in `seq` order.
    pub records: Vec<Record>,
    /// The checker's verdict (empty: every rule held).
    #[serde(default)]
    pub violations: Vec<Violation>,
}

impl HistoryFile {
    /// Reads a history written by [`History::save`].
    ///
    /// # Errors
    /// When the file cannot be read or is not a history.
    pub fn load(path: &Path) -> std::io::Result<Self> {
        let text = std::fs::read_to_string(path)?;
        serde_json::from_str(&text).map_err(std::io::Error::other)
    }
}

/// Where [`History::save`] put a drill's evidence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SavedFiles {
    /// `target/drill-histories/<drill>.json`.
    pub json: PathBuf,
    /// `target/drill-histories/<drill>.svg`.
    pub svg: PathBuf,
}

struct Inner {
    name: String,
    start: Instant,
    records: Mutex<Vec<Record>>,
    next_op: AtomicU64,
    next_fault: AtomicU64,
}

/// A thread-safe, cheaply cloneable history of one drill.
#[derive(Clone)]
pub struct History {
    inner: Arc<Inner>,
}

impl History {
    /// A new, empty history whose clock starts now. `name` names the files it is saved to (keep
    /// it to letters, digits, `-` and `_`).
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            inner: Arc::new(Inner {
                name: name.into(),
                start: Instant::now(),
                records: Mutex::new(Vec::new()),
                next_op: AtomicU64::new(1),
                next_fault: AtomicU64::new(1),
            }),
        }
    }

    /// The drill's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// When the history started (its time zero).
    pub fn start(&self) -> Instant {
        self.inner.start
    }

    /// Microseconds since the history started.
    pub fn elapsed_us(&self) -> u64 {
        micros(self.inner.start.elapsed())
    }

    /// A recorder for the operations of client `id`.
    pub fn client(&self, id: impl Into<String>) -> ClientRecorder {
        ClientRecorder {
            history: self.clone(),
            id: Arc::from(id.into()),
        }
    }

    /// Records that fault `name` began, hitting `target` (a client id or server name; `None`:
    /// everything). Heal it with [`FaultHandle::heal`]; a handle dropped unhealed leaves the fault open
    /// (the checker reports it).
    pub fn fault(&self, name: &str, target: Option<&str>) -> FaultHandle {
        let id = self.inner.next_fault.fetch_add(1, Ordering::SeqCst);
        self.push(Record {
            kind: Kind::FaultStart,
            fault: Some(name.to_owned()),
            fault_id: Some(id),
            target: target.map(str::to_owned),
            ..Record::default()
        });
        FaultHandle {
            history: self.clone(),
            id,
            name: name.to_owned(),
            target: target.map(str::to_owned),
            healed: false,
        }
    }

    /// Records a fault that is over as soon as it happened (a process killed, a lease
    /// force-expired): its effects play out through TTLs, not through a heal.
    pub fn fault_instant(&self, name: &str, target: Option<&str>) {
        self.fault(name, target).heal();
    }

    /// Records a coordinator-side intervention on `key` that ends its current hold without the
    /// holder (a test hook's force-expire, a session killed from outside). The checker then no
    /// longer expects the hold to be exclusive after this point.
    pub fn expire(&self, key: &LockKey, name: &str) {
        let id = self.inner.next_fault.fetch_add(1, Ordering::SeqCst);
        for kind in [Kind::FaultStart, Kind::FaultEnd] {
            self.push(Record {
                kind,
                key: Some(key.to_string()),
                fault: Some(name.to_owned()),
                fault_id: Some(id),
                ..Record::default()
            });
        }
    }

    /// Records free text for the reader of the history.
    pub fn note(&self, text: impl Into<String>) {
        self.push(Record {
            kind: Kind::Note,
            detail: Some(text.into()),
            ..Record::default()
        });
    }

    /// Records the final state of `resource`, read after the drill.
    pub fn final_state(&self, resource: &str, kind: ResourceKind, values: Vec<String>) {
        self.push(Record {
            kind: Kind::FinalState,
            resource: Some(resource.to_owned()),
            resource_kind: Some(kind),
            values: Some(values),
            ..Record::default()
        });
    }

    /// A copy of every record so far, in order.
    pub fn snapshot(&self) -> Vec<Record> {
        self.records().clone()
    }

    /// The history with the checker's verdict, as saved.
    pub fn to_file(&self, violations: &[Violation]) -> HistoryFile {
        HistoryFile {
            name: self.inner.name.clone(),
            records: self.snapshot(),
            violations: violations.to_vec(),
        }
    }

    /// Writes `<drill>.json` (records and violations) and `<drill>.svg` (the timeline) to
    /// [`histories_dir`].
    ///
    /// # Errors
    /// When the directory or the files cannot be written.
    pub fn save(&self, violations: &[Violation]) -> std::io::Result<SavedFiles> {
        self.save_to(&histories_dir(), violations)
    }

    /// As [`History::save`], into `dir`.
    ///
    /// # Errors
    /// When the directory or the files cannot be written.
    pub fn save_to(&self, dir: &Path, violations: &[Violation]) -> std::io::Result<SavedFiles> {
        std::fs::create_dir_all(dir)?;
        let file = self.to_file(violations);
        let json = dir.join(format!("{}.json", file.name));
        let svg = dir.join(format!("{}.svg", file.name));
        let text = serde_json::to_string_pretty(&file).map_err(std::io::Error::other)?;
        std::fs::write(&json, text)?;
        std::fs::write(&svg, super::timeline::render(&file))?;
        Ok(SavedFiles { json, svg })
    }

    fn records(&self) -> std::sync::MutexGuard<'_, Vec<Record>> {
        self.inner
            .records
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn push(&self, mut record: Record) {
        let mut records = self.records();
        record.seq = records.len() as u64;
        record.at_us = micros(self.inner.start.elapsed());
        records.push(record);
    }

    fn next_op(&self) -> u64 {
        self.inner.next_op.fetch_add(1, Ordering::SeqCst)
    }
}

impl fmt::Debug for History {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("History")
            .field("name", &self.inner.name)
            .field("records", &self.records().len())
            .finish()
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// `target/drill-histories`: under `$CARGO_TARGET_DIR` when set, else the `target/` directory of
/// the workspace that contains `$CARGO_MANIFEST_DIR` (or this crate).
pub fn histories_dir() -> PathBuf {
    target_dir().join("drill-histories")
}

fn target_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("CARGO_TARGET_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    let manifest = std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from);
    // The workspace root is the outermost ancestor with a Cargo.lock (falling back to the first
    // one with a target/ directory).
    let root = manifest
        .ancestors()
        .filter(|dir| dir.join("Cargo.lock").is_file())
        .last()
        .or_else(|| manifest.ancestors().find(|dir| dir.join("target").is_dir()))
        .unwrap_or(&manifest);
    root.join("target")
}

/// Identifies one hold (one grant) in records: its key, token digest and fencing token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hold {
    /// The lock key.
    pub key: LockKey,
    /// The ownership token's digest.
    pub token: TokenDigest,
    /// The fencing token, if the backend mints them.
    pub fencing: Option<FencingToken>,
    /// The TTL of the grant.
    pub ttl: Duration,
}

impl From<&Lease> for Hold {
    fn from(lease: &Lease) -> Self {
        Self {
            key: lease.key().clone(),
            token: lease.token().digest(),
            fencing: lease.fencing_token(),
            ttl: lease.ttl(),
        }
    }
}

impl From<&LockGuard> for Hold {
    fn from(guard: &LockGuard) -> Self {
        Self {
            key: guard.key().clone(),
            token: guard.token_digest(),
            fencing: guard.fencing_token(),
            ttl: guard.ttl(),
        }
    }
}

impl From<&Hold> for Hold {
    fn from(hold: &Hold) -> Self {
        hold.clone()
    }
}

/// Records the operations of one client. Cheap to clone.
#[derive(Clone)]
pub struct ClientRecorder {
    history: History,
    id: Arc<str>,
}

impl ClientRecorder {
    /// The client's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    fn invoke(&self, op: Op, key: &LockKey, fill: impl FnOnce(&mut Record)) -> PendingOp {
        let mut record = Record {
            kind: Kind::Invoke,
            op: Some(op),
            op_id: Some(self.history.next_op()),
            client: Some(self.id.to_string()),
            key: Some(key.to_string()),
            ..Record::default()
        };
        fill(&mut record);
        self.history.push(record.clone());
        PendingOp {
            history: self.history.clone(),
            template: record,
            done: false,
        }
    }

    /// Records the start of an acquisition (`try_acquire` or `acquire`) of `key` for `ttl`.
    pub fn acquire(&self, key: &LockKey, ttl: Duration) -> PendingOp {
        self.invoke(Op::Acquire, key, |r| r.ttl_ms = Some(millis(ttl)))
    }

    /// Records the start of a renewal of `hold` for `ttl`.
    pub fn renew(&self, hold: impl Into<Hold>, ttl: Duration) -> PendingOp {
        let hold = hold.into();
        self.invoke(Op::Renew, &hold.key, |r| {
            fill_hold(r, &hold);
            r.ttl_ms = Some(millis(ttl));
        })
    }

    /// Records that `hold`'s watchdog has renewed it `renewals` times and now trusts it until
    /// `local_deadline` ([`LockGuard::local_deadline`]). The checker extends the grant's
    /// definite lease to that deadline. See [`ClientRecorder::guard_renewed`].
    pub fn renewed(&self, hold: impl Into<Hold>, local_deadline: Instant, renewals: u64) {
        let hold = hold.into();
        let mut record = Record {
            kind: Kind::Renewed,
            client: Some(self.id.to_string()),
            key: Some(hold.key.to_string()),
            deadline_us: Some(micros(
                local_deadline.saturating_duration_since(self.history.start()),
            )),
            renewals: Some(renewals),
            ..Record::default()
        };
        fill_hold(&mut record, &hold);
        self.history.push(record);
    }

    /// [`ClientRecorder::renewed`] from `guard`'s own numbers, when it has renewed at least once
    /// (nothing to record otherwise: the grant's TTL already bounds its definite lease).
    pub fn guard_renewed(&self, guard: &LockGuard) {
        let renewals = guard.renewals();
        if renewals > 0 {
            self.renewed(guard, guard.local_deadline(), renewals);
        }
    }

    /// Records the start of a release of `hold`.
    pub fn release(&self, hold: impl Into<Hold>) -> PendingOp {
        let hold = hold.into();
        self.invoke(Op::Release, &hold.key, |r| fill_hold(r, &hold))
    }

    /// Records the start of a write of `value` to `resource` with `hold`'s tokens.
    pub fn write(
        &self,
        hold: impl Into<Hold>,
        resource: &str,
        value: impl Into<String>,
    ) -> PendingOp {
        let hold = hold.into();
        self.invoke(Op::Write, &hold.key, |r| {
            fill_hold(r, &hold);
            r.resource = Some(resource.to_owned());
            r.value = Some(value.into());
        })
    }

    /// Records the start of an operator's `force_release` of `key`.
    pub fn force_release(&self, key: &LockKey) -> PendingOp {
        self.invoke(Op::ForceRelease, key, |_| {})
    }

    /// Records that this client learned `hold` is lost, and why.
    pub fn lost(&self, hold: impl Into<Hold>, reason: impl fmt::Display) {
        let hold = hold.into();
        let mut record = Record {
            kind: Kind::Lost,
            client: Some(self.id.to_string()),
            key: Some(hold.key.to_string()),
            detail: Some(reason.to_string()),
            ..Record::default()
        };
        fill_hold(&mut record, &hold);
        self.history.push(record);
    }
}

impl fmt::Debug for ClientRecorder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientRecorder")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn fill_hold(record: &mut Record, hold: &Hold) {
    record.token = Some(hold.token.to_string());
    record.fencing = hold.fencing.map(FencingToken::get);
}

/// An invoked operation waiting for its outcome. Complete it with one of its methods; dropping it
/// uncompleted records [`Kind::Unknown`] (a cancelled operation may have taken effect).
#[must_use = "record the operation's outcome"]
pub struct PendingOp {
    history: History,
    template: Record,
    done: bool,
}

impl PendingOp {
    fn complete(mut self, kind: Kind, fill: impl FnOnce(&mut Record)) {
        self.done = true;
        let mut record = Record {
            kind,
            op: self.template.op,
            op_id: self.template.op_id,
            client: self.template.client.take(),
            key: self.template.key.take(),
            token: self.template.token.take(),
            fencing: self.template.fencing,
            resource: self.template.resource.take(),
            ..Record::default()
        };
        fill(&mut record);
        self.history.push(record);
    }

    /// Acquire: granted `hold` (a `&Lease`, a `&LockGuard` or a [`Hold`]).
    pub fn granted(self, hold: impl Into<Hold>) {
        let hold = hold.into();
        self.complete(Kind::Ok, |r| {
            fill_hold(r, &hold);
            r.ttl_ms = Some(millis(hold.ttl));
            r.granted = Some(true);
        });
    }

    /// Acquire: somebody else holds the key (`try_acquire` returned `None`).
    pub fn busy(self) {
        self.complete(Kind::Ok, |r| r.granted = Some(false));
    }

    /// Release: what it returned.
    pub fn released(self, released: bool) {
        self.complete(Kind::Ok, |r| r.released = Some(released));
    }

    /// Renew, force-release: done. Write: accepted by the resource.
    pub fn ok(self) {
        let ttl = self.template.ttl_ms;
        self.complete(Kind::Ok, |r| r.ttl_ms = ttl);
    }

    /// Write: rejected by the resource as stale (`highest`: the newest token it had accepted).
    pub fn rejected(self, highest: Option<FencingToken>) {
        self.complete(Kind::Fail, |r| {
            r.highest = highest.map(FencingToken::get);
            r.error = Some("stale fencing token".to_owned());
        });
    }

    /// Failed without effect.
    pub fn fail(self, error: impl fmt::Display) {
        self.complete(Kind::Fail, |r| r.error = Some(error.to_string()));
    }

    /// May or may not have taken effect.
    pub fn unknown(self, error: impl fmt::Display) {
        self.complete(Kind::Unknown, |r| r.error = Some(error.to_string()));
    }

    /// Records a lock error: [`lock_core::Error::Indeterminate`] as unknown, anything else as a
    /// failure without effect.
    pub fn error(self, error: &lock_core::Error) {
        if matches!(error, lock_core::Error::Indeterminate { .. }) {
            self.unknown(error);
        } else {
            self.fail(error);
        }
    }
}

impl Drop for PendingOp {
    fn drop(&mut self) {
        if !self.done {
            self.done = true;
            let mut record = self.template.clone();
            record.kind = Kind::Unknown;
            record.value = None;
            record.ttl_ms = None;
            record.error = Some("dropped before its outcome was known".to_owned());
            self.history.push(record);
        }
    }
}

impl fmt::Debug for PendingOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PendingOp")
            .field("op", &self.template.op)
            .field("op_id", &self.template.op_id)
            .field("client", &self.template.client)
            .finish_non_exhaustive()
    }
}

/// A fault in progress; [`FaultHandle::heal`] records its end.
#[must_use = "heal the fault so the checker knows when liveness is due"]
pub struct FaultHandle {
    history: History,
    id: u64,
    name: String,
    target: Option<String>,
    healed: bool,
}

impl FaultHandle {
    /// Records that the fault healed.
    pub fn heal(mut self) {
        self.healed = true;
        self.history.push(Record {
            kind: Kind::FaultEnd,
            fault: Some(self.name.clone()),
            fault_id: Some(self.id),
            target: self.target.clone(),
            ..Record::default()
        });
    }
}

impl fmt::Debug for FaultHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultHandle")
            .field("name", &self.name)
            .field("target", &self.target)
            .field("healed", &self.healed)
            .finish()
    }
}
