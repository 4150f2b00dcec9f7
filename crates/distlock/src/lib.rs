#![doc = include_str!("../README.md")]
#![deny(missing_docs)]
#![forbid(unsafe_code)]

mod connect;

/// The root README's examples, compiled as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct RootReadme;

pub use connect::{Backend, connect, connect_unobserved, supported_schemes};
/// The core: the [`DistributedLock`] trait, its types, the guard and the in-memory backend.
pub use lock_core::*;

#[cfg(feature = "etcd")]
pub use lock_etcd::{self as etcd, EtcdLock, EtcdLockConfig};
#[cfg(feature = "pg")]
pub use lock_pg::{self as pg, PgLock, PgLockConfig};
#[cfg(feature = "redis")]
pub use lock_redis::{self as redis, RedisLock, RedisLockConfig};
#[cfg(feature = "zk")]
pub use lock_zk::{self as zk, ZkLock, ZkLockConfig};
