#![doc = include_str!("../README.md")]
#![deny(missing_docs)]
#![forbid(unsafe_code)]

mod connect;

/// The root README's examples, compiled as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct RootReadme;

pub use connect::{Backend, connect, connect_unobserved, supported_schemes};
/// The driver interface ([`raw::Driver`] and the toolbox drivers share), for writing a driver
/// of your own; see `examples/toy-driver`.
pub use lock_core::raw;
/// The user API, as an explicit list: the [`DistributedLock`] trait and its conveniences, the
/// guard, the types a call names, errors, capabilities, the resource side of fencing, metrics
/// and the in-memory backend. What only a driver author needs is in [`raw`].
pub use lock_core::{
    AuditReport, BoxError, BoxedFuture, Capabilities, DistributedLock, DistributedLockExt, DynLock,
    Error, FencedRegister, FencingGuarantee, FencingToken, Finding, HolderIdentity, HolderInfo,
    InMemoryLock, JobContext, Lease, LockBuilder, LockGuard, LockKey, LockOptions, LossReason,
    Observed, OwnershipToken, Result, Secret, StaleFencingToken, TokenDigest, Verdict, Watchdog,
    drift_margin, finish_background_releases, record_fencing_rejection,
};
/// Leader election over the lock, on every backend that mints fencing tokens: see
/// [`election`].
pub use lock_core::{Election, Leader, Leadership, election};

#[cfg(feature = "etcd")]
pub use lock_etcd::{self as etcd, EtcdLock, EtcdLockConfig};
#[cfg(feature = "pg")]
pub use lock_pg::{self as pg, PgLock, PgLockConfig};
#[cfg(feature = "redis")]
pub use lock_redis::{self as redis, RedisLock, RedisLockConfig};
#[cfg(feature = "zk")]
pub use lock_zk::{self as zk, ZkLock, ZkLockConfig};
