//! The one error type of distlock.

use std::time::Duration;

/// A boxed source error from a client library.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong with a distributed lock.
///
/// Drivers keep their own private error types and convert into this enum with context
/// (backend name, operation, key). Messages never contain ownership tokens or credentials.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The key was rejected before any I/O.
    #[error("invalid lock key: {reason}")]
    InvalidKey {
        /// Why the key is invalid.
        reason: String,
    },
    /// The TTL was rejected before any I/O (zero, below the backend's minimum, or too large).
    #[error("invalid ttl {ttl:?}: {reason}")]
    InvalidTtl {
        /// The TTL that was asked for.
        ttl: Duration,
        /// Why it is invalid.
        reason: String,
    },
    /// A configuration value (URL, option, table name, …) is invalid.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The backend cannot provide what was asked for; checked before any I/O.
    #[error("the {backend} backend does not support {what}")]
    Unsupported {
        /// Backend name, e.g. `"redis"`.
        backend: &'static str,
        /// What was asked for.
        what: String,
    },
    /// The lease is no longer ours: it expired, was released, or belongs to another owner.
    #[error("lock {key:?} is not held by this owner")]
    NotHeld {
        /// The lock key.
        key: String,
    },
    /// `acquire` did not get the lock before its deadline.
    #[error("timed out after {waited:?} waiting for lock {key:?}")]
    Timeout {
        /// The lock key.
        key: String,
        /// How long the caller waited.
        waited: Duration,
    },
    /// The coordinator could not be reached; nothing was applied. Fail closed.
    #[error("{backend} is unavailable during {op}: {message}")]
    Unavailable {
        /// Backend name.
        backend: &'static str,
        /// The operation, e.g. `"try_acquire"`.
        op: &'static str,
        /// What happened.
        message: String,
        /// The client library's error.
        #[source]
        source: Option<BoxError>,
    },
    /// The request was sent and may or may not have been applied ("outcome unknown").
    ///
    /// The driver has already tried to undo a possible grant with a compare-and-release of the
    /// attempt's own token; the caller must not assume it holds the lock.
    #[error("outcome of {op} on lock {key:?} at {backend} is unknown: {message}")]
    Indeterminate {
        /// Backend name.
        backend: &'static str,
        /// The operation.
        op: &'static str,
        /// The lock key.
        key: String,
        /// What happened.
        message: String,
    },
    /// Any other error reported by the coordinator or the client library.
    #[error("{backend} error during {op}: {message}")]
    Backend {
        /// Backend name.
        backend: &'static str,
        /// The operation.
        op: &'static str,
        /// What happened.
        message: String,
        /// The client library's error.
        #[source]
        source: Option<BoxError>,
    },
}

impl Error {
    /// `true` when retrying the same operation later may succeed (timeouts, unreachable
    /// coordinator, unknown outcome). Input, configuration and ownership errors are permanent.
    pub fn is_temporary(&self) -> bool {
        matches!(
            self,
            Error::Timeout { .. } | Error::Unavailable { .. } | Error::Indeterminate { .. }
        )
    }

    /// Shorthand for [`Error::Unsupported`].
    pub fn unsupported(backend: &'static str, what: impl Into<String>) -> Self {
        Error::Unsupported {
            backend,
            what: what.into(),
        }
    }

    /// Shorthand for [`Error::Unavailable`] with a source error.
    pub fn unavailable(
        backend: &'static str,
        op: &'static str,
        source: impl Into<BoxError>,
    ) -> Self {
        let source = source.into();
        Error::Unavailable {
            backend,
            op,
            message: source.to_string(),
            source: Some(source),
        }
    }

    /// Shorthand for [`Error::Backend`] with a source error.
    pub fn backend(backend: &'static str, op: &'static str, source: impl Into<BoxError>) -> Self {
        let source = source.into();
        Error::Backend {
            backend,
            op,
            message: source.to_string(),
            source: Some(source),
        }
    }

    /// Shorthand for [`Error::NotHeld`].
    pub fn not_held(key: &crate::LockKey) -> Self {
        Error::NotHeld {
            key: key.as_str().to_owned(),
        }
    }

    /// A short, stable name of the variant, for metric labels.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::InvalidKey { .. } => "invalid_key",
            Error::InvalidTtl { .. } => "invalid_ttl",
            Error::Config(_) => "config",
            Error::Unsupported { .. } => "unsupported",
            Error::NotHeld { .. } => "not_held",
            Error::Timeout { .. } => "timeout",
            Error::Unavailable { .. } => "unavailable",
            Error::Indeterminate { .. } => "indeterminate",
            Error::Backend { .. } => "backend",
        }
    }
}
