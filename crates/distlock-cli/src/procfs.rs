//! Who is in a process group, from `/proc` (Linux).

/// Whether process group `pgid` has a live (not zombie) member other than `except`. `true`
/// when `/proc` cannot be read: callers then keep treating the group as alive (the safe side).
pub fn has_live_members(pgid: i32, except: i32) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return true;
    };
    for entry in entries.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if pid == except {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid pgrp …: comm may contain spaces and parentheses.
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let mut fields = rest.split_whitespace();
        let state = fields.next();
        let group = fields.nth(1).and_then(|g| g.parse::<i32>().ok());
        if group == Some(pgid) && !matches!(state, Some("Z" | "X")) {
            return true;
        }
    }
    false
}
