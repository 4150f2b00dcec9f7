#![doc = include_str!("../README.md")]
#![allow(clippy::unwrap_used, clippy::expect_used)] // test-support code: a failed expectation is a failed test

pub mod config_errors;
pub mod drill;
mod harness;
pub mod logs;
pub mod properties;
pub mod security;
pub mod servers;
pub mod suite;
mod url_props;

pub use harness::{
    Harness, Outcome, TestBackend, backend_url, backends_required, check_declared_skip, fresh_key,
    run_declared_skip, run_property, run_property_strict, run_then_exit,
};
pub use lock_core::raw::async_trait;
pub use url_props::check_url_parser;

/// Expands into one `#[test]` per conformance property, each running on its own multi-threaded
/// tokio runtime against the [`Harness`] returned by `$setup` (an `async fn() -> Option<Harness>`).
///
/// Declare the properties your backend skips for a missing capability, with the reason:
///
/// ```ignore
/// conformance::conformance_tests!(setup; skip: {
///     waiters_are_served_in_fifo_order: "fair_queue not claimed: waiters race on each release",
/// });
/// ```
///
/// A declared property becomes `#[ignore = "reason"]` (libtest reports it as ignored, with the
/// reason), and `declared_skips::<property>` checks that the backend really lacks the capability
/// (the property must answer "skipped"; one that runs is a stale declaration and fails). Any other
/// property that skips at runtime fails: a skip never shows as `ok`. `skip: {}` declares none.
///
/// `conformance_tests!(setup)` is `skip: {}`: every property must run.
#[macro_export]
macro_rules! conformance_tests {
    ($setup:path) => {
        $crate::conformance_tests!($setup; skip: {});
    };
    ($setup:path; skip: { $($skipped:ident : $why:literal),* $(,)? }) => {
        $crate::__conformance_strict!(($) $setup; { $($skipped : $why),* });
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_strict {
    // `$d` is a `$` token, so that the helper macro defined here can have metavariables of its
    // own: it matches each declared property by name (macro_rules cannot compare identifiers any
    // other way) and makes it an ignored test.
    (($d:tt) $setup:path; { $($skipped:ident : $why:literal),* }) => {
        macro_rules! __distlock_conformance_test {
            $(
                ($d setup_:path, $skipped) => {
                    #[test]
                    #[ignore = $why]
                    fn $skipped() {
                        $crate::run_declared_skip(
                            stringify!($skipped),
                            $d setup_,
                            $crate::properties::$skipped,
                        );
                    }
                };
            )*
            ($d setup_:path, $d property:ident) => {
                #[test]
                fn $d property() {
                    $crate::run_property_strict(
                        stringify!($d property),
                        $d setup_,
                        $crate::properties::$d property,
                    );
                }
            };
        }
        $crate::__conformance_properties!(__distlock_conformance_test, $setup);

        /// Each declared skip is checked: the backend must really lack the capability.
        mod declared_skips {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[test]
                fn $skipped() {
                    $crate::check_declared_skip(
                        stringify!($skipped),
                        $setup,
                        $crate::properties::$skipped,
                    );
                }
            )*
        }
    };
}
