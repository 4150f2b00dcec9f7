//! `ZkLockConfig`: everything the driver needs, parseable from one URL.

use std::time::Duration;

use lock_core::raw::{Error, HolderIdentity, Result, Secret, check_durations};

/// Who may touch the lock nodes this client creates.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum ZkAcl {
    /// `world:anyone` with all permissions (what Curator uses by default).
    #[default]
    Open,
    /// Only the authenticated creator (`auth` scheme); needs digest credentials in the URL.
    Creator,
}

/// Configuration of a [`crate::ZkLock`].
///
/// Parsed from a URL by [`ZkLockConfig::from_url`]:
///
/// ```text
/// zk://[user:password@]host:port[,host:port...][/chroot][?option=value&...]
/// ```
///
/// | option | default | meaning |
/// |---|---|---|
/// | `session_timeout` | `10s` | session timeout asked of the server; also the smallest TTL accepted (see the crate docs) |
/// | `connect_timeout` | `5s` | bound on establishing a session (at most 24 h) |
/// | `timeout` | `5s` | bound on each request while connected or reconnecting (at most 24 h; an `acquire`'s requests also end by its deadline); sets [`ZkLockConfig::timeout`] |
/// | `op_timeout` | | the older name of `timeout`, still accepted (giving both is an error) |
/// | `root` | `/distlock` | parent of every lock directory (`<root>/<escaped key>/_c_<uuid>-lock-<seq>`) |
/// | `acl` | `open` | `open` (world:anyone) or `creator` (needs `user:password@`) |
/// | `label` | none | a short label added to the holder identity stored as each lock node's data (1–64 of `A-Za-z0-9-_.:/@`) |
/// | `session_watch_from` | `1000` | from how many held locks of one session on, further held locks are watched by one persistent recursive watch on `root` instead of a watch each (`0`: always; `off`: never); see [`ZkLockConfig::session_watch_from`] |
///
/// Durations take a unit (`250ms`, `10s`, `2m`); a bare number is refused, not guessed. Credentials in
/// the URL are sent as ZooKeeper `digest` auth (`user:password`) and never shown by `Debug`.
///
/// Build one with [`ZkLockConfig::new`] or [`ZkLockConfig::from_url`] and set fields on it (the
/// struct is `#[non_exhaustive]`: it may gain fields).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ZkLockConfig {
    /// Comma-separated `host:port` list.
    pub hosts: String,
    /// Optional chroot (`/app`), applied by the client to every path.
    pub chroot: Option<String>,
    /// The lock root; must be an absolute path other than `/`.
    pub root: String,
    /// The session timeout asked of the server.
    pub session_timeout: Duration,
    /// Bound on establishing a session.
    pub connect_timeout: Duration,
    /// Bound on each request (the URL option `timeout`, or its older name `op_timeout`).
    pub timeout: Duration,
    /// `digest` credentials: user and password.
    pub auth: Option<(String, Secret)>,
    /// ACL of the lock nodes.
    pub acl: ZkAcl,
    /// A label added to the holder identity this client stores next to its grants (see
    /// [`lock_core::raw::HolderIdentity::check_label`] for what it may contain).
    pub label: Option<String>,
    /// From how many held locks (renewal-group members) of one session on, a further held lock
    /// is watched by the session's one persistent recursive watch on the lock root instead of
    /// a node watch of its own; `None`: never. A node watch costs about 1 KiB of this process's
    /// memory per held lock; the session watch costs every create and delete under the root, by
    /// any client, an event to this session while it is in use. Needs ZooKeeper 3.6 or later
    /// (older servers keep a watch per lock). Default [`ZkLockConfig::DEFAULT_SESSION_WATCH_FROM`].
    pub session_watch_from: Option<usize>,
}

impl ZkLockConfig {
    /// The default lock root.
    pub const DEFAULT_ROOT: &'static str = "/distlock";
    /// The default session timeout.
    pub const DEFAULT_SESSION_TIMEOUT: Duration = Duration::from_secs(10);
    /// The longest `connect_timeout` and `timeout` accepted (a day): longer ones are
    /// refused rather than overflowing an instant.
    pub const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);
    /// The default [`ZkLockConfig::session_watch_from`].
    pub const DEFAULT_SESSION_WATCH_FROM: usize = 1000;

    /// A configuration for `hosts` (`host:port[,host:port...]`) with every default.
    pub fn new(hosts: impl Into<String>) -> Self {
        Self {
            hosts: hosts.into(),
            chroot: None,
            root: Self::DEFAULT_ROOT.to_owned(),
            session_timeout: Self::DEFAULT_SESSION_TIMEOUT,
            connect_timeout: Duration::from_secs(5),
            timeout: Duration::from_secs(5),
            auth: None,
            acl: ZkAcl::Open,
            label: None,
            session_watch_from: Some(Self::DEFAULT_SESSION_WATCH_FROM),
        }
    }

    /// Parses `zk://[user:password@]host:port[,host:port...][/chroot][?options]`.
    ///
    /// # Errors
    /// [`Error::Config`] for another scheme, no host, a bad chroot or root, an unknown option or
    /// a malformed value.
    pub fn from_url(url: &str) -> Result<Self> {
        let rest = url
            .strip_prefix("zk://")
            .or_else(|| url.strip_prefix("zookeeper://"))
            .ok_or_else(|| config("the URL must start with zk://"))?;
        let (rest, query) = match rest.split_once('?') {
            Some((r, q)) => (r, Some(q)),
            None => (rest, None),
        };
        let (authority, chroot) = match rest.find('/') {
            Some(i) => (&rest[..i], Some(&rest[i..])),
            None => (rest, None),
        };
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, authority),
        };
        if hosts.is_empty() || hosts.split(',').any(|h| h.trim().is_empty()) {
            return Err(config("the URL names no host (zk://host:port)"));
        }
        validate_hosts(hosts)?;
        let mut cfg = Self::new(hosts);
        if let Some(userinfo) = userinfo {
            let (user, password) = userinfo
                .split_once(':')
                .ok_or_else(|| config("credentials must be user:password"))?;
            cfg.auth = Some((
                lock_core::raw::decode_url_credential(user)?,
                lock_core::raw::decode_url_credential(password)?.into(),
            ));
        }
        cfg.chroot = match chroot {
            None | Some("/") => None,
            Some(c) => Some(validate_path("chroot", c.trim_end_matches('/'))?),
        };
        // The per-request bound's name as given (`timeout`, or its older name `op_timeout`):
        // both at once would leave one of them silently ignored.
        let mut timeout_given: Option<&'static str> = None;
        for (name, value) in url::form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
            match &*name {
                "session_timeout" => {
                    cfg.session_timeout =
                        lock_core::raw::parse_duration_option(&name, &value, None)?
                }
                "connect_timeout" => {
                    cfg.connect_timeout =
                        lock_core::raw::parse_duration_option(&name, &value, None)?
                }
                given @ ("timeout" | "op_timeout") => {
                    let given = if given == "timeout" {
                        "timeout"
                    } else {
                        "op_timeout"
                    };
                    if let Some(earlier) = timeout_given.filter(|earlier| *earlier != given) {
                        return Err(config(format!(
                            "{earlier} and {given} are the same option (op_timeout is the older \
                             name of timeout): give only one"
                        )));
                    }
                    timeout_given = Some(given);
                    cfg.timeout = lock_core::raw::parse_duration_option(&name, &value, None)?
                }
                "root" => cfg.root = value.into_owned(),
                "acl" => {
                    cfg.acl = match &*value {
                        "open" => ZkAcl::Open,
                        "creator" => ZkAcl::Creator,
                        other => {
                            return Err(config(format!(
                                "acl must be open or creator, not {other:?}"
                            )));
                        }
                    }
                }
                "label" => cfg.label = Some(value.into_owned()),
                "session_watch_from" => cfg.session_watch_from = match &*value {
                    "off" => None,
                    n => Some(n.parse().map_err(|_| {
                        config(format!(
                            "session_watch_from must be a number of held locks or off, not {n:?}"
                        ))
                    })?),
                },
                other => return Err(config(format!("unknown option {other:?}"))),
            }
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the values (done by [`ZkLockConfig::from_url`] and by `connect`).
    ///
    /// # Errors
    /// [`Error::Config`] when a value is unusable.
    pub fn validate(&self) -> Result<()> {
        validate_hosts(&self.hosts)?;
        if let Some(chroot) = &self.chroot
            && validate_path("chroot", chroot).is_err()
        {
            return Err(config(format!(
                "chroot {chroot:?} must be an absolute ZooKeeper path other than / (e.g. /app)"
            )));
        }
        let root = self.root.trim_end_matches('/');
        if root.is_empty() {
            return Err(config(
                "root must be an absolute path other than / (e.g. /distlock)",
            ));
        }
        validate_path("root", root)?;
        // The session timeout travels as 32-bit milliseconds.
        let max_session = Duration::from_millis(i32::MAX as u64);
        check_durations(max_session, &[("session_timeout", self.session_timeout)])
            .map_err(config)?;
        check_durations(
            Self::MAX_TIMEOUT,
            &[
                ("connect_timeout", self.connect_timeout),
                ("timeout", self.timeout),
            ],
        )
        .map_err(config)?;
        if self.acl == ZkAcl::Creator && self.auth.is_none() {
            return Err(config("acl=creator needs user:password@ credentials"));
        }
        if let Some(label) = &self.label {
            HolderIdentity::check_label(label).map_err(|e| match e {
                Error::Config(why) => config(format!("label: {why}")),
                other => other,
            })?;
        }
        Ok(())
    }

    /// The lock root without a trailing slash.
    pub(crate) fn root(&self) -> &str {
        self.root.trim_end_matches('/')
    }

    /// The connect string `zookeeper-client` expects (`hosts[/chroot]`).
    pub fn connect_string(&self) -> String {
        match &self.chroot {
            Some(c) => format!("{}{c}", self.hosts),
            None => self.hosts.clone(),
        }
    }
}

fn config(msg: impl Into<String>) -> Error {
    Error::Config(format!("zk: {}", msg.into()))
}

/// `host[:port][,host[:port]...]`: no empty host, no control characters or whitespace, and a
/// port (when given) that is a number the network can use.
fn validate_hosts(hosts: &str) -> Result<()> {
    if hosts.is_empty() {
        return Err(config("no host"));
    }
    for host in hosts.split(',') {
        if host.is_empty() || host.chars().any(|c| c.is_control() || c.is_whitespace()) {
            return Err(config(format!("bad host {host:?} in {hosts:?}")));
        }
        if host.contains(['/', '?', '@', '#']) {
            return Err(config(format!(
                "bad host {host:?} (a chroot goes into the chroot field)"
            )));
        }
        if let Some((name, port)) = host.rsplit_once(':')
            && (name.is_empty() || port.parse::<u16>().map_or(true, |p| p == 0))
        {
            return Err(config(format!("bad port in {host:?}")));
        }
    }
    Ok(())
}

fn validate_path(what: &str, path: &str) -> Result<String> {
    let ok = path.starts_with('/')
        && path[1..]
            .split('/')
            .all(|seg| !seg.is_empty() && seg != "." && seg != "..")
        && !path.chars().any(char::is_control);
    if ok {
        Ok(path.to_owned())
    } else {
        Err(config(format!(
            "{what} {path:?} is not an absolute ZooKeeper path"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_option() {
        let c = ZkLockConfig::from_url(
            "zk://bob:s%40cret@h1:2181,h2:2182/app/x?session_timeout=1500ms&connect_timeout=2s&op_timeout=3ms&root=/locks/r&acl=creator&label=cron@web-1",
        )
        .unwrap();
        assert_eq!(c.hosts, "h1:2181,h2:2182");
        assert_eq!(c.chroot.as_deref(), Some("/app/x"));
        assert_eq!(c.connect_string(), "h1:2181,h2:2182/app/x");
        assert_eq!(c.session_timeout, Duration::from_millis(1500));
        assert_eq!(c.connect_timeout, Duration::from_secs(2));
        assert_eq!(c.timeout, Duration::from_millis(3));
        assert_eq!(c.root(), "/locks/r");
        assert_eq!(c.acl, ZkAcl::Creator);
        assert_eq!(c.auth, Some(("bob".into(), "s@cret".into())));
        assert_eq!(c.label.as_deref(), Some("cron@web-1"));
        let shown = format!("{c:?}");
        assert!(
            !shown.contains("s@cret") && shown.contains("redacted"),
            "{shown}"
        );
    }

    #[test]
    fn timeout_is_the_per_request_bound_and_op_timeout_its_alias() {
        let c = ZkLockConfig::from_url("zk://h:1?timeout=750ms&connect_timeout=2s").unwrap();
        assert_eq!(c.timeout, Duration::from_millis(750));
        assert_eq!(c.connect_timeout, Duration::from_secs(2));
        // The older name still works.
        let c = ZkLockConfig::from_url("zk://h:1?op_timeout=750ms").unwrap();
        assert_eq!(c.timeout, Duration::from_millis(750));
        // The same name twice is not a conflict (the last one counts, as for every option).
        let c = ZkLockConfig::from_url("zk://h:1?timeout=1s&timeout=750ms").unwrap();
        assert_eq!(c.timeout, Duration::from_millis(750));
        // Both names at once: one would be ignored, so neither is guessed.
        conformance::config_errors::assert_config_errors(
            ZkLockConfig::from_url,
            &[
                ("zk://h:1?timeout=1s&op_timeout=2s", "op_timeout"),
                ("zk://h:1?op_timeout=2s&timeout=1s", "op_timeout"),
                ("zk://h:1?timeout=1s&op_timeout=1s", "op_timeout"),
            ],
        );
    }

    #[test]
    fn defaults() {
        let c = ZkLockConfig::from_url("zk://127.0.0.1:2181").unwrap();
        assert_eq!(c.chroot, None);
        assert_eq!(c.root(), "/distlock");
        assert_eq!(c.session_timeout, Duration::from_secs(10));
        assert_eq!(c.acl, ZkAcl::Open);
    }

    #[test]
    fn rejects_bad_urls() {
        conformance::config_errors::assert_config_errors(
            ZkLockConfig::from_url,
            &[
                ("redis://h:1", "zk://"),
                ("zk://", "no host"),
                ("zk://h:1,", "no host"),
                ("zk://h:x", "bad port"),
                ("zk://h:1?nope=1", "nope"),
                ("zk://h:1?session_timeout=fast", "session_timeout"),
                ("zk://h:1?session_timeout=10x", "session_timeout"),
                ("zk://h:1?session_timeout=0", "session_timeout"),
                // A bare number is refused rather than read in some unit.
                ("zk://h:1?session_timeout=1500", "session_timeout"),
                ("zk://h:1?op_timeout=3", "op_timeout"),
                ("zk://h:1?root=/", "root"),
                ("zk://h:1?root=relative", "root"),
                ("zk://h:1?root=/a/../b", "root"),
                ("zk://h:1/a//b", "chroot"),
                ("zk://h:1?acl=creator", "acl"),
                ("zk://h:1?acl=weird", "acl"),
                ("zk://bob@h:1", "user:password"),
                ("zk://h:1?label=", "label"),
                ("zk://h:1?label=has%20space", "label"),
                ("zk://h:1?label=new%0Aline", "label"),
            ],
        );
    }
}

#[cfg(test)]
mod url_proptests {
    /// Any input gets a config or a typed error, never a panic; a password never shows.
    #[test]
    fn from_url_never_panics_or_shows_the_password() {
        conformance::check_url_parser("zk", super::ZkLockConfig::from_url);
    }
}
