//! The clock `distlock run` and its guard process share: `CLOCK_BOOTTIME`, which also counts
//! time the machine spent suspended, so a deadline passed between processes as a number can only
//! come early, never late.

use std::time::Duration;

use nix::time::{ClockId, clock_gettime};

/// Now, in nanoseconds of `CLOCK_BOOTTIME`. Should the clock be unreadable (it cannot on
/// Linux), `i64::MAX`: every deadline then counts as passed, which is the safe side.
pub fn now_ns() -> i64 {
    clock_gettime(ClockId::CLOCK_BOOTTIME)
        .ok()
        .and_then(|t| {
            t.tv_sec()
                .checked_mul(1_000_000_000)
                .and_then(|s| s.checked_add(t.tv_nsec()))
        })
        .unwrap_or(i64::MAX)
}

/// `deadline` (a tokio instant) as `CLOCK_BOOTTIME` nanoseconds, rounded towards earlier.
pub fn deadline_ns(deadline: tokio::time::Instant) -> i64 {
    // Read the boot clock first: the instant read after it is later, so the remaining time
    // computed from it is shorter and the converted deadline earlier, never later.
    let boot = now_ns();
    let now = tokio::time::Instant::now();
    let remaining = deadline.saturating_duration_since(now);
    if remaining.is_zero() {
        let overdue = now.saturating_duration_since(deadline);
        boot.saturating_sub(nanos(overdue))
    } else {
        boot.saturating_add(nanos(remaining))
    }
}

fn nanos(d: Duration) -> i64 {
    i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)
}
