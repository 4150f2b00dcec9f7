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
        parts.push(holder.to_string());
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
                h.holder.as_ref().map_or_else(none, ToString::to_string)
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
