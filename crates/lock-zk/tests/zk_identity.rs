//! The holder identity (host, pid, start time, label) each client writes as the data of its
//! contender nodes, shown by `inspect` from any client — always the current holder's.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed expectation is a failed test

mod support;

use support::{ROOT, SESSION, children, config, plain_key, raw_client};

use std::time::Duration;

use lock_core::{DistributedLock, Error, HolderIdentity, LockKey};
use lock_zk::{ZkLock, ZkLockConfig};
use tokio::time::{Instant, timeout};
use zookeeper_client as zk;

const SLACK: Duration = Duration::from_secs(5);

fn labelled(config: &ZkLockConfig, label: &str) -> ZkLockConfig {
    let mut config = config.clone();
    config.label = Some(label.into());
    config
}

/// The identity another client's `inspect` shows for `key`, and the fencing token next to it.
async fn shown(observer: &ZkLock, key: &LockKey) -> (Option<String>, Option<u64>) {
    let info = observer.inspect(key).await.unwrap().expect("held");
    (
        info.holder.map(|h| h.as_str().to_owned()),
        info.fencing_token.map(|t| t.get()),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_shows_the_current_holders_identity_as_the_lock_changes_hands() {
    let Some(config) = config() else { return };
    let a = ZkLock::connect(labelled(&config, "zk-holder-a"))
        .await
        .unwrap();
    let b = ZkLock::connect(labelled(&config, "zk-holder-b"))
        .await
        .unwrap();
    let observer = ZkLock::connect(config.clone()).await.unwrap();
    let key = plain_key();
    let expected_a = HolderIdentity::process(Some("zk-holder-a")).unwrap();
    let expected_b = HolderIdentity::process(Some("zk-holder-b")).unwrap();

    let first = a.try_acquire(&key, SESSION).await.unwrap().unwrap();
    let (who, fence) = shown(&observer, &key).await;
    assert_eq!(who.as_deref(), Some(expected_a.as_str()));
    assert!(
        who.unwrap()
            .contains(&format!("pid={}", std::process::id()))
    );
    assert_eq!(fence, first.fencing_token().map(|t| t.get()));

    // A waiter queued behind the holder: its node carries its own identity, but the holder's
    // is what `inspect` shows while the holder holds.
    let waiter = {
        let (b, key) = (b.clone(), key.clone());
        tokio::spawn(async move { b.acquire(&key, SESSION, Instant::now() + SLACK * 2).await })
    };
    let until = Instant::now() + SLACK;
    while observer.inspect(&key).await.unwrap().unwrap().waiters != Some(1) {
        assert!(Instant::now() < until, "the waiter never queued");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        shown(&observer, &key).await.0.as_deref(),
        Some(expected_a.as_str())
    );

    // Release → the waiter is granted: the new holder's identity, next to its fencing token.
    assert!(a.release(&first).await.unwrap());
    let second = timeout(SLACK * 2, waiter).await.unwrap().unwrap().unwrap();
    let (who, fence) = shown(&observer, &key).await;
    assert_eq!(who.as_deref(), Some(expected_b.as_str()));
    assert_eq!(fence, second.fencing_token().map(|t| t.get()));

    // Release → a later acquire by the first client: its identity again, never the last one's.
    assert!(b.release(&second).await.unwrap());
    let third = a.try_acquire(&key, SESSION).await.unwrap().unwrap();
    let (who, fence) = shown(&observer, &key).await;
    assert_eq!(who.as_deref(), Some(expected_a.as_str()));
    assert_eq!(fence, third.fencing_token().map(|t| t.get()));
    assert!(a.release(&third).await.unwrap());
    assert!(observer.inspect(&key).await.unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_data_has_no_identity_and_foreign_data_is_sanitised() {
    let Some(config) = config() else { return };
    let raw = raw_client(&config).await;
    let observer = ZkLock::connect(config.clone()).await.unwrap();
    let key = plain_key();
    let dir = format!("{ROOT}/{key}");
    raw.mkdir(
        &dir,
        &zk::CreateMode::Container.with_acls(zk::Acls::anyone_all()),
    )
    .await
    .unwrap();
    let ephemeral = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
    // What an older distlock version created: a node without data.
    let prefix = format!("{dir}/_c_{}-lock-", uuid::Uuid::new_v4());
    let (_, seq) = raw.create(&prefix, &[], &ephemeral).await.unwrap();
    let info = observer.inspect(&key).await.unwrap().expect("held");
    assert!(info.holder.is_none(), "{:?}", info.holder);
    assert!(info.fencing_token.is_some());
    raw.delete(&format!("{prefix}{seq}"), None).await.unwrap();
    // Data with control characters (a terminal escape, a newline) is shown without them.
    let prefix = format!("{dir}/_c_{}-lock-", uuid::Uuid::new_v4());
    let (_, seq) = raw
        .create(&prefix, b"host=x\n\x1b[2Jpid=1", &ephemeral)
        .await
        .unwrap();
    let holder = observer
        .inspect(&key)
        .await
        .unwrap()
        .unwrap()
        .holder
        .unwrap();
    assert!(
        holder
            .as_str()
            .bytes()
            .all(|b| b.is_ascii_graphic() || b == b' ')
    );
    assert!(holder.as_str().starts_with("host=x"), "{holder:?}");
    raw.delete(&format!("{prefix}{seq}"), None).await.unwrap();
    // A foreign node whose ACL does not let us read its data: still held, no identity.
    let unreadable = [zk::Acl::new(
        zk::Permission::WRITE | zk::Permission::DELETE | zk::Permission::ADMIN,
        zk::AuthId::anyone(),
    )];
    let prefix = format!("{dir}/_c_{}-lock-", uuid::Uuid::new_v4());
    let (stat, seq) = raw
        .create(
            &prefix,
            b"secret-ish",
            &zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::new(&unreadable)),
        )
        .await
        .unwrap();
    let info = observer.inspect(&key).await.unwrap().expect("held");
    assert!(info.holder.is_none(), "{:?}", info.holder);
    assert_eq!(
        info.fencing_token.map(|t| t.get()),
        u64::try_from(stat.czxid).ok()
    );
    raw.delete(&format!("{prefix}{seq}"), None).await.unwrap();
    assert!(children(&raw, &dir).await.is_empty());
}

/// A bad label is refused before any I/O: against a port nobody listens on, the error is still
/// `Config`, not `Unavailable`.
#[tokio::test]
async fn a_bad_label_is_a_config_error_before_any_io() {
    let mut closed = ZkLockConfig::new("127.0.0.1:1");
    for bad in ["", "has space", "new\nline", &"x".repeat(65)] {
        closed.label = Some(bad.to_owned());
        let err = ZkLock::connect(closed.clone()).await.unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{bad:?}: {err}");
        assert!(matches!(ZkLock::new(closed.clone()), Err(Error::Config(_))));
    }
    let err = ZkLock::connect_url("zk://127.0.0.1:1?label=a%20b")
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err}");
    closed.label = Some("ok-label".into());
    let err = ZkLock::connect(closed).await.unwrap_err();
    assert!(matches!(err, Error::Unavailable { .. }), "{err}");
}
