//! One-line messages for `sqlx` errors: PostgreSQL's own message and SQLSTATE without the
//! server's C source line that `sqlx` appends ("… does not exist at line 768"), and for a failed
//! connect the address (never the credentials) first.

use std::{error::Error as StdError, fmt};

use sqlx::postgres::PgConnectOptions;

/// A `sqlx` error with a one-line message; the `sqlx` error stays its source.
#[derive(Debug)]
pub(crate) struct PgError {
    message: String,
    source: sqlx::Error,
}

impl PgError {
    /// A statement's (or the session's) error.
    pub(crate) fn new(source: sqlx::Error) -> Self {
        Self {
            message: one_line(&source),
            source,
        }
    }

    /// No connection to `options`' server could be had.
    pub(crate) fn connecting(options: &PgConnectOptions, source: sqlx::Error) -> Self {
        Self {
            message: format!(
                "cannot connect to {}: {}",
                address(options),
                one_line(&source)
            ),
            source,
        }
    }

    /// No connection to `options`' server could be had, for the reason `cause`.
    pub(crate) fn connecting_because(
        options: &PgConnectOptions,
        cause: &str,
        source: sqlx::Error,
    ) -> Self {
        Self {
            message: format!("cannot connect to {}: {cause}", address(options)),
            source,
        }
    }

    /// The `sqlx` error, to classify.
    pub(crate) fn sqlx(&self) -> &sqlx::Error {
        &self.source
    }
}

impl fmt::Display for PgError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl StdError for PgError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(&self.source)
    }
}

/// `host:port/database`: where the client connects, without user or password.
pub(crate) fn address(options: &PgConnectOptions) -> String {
    let host = options.get_host();
    let host = if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_owned()
    };
    format!(
        "{host}:{}/{}",
        options.get_port(),
        options.get_database().unwrap_or_default()
    )
}

/// The error on one line: a server error as its message and SQLSTATE, an I/O error as itself
/// (not "error communicating with database: …"), anything else as `sqlx` says it; never the
/// server's source line, never a line break.
pub(crate) fn one_line(e: &sqlx::Error) -> String {
    let text = match e {
        sqlx::Error::Database(db) => match db.code() {
            Some(code) => format!("{} (SQLSTATE {code})", db.message()),
            None => db.message().to_owned(),
        },
        sqlx::Error::Io(io) => io.to_string(),
        sqlx::Error::PoolTimedOut => "no connection within connect_timeout".to_owned(),
        other => other.to_string(),
    };
    strip_source_line(&text.split_whitespace().collect::<Vec<_>>().join(" ")).to_owned()
}

/// `text` without a trailing " at line <digits>" (where in PostgreSQL's C sources the error
/// was raised, which `sqlx` appends to the server's message).
pub(crate) fn strip_source_line(text: &str) -> &str {
    match text.rsplit_once(" at line ") {
        Some((head, line)) if !line.is_empty() && line.bytes().all(|b| b.is_ascii_digit()) => head,
        _ => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_server_source_line_is_stripped() {
        assert_eq!(
            strip_source_line("role \"nouser\" does not exist at line 768"),
            "role \"nouser\" does not exist"
        );
        assert_eq!(
            strip_source_line("seen at line 7 of the file"),
            "seen at line 7 of the file"
        );
        assert_eq!(strip_source_line("ends at line "), "ends at line ");
        assert_eq!(strip_source_line("plain"), "plain");
    }

    #[test]
    fn io_errors_are_one_line_without_sqlx_prefix() {
        let e = sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "Connection refused\n(os error 111)",
        ));
        assert_eq!(one_line(&e), "Connection refused (os error 111)");
    }

    #[test]
    fn the_address_has_no_credentials() {
        let options: PgConnectOptions = "postgres://app:hunter2@db.example:6432/jobs"
            .parse()
            .unwrap();
        let e = PgError::connecting(&options, sqlx::Error::PoolTimedOut);
        assert_eq!(
            e.to_string(),
            "cannot connect to db.example:6432/jobs: no connection within connect_timeout"
        );
        let v6 = PgConnectOptions::new().host("::1").port(5).database("d");
        assert_eq!(address(&v6), "[::1]:5/d");
    }
}
