//! `audit`: read the ZooKeeper settings the lease and the fence depend on and grade each
//! (see the README's "How this driver keeps the invariant").

use std::{
    io::{Read, Write},
    net::{TcpStream, ToSocketAddrs},
    time::Duration,
};

use lock_core::raw::{AuditReport, Error, Result, no_answer};
use tokio::time::{Instant, timeout};
use zookeeper_client as zk;

use crate::{BACKEND, ZkAcl, ZkLockConfig};

/// What a four-letter word returned, per member of the URL.
#[derive(Debug)]
struct Member {
    host: String,
    /// `srvr`'s reply (or why there is none).
    srvr: std::result::Result<String, String>,
    /// `conf`'s reply.
    conf: std::result::Result<String, String>,
}

impl Member {
    fn line(text: &str, key: &str) -> Option<String> {
        text.lines()
            .find_map(|l| l.strip_prefix(key))
            .map(|v| v.trim_start_matches([':', '=']).trim().to_owned())
    }
    fn mode(&self) -> Option<String> {
        self.srvr.as_ref().ok().and_then(|s| Self::line(s, "Mode"))
    }
    fn conf(&self, key: &str) -> Option<u64> {
        self.conf
            .as_ref()
            .ok()
            .and_then(|s| Self::line(s, key))
            .and_then(|v| v.parse().ok())
    }
}

/// Reads the ensemble's settings that the lease and the fence depend on and grades each PASS /
/// WARN / FAIL with why and what to change. Read-only: four-letter words `srvr` and `conf`
/// (need `4lw.commands.whitelist`), one session with the configured timeout (its negotiated
/// timeout), `/zookeeper/config`, and an anonymous session's read of the lock root.
///
/// Checks: `version` (the lowest of the members': container nodes, used for lock directories,
/// need 3.5.3+, below FAILs; a session holding many locks needs 3.6+ for its persistent
/// recursive watch and ephemeral listing, 3.5 WARNs; TTL nodes are not used), `members` and `quorum` (members of the URL that serve, and in which mode),
/// `session-timeout` (negotiated vs asked: a raised one is refused by the driver, a lowered one
/// shortens every lease; below 2 × tickTime the trust window's bound breaks), `auth` (whether a
/// session without credentials may touch the lock root).
///
/// # Errors
/// [`Error::Config`] for an invalid configuration; [`Error::Unavailable`] when no session can be
/// established.
pub async fn audit(config: &ZkLockConfig) -> Result<AuditReport> {
    config.validate()?;
    let mut report = AuditReport::new(BACKEND);
    let hosts: Vec<String> = config
        .hosts
        .split(',')
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .collect();
    let mut members = Vec::new();
    for host in &hosts {
        members.push(Member {
            host: host.clone(),
            srvr: four_letters(host, "srvr", config.connect_timeout).await,
            conf: four_letters(host, "conf", config.connect_timeout).await,
        });
    }

    let client = session(config, true).await?;
    let mut best: Option<Duration> = None;
    for _ in 0..5 {
        let sent = Instant::now();
        if timeout(config.timeout, client.check_stat("/"))
            .await
            .is_ok_and(|r| r.is_ok())
        {
            let rtt = sent.elapsed();
            best = Some(best.map_or(rtt, |b| b.min(rtt)));
        }
    }
    report.round_trip = best;

    grade_version(&mut report, &members);
    let ensemble = match timeout(config.timeout, client.get_config()).await {
        Ok(Ok((data, _))) => String::from_utf8_lossy(&data)
            .lines()
            .filter(|l| l.starts_with("server."))
            .count(),
        _ => 0,
    };
    grade_ensemble(&mut report, &members, ensemble);
    let tick = members
        .iter()
        .find_map(|m| m.conf("tickTime"))
        .map(Duration::from_millis);
    let max = members.iter().find_map(|m| m.conf("maxSessionTimeout"));
    grade_session(
        &mut report,
        config.session_timeout,
        client.session_timeout(),
        tick,
        max,
    );
    drop(client);
    auth(&mut report, config).await;
    Ok(report)
}

async fn session(config: &ZkLockConfig, with_auth: bool) -> Result<zk::Client> {
    let mut connector = zk::Client::connector()
        .with_session_timeout(config.session_timeout)
        .with_fail_eagerly();
    if with_auth && let Some((user, password)) = &config.auth {
        connector =
            connector.with_auth("digest", format!("{user}:{}", password.expose()).as_bytes());
    }
    match timeout(
        config.connect_timeout,
        connector.connect(&config.connect_string()),
    )
    .await
    {
        Ok(Ok(client)) => Ok(client),
        Ok(Err(e @ (zk::Error::AuthFailed | zk::Error::NoAuth))) => {
            Err(Error::backend(BACKEND, "connect", e))
        }
        Ok(Err(e)) => Err(Error::unavailable(BACKEND, "connect", e)),
        Err(_) => Err(no_answer(BACKEND, "connect", config.connect_timeout)),
    }
}

/// Sends a four-letter word and reads the reply (blocking I/O on the blocking pool, bounded by
/// `budget` for the connect and each read).
async fn four_letters(
    host: &str,
    word: &'static str,
    budget: Duration,
) -> std::result::Result<String, String> {
    let host = host.to_owned();
    let run = move || -> std::result::Result<String, String> {
        let addr = host
            .to_socket_addrs()
            .map_err(|e| e.to_string())?
            .next()
            .ok_or_else(|| format!("{host}: no address"))?;
        let mut stream = TcpStream::connect_timeout(&addr, budget).map_err(|e| e.to_string())?;
        stream
            .set_read_timeout(Some(budget))
            .map_err(|e| e.to_string())?;
        stream
            .set_write_timeout(Some(budget))
            .map_err(|e| e.to_string())?;
        stream
            .write_all(word.as_bytes())
            .map_err(|e| e.to_string())?;
        let mut reply = String::new();
        // At most 64 KiB: a reply is a few hundred bytes.
        stream
            .take(64 * 1024)
            .read_to_string(&mut reply)
            .map_err(|e| e.to_string())?;
        if reply.contains("is not in the whitelist") {
            return Err(format!("`{word}` is not in 4lw.commands.whitelist"));
        }
        Ok(reply)
    };
    match timeout(budget * 3, tokio::task::spawn_blocking(run)).await {
        Ok(Ok(reply)) => reply,
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no reply within {:?}", budget * 3)),
    }
}

/// A version as (major, minor, patch).
type Version = (u32, u32, u32);

fn parse_version(v: &str) -> Option<Version> {
    let core = v.split(['-', ' ', ',']).next()?;
    let mut parts = core.split('.').map(|p| p.parse::<u32>().ok());
    Some((
        parts.next().flatten()?,
        parts.next().flatten().unwrap_or(0),
        parts.next().flatten().unwrap_or(0),
    ))
}

/// Grades the lowest version among the members that answered `srvr`: during a rolling upgrade
/// a session may meet any of them, so the oldest bounds what the driver can use.
fn grade_version(report: &mut AuditReport, members: &[Member]) {
    let short = |v: &str| v.split(',').next().unwrap_or(v).trim().to_owned();
    // (short form, parsed) of every member that told its version.
    let versions: Vec<(String, Option<Version>)> = members
        .iter()
        .filter_map(|m| {
            m.srvr
                .as_ref()
                .ok()
                .and_then(|s| Member::line(s, "Zookeeper version"))
        })
        .map(|v| (short(&v), parse_version(&v)))
        .collect();
    // Not understood comes first: it cannot be vouched for.
    let Some((lowest, version)) = versions.iter().min_by_key(|(_, v)| *v).cloned() else {
        let why = members
            .iter()
            .find_map(|m| m.srvr.as_ref().err().cloned())
            .unwrap_or_default();
        report.warn(
            "version",
            "unknown",
            format!("`srvr` gave no version ({why})"),
            "add srvr and conf to 4lw.commands.whitelist so the audit can read the ensemble",
        );
        return;
    };
    let mut observed = lowest.clone();
    if versions.iter().any(|(s, _)| *s != lowest) {
        observed.push_str(" (the lowest of the members: they differ)");
    }
    match version {
        Some(v) if v >= (3, 6, 0) => {
            report.pass(
                "version",
                observed,
                "3.6+: container nodes (the lock directories), and the persistent recursive \
                 watch and ephemeral listing that a session holding many locks uses; TTL nodes \
                 are not used",
            );
        }
        Some(v) if v >= (3, 5, 3) => {
            report.warn(
                "version",
                observed,
                "3.5: container nodes (the lock directories) are supported, but not persistent \
                 recursive watches or listing a session's ephemeral nodes (3.6+): each held lock \
                 keeps a watch of its own however many a session holds (about 1 KiB of client \
                 memory each), and after a reconnection the client re-registers them all before \
                 a renewal is answered — with 100,000 held locks that outlasted a 10 s session's \
                 leases and every lock was lost",
                "upgrade to ZooKeeper 3.6 or newer (3.8 is what the tests run); until then keep \
                 the locks one process holds well below thousands",
            );
        }
        Some(_) => {
            report.fail(
                "version",
                observed,
                "older than 3.5.3: no container nodes, which the lock directories are",
                "upgrade to ZooKeeper 3.6 or newer (3.8 is what the tests run)",
            );
        }
        None => {
            report.warn(
                "version",
                observed,
                "version not understood",
                "use ZooKeeper 3.6 or newer",
            );
        }
    }
}

fn grade_ensemble(report: &mut AuditReport, members: &[Member], ensemble: usize) {
    let size = if ensemble == 0 {
        members.len()
    } else {
        ensemble
    };
    let modes: Vec<String> = members
        .iter()
        .map(|m| match (m.mode(), &m.srvr) {
            (Some(mode), _) => format!("{} {mode}", m.host),
            (None, Ok(text)) if text.contains("not currently serving") => {
                format!("{} not serving", m.host)
            }
            (None, Ok(_)) => format!("{} unknown", m.host),
            (None, Err(e)) => format!("{} unreachable ({e})", m.host),
        })
        .collect();
    let standalone = members
        .iter()
        .any(|m| m.mode().as_deref() == Some("standalone"));
    if standalone || size <= 1 {
        report.warn(
            "members",
            "standalone (1 server)",
            "a single server: no failure is tolerated, and losing its disk loses the lock nodes",
            "run an ensemble of 3 (or 5)",
        );
    } else if size.is_multiple_of(2) {
        report.warn(
            "members",
            format!("{size} servers"),
            "an even count tolerates no more failures than one server fewer",
            "run an odd number of servers (3 or 5)",
        );
    } else {
        report.pass(
            "members",
            format!("{size} servers"),
            format!("tolerates {} failed server(s)", (size - 1) / 2),
        );
    }
    let serving = members.iter().filter(|m| m.mode().is_some()).count();
    let leader = members
        .iter()
        .any(|m| matches!(m.mode().as_deref(), Some("leader" | "standalone")));
    let unread = members.iter().all(|m| m.srvr.is_err());
    let observed = modes.join(", ");
    if unread {
        report.warn(
            "quorum",
            observed,
            "`srvr` could not be read from any member",
            "add srvr to 4lw.commands.whitelist",
        );
    } else if serving == 0 {
        report.fail(
            "quorum",
            observed,
            "no member of the URL serves (no quorum): no lock can be taken or kept",
            "bring members back until a majority serves",
        );
    } else if serving < members.len() {
        report.warn(
            "quorum",
            observed,
            "some members of the URL do not serve: fewer failures than designed are tolerated now",
            "bring the members that do not serve back",
        );
    } else if !leader && members.len() < size {
        report.pass(
            "quorum",
            observed,
            "every member of the URL serves (the leader is not in the URL)",
        );
    } else {
        report.pass("quorum", observed, "every member of the URL serves");
    }
}

fn ms(d: Duration) -> String {
    format!("{} ms", d.as_millis())
}

fn grade_session(
    report: &mut AuditReport,
    asked: Duration,
    negotiated: Duration,
    tick: Option<Duration>,
    max: Option<u64>,
) {
    let observed = format!(
        "asked {}, negotiated {}{}",
        ms(asked),
        ms(negotiated),
        max.map_or_else(String::new, |m| format!(" (maxSessionTimeout {m} ms)"))
    );
    if let Some(tick) = tick
        && negotiated < tick * 2
    {
        report.fail(
            "session-timeout",
            format!("{observed}, tickTime {}", ms(tick)),
            "below 2 × tickTime the leader may not hear a ping within a quarter timeout: the lease's trust bound breaks",
            "raise minSessionTimeout to at least 2 × tickTime (the default) and ask for a longer session_timeout",
        );
        return;
    }
    if negotiated > asked + Duration::from_millis(1) {
        report.fail(
            "session-timeout",
            observed,
            "the server raised the session timeout (minSessionTimeout): the driver refuses to connect",
            format!("ask for session_timeout >= {} ms", negotiated.as_millis()),
        );
    } else if negotiated + Duration::from_millis(1) < asked {
        report.warn(
            "session-timeout",
            observed,
            "the server lowered the session timeout (maxSessionTimeout): every lease is capped at it and must renew more often",
            format!(
                "raise maxSessionTimeout to at least {} ms, or ask for session_timeout <= {} ms",
                asked.as_millis(),
                negotiated.as_millis()
            ),
        );
    } else {
        report.pass(
            "session-timeout",
            observed,
            "the session lasts what was asked; leases count from it",
        );
    }
}

/// Whether an anonymous session may read (and so, with an open ACL, change) the lock root.
async fn auth(report: &mut AuditReport, config: &ZkLockConfig) {
    let root = if config.root().is_empty() {
        "/"
    } else {
        config.root()
    };
    let anonymous = match session(config, false).await {
        Ok(client) => client,
        Err(e) => {
            report.pass(
                "auth",
                "anonymous sessions refused",
                format!("a session without credentials is refused ({e})"),
            );
            return;
        }
    };
    let listed = timeout(config.timeout, anonymous.list_children(root)).await;
    let acl = timeout(config.timeout, anonymous.get_acl(root)).await;
    match (listed, acl) {
        (Ok(Err(zk::Error::NoAuth | zk::Error::AuthFailed)), _)
        | (Ok(Err(zk::Error::SessionExpired | zk::Error::ConnectionLoss)), _) => {
            report.pass(
                "auth",
                "anonymous requests refused",
                "a session without credentials cannot read the lock root",
            );
        }
        (_, Ok(Ok((acls, _))))
            if acls
                .iter()
                .any(|a| a.scheme() == "world" && a.permission().has(zk::Permission::DELETE)) =>
        {
            report.warn(
                "auth",
                format!("anonymous sessions allowed; {root} open to world"),
                "any client that reaches the port can delete lock nodes (take locks from their holders)",
                "enforce auth (enforce.auth.enabled=true) and use acl=creator with credentials",
            );
        }
        (_, Ok(Ok(_))) => {
            report.pass(
                "auth",
                format!("anonymous sessions allowed; {root} not open to world"),
                "the lock root's ACL keeps anonymous clients from deleting lock nodes",
            );
        }
        (_, Ok(Err(zk::Error::NoNode))) => {
            let open = config.acl == ZkAcl::Open;
            let verdict = if open {
                "anonymous sessions allowed; lock root not created yet (acl=open)"
            } else {
                "anonymous sessions allowed; lock root not created yet (acl=creator)"
            };
            if open {
                report.warn(
                    "auth",
                    verdict,
                    "lock nodes will be created world-writable: any client can delete them",
                    "enforce auth (enforce.auth.enabled=true) and use acl=creator with credentials",
                );
            } else {
                report.pass(
                    "auth",
                    verdict,
                    "lock nodes will be created for their creator only",
                );
            }
        }
        _ => {
            report.warn(
                "auth",
                "unknown",
                "could not read the lock root's ACL anonymously",
                "check by hand that anonymous clients cannot delete lock nodes",
            );
        }
    }
}

/// How many nodes lie under the lock root (lock directories and contenders; 0 when the root
/// does not exist). For checking that a test run left nothing behind.
///
/// # Errors
/// [`Error::Config`] for the root `/`; [`Error::Unavailable`] / [`Error::Backend`] otherwise.
pub async fn namespace_size(config: &ZkLockConfig) -> Result<usize> {
    let root = own_root(config)?;
    let client = session(config, true).await?;
    match timeout(config.timeout, client.count_descendants_number(&root)).await {
        Ok(Ok(n)) => Ok(n),
        Ok(Err(zk::Error::NoNode)) => Ok(0),
        Ok(Err(e)) => Err(Error::backend(BACKEND, "count", e)),
        Err(_) => Err(no_answer(BACKEND, "count", config.timeout)),
    }
}

/// Deletes the lock root and everything under it — **only for a root of your own**, such as a
/// test run's: a contender node deleted under its holder hands the lock to the next one.
/// Returns how many nodes were deleted.
///
/// # Errors
/// [`Error::Config`] for the root `/`; [`Error::Unavailable`] / [`Error::Backend`] otherwise.
pub async fn purge_namespace(config: &ZkLockConfig) -> Result<usize> {
    let root = own_root(config)?;
    let client = session(config, true).await?;
    let mut deleted = 0;
    // Depth first, children before their parent; a node that vanished meanwhile is fine.
    let mut stack = vec![(root, false)];
    while let Some((path, expanded)) = stack.pop() {
        if expanded {
            match timeout(config.timeout, client.delete(&path, None)).await {
                Ok(Ok(())) => deleted += 1,
                Ok(Err(zk::Error::NoNode)) => {}
                Ok(Err(e)) => return Err(Error::backend(BACKEND, "delete", e)),
                Err(_) => return Err(no_answer(BACKEND, "delete", config.timeout)),
            }
            continue;
        }
        let children = match timeout(config.timeout, client.list_children(&path)).await {
            Ok(Ok(children)) => children,
            Ok(Err(zk::Error::NoNode)) => continue,
            Ok(Err(e)) => return Err(Error::backend(BACKEND, "list", e)),
            Err(_) => return Err(no_answer(BACKEND, "list", config.timeout)),
        };
        stack.push((path.clone(), true));
        for child in children {
            stack.push((format!("{path}/{child}"), false));
        }
    }
    Ok(deleted)
}

fn own_root(config: &ZkLockConfig) -> Result<String> {
    config.validate()?;
    let root = config.root();
    if root.is_empty() || root == "/" {
        return Err(Error::Config(
            "refusing to touch the whole tree: the lock root is /".to_owned(),
        ));
    }
    Ok(root.to_owned())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use lock_core::raw::{AuditReport, Verdict};

    use super::{Member, grade_version};

    /// Members whose `srvr` said these versions (`None`: the four-letter word was refused).
    fn members(versions: &[Option<&str>]) -> Vec<Member> {
        versions
            .iter()
            .enumerate()
            .map(|(i, v)| Member {
                host: format!("127.0.0.1:{}", 2181 + i),
                srvr: v
                    .map(|v| {
                        format!("Zookeeper version: {v}, built on 2023-01-01\nMode: follower\n")
                    })
                    .ok_or_else(|| "not in the whitelist".to_owned()),
                conf: Err("not asked".to_owned()),
            })
            .collect()
    }

    fn graded(versions: &[Option<&str>]) -> (Verdict, String) {
        let mut report = AuditReport::new("zookeeper");
        grade_version(&mut report, &members(versions));
        let f = report
            .findings
            .iter()
            .find(|f| f.check == "version")
            .unwrap();
        (f.verdict, f.observed.clone())
    }

    #[test]
    fn the_version_is_graded_by_what_the_driver_needs_of_it() {
        assert_eq!(graded(&[Some("3.8.4-abc")]).0, Verdict::Pass);
        assert_eq!(graded(&[Some("3.6.0")]).0, Verdict::Pass);
        // No persistent recursive watch or ephemeral listing: a session with many locks keeps
        // a watch per lock and may lose them all across a reconnection.
        assert_eq!(graded(&[Some("3.5.10")]).0, Verdict::Warn);
        assert_eq!(graded(&[Some("3.5.3")]).0, Verdict::Warn);
        // No container nodes.
        assert_eq!(graded(&[Some("3.5.2-alpha")]).0, Verdict::Fail);
        assert_eq!(graded(&[Some("3.4.14")]).0, Verdict::Fail);
        assert_eq!(graded(&[Some("banana")]).0, Verdict::Warn);
        assert_eq!(graded(&[None]).0, Verdict::Warn);
    }

    #[test]
    fn the_lowest_member_s_version_is_the_one_graded() {
        // A rolling upgrade: a session may meet the old member.
        let (verdict, observed) = graded(&[Some("3.8.4"), Some("3.5.9"), None]);
        assert_eq!(verdict, Verdict::Warn);
        assert!(observed.starts_with("3.5.9"), "{observed}");
        assert!(observed.contains("differ"), "{observed}");
        let (verdict, observed) = graded(&[Some("3.8.4"), Some("3.8.4")]);
        assert_eq!((verdict, observed.as_str()), (Verdict::Pass, "3.8.4"));
        let (verdict, _) = graded(&[Some("3.8.4"), Some("3.4.6")]);
        assert_eq!(verdict, Verdict::Fail);
    }
}
