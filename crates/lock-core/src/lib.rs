#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

pub mod audit;
mod backoff;
mod capabilities;
pub mod election;
mod error;
mod ext;
pub mod fencing;
mod guard;
mod key;
mod lease;
mod lock;
mod memory;
pub mod observe;
mod options;
pub mod raw;
mod renewer;
mod secret;
mod token;

pub use audit::{AuditReport, Finding, Verdict};
pub use capabilities::{Capabilities, FencingGuarantee};
pub use election::{Election, Leader, Leadership};
pub use error::{BoxError, Error, Result};
pub use ext::{BoxedFuture, DistributedLockExt, JobContext, LockBuilder, LockOptions, Watchdog};
pub use fencing::{FencedRegister, StaleFencingToken};
pub use guard::LockGuard;
pub use key::LockKey;
pub use lease::{HolderIdentity, HolderInfo, Lease, drift_margin};
pub use lock::{DistributedLock, DynLock, LossReason};
pub use memory::InMemoryLock;
pub use observe::{Observed, record_fencing_rejection};
pub use secret::Secret;
pub use token::{FencingToken, OwnershipToken, TokenDigest};

/// Before a process exits: waits until the background clean-ups this process started — a
/// dropped guard's release, a cancelled `acquire` leaving its wait queue, the undo of an
/// attempt whose outcome was unknown — have finished, or `limit` has passed, so that no lock is
/// left to run out its TTL for a process that is gone. Returns whether none is pending.
pub async fn finish_background_releases(limit: std::time::Duration) -> bool {
    raw::cleanup::finish(limit).await
}
