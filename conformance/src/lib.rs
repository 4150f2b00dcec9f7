//! The conformance suite every distlock backend runs against a real server.
//!
//! A backend's `tests/conformance.rs` implements [`TestBackend`], writes an
//! `async fn setup() -> Option<Harness>` (using [`backend_url`], which fails the test when
//! `DISTLOCK_REQUIRE_BACKENDS=1` and the server's URL is missing) and calls
//! `conformance::conformance_tests!(setup);`, which expands into one named test per property in
//! [`properties`]. A property is skipped only when the backend does not claim the capability it
//! checks.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test-support code: a failed expectation is a failed test

pub mod drill;
mod harness;
pub mod properties;
pub mod security;
mod url_props;

pub use harness::{
    Harness, Outcome, TestBackend, backend_url, backends_required, fresh_key, run_property,
    run_then_exit,
};
pub use lock_core::async_trait;
pub use url_props::check_url_parser;

/// Expands into one `#[test]` per conformance property, each running on its own multi-threaded
/// tokio runtime against the [`Harness`] returned by `$setup` (an `async fn() -> Option<Harness>`).
#[macro_export]
macro_rules! conformance_tests {
    ($setup:path) => {
        $crate::__conformance_tests!(
            $setup;
            exclusive_try_acquire,
            concurrent_first_acquire_has_one_winner,
            independent_keys,
            release_then_reacquire,
            release_by_stale_token_is_a_no_op,
            renew_extends_the_lease,
            renew_after_expiry_fails_and_does_not_extend_the_new_holder,
            abandoned_lease_becomes_acquirable_after_ttl,
            fencing_tokens_strictly_increase,
            stale_holder_write_is_rejected,
            mutual_exclusion_under_contention,
            acquire_times_out_at_its_deadline,
            waiter_is_woken_promptly_by_release,
            waiters_are_served_in_fifo_order,
            dropped_acquire_leaves_nothing_behind,
            watchdog_keeps_the_lease_alive,
            lost_fires_when_the_lock_is_taken_away,
            lost_fires_at_the_local_deadline_before_anyone_else_is_granted,
            run_exclusive_skips_when_held_and_releases_after,
            dropped_guard_releases_the_lock,
            inspect_reports_the_holder,
            bad_input_is_rejected_before_io,
            capabilities_are_honest,
            force_release_removes_any_holder,
        );
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_tests {
    ($setup:path; $($property:ident),+ $(,)?) => {
        $(
            #[test]
            fn $property() {
                $crate::run_property(stringify!($property), $setup, $crate::properties::$property);
            }
        )+
    };
}
