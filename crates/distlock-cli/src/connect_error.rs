//! One line for a failed connect: the backend, the address (never the credentials) and the
//! cause, instead of a client library's nested debug output.

use std::{error::Error as _, time::Duration};

use distlock::Error;

/// The message for `error`, returned by connecting to `url`.
pub async fn describe(url: &str, error: &Error) -> String {
    let (backend, op) = match error {
        Error::Unavailable { backend, op, .. } | Error::Backend { backend, op, .. } => {
            (*backend, *op)
        }
        // Input and configuration errors already say what is wrong, without I/O.
        _ => return error.to_string(),
    };
    let hosts = hosts(url);
    let mut cause = root_cause(error);
    if matches!(error, Error::Unavailable { .. })
        && let Some(first) = hosts.first()
        && let Some(tcp) = probe(first).await
    {
        // The client library may not say whether the address refused or did not answer.
        if !cause.to_ascii_lowercase().contains(&tcp) {
            cause = format!("{cause} (TCP to {first}: {tcp})");
        }
    }
    let at = if hosts.is_empty() {
        String::new()
    } else {
        format!(" at {}", hosts.join(","))
    };
    let during = if op == "connect" {
        String::new()
    } else {
        format!(" ({op})")
    };
    let verb = if matches!(error, Error::Backend { .. }) {
        "refused by"
    } else {
        "cannot reach"
    };
    format!("{verb} {backend}{at}{during}: {cause}")
}

/// The innermost error's text, on one line, without PostgreSQL's source-line suffix.
fn root_cause(error: &Error) -> String {
    let message = match error {
        Error::Unavailable { message, .. } | Error::Backend { message, .. } => message.clone(),
        other => other.to_string(),
    };
    let mut deepest: Option<String> = None;
    let mut source = error.source();
    while let Some(e) = source {
        deepest = Some(e.to_string());
        source = e.source();
    }
    let text = deepest
        .filter(|d| !d.is_empty() && d.len() <= message.len())
        .unwrap_or(message);
    let line = text.lines().next().unwrap_or_default().trim();
    // tonic (etcd) appends its error's debug form.
    let line = line.split_once(", source: ").map_or(line, |(head, _)| head);
    // sqlx appends where in the server's sources the error was raised: noise to an operator.
    let line = match line.rsplit_once(" at line ") {
        Some((head, tail)) if tail.chars().all(|c| c.is_ascii_digit()) => head,
        _ => line,
    };
    line.to_owned()
}

/// `host:port` of each address in the URL: no scheme, credentials, path or query.
fn hosts(url: &str) -> Vec<String> {
    let Some((_, rest)) = url.split_once("://") else {
        return Vec::new();
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let authority = authority
        .rsplit_once('@')
        .map_or(authority, |(_, hosts)| hosts);
    authority
        .split(',')
        .filter(|h| !h.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Whether a TCP connection to `host` is refused, times out or opens (within 1 s).
async fn probe(host: &str) -> Option<String> {
    let connect = tokio::net::TcpStream::connect(host);
    match tokio::time::timeout(Duration::from_secs(1), connect).await {
        // It connects: the library's message is the cause.
        Ok(Ok(_)) => None,
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
            Some("connection refused".to_owned())
        }
        Ok(Err(e)) => Some(e.to_string()),
        Err(_) => Some("no answer within 1s".to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_leave_out_credentials_paths_and_options() {
        assert_eq!(
            hosts("postgres://u:secret@127.0.0.1:5432/db?sslmode=require"),
            ["127.0.0.1:5432"]
        );
        assert_eq!(
            hosts("zk://a:1,b:2/chroot?session_timeout=2s"),
            ["a:1", "b:2"]
        );
        assert_eq!(hosts("redis://[::1]:6379/0"), ["[::1]:6379"]);
        assert!(hosts("nonsense").is_empty());
    }
}
