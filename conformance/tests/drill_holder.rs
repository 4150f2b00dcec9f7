//! The holder process on its own (`memory://` lives inside the holder, so these tests check the
//! process machinery: events, SIGSTOP / SIGCONT / SIGKILL, exit statuses).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed expectation is a failed test

use std::{os::unix::process::ExitStatusExt, time::Duration};

use conformance::{
    drill::{
        HolderEvent, HolderProcess,
        holder::{HOLDER_BINARY, HolderOptions},
    },
    fresh_key,
};

const BIN: &str = env!("CARGO_BIN_EXE_distlock-drill-holder");
/// The bound on anything that must happen (a process start on a loaded 2-core machine).
const SOON: Duration = Duration::from_secs(10);

async fn spawn(options: &HolderOptions) -> HolderProcess {
    HolderProcess::spawn_with(BIN.as_ref(), options)
        .await
        .expect("the holder binary should start")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holder_reports_its_grant_and_releases_when_its_stdin_closes() {
    let key = fresh_key("holder");
    let mut holder = spawn(&HolderOptions::new(
        "memory://",
        key.clone(),
        Duration::from_secs(5),
    ))
    .await;
    let (fencing, token, _) = holder
        .wait_acquired(SOON)
        .await
        .expect("the holder should acquire");
    assert_eq!(fencing, Some(1));
    assert_eq!(token.len(), 8, "a token digest, never the token");
    assert!(matches!(
        holder.events().first(),
        Some(HolderEvent::Started { pid }) if *pid == holder.pid()
    ));

    holder.release();
    assert!(
        holder
            .wait_for(SOON, |e| matches!(
                e,
                HolderEvent::Released { released: true }
            ))
            .await
            .is_some(),
        "{:?}",
        holder.events()
    );
    assert!(holder.wait_exit(SOON).await.unwrap().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_holder_freezes_and_after_cont_learns_it_lost_its_lease() {
    let ttl = Duration::from_millis(300);
    let holder = spawn(&HolderOptions::new("memory://", fresh_key("holder"), ttl)).await;
    holder.wait_acquired(SOON).await.expect("acquired");
    // Alive: its watchdog renews.
    holder
        .wait_for(SOON, |e| matches!(e, HolderEvent::Renewed { .. }))
        .await
        .expect("the watchdog should renew");

    holder.stop().await.unwrap();
    assert!(holder.is_stopped().unwrap(), "SIGSTOP should stop it");
    // Lines written just before the SIGSTOP may still be in the pipe: count from one TTL into
    // the pause (the reader drains a pipe in microseconds), then nothing new may arrive.
    tokio::time::sleep(ttl).await;
    let before = holder.events().len();
    // The rest of the pause: well past the TTL in all.
    tokio::time::sleep(2 * ttl).await;
    assert_eq!(
        holder.events().len(),
        before,
        "a stopped holder reports nothing: {:?}",
        holder.events()
    );

    holder.cont().await.unwrap();
    assert!(!holder.is_stopped().unwrap());
    let (_, lost) = holder
        .wait_for(SOON, |e| matches!(e, HolderEvent::Lost { .. }))
        .await
        .expect("after the pause the holder must learn it lost the lease");
    assert!(
        matches!(&lost, HolderEvent::Lost { reason } if reason.contains("deadline")),
        "{lost:?}"
    );
    let mut holder = holder;
    assert_eq!(holder.wait_exit(SOON).await.unwrap().code(), Some(3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holder_dies_without_releasing() {
    let mut options = HolderOptions::new("memory://", fresh_key("holder"), Duration::from_secs(5));
    options.write_every = Some(Duration::from_millis(20));
    let mut holder = spawn(&options).await;
    holder.wait_acquired(SOON).await.expect("acquired");
    holder
        .wait_for(
            SOON,
            |e| matches!(e, HolderEvent::Write { seq, fencing: Some(1) } if *seq >= 2),
        )
        .await
        .expect("the holder should write with its fencing token while it holds");

    holder.kill().unwrap();
    let status = holder.wait_exit(SOON).await.unwrap();
    assert_eq!(status.signal(), Some(9), "{status:?}");
    assert!(
        !holder
            .events()
            .iter()
            .any(|e| matches!(e, HolderEvent::Released { .. })),
        "a killed holder cannot release"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spawn_finds_the_binary_and_bad_urls_fail_cleanly() {
    assert!(HolderProcess::binary().ends_with(HOLDER_BINARY));
    let key = fresh_key("holder");
    let holder = HolderProcess::spawn("memory://", &key, Duration::from_secs(5))
        .await
        .expect("the binary should be found next to the test executable");
    holder.wait_acquired(SOON).await.expect("acquired");
    drop(holder); // killed on drop

    let mut holder =
        HolderProcess::spawn("nosuch://user:secret@host:1", &key, Duration::from_secs(5))
            .await
            .unwrap();
    let (_, event) = holder
        .wait_for(SOON, |e| matches!(e, HolderEvent::Error { .. }))
        .await
        .expect("an unknown scheme is reported");
    assert!(
        matches!(&event, HolderEvent::Error { message } if message.contains("nosuch") && !message.contains("secret")),
        "{event:?}"
    );
    assert_eq!(holder.wait_exit(SOON).await.unwrap().code(), Some(2));
}
