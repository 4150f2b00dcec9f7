//! `inspect` and `release --force` (and the capability lines `check` prints).

use std::{
    io::{BufRead, IsTerminal},
    time::Duration,
};

use distlock::{Capabilities, DynLock, FencingGuarantee, HolderInfo, LockKey};

use crate::{
    InspectArgs, ReleaseArgs,
    duration::format_duration,
    exit::{self, code_for},
};

fn key_or_exit(key: &str) -> Result<LockKey, u8> {
    LockKey::new(key).map_err(|e| {
        say!("distlock: {e}");
        exit::USAGE
    })
}

/// One line describing a holder, for messages.
pub fn describe_holder(info: &HolderInfo) -> String {
    let mut parts = Vec::new();
    if let Some(holder) = &info.holder {
        parts.push(readable_since(
            &holder.to_string(),
            std::time::SystemTime::now(),
        ));
    }
    if let Some(digest) = info.token_digest {
        parts.push(format!("token {digest}"));
    }
    if let Some(fencing) = info.fencing_token {
        parts.push(format!("fencing token {fencing}"));
    }
    if let Some(ttl) = info.ttl_remaining {
        parts.push(format!("{} left", format_duration(ttl)));
    }
    if let Some(waiters) = info.waiters.filter(|&w| w > 0) {
        parts.push(format!("{waiters} waiting"));
    }
    if parts.is_empty() {
        "an unknown holder".to_owned()
    } else {
        parts.join(", ")
    }
}

/// A holder identity with its `since=EPOCH` (seconds) shown as RFC 3339 UTC and its age:
/// `since=2026-12-08T00:25:54Z (12 s ago)`. Other words are left as they are.
pub fn readable_since(holder: &str, now: std::time::SystemTime) -> String {
    holder
        .split(' ')
        .map(|word| {
            let Some(epoch) = word
                .strip_prefix("since=")
                .and_then(|n| n.parse::<u64>().ok())
            else {
                return word.to_owned();
            };
            let now = now
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            let age = match now.checked_sub(epoch) {
                Some(age) => format!("{} ago", age_text(age)),
                None => format!("{} from now", age_text(epoch - now)),
            };
            format!("since={} ({age})", rfc3339(epoch))
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// `12 s`, `5 min`, `3 h`, `2 d`.
fn age_text(seconds: u64) -> String {
    match seconds {
        s if s < 120 => format!("{s} s"),
        s if s < 7200 => format!("{} min", s / 60),
        s if s < 172_800 => format!("{} h", s / 3600),
        s => format!("{} d", s / 86_400),
    }
}

/// Seconds since the Unix epoch as RFC 3339 UTC (`2026-12-08T00:25:54Z`).
fn rfc3339(epoch: u64) -> String {
    let (days, rest) = (epoch / 86_400, epoch % 86_400);
    // Howard Hinnant's civil_from_days.
    let z = i64::try_from(days).unwrap_or(0) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rest / 3600,
        rest / 60 % 60,
        rest % 60
    )
}

/// `distlock inspect KEY [--json]`.
pub async fn inspect(lock: DynLock, args: InspectArgs) -> u8 {
    let key = match key_or_exit(&args.key) {
        Ok(key) => key,
        Err(code) => return code,
    };
    let holder = match lock.inspect(&key).await {
        Ok(holder) => holder,
        Err(e) => {
            say!("distlock: {e}");
            return code_for(&e);
        }
    };
    if args.json {
        let value = serde_json::json!({
            "key": key.as_str(),
            "backend": lock.backend_name(),
            "held": holder.is_some(),
            "token_digest": holder.as_ref().and_then(|h| h.token_digest).map(|d| d.to_string()),
            "fencing_token": holder.as_ref().and_then(|h| h.fencing_token).map(|f| f.get()),
            "ttl_remaining_ms": holder.as_ref().and_then(|h| h.ttl_remaining).map(|t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX)),
            "waiters": holder.as_ref().and_then(|h| h.waiters),
            "holder": holder.as_ref().and_then(|h| h.holder.as_ref()).map(|h| h.as_str()),
        });
        println!("{value}");
        return if holder.is_some() {
            exit::OK
        } else {
            exit::FAILED
        };
    }
    match holder {
        None => {
            println!("{key}: free");
            return exit::FAILED;
        }
        Some(h) => {
            println!("{key}: held");
            let none = || "-".to_owned();
            println!(
                "  holder token:   {}",
                h.token_digest.map_or_else(none, |d| d.to_string())
            );
            println!(
                "  fencing token:  {}",
                h.fencing_token.map_or_else(none, |f| f.to_string())
            );
            println!(
                "  ttl remaining:  {}",
                h.ttl_remaining.map_or_else(none, format_duration)
            );
            println!(
                "  waiters:        {}",
                h.waiters.map_or_else(none, |w| w.to_string())
            );
            println!(
                "  holder:         {}",
                h.holder.as_ref().map_or_else(none, |h| readable_since(
                    &h.to_string(),
                    std::time::SystemTime::now()
                ))
            );
        }
    }
    exit::OK
}

/// `distlock release --force KEY [--yes]`.
pub async fn release(lock: DynLock, args: ReleaseArgs) -> u8 {
    let key = match key_or_exit(&args.key) {
        Ok(key) => key,
        Err(code) => return code,
    };
    if !lock.capabilities().force_release {
        say!(
            "distlock: the {} backend does not support force_release",
            lock.backend_name()
        );
        return exit::CONFIG;
    }
    let holder = match lock.inspect(&key).await {
        Ok(Some(holder)) => holder,
        Ok(None) => {
            say!("distlock: {key} is not held; nothing released");
            return exit::FAILED;
        }
        Err(e) => {
            say!("distlock: {e}");
            return code_for(&e);
        }
    };
    // Remove exactly the grant shown (its fencing token names it), so a holder that took over
    // while the operator read the warning is left alone. A holder without a token (a foreign
    // client's value) cannot be named, so it is not removed.
    let Some(fence) = holder.fencing_token else {
        say!(
            "distlock: {key} is held by {}, a grant without a fencing token (not distlock's?): \
             release --force removes only a grant it can name; nothing released",
            describe_holder(&holder)
        );
        return exit::FAILED;
    };
    if !args.yes {
        say!("{key} is held by {}", describe_holder(&holder));
        say!(
            "Force-releasing removes that lease now, whatever its holder is doing. If the holder is\n\
             still alive (paused, partitioned, slow), it may keep working — and writing — until it\n\
             notices the loss at its next renewal; only a resource that checks fencing tokens will\n\
             reject its writes (the next holder gets a newer token). Do this only when you know the\n\
             holder is dead or its writes are fenced."
        );
        if !std::io::stdin().is_terminal() {
            say!(
                "distlock: refusing to force-release without confirmation: stdin is not a terminal (pass --yes)"
            );
            return exit::USAGE;
        }
        crate::diag::write(format!("Force-release {key}? [y/N] "));
        crate::diag::flush(std::time::Duration::from_secs(5));
        let mut answer = String::new();
        let confirmed = std::io::stdin().lock().read_line(&mut answer).is_ok()
            && matches!(answer.trim().to_ascii_lowercase().as_str(), "y" | "yes");
        if !confirmed {
            say!("not released");
            return exit::FAILED;
        }
    }
    match lock.force_release_grant(&key, fence).await {
        Ok(true) => {
            println!(
                "released {key} (it was held by {})",
                describe_holder(&holder)
            );
            exit::OK
        }
        Ok(false) => {
            say!(
                "distlock: {key} is no longer held by that grant (released, expired or taken over meanwhile); nothing released"
            );
            exit::FAILED
        }
        Err(e) => {
            say!("distlock: {e}");
            code_for(&e)
        }
    }
}

pub fn describe_capabilities(backend: &str, caps: &Capabilities) -> Vec<String> {
    let flag = |on: bool| if on { "yes" } else { "no" };
    let fencing = match caps.fencing {
        _ if backend == "memory" => "in this process only (memory://)",
        FencingGuarantee::None => "none",
        FencingGuarantee::SingleNode => {
            "single-node (lost if the coordinator loses acknowledged writes)"
        }
        FencingGuarantee::Quorum => "quorum (consensus-backed)",
        _ => "unknown (a newer fencing guarantee)",
    };
    let ttl_limit = |d: Duration| {
        if d.is_zero() {
            "-".to_owned()
        } else {
            format_duration(d)
        }
    };
    vec![
        format!("  fencing tokens:     {fencing}"),
        format!("  server-side TTL:    {}", flag(caps.lease_ttl)),
        format!("  renew:              {}", flag(caps.renew)),
        format!("  session-bound:      {}", flag(caps.session_bound)),
        format!("  waiters notified:   {}", flag(caps.wait_notify)),
        format!("  FIFO queue:         {}", flag(caps.fair_queue)),
        format!("  loss reported:      {}", flag(caps.lost_notify)),
        format!("  force release:      {}", flag(caps.force_release)),
        format!(
            "  ttl min / max / granularity: {} / {} / {}",
            ttl_limit(caps.min_ttl),
            ttl_limit(caps.max_ttl),
            ttl_limit(caps.ttl_granularity)
        ),
    ]
}

#[cfg(test)]
mod since_tests {
    use std::time::{Duration, UNIX_EPOCH};

    use super::*;

    #[test]
    fn since_is_rfc3339_and_an_age() {
        let now = UNIX_EPOCH + Duration::from_secs(1_796_689_702);
        assert_eq!(
            readable_since("host=vm pid=7 since=1796689690 label=a", now),
            "host=vm pid=7 since=2026-12-08T00:28:10Z (12 s ago) label=a"
        );
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(readable_since("host=vm since=x", now), "host=vm since=x");
    }
}
