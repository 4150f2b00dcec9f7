//! The command of `distlock run` never outlives the lease: whatever happens to distlock (killed,
//! hung up, frozen) or to the lease (lost), the command's whole process group is gone before the
//! coordinator can grant the lock to someone else, and a second `run` never overlaps it.
//! Against Redis (`DISTLOCK_TEST_REDIS_URL`; the guard does not depend on the backend) and the
//! in-memory backend under a pseudo-terminal (`script`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    io::Write,
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    thread,
    time::{Duration, Instant},
};

use nix::{
    sys::signal::{Signal, kill, killpg},
    unistd::Pid,
};

fn distlock(url: &str) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_distlock"));
    command.env("DISTLOCK_URL", url).stdin(Stdio::null());
    command
}

fn redis_url() -> Option<String> {
    conformance::backend_url("DISTLOCK_TEST_REDIS_URL")
}

fn fresh_key(label: &str) -> String {
    format!("distlock-cli-test/{label}/{:016x}", rand::random::<u64>())
}

fn temp_dir(label: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "distlock-cli-{label}-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Waits for `path` (written with a rename, so complete) and returns its trimmed content.
fn wait_for_file(path: &Path, child: &mut Child, within: Duration) -> String {
    let deadline = Instant::now() + within;
    loop {
        if let Ok(text) = std::fs::read_to_string(path) {
            return text.trim().to_owned();
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("distlock exited with {status} before starting its command");
        }
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        thread::sleep(Duration::from_millis(10));
    }
}

/// Whether process `pid` exists and is not a zombie.
fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X")
    })
}

/// Waits until none of `pids` is alive; returns when that was seen.
fn wait_until_dead(pids: &[i32], within: Duration) -> Result<Instant, Vec<i32>> {
    let deadline = Instant::now() + within;
    loop {
        let now = Instant::now();
        let living: Vec<i32> = pids.iter().copied().filter(|&p| alive(p)).collect();
        if living.is_empty() {
            return Ok(now);
        }
        if now > deadline {
            return Err(living);
        }
        thread::sleep(Duration::from_millis(5));
    }
}

fn wait_with_timeout(mut child: Child, within: Duration) -> Output {
    let deadline = Instant::now() + within;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("distlock did not exit within {within:?}");
        }
        thread::sleep(Duration::from_millis(10));
    }
    child.wait_with_output().unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// When the lease on `key` ends at the coordinator at the earliest, from `inspect` (no renewal
/// can come any more).
fn lease_end(url: &str, key: &str) -> Instant {
    let asked = Instant::now();
    let out = distlock(url)
        .args(["inspect", key, "--json"])
        .output()
        .unwrap();
    let value: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(value["held"], true, "{value}");
    asked + Duration::from_millis(value["ttl_remaining_ms"].as_u64().unwrap())
}

/// The holder's command: it and a background grandchild that ignores SIGTERM both append
/// `first` lines to `log` every 20 ms; `pids` gets both pids and the process group.
fn holder_script(dir: &Path) -> String {
    format!(
        "(trap '' TERM; while :; do echo first >> {d}/log; sleep 0.02; done) & \
         echo \"$$ $! $(cut -d' ' -f5 /proc/$$/stat)\" > {d}/pids.tmp; mv {d}/pids.tmp {d}/pids; \
         while :; do echo first >> {d}/log; sleep 0.02; done",
        d = dir.display()
    )
}

fn read_pids(text: &str) -> (i32, i32, i32) {
    let v: Vec<i32> = text
        .split_whitespace()
        .map(|s| s.parse().unwrap())
        .collect();
    (v[0], v[1], v[2])
}

/// No `first` line after the second holder's line: the two never overlapped.
fn assert_no_overlap(log: &Path) {
    let text = std::fs::read_to_string(log).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let second = lines
        .iter()
        .position(|l| *l == "second")
        .unwrap_or_else(|| panic!("the second holder never ran:\n{text}"));
    let after: Vec<&&str> = lines[second..].iter().filter(|l| **l == "first").collect();
    assert!(
        after.is_empty(),
        "the first holder's command wrote {} lines after the second holder started",
        after.len()
    );
    assert!(second > 0, "the first holder's command never wrote");
}

/// distlock gets `signal` while its command runs; the command and its grandchild are gone
/// before the lease ends, and a second `run` waiting for the lock starts only after them.
fn distlock_signalled_mid_run(signal: Signal) {
    let Some(url) = redis_url() else { return };
    let key = fresh_key(&format!("signalled-{signal}"));
    let dir = temp_dir("signalled");
    let mut holder = distlock(&url)
        .args(["run", &key, "--ttl", "3s", "--", "sh", "-c"])
        .arg(holder_script(&dir))
        .stdout(Stdio::null())
        // A file, not a pipe: a surviving grandchild must not keep the test waiting for EOF.
        .stderr(std::fs::File::create(dir.join("stderr")).unwrap())
        .spawn()
        .unwrap();
    let (top, grandchild, group) = read_pids(&wait_for_file(
        &dir.join("pids"),
        &mut holder,
        Duration::from_secs(20),
    ));
    let distlock_pid = Pid::from_raw(i32::try_from(holder.id()).unwrap());
    kill(distlock_pid, signal).unwrap();
    let end = (signal != Signal::SIGHUP).then(|| lease_end(&url, &key));
    let second = distlock(&url)
        .args(["run", &key, "--wait", "20s", "--", "sh", "-c"])
        .arg(format!("echo second >> {}/log", dir.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();

    let gone = wait_until_dead(&[top, grandchild], Duration::from_secs(10));
    let gone = gone.unwrap_or_else(|living| {
        let _ = killpg(Pid::from_raw(group), Signal::SIGKILL);
        let _ = kill(distlock_pid, Signal::SIGKILL);
        panic!("after {signal}, the command's processes {living:?} still run")
    });
    if let Some(end) = end {
        assert!(
            gone < end,
            "after {signal}: the command was still running {:?} after the lease ended",
            gone - end
        );
        eprintln!(
            "after {signal}: the command and its grandchild were gone {:?} before the lease ended",
            end - gone
        );
    }
    let out = wait_with_timeout(second, Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(0), "second run: {}", stderr(&out));
    assert_no_overlap(&dir.join("log"));

    if signal == Signal::SIGSTOP {
        kill(distlock_pid, Signal::SIGCONT).unwrap();
    }
    let out = wait_with_timeout(holder, Duration::from_secs(20));
    let expected = match signal {
        Signal::SIGKILL => None,
        Signal::SIGHUP => Some(128 + 1),
        _ => Some(76),
    };
    let err = std::fs::read_to_string(dir.join("stderr")).unwrap_or_default();
    assert_eq!(out.status.code(), expected, "{signal}: {err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_killed_distlock_leaves_no_command_running_past_the_lease() {
    distlock_signalled_mid_run(Signal::SIGKILL);
}

#[test]
fn a_hung_up_distlock_stops_its_command_before_releasing() {
    distlock_signalled_mid_run(Signal::SIGHUP);
}

#[test]
fn a_frozen_distlock_leaves_no_command_running_past_the_lease() {
    distlock_signalled_mid_run(Signal::SIGSTOP);
}

/// The lease is taken away (force-released) while the command runs; the command's top process
/// exits on SIGTERM, its background child ignores SIGTERM: it is SIGKILLed by the lease's local
/// deadline, before distlock exits with 76.
#[test]
fn a_lost_lease_kills_a_background_child_that_ignores_sigterm() {
    let Some(url) = redis_url() else { return };
    let key = fresh_key("lost-background");
    let dir = temp_dir("lost-background");
    let mut holder = distlock(&url)
        .args([
            "run",
            &key,
            "--ttl",
            "3s",
            "--kill-after",
            "1s",
            "--",
            "sh",
            "-c",
        ])
        .arg(format!(
            "(trap '' TERM; while :; do echo bg >> {d}/log; sleep 0.02; done) & \
             echo $! > {d}/bg.tmp; mv {d}/bg.tmp {d}/bg; wait",
            d = dir.display()
        ))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("stderr")).unwrap())
        .spawn()
        .unwrap();
    let background: i32 = wait_for_file(&dir.join("bg"), &mut holder, Duration::from_secs(20))
        .parse()
        .unwrap();
    let out = distlock(&url)
        .args(["release", "--force", "--yes", &key])
        .output()
        .unwrap();
    // The last renewal was before this, so the local deadline is less than a TTL away.
    let released = Instant::now();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));

    let out = wait_with_timeout(holder, Duration::from_secs(20));
    let exited = Instant::now();
    let survived = alive(background);
    if survived {
        let _ = kill(Pid::from_raw(background), Signal::SIGKILL);
    }
    let err = std::fs::read_to_string(dir.join("stderr")).unwrap_or_default();
    assert!(
        !survived,
        "distlock exited while the background child still ran: {err}"
    );
    assert_eq!(out.status.code(), Some(76), "{err}");
    assert!(
        exited - released < Duration::from_secs(3),
        "the background child outlived the local deadline: {:?} after the release",
        exited - released
    );
    let _ = std::fs::remove_dir_all(&dir);
}

fn script_available() -> bool {
    Command::new("script")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Runs `shell` (a `sh -c` line) under `script`'s pseudo-terminal, typing `input` after 300 ms.
fn under_a_terminal(shell: &str, input: &str, within: Duration) -> (Option<i32>, String) {
    assert!(script_available(), "`script` (util-linux) is needed");
    let mut child = Command::new("script")
        .args(["-qec", shell, "/dev/null"])
        .env_remove("DISTLOCK_URL")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let input = input.to_owned();
    let typist = thread::spawn(move || {
        thread::sleep(Duration::from_millis(300));
        let _ = stdin.write_all(input.as_bytes());
        // Keep the terminal's input open until the run is over.
        thread::sleep(Duration::from_secs(15));
    });
    let out = wait_with_timeout(child, within);
    drop(typist);
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &stderr(&out);
    (out.status.code(), text)
}

/// A command that reads the terminal gets it (it is the terminal's foreground process group for
/// its run), reads what is typed, and releases the lock when done.
#[test]
fn a_command_that_reads_the_terminal_gets_it() {
    let shell = format!(
        "{} --url memory:// run --ttl 3s k -- sh -c 'read x; echo got:$x'",
        env!("CARGO_BIN_EXE_distlock")
    );
    let (code, text) = under_a_terminal(&shell, "hello\n", Duration::from_secs(10));
    assert!(text.contains("got:hello"), "{text}");
    assert_eq!(code, Some(0), "{text}");
}

/// distlock itself runs in the background of a terminal (a job-control shell's `&`): the
/// command cannot get the terminal; reading it stops the command (SIGTTIN), which is reported
/// and terminated instead of holding the lock forever.
#[test]
fn a_command_stopped_by_the_terminal_does_not_hold_the_lock_forever() {
    let shell = format!(
        "sh -c 'set -m; {} --url memory:// run --ttl 3s k -- sh -c \"read x; echo got:\\$x\" & wait $!; echo status:$?'",
        env!("CARGO_BIN_EXE_distlock")
    );
    let (_, text) = under_a_terminal(&shell, "hello\n", Duration::from_secs(10));
    assert!(text.contains("stopped by SIGTTIN"), "{text}");
    assert!(text.contains("status:149"), "{text}");
}
