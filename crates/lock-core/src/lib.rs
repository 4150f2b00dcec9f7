#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

pub mod audit;
mod backoff;
mod capabilities;
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
mod token;

pub use audit::{AuditReport, Finding, Verdict};
pub use capabilities::{Capabilities, FencingGuarantee};
pub use error::{BoxError, Error, Result};
pub use ext::{BoxedFuture, DistributedLockExt, JobContext, LockBuilder, LockOptions, Watchdog};
pub use fencing::{FencedRegister, StaleFencingToken};
pub use guard::LockGuard;
pub use key::LockKey;
pub use lease::{HolderIdentity, HolderInfo, Lease, drift_margin};
pub use lock::{DistributedLock, DynLock, LossReason};
pub use memory::InMemoryLock;
pub use observe::{Observed, record_fencing_rejection};
pub use token::{FencingToken, OwnershipToken, TokenDigest};
