//! The conformance properties as a runtime table, for runners outside `cargo test` (`distlock
//! conformance --url URL` runs them against a user's own coordinator).
//!
//! Generated from the same list [`crate::conformance_tests!`] expands
//! (`__conformance_properties!`), so there is still one list: a property registered there is
//! here too.

use std::{
    panic::AssertUnwindSafe,
    time::{Duration, Instant},
};

use futures::{FutureExt, future::BoxFuture};

use crate::{Harness, Outcome};

/// One property: its name (a sentence in snake case) and how to run it.
#[derive(Clone, Copy)]
pub struct Property {
    /// E.g. `fencing_tokens_strictly_increase`.
    pub name: &'static str,
    /// Runs the property against a harness.
    pub run: fn(Harness) -> BoxFuture<'static, Outcome>,
}

impl std::fmt::Debug for Property {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Property")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

macro_rules! __distlock_push_property {
    ($list:path, $property:ident) => {
        $list.push(Property {
            name: stringify!($property),
            run: |h| Box::pin($crate::properties::$property(h)),
        });
    };
}

/// Every registered property, in the suite's order.
// One push per property is what the shared list macro expands to.
#[allow(clippy::vec_init_then_push)]
pub fn properties() -> Vec<Property> {
    let mut list: Vec<Property> = Vec::new();
    crate::__conformance_properties!(__distlock_push_property, list);
    list
}

/// How one property ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Every assertion held.
    Passed,
    /// The backend does not claim the capability it checks.
    Skipped(String),
    /// An assertion failed (the panic's message) or it ran past its time limit.
    Failed(String),
}

/// One property's result.
#[derive(Clone, Debug)]
pub struct Report {
    /// The property.
    pub name: &'static str,
    /// How it ended.
    pub verdict: Verdict,
    /// How long it ran.
    pub took: Duration,
}

/// Runs `property` against `harness` on the current runtime, turning a panic (a failed
/// assertion) into [`Verdict::Failed`] with its message, and giving up after `limit`.
pub async fn run(property: Property, harness: Harness, limit: Duration) -> Report {
    let started = Instant::now();
    let future = AssertUnwindSafe((property.run)(harness)).catch_unwind();
    let verdict = match tokio::time::timeout(limit, future).await {
        Ok(Ok(Outcome::Passed)) => Verdict::Passed,
        Ok(Ok(Outcome::Skipped(why))) => Verdict::Skipped(why.to_owned()),
        Ok(Err(panic)) => Verdict::Failed(panic_message(panic.as_ref())),
        Err(_) => Verdict::Failed(format!("did not finish within {limit:?}")),
    };
    Report {
        name: property.name,
        verdict,
        took: started.elapsed(),
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else {
        "panicked".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_lists_every_property_once() {
        let names: Vec<&str> = properties().iter().map(|p| p.name).collect();
        assert!(names.contains(&"fencing_tokens_strictly_increase"));
        assert!(names.contains(&"exclusive_try_acquire"));
        let mut unique = names.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), names.len(), "{names:?}");
    }
}
