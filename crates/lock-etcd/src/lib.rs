#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

mod audit;
mod config;
mod error;
mod keys;
mod lock;
mod session;
mod watch;

pub use audit::{audit, namespace_size, purge_namespace};
pub use config::{EtcdLockConfig, EtcdTlsConfig};
pub use lock::{EtcdLock, EtcdRequestCounts};
