//! Holds the conformance suite on lock-core's in-memory reference backend (`tests/memory.rs`).
//!
//! A crate of its own so that it builds from lock-core and the conformance library alone: the
//! conformance crate's own tests (the drills) depend on every driver, and `scripts/mutants.sh`
//! rebuilds this suite once per lock-core mutant. There is no library code here.
