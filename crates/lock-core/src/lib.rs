#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

pub mod audit;
mod backoff;
pub mod batch;
mod capabilities;
pub mod cleanup;
mod error;
mod ext;
pub mod fencing;
mod guard;
pub mod handoff;
mod key;
mod lease;
mod lock;
mod memory;
pub mod observe;
mod options;
mod token;

pub use audit::{AuditReport, Finding, Verdict};
pub use backoff::{AcquireWait, Backoff};
pub use batch::Batcher;
pub use capabilities::{Capabilities, FencingGuarantee};
pub use error::{BoxError, Error, Result};
pub use ext::{BoxedFuture, DistributedLockExt, JobContext, LockBuilder, LockOptions, Watchdog};
pub use fencing::{FencedRegister, StaleFencingToken};
pub use guard::LockGuard;
pub use key::LockKey;
pub use lease::{HolderIdentity, HolderInfo, Lease, drift_margin};
pub use lock::{DistributedLock, DynLock, LossReason, poll_acquire};
pub use memory::InMemoryLock;
pub use observe::{Observed, record_fencing_rejection};
pub use options::{decode_url_credential, parse_duration_option};
pub use token::{FencingToken, OwnershipToken, TokenDigest};

/// Re-exported so drivers implement the trait with the same macro version.
pub use async_trait::async_trait;
