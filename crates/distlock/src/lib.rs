#![doc = include_str!("../README.md")]
#![deny(missing_docs)]
#![forbid(unsafe_code)]

mod connect;

pub use connect::{Backend, connect, supported_schemes};
/// The core: the [`DistributedLock`] trait, its types, the guard and the in-memory backend.
pub use lock_core::*;
