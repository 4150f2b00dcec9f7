//! The conformance suite every distlock backend runs against a real server.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test-support code: a failed expectation is a failed test

mod harness;

pub use harness::{
    Harness, Outcome, TestBackend, backend_url, backends_required, fresh_key, run_property,
};
pub use lock_core::async_trait;
