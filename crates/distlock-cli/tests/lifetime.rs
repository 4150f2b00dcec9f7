//! The command of `distlock run` never outlives the lease: whatever happens to distlock (killed,
//! hung up, frozen) or to the lease (lost), the command's whole process group is gone before the
//! coordinator can grant the lock to someone else, and a second `run` never overlaps it.
//! Against every coordinator whose test URL is set (`DISTLOCK_TEST_{REDIS,ETCD,ZK,PG}_URL`), in
//! parallel, and the in-memory backend under a pseudo-terminal (`script`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::{
    io::Write,
    path::Path,
    process::{Child, Command, Output, Stdio},
    thread,
    time::{Duration, Instant, SystemTime},
};
use support::{Tally, backends, fresh_key, on_every_backend, temp_dir};

use distlock::Backend;
use nix::{
    sys::signal::{Signal, kill, killpg},
    unistd::Pid,
};

fn distlock(url: &str) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_distlock"));
    command.env("DISTLOCK_URL", url).stdin(Stdio::null());
    command
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
            // What it said so far, for whoever investigates (its stderr may be a pipe).
            let said = child
                .wait_with_output()
                .map(|out| String::from_utf8_lossy(&out.stderr).into_owned())
                .unwrap_or_default();
            panic!("distlock did not exit within {within:?}; its stderr: {said}");
        }
        thread::sleep(Duration::from_millis(10));
    }
    child.wait_with_output().unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// When the lease on `key` ends at the coordinator at the earliest (no renewal can come any
/// more), by the coordinator's own view. Redis and PostgreSQL tell the key's or row's expiry to
/// the millisecond through `inspect`. etcd rounds its lease TTL to whole seconds and ZooKeeper
/// says nothing of a session's expiry, so there the end is watched as it happens: an in-process
/// client reads the key every 5 ms until the coordinator has removed it (the lease expired, the
/// session timed out); the last read that still saw it held was sent before the end, so its
/// send time is a lower bound of the end, within one read.
fn lease_end(backend: Backend, url: &str, key: &str) -> Option<SystemTime> {
    if matches!(backend, Backend::Etcd | Backend::ZooKeeper) {
        return Some(observed_end(url, key));
    }
    if !matches!(backend, Backend::Redis | Backend::Postgres) {
        return None;
    }
    let asked = SystemTime::now();
    let out = distlock(url)
        .args(["inspect", key, "--json"])
        .output()
        .unwrap();
    let value: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(value["held"], true, "{value}");
    Some(asked + Duration::from_millis(value["ttl_remaining_ms"].as_u64().unwrap()))
}

/// See [`lease_end`]: the send time of the last read that saw `key` held, reading until it is
/// free (at most 30 s).
fn observed_end(url: &str, key: &str) -> SystemTime {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let lock = distlock::connect(url).await.unwrap();
        let key = distlock::LockKey::new(key).unwrap();
        let give_up = Instant::now() + Duration::from_secs(30);
        let mut last_held = None;
        loop {
            let sent = SystemTime::now();
            match lock.inspect(&key).await {
                Ok(Some(_)) => last_held = Some(sent),
                Ok(None) => return last_held.expect("the lease had ended before it was watched"),
                Err(e) => panic!("inspect {key}: {e}"),
            }
            assert!(Instant::now() < give_up, "{key} stayed held for 30 s");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
}

/// The holder's command: it and a background grandchild that ignores SIGTERM both append
/// `first` lines to `log` and to `first` (whose modification time is then their last write)
/// every 20 ms; `pids` gets both pids and the process group.
fn holder_script(dir: &Path) -> String {
    format!(
        "w() {{ echo first >> {d}/log; echo >> {d}/first; }}; \
         (trap '' TERM; while :; do w; sleep 0.02; done) & \
         echo \"$$ $! $(cut -d' ' -f5 /proc/$$/stat)\" > {d}/pids.tmp; mv {d}/pids.tmp {d}/pids; \
         while :; do w; sleep 0.02; done",
        d = dir.display()
    )
}

fn modified(path: &Path) -> SystemTime {
    std::fs::metadata(path).unwrap().modified().unwrap()
}

fn read_pids(text: &str) -> (i32, i32, i32) {
    let v: Vec<i32> = text
        .split_whitespace()
        .map(|s| s.parse().unwrap())
        .collect();
    (v[0], v[1], v[2])
}

/// No `first` line after the second holder's line: the two never overlapped.
fn assert_no_overlap(backend: Backend, log: &Path) {
    let text = std::fs::read_to_string(log).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let second = lines
        .iter()
        .position(|l| *l == "second")
        .unwrap_or_else(|| panic!("{backend}: the second holder never ran:\n{text}"));
    let after: Vec<&&str> = lines[second..].iter().filter(|l| **l == "first").collect();
    assert!(
        after.is_empty(),
        "{backend}: the first holder's command wrote {} lines after the second holder started",
        after.len()
    );
    assert!(
        second > 0,
        "{backend}: the first holder's command never wrote"
    );
}

/// distlock gets `signal` while its command runs; the command and its grandchild are gone
/// before the lease ends, and a second `run` waiting for the lock starts only after them.
fn distlock_signalled_mid_run(signal: Signal, backend: Backend, url: String) {
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
    let end = if signal == Signal::SIGHUP {
        None
    } else {
        lease_end(backend, &url, &key)
    };
    let second = distlock(&url)
        // -v: says when it acquired and released, for a failure's message.
        .args(["run", &key, "-v", "--wait", "20s", "--", "sh", "-c"])
        .arg(format!(
            "echo second >> {d}/log; echo >> {d}/second",
            d = dir.display()
        ))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();

    if let Err(living) = wait_until_dead(&[top, grandchild], Duration::from_secs(10)) {
        let _ = killpg(Pid::from_raw(group), Signal::SIGKILL);
        let _ = kill(distlock_pid, Signal::SIGKILL);
        panic!("{backend}: after {signal}, the command's processes {living:?} still run")
    }
    // Judged by the command's last write (the file's modification time), not by when this
    // thread happened to look: robust to a busy machine.
    let last_write = modified(&dir.join("first"));
    if let Some(end) = end {
        match end.duration_since(last_write) {
            Ok(before) => eprintln!(
                "{backend}: after {signal}: the command's last write was {before:?} before the lease ended"
            ),
            Err(e) => panic!(
                "{backend}: after {signal}: the command wrote {:?} after the lease ended",
                e.duration()
            ),
        }
    }
    let second_started = Instant::now();
    let out = wait_with_timeout(second, Duration::from_secs(30));
    eprintln!(
        "{backend}: after {signal}: the second run got the lock within {:?}",
        second_started.elapsed()
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "{backend}: second run: {}",
        stderr(&out)
    );
    assert_no_overlap(backend, &dir.join("log"));
    assert!(
        last_write <= modified(&dir.join("second")),
        "{backend}: the first holder's command wrote after the second holder's"
    );

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
    assert_eq!(out.status.code(), expected, "{backend}: {signal}: {err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_killed_distlock_leaves_no_command_running_past_the_lease() {
    on_every_backend(
        "a_killed_distlock_leaves_no_command_running_past_the_lease",
        |backend, url| {
            distlock_signalled_mid_run(Signal::SIGKILL, backend, url);
        },
    );
}

#[test]
fn a_hung_up_distlock_stops_its_command_before_releasing() {
    on_every_backend(
        "a_hung_up_distlock_stops_its_command_before_releasing",
        |backend, url| {
            distlock_signalled_mid_run(Signal::SIGHUP, backend, url);
        },
    );
}

#[test]
fn a_frozen_distlock_leaves_no_command_running_past_the_lease() {
    on_every_backend(
        "a_frozen_distlock_leaves_no_command_running_past_the_lease",
        |backend, url| {
            distlock_signalled_mid_run(Signal::SIGSTOP, backend, url);
        },
    );
}

/// The lease is taken away (force-released) while the command runs; the command's top process
/// exits on SIGTERM, its background child ignores SIGTERM: it is SIGKILLed by the lease's local
/// deadline, before distlock exits with 76.
#[test]
fn a_lost_lease_kills_a_background_child_that_ignores_sigterm() {
    on_every_backend(
        "a_lost_lease_kills_a_background_child_that_ignores_sigterm",
        lost_lease_with_a_background_child,
    );
}

fn lost_lease_with_a_background_child(backend: Backend, url: String) {
    let key = fresh_key("lost-background");
    let dir = temp_dir("lost-background");
    let mut holder = distlock(&url)
        .args([
            "run",
            &key,
            "--ttl",
            "3s",
            "--kill-after",
            // At most a third of what a renewed lease has left (ZooKeeper's 2 s session: 1 s).
            "300ms",
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
    assert_eq!(out.status.code(), Some(0), "{backend}: {}", stderr(&out));

    let out = wait_with_timeout(holder, Duration::from_secs(20));
    let exited = Instant::now();
    let survived = alive(background);
    if survived {
        let _ = kill(Pid::from_raw(background), Signal::SIGKILL);
    }
    let err = std::fs::read_to_string(dir.join("stderr")).unwrap_or_default();
    assert!(
        !survived,
        "{backend}: distlock exited while the background child still ran: {err}"
    );
    assert_eq!(out.status.code(), Some(76), "{backend}: {err}");
    assert!(
        exited - released < Duration::from_secs(3),
        "{backend}: the background child outlived the local deadline: {:?} after the release",
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

/// The in-memory backend and every coordinator of [`backends`], for the terminal tests.
fn terminal_targets() -> Vec<(Backend, String)> {
    let mut targets = vec![(Backend::Memory, "memory://".to_owned())];
    targets.extend(backends());
    targets
}

/// Whether `key` is held, asked of the coordinator by another process. `None` on memory://,
/// whose coordinator lived in the process that ran.
fn held_after(backend: Backend, url: &str, key: &str) -> Option<bool> {
    if backend == Backend::Memory {
        return None;
    }
    let out = distlock(url)
        .args(["inspect", key, "--json"])
        .output()
        .unwrap();
    let value: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{backend}: inspect --json ({e}): {}", stderr(&out)));
    Some(
        value["held"]
            .as_bool()
            .unwrap_or_else(|| panic!("{backend}: {value}")),
    )
}

/// A command that reads the terminal gets it (it is the terminal's foreground process group for
/// its run), reads what is typed, and releases the lock when done. On every backend.
#[test]
fn a_command_that_reads_the_terminal_gets_it() {
    let targets = terminal_targets();
    let tally = Tally::new("a_command_that_reads_the_terminal_gets_it", &targets);
    for (backend, url) in targets {
        let key = fresh_key("terminal-reader");
        let shell = format!(
            "{} --url '{url}' run --ttl 3s '{key}' -- sh -c 'read x; echo got:$x'",
            env!("CARGO_BIN_EXE_distlock")
        );
        let (code, text) = under_a_terminal(&shell, "hello\n", Duration::from_secs(20));
        assert!(text.contains("got:hello"), "{backend}: {text}");
        assert_eq!(code, Some(0), "{backend}: {text}");
        assert_ne!(
            held_after(backend, &url, &key),
            Some(true),
            "{backend}: the lock is still held after the run: {text}"
        );
        tally.ran(backend);
    }
    tally.assert_each_ran_once();
}

/// distlock itself runs in the background of a terminal (a job-control shell's `&`): the
/// command cannot get the terminal; reading it stops the command (SIGTTIN), which is reported
/// and terminated instead of holding the lock forever: the lock is free once distlock exited.
/// On every backend.
#[test]
fn a_command_stopped_by_the_terminal_does_not_hold_the_lock_forever() {
    let targets = terminal_targets();
    let tally = Tally::new(
        "a_command_stopped_by_the_terminal_does_not_hold_the_lock_forever",
        &targets,
    );
    for (backend, url) in targets {
        let key = fresh_key("terminal-stopped");
        let shell = format!(
            "sh -c 'set -m; {} --url \"{url}\" run --ttl 3s \"{key}\" -- sh -c \"read x; echo got:\\$x\" & wait $!; echo status:$?'",
            env!("CARGO_BIN_EXE_distlock")
        );
        let (_, text) = under_a_terminal(&shell, "hello\n", Duration::from_secs(20));
        assert!(text.contains("stopped by SIGTTIN"), "{backend}: {text}");
        assert!(text.contains("status:149"), "{backend}: {text}");
        assert_ne!(
            held_after(backend, &url, &key),
            Some(true),
            "{backend}: the lock is still held after distlock exited: {text}"
        );
        tally.ran(backend);
    }
    tally.assert_each_ran_once();
}

/// distlock's stderr is a pipe nobody reads any more (`distlock … 2>&1 | head -1`): its
/// messages fail, and it still terminates the command of a lost lease and exits 76.
#[test]
fn a_closed_stderr_does_not_keep_a_lost_lease_s_command_running() {
    let Some(url) = conformance::backend_url("DISTLOCK_TEST_REDIS_URL") else {
        return;
    };
    let key = fresh_key("closed-stderr");
    let dir = temp_dir("closed-stderr");
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let mut holder = distlock(&url)
        .args(["run", &key, "--ttl", "3s", "--", "sh", "-c"])
        .arg(format!(
            "trap '' TERM; echo $$ > {d}/pid.tmp; mv {d}/pid.tmp {d}/pid; while :; do sleep 0.05; done",
            d = dir.display()
        ))
        .stdout(Stdio::null())
        .stderr(writer)
        .spawn()
        .unwrap();
    let pid: i32 = wait_for_file(&dir.join("pid"), &mut holder, Duration::from_secs(20))
        .parse()
        .unwrap();
    let out = distlock(&url)
        .args(["release", "--force", "--yes", &key])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let out = wait_with_timeout(holder, Duration::from_secs(20));
    let survived = alive(pid);
    if survived {
        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
    }
    assert!(!survived, "the command survived the lost lease");
    assert_eq!(out.status.code(), Some(76));
    let _ = std::fs::remove_dir_all(&dir);
}
