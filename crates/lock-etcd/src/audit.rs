//! `audit`: read the etcd cluster's state the fence and the lease depend on and grade each
//! (see the README's invariant section: trust needs a quorum behind the member we talk to).

use std::time::Duration;

use etcd_client::{Client, ConnectOptions, DeleteOptions, GetOptions};
use lock_core::raw::{AuditReport, Error, Result, no_answer};
use tokio::time::{Instant, timeout};

use crate::{EtcdLockConfig, client::BACKEND};

/// What one member answered.
#[derive(Debug)]
struct Probe {
    endpoint: String,
    /// `status` answered: (version, leader id, member id).
    status: std::result::Result<(String, u64, u64), String>,
    /// A linearizable read (served only with the leader's agreement) succeeded.
    linearizable: std::result::Result<(), String>,
}

impl Probe {
    fn healthy(&self) -> bool {
        matches!(&self.status, Ok((_, leader, _)) if *leader != 0) && self.linearizable.is_ok()
    }
}

/// Reads the cluster's state that the fence and the lease depend on and grades each PASS / WARN
/// / FAIL with why and what to change. Read-only (`Status`, `MemberList` and linearizable
/// reads of the lock prefix); it takes no lock.
///
/// Checks: `version` (and whether etcd's own Lock RPC has etcd#11456: not used by distlock,
/// but other clients of the same keys would be), `members` (a single member or an even count
/// tolerate no failure), `health` (members that answer with a leader and serve linearizable
/// reads; a minority down is a WARN, no quorum a FAIL), `leader`, `endpoints` (each URL
/// endpoint answers and is not cut off from the leader), `auth` (whether a client without
/// credentials may read and write the lock prefix).
///
/// # Errors
/// [`Error::Config`] for an invalid configuration or an unreadable TLS file;
/// [`Error::Unavailable`] when no endpoint of the URL answers at all.
pub async fn audit(config: &EtcdLockConfig) -> Result<AuditReport> {
    config.validate()?;
    let prefix = config.normalized_prefix();
    let budget = config.connect_timeout.saturating_add(config.timeout);
    let scheme = if config.tls.is_some() {
        "https"
    } else {
        "http"
    };
    let mut report = AuditReport::new(BACKEND);

    // Our endpoints first: who answers, and through whom the member list comes.
    let mut probes = Vec::new();
    for endpoint in &config.endpoints {
        probes.push(probe(config, &format!("{scheme}://{endpoint}"), &prefix, budget).await?);
    }
    let Some(reachable) = probes
        .iter()
        .find(|p| p.status.is_ok())
        .map(|p| p.endpoint.clone())
    else {
        let why = probes
            .iter()
            .map(|p| {
                format!(
                    "{}: {}",
                    p.endpoint,
                    p.status.as_ref().err().map_or("", |s| s)
                )
            })
            .collect::<Vec<_>>()
            .join("; ");
        return Err(Error::Unavailable {
            backend: BACKEND,
            op: "audit",
            message: format!("no endpoint answered ({why})"),
            source: None,
        });
    };

    let mut client = connect(config, &reachable, true).await?;
    let mut best: Option<Duration> = None;
    for _ in 0..5 {
        let sent = Instant::now();
        if timeout(budget, client.status())
            .await
            .is_ok_and(|r| r.is_ok())
        {
            let rtt = sent.elapsed();
            best = Some(best.map_or(rtt, |b| b.min(rtt)));
        }
    }
    report.round_trip = best;

    let members: Vec<(u64, String, Option<String>, bool)> =
        match timeout(budget, client.member_list()).await {
            Ok(Ok(list)) => list
                .members()
                .iter()
                .map(|m| {
                    (
                        m.id(),
                        m.name().to_owned(),
                        m.client_urls().first().cloned(),
                        m.is_learner(),
                    )
                })
                .collect(),
            Ok(Err(e)) => return Err(Error::backend(BACKEND, "member list", e)),
            Err(_) => return Err(no_answer(BACKEND, "member list", budget)),
        };

    // Every voting member, through its own advertised client URL (a member the URL does not
    // list still counts for the quorum).
    let mut member_probes = Vec::new();
    for (id, name, url, learner) in &members {
        if *learner {
            continue;
        }
        let known = probes
            .iter()
            .find(|p| matches!(&p.status, Ok((_, _, m)) if m == id));
        let healthy = match (known, url) {
            (Some(p), _) => p.healthy(),
            (None, Some(url)) => probe(config, url, &prefix, budget).await?.healthy(),
            (None, None) => false,
        };
        let label = if name.is_empty() {
            format!("{id:x}")
        } else {
            name.clone()
        };
        member_probes.push((label, healthy));
    }

    if let Some((version, ..)) = probes.iter().find_map(|p| p.status.as_ref().ok()) {
        grade_version(&mut report, version);
    }
    grade_members(&mut report, &member_probes);
    let leaders: Vec<u64> = probes
        .iter()
        .filter(|p| p.linearizable.is_ok())
        .filter_map(|p| p.status.as_ref().ok().map(|s| s.1))
        .filter(|&l| l != 0)
        .collect();
    match leaders.first() {
        Some(leader) => {
            let name = members
                .iter()
                .find(|m| m.0 == *leader)
                .map_or_else(|| format!("{leader:x}"), |m| m.1.clone());
            report.pass("leader", name, "a leader is elected and serves our reads");
        }
        None => {
            report.fail(
                "leader",
                "none",
                "no member we reach has a leader that serves reads: every lock operation fails",
                "restore a quorum (start the stopped members)",
            );
        }
    }
    grade_endpoints(&mut report, &probes);
    auth(&mut report, config, &reachable, &prefix, budget).await?;
    Ok(report)
}

fn options(config: &EtcdLockConfig, with_user: bool) -> Result<ConnectOptions> {
    let mut options = ConnectOptions::new()
        .with_connect_timeout(config.connect_timeout)
        .with_timeout(config.timeout)
        .with_require_leader(true);
    if with_user && let Some(user) = &config.user {
        options = options.with_user(user.clone(), config.password_text());
    }
    if let Some(tls) = &config.tls {
        options = options.with_tls(crate::client::tls_options(tls)?);
    }
    Ok(options)
}

async fn connect(config: &EtcdLockConfig, url: &str, with_user: bool) -> Result<Client> {
    let budget = config.connect_timeout.saturating_add(config.timeout);
    match timeout(
        budget,
        Client::connect([url.to_owned()], Some(options(config, with_user)?)),
    )
    .await
    {
        Ok(Ok(client)) => Ok(client),
        Ok(Err(e)) => Err(Error::unavailable(BACKEND, "connect", e)),
        Err(_) => Err(Error::Unavailable {
            backend: BACKEND,
            op: "connect",
            message: format!("{url}: no answer within {budget:?}"),
            source: None,
        }),
    }
}

/// One member on its own: its status, and a linearizable read (which a member cut off from
/// the leader cannot serve). Errors other than a bad configuration become the probe's result.
async fn probe(
    config: &EtcdLockConfig,
    url: &str,
    prefix: &str,
    budget: Duration,
) -> Result<Probe> {
    let mut client = match connect(config, url, true).await {
        Ok(client) => client,
        Err(e @ Error::Config(_)) => return Err(e),
        Err(e) => {
            return Ok(Probe {
                endpoint: url.to_owned(),
                status: Err(e.to_string()),
                linearizable: Err("not connected".to_owned()),
            });
        }
    };
    let status = match timeout(budget, client.status()).await {
        Ok(Ok(s)) => Ok((
            s.version().to_owned(),
            s.leader(),
            s.header().map_or(0, |h| h.member_id()),
        )),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no answer within {budget:?}")),
    };
    let read = GetOptions::new().with_limit(1).with_keys_only();
    let linearizable = past_elections(budget, || {
        // A clone shares the channel: each attempt owns its handle.
        let (mut client, read) = (client.clone(), read.clone());
        async move { client.get(prefix, Some(read)).await }
    })
    .await
    .map(drop);
    Ok(Probe {
        endpoint: url.to_owned(),
        status,
        linearizable,
    })
}

/// Runs `attempt` (a linearizable read) within `budget`, again after a short pause while it
/// fails with "leader changed": right after an election a member that serves refuses the reads
/// it had queued under the old leader, and reading once would grade a cluster that serves as
/// one without quorum. Any other error, or the budget's end, is the answer.
async fn past_elections<T, F, Fut>(
    budget: Duration,
    mut attempt: F,
) -> std::result::Result<T, String>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = std::result::Result<T, etcd_client::Error>>,
{
    let deadline = Instant::now() + budget;
    loop {
        match tokio::time::timeout_at(deadline, attempt()).await {
            Ok(Ok(value)) => return Ok(value),
            Ok(Err(e)) if leader_changed(&e) && Instant::now() + ELECTION_PAUSE < deadline => {
                tokio::time::sleep(ELECTION_PAUSE).await;
            }
            Ok(Err(e)) => return Err(e.to_string()),
            Err(_) => return Err(format!("no answer within {budget:?}")),
        }
    }
}

/// The pause before a read refused with "leader changed" is sent again.
const ELECTION_PAUSE: Duration = Duration::from_millis(50);

/// Whether etcd refused a request because its leader changed while the request waited (the
/// new leader is there: the same request sent again is served).
fn leader_changed(e: &etcd_client::Error) -> bool {
    matches!(e, etcd_client::Error::GRpcStatus(s)
        if s.code() == tonic::Code::Unavailable && s.message().contains("leader changed"))
}

fn grade_version(report: &mut AuditReport, version: &str) {
    let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    if (major, minor) < (3, 4) {
        report.warn(
            "version",
            version,
            "older than etcd 3.4 (not tested; leases and require-leader behave differently)",
            "upgrade to etcd 3.4 or newer (3.5+ recommended)",
        );
    } else if (major, minor) < (3, 5) {
        report.pass(
            "version",
            version,
            "etcd 3.4: distlock's keys are safe; etcd's own Lock RPC (etcdctl lock, v3lock) has etcd#11456 — do not mix it with distlock on the same names",
        );
    } else {
        report.pass(
            "version",
            version,
            "etcd 3.5+ (its own Lock RPC has the etcd#11456 fix)",
        );
    }
}

fn grade_members(report: &mut AuditReport, members: &[(String, bool)]) {
    let n = members.len();
    let up = members.iter().filter(|m| m.1).count();
    let observed = format!("{n} voting member(s)");
    if n <= 1 {
        report.warn(
            "members",
            observed,
            "a single member: no failure is tolerated, and losing its disk loses every fence",
            "run 3 (or 5) members for a lock that must survive a machine",
        );
    } else if n.is_multiple_of(2) {
        report.warn(
            "members",
            observed,
            "an even count tolerates no more failures than one member fewer",
            "run an odd number of members (3 or 5)",
        );
    } else {
        report.pass(
            "members",
            observed,
            format!("tolerates {} failed member(s)", (n - 1) / 2),
        );
    }
    let down: Vec<&str> = members
        .iter()
        .filter(|m| !m.1)
        .map(|m| m.0.as_str())
        .collect();
    let observed = if down.is_empty() {
        format!("{up}/{n} healthy")
    } else {
        format!("{up}/{n} healthy; not serving: {}", down.join(", "))
    };
    if up == n {
        report.pass(
            "health",
            observed,
            "every member answers with a leader and serves linearizable reads",
        );
    } else if up > n / 2 {
        report.warn(
            "health",
            observed,
            "quorum kept, but fewer failures than designed are tolerated now",
            "bring the members that do not serve back",
        );
    } else {
        report.fail(
            "health",
            observed,
            "no quorum: no lease can be granted or renewed",
            "bring members back until a majority serves",
        );
    }
}

fn grade_endpoints(report: &mut AuditReport, probes: &[Probe]) {
    let bad: Vec<String> = probes
        .iter()
        .filter(|p| !p.healthy())
        .map(|p| {
            let why = match (&p.status, &p.linearizable) {
                (Err(e), _) => format!("does not answer ({e})"),
                (Ok((_, 0, _)), _) => "has no leader".to_owned(),
                (Ok(_), Err(e)) => format!("cut off from the leader ({e})"),
                (Ok(_), Ok(())) => "unknown".to_owned(),
            };
            format!("{} {why}", p.endpoint)
        })
        .collect();
    let n = probes.len();
    if bad.is_empty() {
        report.pass(
            "endpoints",
            format!("{n}/{n} serving"),
            "every endpoint of the URL serves linearizable reads",
        );
    } else if bad.len() < n {
        report.warn(
            "endpoints",
            format!("{}/{n} serving; {}", n - bad.len(), bad.join("; ")),
            "requests the client sends to these fail (Unavailable; leases stay safe, but operations fail now and then)",
            "fix or remove these endpoints from the URL",
        );
    } else {
        report.fail(
            "endpoints",
            format!("0/{n} serving; {}", bad.join("; ")),
            "no endpoint of the URL serves: every lock operation fails",
            "list members that are part of a quorum in the URL",
        );
    }
}

/// Whether a client without credentials may read the lock prefix.
async fn auth(
    report: &mut AuditReport,
    config: &EtcdLockConfig,
    url: &str,
    prefix: &str,
    budget: Duration,
) -> Result<()> {
    let mut anonymous = match connect(config, url, false).await {
        Ok(client) => client,
        Err(e @ Error::Config(_)) => return Err(e),
        Err(e) => {
            report.warn(
                "auth",
                "unknown",
                format!("an anonymous client could not connect to check: {e}"),
                "check by hand that auth is enabled (etcdctl auth enable)",
            );
            return Ok(());
        }
    };
    let read = GetOptions::new().with_limit(1).with_keys_only();
    match timeout(budget, anonymous.get(prefix, Some(read))).await {
        Ok(Ok(_)) => {
            report.warn(
                "auth",
                "off",
                "any client that reaches the port can delete or take locks (and their fences)",
                "create a user with a role limited to the lock prefix and run etcdctl auth enable",
            );
        }
        Ok(Err(e)) => {
            report.pass(
                "auth",
                "on",
                format!("a client without credentials is refused ({e})"),
            );
        }
        Err(_) => {
            report.warn(
                "auth",
                "unknown",
                "an anonymous read did not answer",
                "check by hand that auth is enabled",
            );
        }
    }
    Ok(())
}

/// A client for the namespace functions, refusing an empty prefix.
async fn prefix_client(config: &EtcdLockConfig) -> Result<(Client, String)> {
    config.validate()?;
    let prefix = config.normalized_prefix();
    if prefix.is_empty() {
        return Err(Error::Config(
            "refusing to touch every key of the cluster: the prefix is empty".to_owned(),
        ));
    }
    let scheme = if config.tls.is_some() {
        "https"
    } else {
        "http"
    };
    let endpoints: Vec<String> = config
        .endpoints
        .iter()
        .map(|e| format!("{scheme}://{e}"))
        .collect();
    let budget = config.connect_timeout.saturating_add(config.timeout);
    match timeout(
        budget,
        Client::connect(endpoints, Some(options(config, true)?)),
    )
    .await
    {
        Ok(Ok(client)) => Ok((client, prefix)),
        Ok(Err(e)) => Err(Error::unavailable(BACKEND, "connect", e)),
        Err(_) => Err(no_answer(BACKEND, "connect", budget)),
    }
}

/// How many keys lie under `config.prefix` (lock entries). For checking that a test run left
/// nothing behind.
///
/// # Errors
/// [`Error::Config`] for an empty prefix; [`Error::Unavailable`] / [`Error::Backend`] otherwise.
pub async fn namespace_size(config: &EtcdLockConfig) -> Result<usize> {
    let (mut client, prefix) = prefix_client(config).await?;
    let budget = config.timeout;
    let found = timeout(
        budget,
        client.get(
            prefix,
            Some(GetOptions::new().with_prefix().with_count_only()),
        ),
    )
    .await
    .map_err(|_| no_answer(BACKEND, "count", budget))?
    .map_err(|e| Error::backend(BACKEND, "count", e))?;
    Ok(usize::try_from(found.count()).unwrap_or(usize::MAX))
}

/// Deletes every key under `config.prefix` — **only for a prefix of your own**, such as a test
/// run's: a lock deleted under its holder is given to the next caller. Returns how many keys
/// were deleted. Leases stay until they expire (they are the clients' sessions).
///
/// # Errors
/// [`Error::Config`] for an empty prefix; [`Error::Unavailable`] / [`Error::Backend`] otherwise.
pub async fn purge_namespace(config: &EtcdLockConfig) -> Result<usize> {
    let (mut client, prefix) = prefix_client(config).await?;
    let budget = config.timeout;
    let deleted = timeout(
        budget,
        client.delete(prefix, Some(DeleteOptions::new().with_prefix())),
    )
    .await
    .map_err(|_| no_answer(BACKEND, "delete", budget))?
    .map_err(|e| Error::backend(BACKEND, "delete", e))?;
    Ok(usize::try_from(deleted.deleted()).unwrap_or(usize::MAX))
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    fn refused(message: &str) -> etcd_client::Error {
        etcd_client::Error::GRpcStatus(tonic::Status::new(tonic::Code::Unavailable, message))
    }

    /// The false FAIL seen right after an election (a member that serves answered the probe's
    /// read with "leader changed"): the probe reads again within its budget, and only then.
    #[tokio::test(start_paused = true)]
    async fn a_read_refused_by_an_election_is_sent_again_within_the_budget() {
        let tries = Cell::new(0);
        let read = past_elections(Duration::from_secs(1), || {
            tries.set(tries.get() + 1);
            let answer = if tries.get() < 3 {
                Err(refused("etcdserver: leader changed"))
            } else {
                Ok(())
            };
            std::future::ready(answer)
        });
        assert_eq!(read.await, Ok(()));
        assert_eq!(tries.get(), 3);

        // Any other refusal is the answer at once.
        tries.set(0);
        let read = past_elections(Duration::from_secs(1), || {
            tries.set(tries.get() + 1);
            std::future::ready(Err::<(), _>(refused("etcdserver: request timed out")))
        });
        assert!(read.await.unwrap_err().contains("request timed out"));
        assert_eq!(tries.get(), 1);

        // An election that does not settle within the budget is still a failure, in time.
        let started = Instant::now();
        let read = past_elections(Duration::from_secs(1), || {
            std::future::ready(Err::<(), _>(refused("etcdserver: leader changed")))
        });
        assert!(read.await.unwrap_err().contains("leader changed"));
        assert!(started.elapsed() <= Duration::from_secs(1));

        // A read that never answers ends with the budget.
        let read = past_elections(
            Duration::from_secs(1),
            std::future::pending::<Result<(), _>>,
        );
        assert!(read.await.unwrap_err().contains("no answer"));
    }
}
