//! Facts about this process and machine, read from `/proc` and the process CPU clock.

use std::time::Duration;

use serde::Serialize;

/// Clock ticks per second of `/proc/<pid>/stat` times (`USER_HZ`, fixed at 100 by the Linux ABI
/// on every architecture this runs on).
const USER_HZ: f64 = 100.0;

/// CPU time (user + system) this process has used so far: `CLOCK_PROCESS_CPUTIME_ID`
/// (nanoseconds), or `/proc/self/stat` (10 ms ticks) where that clock cannot be read.
pub fn cpu_time() -> Option<Duration> {
    use nix::time::{ClockId, clock_gettime};
    if let Ok(t) = clock_gettime(ClockId::CLOCK_PROCESS_CPUTIME_ID) {
        return Some(Duration::from(t));
    }
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    parse_cpu_ticks(&stat).map(|ticks| Duration::from_secs_f64(ticks as f64 / USER_HZ))
}

/// `utime + stime` (fields 14 and 15) of a `/proc/<pid>/stat` line. The command name (field 2)
/// may contain spaces and parentheses, so fields are counted after its last `)`.
pub fn parse_cpu_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    // After the name: field 3 (state) is the first; utime is field 14, i.e. index 11 here.
    let utime: u64 = fields.nth(11)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// Resident memory of this process in bytes (`VmRSS` of `/proc/self/status`).
pub fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    parse_vm_rss(&status)
}

/// The `VmRSS:` line of a `/proc/<pid>/status`, in bytes.
pub fn parse_vm_rss(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// What the numbers were measured on.
#[derive(Clone, Debug, Serialize)]
pub struct Machine {
    /// Logical CPUs available to this process.
    pub nproc: usize,
    /// `model name` of the first CPU in `/proc/cpuinfo`.
    pub cpu_model: String,
    /// Kernel release.
    pub kernel: String,
    /// Total memory in GiB.
    pub mem_gib: f64,
    /// `/proc/loadavg` when the run started (the machine is shared: a hint of the noise).
    pub loadavg_at_start: String,
}

impl Machine {
    /// Reads the facts of this machine.
    pub fn detect() -> Self {
        let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
        let cpu_model = read("/proc/cpuinfo")
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split_once(':'))
            .map_or_else(|| "unknown".to_owned(), |(_, v)| v.trim().to_owned());
        let mem_kb: f64 = read("/proc/meminfo")
            .lines()
            .find(|l| l.starts_with("MemTotal:"))
            .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
            .unwrap_or(0.0);
        let load = read("/proc/loadavg");
        Self {
            nproc: std::thread::available_parallelism().map_or(1, usize::from),
            cpu_model,
            kernel: read("/proc/sys/kernel/osrelease").trim().to_owned(),
            mem_gib: (mem_kb / 1024.0 / 1024.0 * 10.0).round() / 10.0,
            loadavg_at_start: load
                .split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" "),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_ticks_skip_a_command_name_with_spaces() {
        let stat = "4242 (tokio (rt) x) S 1 4242 4242 0 -1 4194560 1000 0 0 0 250 37 0 0 20 0 3 0";
        assert_eq!(parse_cpu_ticks(stat), Some(287));
        assert_eq!(parse_cpu_ticks("garbage"), None);
    }

    #[test]
    fn vm_rss_in_bytes() {
        let status = "Name:\tx\nVmPeak:\t  9000 kB\nVmRSS:\t   1234 kB\nThreads:\t3\n";
        assert_eq!(parse_vm_rss(status), Some(1234 * 1024));
        assert_eq!(parse_vm_rss("Name:\tx\n"), None);
    }

    #[test]
    fn this_process_is_readable() {
        assert!(resident_bytes().unwrap() > 0);
        assert!(cpu_time().is_some());
    }
}
