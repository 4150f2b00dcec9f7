#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

mod audit;
mod config;
mod lock;
mod path;
mod session;
mod watch;

pub use audit::{audit, namespace_size, purge_namespace};
pub use config::{ZkAcl, ZkLockConfig};
pub use lock::ZkLock;

/// The backend name used in errors and metric labels.
pub const BACKEND: &str = "zk";
