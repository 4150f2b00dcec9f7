#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

mod audit;
mod config;
mod error;
mod keys;
mod lock;
mod session;
mod watch;

pub use audit::audit;
pub use config::{EtcdLockConfig, EtcdTlsConfig};
pub use lock::{EtcdLock, EtcdRequestCounts};
