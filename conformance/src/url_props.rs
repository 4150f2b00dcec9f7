//! The property every driver's URL parser must have, shared so each driver checks it the same way.

use std::fmt;

use proptest::{
    prelude::*,
    test_runner::{Config, TestCaseError, TestRunner},
};

/// Checks `parse` over arbitrary text and over URL-shaped input with the given scheme
/// alternatives (a regex fragment such as `"redis|rediss"`) and a password `secretpw`: every input
/// yields a config or `Error::Config` (never a panic or another error kind), and the password never
/// appears in the parsed config's `Debug`. Panics (fails the test) with the minimal failing input.
pub fn check_url_parser<T: fmt::Debug>(
    schemes: &str,
    parse: impl Fn(&str) -> lock_core::Result<T>,
) {
    let shaped = format!(
        "({schemes})://([a-z]{{1,4}}(:secretpw)?@)?(127\\.0\\.0\\.1|localhost|[a-z]{{1,8}}|[0-9a-z.:,\\[\\]]{{0,16}})(:[0-9]{{1,5}})?(,[a-z]{{1,5}}:[0-9]{{1,4}})?(/[a-z0-9%]{{0,6}})?(\\?([a-z_]{{1,12}}=[a-z0-9%./]{{0,6}}&?){{0,3}})?"
    );
    let inputs = prop_oneof!["\\PC{0,60}", shaped.as_str()];
    let mut runner = TestRunner::new(Config::default());
    let result = runner.run(&inputs, |url| match parse(&url) {
        Ok(config) => {
            let shown = format!("{config:?}");
            if shown.contains("secretpw") {
                return Err(TestCaseError::fail(format!(
                    "the password shows in {shown}"
                )));
            }
            Ok(())
        }
        Err(lock_core::Error::Config(_)) => Ok(()),
        Err(other) => Err(TestCaseError::fail(format!("not a Config error: {other}"))),
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}
