//! `distlock run` across processes, against every real coordinator compiled into this binary
//! whose test URL is set (`DISTLOCK_TEST_{REDIS,ETCD,ZK,PG}_URL`; with
//! `DISTLOCK_REQUIRE_BACKENDS=1` a missing URL fails the test).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::{
    path::Path,
    process::{Child, Command, Output, Stdio},
    thread,
    time::{Duration, Instant},
};

use nix::{
    sys::signal::{Signal, killpg},
    unistd::Pid,
};
use support::{Tally, backends, fresh_key, on_every_backend, temp_dir, wait_for_file};

fn distlock(url: &str) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_distlock"));
    command.env("DISTLOCK_URL", url).stdin(Stdio::null());
    command
}

/// Waits for distlock to exit; on timeout kills it and the command's process group `group`.
fn wait_with_timeout(mut child: Child, within: Duration, group: Option<i32>) -> Output {
    let deadline = Instant::now() + within;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            if let Some(group) = group {
                let _ = killpg(Pid::from_raw(group), Signal::SIGKILL);
            }
            panic!("distlock did not exit within {within:?}");
        }
        thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// Two processes taking turns on one key: every critical section is `start T` … `end T` with no
/// other line in between, and the fencing tokens T strictly increase.
#[test]
fn two_runs_on_one_key_never_overlap() {
    let backends = backends();
    let tally = Tally::new("two_runs_on_one_key_never_overlap", &backends);
    for (backend, url) in backends {
        let key = fresh_key("overlap");
        let dir = temp_dir("overlap");
        let log = dir.join("log");
        let script = format!(
            "echo \"start $DISTLOCK_FENCING_TOKEN\" >> {log}; sleep 0.2; echo \"end $DISTLOCK_FENCING_TOKEN\" >> {log}",
            log = log.display()
        );
        let workers: Vec<_> = (0..2)
            .map(|_| {
                let (url, key, script) = (url.clone(), key.clone(), script.clone());
                thread::spawn(move || {
                    for _ in 0..3 {
                        let out = distlock(&url)
                            .args([
                                "run", &key, "--ttl", "5s", "--wait", "60s", "--", "sh", "-c",
                                &script,
                            ])
                            .output()
                            .unwrap();
                        assert_eq!(
                            out.status.code(),
                            Some(0),
                            "{}",
                            String::from_utf8_lossy(&out.stderr)
                        );
                    }
                })
            })
            .collect();
        for worker in workers {
            worker.join().unwrap();
        }
        let text = std::fs::read_to_string(&log).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 12, "{backend}: {text}");
        let mut last = 0u64;
        for pair in lines.chunks(2) {
            let start = pair[0]
                .strip_prefix("start ")
                .unwrap_or_else(|| panic!("{backend}: {text}"));
            let end = pair[1]
                .strip_prefix("end ")
                .unwrap_or_else(|| panic!("{backend}: {text}"));
            assert_eq!(start, end, "{backend}: interleaved sections:\n{text}");
            let token: u64 = start.parse().unwrap();
            assert!(
                token > last,
                "{backend}: fencing tokens did not increase:\n{text}"
            );
            last = token;
        }
        let _ = std::fs::remove_dir_all(&dir);
        tally.ran(backend);
    }
    tally.assert_each_ran_once();
}

/// Starts `distlock run KEY` holding the lock with a command that sleeps 30 s, once the
/// command has started.
fn hold(url: &str, key: &str, dir: &Path) -> Child {
    let started = dir.join("started");
    let mut holder = distlock(url)
        .args(["run", key, "--ttl", "10s", "--", "sh", "-c"])
        .arg(format!("touch {}; sleep 30", started.display()))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_file(&started, &mut holder, Duration::from_secs(20));
    holder
}

/// Sends `signal` to a `distlock` process and waits (at most 20 s) for it to exit.
fn stop(child: Child, signal: Signal) -> Output {
    let pid = Pid::from_raw(i32::try_from(child.id()).unwrap());
    nix::sys::signal::kill(pid, signal).unwrap();
    wait_with_timeout(child, Duration::from_secs(20), None)
}

/// `distlock run KEY -- true`: takes the lock at once or not at all.
fn run_true(url: &str, key: &str) -> Output {
    distlock(url)
        .args(["run", key, "--", "true"])
        .output()
        .unwrap()
}

/// `distlock inspect KEY --json`.
fn inspect_json(url: &str, key: &str) -> serde_json::Value {
    let out = distlock(url)
        .args(["inspect", key, "--json"])
        .output()
        .unwrap();
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn a_held_lock_is_not_acquired_with_the_documented_exit_status() {
    let backends = backends();
    let tally = Tally::new(
        "a_held_lock_is_not_acquired_with_the_documented_exit_status",
        &backends,
    );
    for (backend, url) in backends {
        let key = fresh_key("conflict");
        let dir = temp_dir("conflict");
        let holder = hold(&url, &key, &dir);

        let out = run_true(&url, &key);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(75), "{backend}: {err}");
        assert!(err.contains("not acquired"), "{backend}: {err}");
        let out = distlock(&url)
            .args(["run", &key, "-E", "9", "--", "true"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(9), "{backend}");
        let out = distlock(&url)
            .args(["run", &key, "--wait", "300ms", "--", "true"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(75), "{backend}");

        let value = inspect_json(&url, &key);
        assert_eq!(value["held"], true, "{backend}: {value}");

        // SIGTERM is forwarded; the command dies of it and distlock reports 128+15.
        let out = stop(holder, Signal::SIGTERM);
        assert_eq!(
            out.status.code(),
            Some(143),
            "{backend}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        // Released on exit: the key is free again.
        let out = run_true(&url, &key);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{backend}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let _ = std::fs::remove_dir_all(&dir);
        tally.ran(backend);
    }
    tally.assert_each_ran_once();
}

/// A command whose lease is taken away is terminated: SIGTERM to its group, then SIGKILL for a
/// command that ignores SIGTERM; distlock exits with 76.
#[test]
fn a_command_whose_lease_is_lost_is_terminated() {
    let backends = backends();
    let tally = Tally::new("a_command_whose_lease_is_lost_is_terminated", &backends);
    for (backend, url) in backends {
        let key = fresh_key("lost");
        let dir = temp_dir("lost");
        let pidfile = dir.join("pid");
        let holder = distlock(&url)
            .args([
                "run",
                &key,
                "--ttl",
                "3s",
                "--kill-after",
                // At most a third of what a renewed lease has left (ZooKeeper's 2 s session:
                // 1 s), so the same flags run on every backend.
                "300ms",
                "--",
                "sh",
                "-c",
            ])
            .arg(format!(
                "trap '' TERM; echo $$ > {}.tmp; mv {0}.tmp {0}; while :; do sleep 0.1; done",
                pidfile.display()
            ))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut holder = holder;
        wait_for_file(&pidfile, &mut holder, Duration::from_secs(20));
        let pgid: i32 = std::fs::read_to_string(&pidfile)
            .unwrap()
            .trim()
            .parse()
            .unwrap();

        let out = distlock(&url)
            .args(["release", "--force", "--yes", &key])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{backend}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains("released"), "{backend}: {stdout}");

        let out = wait_with_timeout(holder, Duration::from_secs(30), Some(pgid));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(76), "{backend}: {err}");
        assert!(err.contains("lost the lock"), "{backend}: {err}");
        assert!(err.contains("SIGKILL"), "{backend}: {err}");
        // Nothing of the command's process group is left running (a killed grandchild may
        // linger as a zombie until init reaps it).
        let alive = live_members_of_group(pgid);
        assert!(
            alive.is_empty(),
            "{backend}: the command's process group survived: {alive:?}"
        );
        let _ = std::fs::remove_dir_all(&dir);
        tally.ran(backend);
    }
    tally.assert_each_ran_once();
}

/// Pids of the processes in process group `pgid` that are not zombies (from /proc/*/stat).
fn live_members_of_group(pgid: i32) -> Vec<i32> {
    let mut alive = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid pgrp ...: comm may contain spaces, so split after the last ')'.
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        if fields.len() > 2 && fields[2] == pgid.to_string() && fields[0] != "Z" {
            alive.push(pid);
        }
    }
    alive
}

/// `distlock run --wait` interrupted while it waits exits with 128+2 after leaving the wait
/// queue, so the holder's release does not hand the lock to the process that is gone (which
/// would leave the lock unused until that waiter's TTL ran out).
#[test]
fn a_waiter_interrupted_while_waiting_leaves_the_queue() {
    let backends = backends();
    let tally = Tally::new(
        "a_waiter_interrupted_while_waiting_leaves_the_queue",
        &backends,
    );
    for (backend, url) in backends {
        let key = fresh_key("interrupted");
        let dir = temp_dir("interrupted");
        let holder = hold(&url, &key, &dir);
        let waiter = distlock(&url)
            .args(["run", &key, "--wait", "60s", "--", "true"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if inspect_json(&url, &key)["waiters"].as_u64().unwrap_or(0) >= 1 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{backend}: the waiter never queued"
            );
            thread::sleep(Duration::from_millis(20));
        }
        let out = stop(waiter, Signal::SIGINT);
        assert_eq!(
            out.status.code(),
            Some(130),
            "{backend}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        // The holder goes at once; its release finds no waiter left to hand the lock to.
        let out = stop(holder, Signal::SIGTERM);
        assert_eq!(out.status.code(), Some(143), "{backend}");
        let out = run_true(&url, &key);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{backend}: the lock went to the interrupted waiter: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let _ = std::fs::remove_dir_all(&dir);
        tally.ran(backend);
    }
    tally.assert_each_ran_once();
}

/// `run --label` records who holds the lock next to the grant; `inspect` (another process)
/// shows that holder — host, distlock's pid, the label — in text and JSON.
#[test]
fn inspect_says_who_holds_the_lock() {
    let backends = backends();
    let tally = Tally::new("inspect_says_who_holds_the_lock", &backends);
    for (backend, url) in backends {
        let key = fresh_key("identity");
        let dir = temp_dir("identity");
        let started = dir.join("started");
        let mut holder = distlock(&url)
            .args([
                "run",
                &key,
                "--ttl",
                "10s",
                "--label",
                "nightly-report",
                "--",
            ])
            .args(["sh", "-c"])
            .arg(format!("touch {}; sleep 30", started.display()))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait_for_file(&started, &mut holder, Duration::from_secs(20));
        let value = inspect_json(&url, &key);
        let who = value["holder"].as_str().unwrap_or_default().to_owned();
        eprintln!("{backend}: the holder is {who:?}");
        assert!(
            who.ends_with(" label=nightly-report")
                && who.contains(&format!("pid={} ", holder.id())),
            "{backend}: inspect --json shows the holder as {who:?}: {value}"
        );
        let out = distlock(&url).args(["inspect", &key]).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        // The text shows the same holder, its `since=` as RFC 3339 with an age instead of the
        // raw epoch the JSON keeps.
        let line = text
            .lines()
            .find_map(|l| l.trim_start().strip_prefix("holder:"))
            .map(str::trim)
            .unwrap_or_else(|| panic!("{backend}: no holder line: {text}"));
        let (head, _) = who.split_once(" since=").expect("a since= in the identity");
        assert!(
            line.starts_with(&format!("{head} since=20"))
                && line.contains(" ago) ")
                && line.ends_with(" label=nightly-report"),
            "{backend}: {text}"
        );
        let _ = stop(holder, Signal::SIGTERM);
        let _ = std::fs::remove_dir_all(&dir);
        tally.ran(backend);
    }
    tally.assert_each_ran_once();
}

#[test]
fn a_bad_label_is_a_usage_error_before_any_io() {
    let out = distlock("redis://127.0.0.1:1")
        .args(["run", "k", "--label", "has space", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("label"));
}

/// A command that runs longer than the TTL (several renewals) is left alone and its exit
/// status passed on. On ZooKeeper a renewed lease may have only half the session left; the
/// guard counting the whole session terminated every such command a few seconds in.
#[test]
fn a_command_outlasting_its_ttl_is_not_terminated() {
    on_every_backend(
        "a_command_outlasting_its_ttl_is_not_terminated",
        |backend, url| {
            let key = fresh_key("outlasting");
            let started = Instant::now();
            let out = distlock(&url)
                .args([
                    "run",
                    &key,
                    "--ttl",
                    "3s",
                    "--",
                    "sh",
                    "-c",
                    "sleep 4; exit 3",
                ])
                .output()
                .unwrap();
            assert_eq!(
                out.status.code(),
                Some(3),
                "{backend}: after {:?}: {}",
                started.elapsed(),
                String::from_utf8_lossy(&out.stderr)
            );
        },
    );
}

/// Job mode for cron lines (issue 21): `--at-least` keeps the lock after the command exited —
/// the next run inside the window is not acquired (75), after it the key is free — and
/// `--at-most` terminates a command that runs too long, as on a lost lease (76). On every
/// backend (ZooKeeper through its keep marker).
#[test]
fn run_at_least_keeps_the_lock_after_the_command_and_at_most_stops_it() {
    let backends = backends();
    let tally = Tally::new(
        "run_at_least_keeps_the_lock_after_the_command_and_at_most_stops_it",
        &backends,
    );
    for (backend, url) in backends {
        let key = fresh_key("at-least");
        let started = Instant::now();
        let out = distlock(&url)
            .args(["run", "--ttl", "2s", "--at-least", "4s", &key, "--", "true"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(0), "{backend}: {err}");
        // The command is long gone; the lock is kept until 4 s after the grant.
        let out = run_true(&url, &key);
        if started.elapsed() < Duration::from_secs(4) {
            assert_eq!(
                out.status.code(),
                Some(75),
                "{backend}: acquired {:?} after a run with --at-least 4s: {}",
                started.elapsed(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let out = distlock(&url)
            .args(["run", "--wait", "10s", &key, "--", "true"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(0), "{backend}");
        assert!(
            started.elapsed() >= Duration::from_secs(4),
            "{backend}: acquired inside --at-least"
        );

        // --at-most: the command would sleep 60 s; it is terminated at about 2 s.
        let key = fresh_key("at-most");
        let started = Instant::now();
        let child = distlock(&url)
            .args([
                "run",
                "--ttl",
                "2s",
                "--at-most",
                "2s",
                &key,
                "--",
                "sleep",
                "60",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let out = wait_with_timeout(child, Duration::from_secs(30), None);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(76), "{backend}: {err}");
        assert!(err.contains("at_most"), "{backend}: {err}");
        assert!(
            started.elapsed() >= Duration::from_secs(2),
            "{backend}: terminated before --at-most"
        );
        tally.ran(backend);
    }
    tally.assert_each_ran_once();
}
