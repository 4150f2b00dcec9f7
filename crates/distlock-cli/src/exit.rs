//! The exit statuses of `distlock`, documented in `--help` and the README.

use distlock::Error;

/// Success. `run` and `elect` pass the command's own status through instead; `leader`: someone
/// leads.
pub const OK: u8 = 0;
/// `check`: a setting FAILs (with `--strict`: or WARNs) or the self-test failed; `conformance`:
/// a property failed or something was left behind; `release`: nothing was released (declined, free, no longer
/// held by the grant shown, or a grant it cannot name); `inspect`: the lock is free; `leader`:
/// nobody leads.
pub const FAILED: u8 = 1;
/// Usage error: bad arguments, invalid key or duration, no URL, no confirmation possible.
pub const USAGE: u8 = 2;
/// The coordinator is unavailable or failed (could not connect, or an operation failed).
pub const UNAVAILABLE: u8 = 69;
/// `run`: the lock was not acquired (held elsewhere, or `--wait` ran out). Settable with `-E`.
/// `elect`: not elected within `--wait`.
pub const NOT_ACQUIRED: u8 = 75;
/// `run`, `elect`: the lease (leadership) was lost (or could not be renewed in time) while the
/// command ran; the command's process group was terminated.
pub const LOST: u8 = 76;
/// `run`, `elect`: distlock itself failed (its guard process could not start or died); the command, if
/// it was started, was terminated.
pub const INTERNAL: u8 = 70;
/// `run`, `elect`: the lease was lost before the command finished, but the loss was noticed only after
/// it had exited, so it was not terminated: its work may have overlapped another holder's.
pub const LOST_UNTERMINATED: u8 = 79;
/// Configuration error: bad URL, unknown scheme, backend not compiled in, invalid option, an
/// operation the backend does not support, or the coordinator refused the configuration
/// when connecting (wrong password, missing role or database).
pub const CONFIG: u8 = 78;
/// `run`, `elect`: the command exists but could not be executed.
pub const CANNOT_EXECUTE: u8 = 126;
/// `run`, `elect`: the command was not found.
pub const NOT_FOUND: u8 = 127;

/// The text shown at the end of `distlock --help`.
pub const HELP: &str = "\
Exit status:
  0        success (`run`, `elect`: the command's own exit status is passed through;
           `leader`: someone leads)
  1        `check`: a setting FAILs (--strict: or WARNs) or the self-test failed;
           `conformance`: the audit FAILs (without --accept-audit-failures), a property
           failed or something was left behind; `release`:
           nothing released (not confirmed, not held, or held by another grant
           meanwhile); `inspect`: the lock is free; `leader`: nobody leads
  2        usage error (bad arguments, invalid key, election name or duration, no URL)
  69       the coordinator is unavailable or failed (`conformance`: it became
           unreachable during the run; the property it was running is named)
  70       `run`, `elect`: distlock's guard process failed; the command was terminated
  75       `run`: lock not acquired (held elsewhere or --wait ran out); change with -E;
           `elect`: not elected within --wait
  76       `run`, `elect`: the lease (leadership) was lost (or not renewed in time) while the
           command ran; the command's process group was terminated
  78       configuration error (bad URL, unknown scheme, backend not compiled in, bad option,
           or refused by the coordinator: wrong password, missing role or database;
           `elect`: a backend without fencing tokens)
  79       `run`, `elect`: the lease was lost before the command finished, noticed too late
           to terminate it
  126/127  `run`, `elect`: the command could not be executed / was not found
  128+N    `run`, `elect`: the command was killed by signal N (149/150: stopped on a terminal
           it does not own), or distlock was interrupted by signal N (SIGINT, SIGTERM,
           SIGHUP, SIGQUIT) while waiting for the lock; `leader --watch`: ended by signal N
           (141: its output was closed)

The URL comes from --url, --url-file or DISTLOCK_URL (--url shows in ps): memory://NAME (this process only), redis://,
rediss://, redis+sentinel://, redis+cluster://, redlock://, etcd://, etcds://, zk://, postgres://,
postgresql:// (as compiled in); driver options go in the query string.";

/// 128 + the signal's number: `run`'s command was killed by it, or distlock itself was
/// interrupted by it while waiting for the lock.
pub fn signalled(signal: i32) -> u8 {
    u8::try_from(128 + signal).unwrap_or(u8::MAX)
}

/// The exit status for a failed connect: a permanent error there is the coordinator refusing
/// our configuration (wrong password, missing role or database): 78, not 69.
pub fn connect_code(error: &Error) -> u8 {
    match error {
        Error::Backend { .. } => CONFIG,
        _ => code_for(error),
    }
}

/// The exit status for an error outside `run`'s own cases.
pub fn code_for(error: &Error) -> u8 {
    match error {
        Error::InvalidKey { .. } | Error::InvalidTtl { .. } => USAGE,
        Error::Config(_) | Error::Unsupported { .. } => CONFIG,
        _ => UNAVAILABLE,
    }
}

#[cfg(test)]
mod tests {
    /// The help names every URL scheme `distlock::connect` knows, so it cannot fall behind.
    #[test]
    fn the_help_lists_every_url_scheme() {
        for backend in distlock::Backend::ALL {
            for scheme in backend.schemes() {
                let named = [' ', '\n']
                    .iter()
                    .any(|before| super::HELP.contains(&format!("{before}{scheme}://")));
                assert!(named, "{scheme}:// is missing from the help");
            }
        }
    }
}
