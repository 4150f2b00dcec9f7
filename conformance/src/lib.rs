//! placeholder while building
