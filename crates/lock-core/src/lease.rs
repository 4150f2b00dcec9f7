//! Leases and holder descriptions.

use std::{any::Any, fmt, sync::Arc, time::Duration};

use tokio::time::Instant;

use crate::{FencingToken, LockKey, OwnershipToken, TokenDigest};

/// What one successful acquisition grants: the key, the secret ownership token, the fencing
/// token (when the backend mints one), the TTL and a conservative local deadline.
///
/// The local deadline is measured on the monotonic clock from the moment the request was *sent*
/// (`sent_at + ttl - margin`), so it can only be earlier than the coordinator's own expiry. Stop
/// trusting the lease at that deadline even if the coordinator has not expired it yet.
///
/// A held lock keeps two leases (its guard's as granted, its renewal slot's as last renewed),
/// so the lease is kept small (issue 24): 88 bytes, where an `Option<FencingToken>`, a
/// `Duration` and two `Instant`s would take 112 — the deadline is kept as an offset from
/// `acquired_at`, the TTL in nanoseconds with the fence's presence in its top bit.
#[derive(Clone)]
pub struct Lease {
    key: LockKey,
    token: OwnershipToken,
    acquired_at: Instant,
    /// The local deadline, in nanoseconds after `acquired_at` (before it when negative).
    deadline: i64,
    /// The TTL in nanoseconds (at most 2⁶³ − 1: 292 years), and [`HAS_FENCING`].
    ttl: u64,
    /// The fencing token when `ttl` has [`HAS_FENCING`].
    fencing: u64,
    backend_state: Option<Arc<dyn Any + Send + Sync>>,
}

/// In [`Lease`]'s `ttl`: the lease has a fencing token.
const HAS_FENCING: u64 = 1 << 63;

/// `ttl` in nanoseconds, capped at 2⁶³ − 1 (292 years: past every backend's maximum TTL).
fn ttl_nanos(ttl: Duration) -> u64 {
    u64::try_from(ttl.as_nanos()).map_or(HAS_FENCING - 1, |n| n.min(HAS_FENCING - 1))
}

/// `at` as nanoseconds from `base` (negative before it), saturating at ±292 years — a
/// monotonic clock never spans that much, so the offset is exact.
fn offset(base: Instant, at: Instant) -> i64 {
    match at.checked_duration_since(base) {
        Some(after) => i64::try_from(after.as_nanos()).unwrap_or(i64::MAX),
        None => i64::try_from(base.duration_since(at).as_nanos()).map_or(i64::MIN, |n| -n),
    }
}

impl Lease {
    /// Builds a lease for a grant whose request was sent at `sent_at`.
    pub fn new(
        key: LockKey,
        token: OwnershipToken,
        fencing: Option<FencingToken>,
        ttl: Duration,
        sent_at: Instant,
    ) -> Self {
        let mut lease = Self {
            key,
            token,
            acquired_at: sent_at,
            deadline: 0,
            ttl: 0,
            fencing: fencing.map_or(0, |f| f.0),
            backend_state: None,
        };
        lease.set_ttl(ttl, fencing.is_some());
        lease.set_local_deadline(local_deadline(sent_at, ttl));
        lease
    }

    fn set_ttl(&mut self, ttl: Duration, fenced: bool) {
        self.ttl = ttl_nanos(ttl) | if fenced { HAS_FENCING } else { 0 };
    }

    fn set_local_deadline(&mut self, at: Instant) {
        self.deadline = offset(self.acquired_at, at);
    }

    /// Attaches driver-private state (a session lease id, a node path, …) to the lease.
    pub fn with_backend_state<T: Any + Send + Sync>(mut self, state: T) -> Self {
        self.backend_state = Some(Arc::new(state));
        self
    }

    /// The driver-private state attached with [`Lease::with_backend_state`], if it has type `T`.
    pub fn backend_state<T: Any + Send + Sync>(&self) -> Option<&T> {
        self.backend_state.as_deref()?.downcast_ref()
    }

    /// Attaches driver-private state the driver also keeps elsewhere (a reaper queue): the
    /// lease shares `state`'s allocation, where [`Lease::with_backend_state`] of an `Arc<T>`
    /// would add one of its own per lease. Read it with [`Lease::backend_state`] of `T` or
    /// [`Lease::shared_backend_state`].
    pub fn with_shared_backend_state<T: Any + Send + Sync>(mut self, state: Arc<T>) -> Self {
        self.backend_state = Some(state);
        self
    }

    /// The driver-private state attached with [`Lease::with_shared_backend_state`] (or
    /// [`Lease::with_backend_state`]), if it has type `T`, as a shared pointer.
    pub fn shared_backend_state<T: Any + Send + Sync>(&self) -> Option<Arc<T>> {
        self.backend_state.clone()?.downcast().ok()
    }

    /// Records a successful renewal whose request was sent at `sent_at`.
    pub fn renewed(&mut self, ttl: Duration, sent_at: Instant) {
        let fenced = self.ttl & HAS_FENCING != 0;
        self.set_ttl(ttl, fenced);
        self.set_local_deadline(local_deadline(sent_at, ttl));
    }

    /// Moves the local deadline to `at` if that is later: a renewal group's renewal renewed
    /// this lease (see [`crate::raw::RenewalGroup`]).
    pub(crate) fn extend_local_deadline(&mut self, at: Instant) {
        let at = self.local_deadline().max(at);
        self.set_local_deadline(at);
    }

    /// The lock key.
    pub fn key(&self) -> &LockKey {
        &self.key
    }

    /// The secret ownership token of this acquisition.
    pub fn token(&self) -> &OwnershipToken {
        &self.token
    }

    /// The fencing token minted with the grant, if the backend mints them.
    pub fn fencing_token(&self) -> Option<FencingToken> {
        (self.ttl & HAS_FENCING != 0).then_some(FencingToken(self.fencing))
    }

    /// The TTL of the last grant or renewal.
    pub fn ttl(&self) -> Duration {
        Duration::from_nanos(self.ttl & !HAS_FENCING)
    }

    /// When the granting request was sent (monotonic clock): the start of the hold.
    pub fn acquired_at(&self) -> Instant {
        self.acquired_at
    }

    /// The conservative local deadline (monotonic clock).
    pub fn local_deadline(&self) -> Instant {
        let magnitude = Duration::from_nanos(self.deadline.unsigned_abs());
        if self.deadline >= 0 {
            self.acquired_at + magnitude
        } else {
            // Exact: the offset was taken between two instants of this clock.
            self.acquired_at
                .checked_sub(magnitude)
                .unwrap_or(self.acquired_at)
        }
    }

    /// Time left before the local deadline (zero once it has passed).
    pub fn remaining(&self) -> Duration {
        self.local_deadline()
            .saturating_duration_since(Instant::now())
    }

    /// `true` while the local deadline has not passed.
    pub fn is_locally_valid(&self) -> bool {
        Instant::now() < self.local_deadline()
    }
}

/// The margin subtracted from a TTL for clock-rate differences and scheduling: 1 % + 5 ms,
/// never more than half the TTL.
pub fn drift_margin(ttl: Duration) -> Duration {
    (ttl / 100 + Duration::from_millis(5)).min(ttl / 2)
}

/// The conservative local deadline of a grant or renewal whose request was sent at `sent_at`.
pub(crate) fn local_deadline(sent_at: Instant, ttl: Duration) -> Instant {
    sent_at + ttl - drift_margin(ttl)
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("key", &self.key)
            .field("token", &self.token.digest())
            .field("fencing", &self.fencing_token())
            .field("ttl", &self.ttl())
            .field("remaining", &self.remaining())
            .finish_non_exhaustive()
    }
}

/// Who holds a key right now, as far as the coordinator knows (from [`crate::DistributedLock::inspect`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HolderInfo {
    /// Digest of the holder's ownership token (never the token itself).
    pub token_digest: Option<TokenDigest>,
    /// The holder's fencing token.
    pub fencing_token: Option<FencingToken>,
    /// Time left on the holder's lease, when the coordinator keeps one per lock.
    pub ttl_remaining: Option<Duration>,
    /// Contenders queued behind the holder, when the backend queues them.
    pub waiters: Option<usize>,
    /// Who the holder is (host, pid, label), when it recorded that next to its grant.
    pub holder: Option<HolderIdentity>,
}

/// A short, non-secret description of who holds a lock — host, process id, when the process
/// started using distlock, and an optional label — recorded by the holder next to its grant so
/// that [`crate::DistributedLock::inspect`] (and `distlock inspect`) can say who holds a lock.
///
/// It never contains the ownership token or credentials. Its text is printable ASCII of at
/// most [`HolderIdentity::MAX_LEN`] bytes, in the form
/// `host=web-1 pid=4242 since=1764578845 label=nightly-report`, so it is safe to log and to store
/// in any coordinator. Text read back from a coordinator (another client's record) goes through
/// [`HolderIdentity::from_stored`], which drops anything that is not printable.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct HolderIdentity(String);

impl HolderIdentity {
    /// The longest identity text, in bytes.
    pub const MAX_LEN: usize = 200;
    /// The longest label, in bytes.
    pub const MAX_LABEL_LEN: usize = 64;

    /// This process's identity, with an optional `label` (checked by
    /// [`HolderIdentity::check_label`]).
    ///
    /// # Errors
    /// [`crate::Error::Config`] for a label that is empty, too long, or not made of ASCII
    /// letters, digits and `-_.:/@`.
    pub fn process(label: Option<&str>) -> crate::Result<Self> {
        static SINCE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
        let since = *SINCE.get_or_init(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs())
        });
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .or_else(|| std::env::var("HOSTNAME").ok())
            .map(|h| sanitize(h.trim(), 64))
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "unknown".to_owned());
        let mut text = format!("host={host} pid={} since={since}", std::process::id());
        if let Some(label) = label {
            Self::check_label(label)?;
            text.push_str(" label=");
            text.push_str(label);
        }
        Ok(Self(sanitize(&text, Self::MAX_LEN)))
    }

    /// Checks a label before any I/O: 1 to [`HolderIdentity::MAX_LABEL_LEN`] bytes of ASCII
    /// letters, digits and `-_.:/@`.
    ///
    /// # Errors
    /// [`crate::Error::Config`] saying what is wrong.
    pub fn check_label(label: &str) -> crate::Result<()> {
        let ok = !label.is_empty()
            && label.len() <= Self::MAX_LABEL_LEN
            && label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.:/@".contains(&b));
        if ok {
            Ok(())
        } else {
            Err(crate::Error::Config(format!(
                "a holder label must be 1 to {} characters of ASCII letters, digits and -_.:/@",
                Self::MAX_LABEL_LEN
            )))
        }
    }

    /// An identity read back from a coordinator: anything not printable ASCII is dropped and the
    /// text is cut at [`HolderIdentity::MAX_LEN`]; `None` when nothing printable is left.
    pub fn from_stored(bytes: &[u8]) -> Option<Self> {
        let text = sanitize(&String::from_utf8_lossy(bytes), Self::MAX_LEN);
        (!text.trim().is_empty()).then(|| Self(text.trim().to_owned()))
    }

    /// The identity text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether the text is in the form [`HolderIdentity::process`] writes (`host=… pid=<digits>
    /// since=<digits>`, then ` label=<label>` or nothing) — a distlock holder's identity — and
    /// not some other text read back from a coordinator (a foreign peer's value).
    pub fn is_process_form(&self) -> bool {
        self.parts().is_some()
    }

    /// The label of an identity in the [process form](HolderIdentity::is_process_form); `None`
    /// without one or for any other text.
    pub fn label(&self) -> Option<&str> {
        self.parts().and_then(|(_, label)| label)
    }

    /// The identity's text without its label: `host=… pid=… since=…`; `None` unless in the
    /// [process form](HolderIdentity::is_process_form).
    pub fn unlabelled(&self) -> Option<&str> {
        self.parts().map(|(base, _)| base)
    }

    /// `(host=… pid=… since=…, label)` of an identity in the process form.
    fn parts(&self) -> Option<(&str, Option<&str>)> {
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        let rest = self.0.strip_prefix("host=")?;
        let (host, rest) = rest.rsplit_once(" pid=")?;
        let (pid, rest) = rest.split_once(" since=")?;
        let (since, label) = match rest.split_once(" label=") {
            Some((since, label)) => (since, Some(label)),
            None => (rest, None),
        };
        let ok = !host.is_empty()
            && digits(pid)
            && digits(since)
            && label.is_none_or(|l| Self::check_label(l).is_ok());
        let base = self.0.len() - label.map_or(0, |l| l.len() + " label=".len());
        ok.then(|| (&self.0[..base], label))
    }
}

/// Printable ASCII only (no control characters, no newlines), at most `max` bytes.
fn sanitize(text: &str, max: usize) -> String {
    text.chars()
        .filter(|c| c.is_ascii_graphic() || *c == ' ')
        .take(max)
        .collect()
}

impl fmt::Display for HolderIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for HolderIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HolderIdentity({:?})", self.0)
    }
}

#[cfg(test)]
mod identity_tests {
    use super::*;

    #[test]
    fn shared_backend_state_is_the_drivers_own_allocation() {
        let state = Arc::new(7_u32);
        let lease = Lease::new(
            LockKey::new("shared-state").unwrap(),
            OwnershipToken::generate(),
            None,
            Duration::from_secs(1),
            Instant::now(),
        )
        .with_shared_backend_state(state.clone());
        assert_eq!(lease.backend_state::<u32>(), Some(&7));
        let shared = lease.shared_backend_state::<u32>().unwrap();
        assert!(Arc::ptr_eq(&shared, &state));
        assert!(lease.shared_backend_state::<u64>().is_none());
        assert!(lease.backend_state::<Arc<u32>>().is_none());
    }

    #[test]
    fn the_process_identity_is_short_printable_and_carries_the_label() {
        let id = HolderIdentity::process(Some("nightly-report")).unwrap();
        let text = id.as_str();
        assert!(text.starts_with("host="), "{text}");
        assert!(
            text.contains(&format!(" pid={} ", std::process::id())),
            "{text}"
        );
        assert!(text.ends_with(" label=nightly-report"), "{text}");
        assert!(text.len() <= HolderIdentity::MAX_LEN);
        assert!(text.bytes().all(|b| b.is_ascii_graphic() || b == b' '));
    }

    #[test]
    fn bad_labels_are_config_errors() {
        for bad in ["", "has space", "new\nline", "é", &"x".repeat(65)] {
            assert!(
                matches!(
                    HolderIdentity::process(Some(bad)),
                    Err(crate::Error::Config(_))
                ),
                "{bad:?}"
            );
        }
        assert!(HolderIdentity::check_label("cron@web-1:/etc/cron.d/x").is_ok());
    }

    #[test]
    fn the_process_form_is_told_from_foreign_text_and_gives_its_label() {
        let labelled = HolderIdentity::process(Some("scheduler-a")).unwrap();
        assert!(labelled.is_process_form());
        assert_eq!(labelled.label(), Some("scheduler-a"));
        let bare = HolderIdentity::process(None).unwrap();
        assert_eq!((bare.is_process_form(), bare.label()), (true, None));
        assert_eq!(labelled.unlabelled(), Some(bare.as_str()));
        assert_eq!(bare.unlabelled(), Some(bare.as_str()));
        for foreign in [
            "10.0.0.7:8080",
            "host=a pid=x since=1",
            "host= pid=1 since=1",
            "host=a pid=1 since=1 label=has space",
            "pid=1 since=1",
        ] {
            let id = HolderIdentity::from_stored(foreign.as_bytes()).unwrap();
            assert!(!id.is_process_form(), "{foreign}");
            assert_eq!((id.label(), id.unlabelled()), (None, None), "{foreign}");
        }
    }

    #[test]
    fn stored_text_is_sanitized() {
        let id = HolderIdentity::from_stored(b"host=a\n\x1b[31mpid=1").unwrap();
        assert_eq!(id.as_str(), "host=a[31mpid=1");
        assert!(HolderIdentity::from_stored(b"\n\t").is_none());
        let long = vec![b'a'; 500];
        assert_eq!(
            HolderIdentity::from_stored(&long).unwrap().as_str().len(),
            HolderIdentity::MAX_LEN
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(fencing: Option<FencingToken>, ttl: Duration, sent_at: Instant) -> Lease {
        Lease::new(
            LockKey::new("lease-repr").unwrap_or_else(|e| panic!("{e}")),
            OwnershipToken::generate(),
            fencing,
            ttl,
            sent_at,
        )
    }

    /// Issue 24: a held lock keeps two leases; the compact form stays exact.
    #[test]
    fn a_lease_is_small_and_keeps_its_values_exactly() {
        assert!(
            size_of::<Lease>() <= 88,
            "a lease takes {} B",
            size_of::<Lease>()
        );
        let now = Instant::now();
        for (fencing, ttl) in [
            (None, Duration::from_millis(1)),
            (Some(FencingToken(0)), Duration::from_nanos(1_234_567_891)),
            (
                Some(FencingToken(u64::MAX)),
                Duration::from_secs(30 * 86_400),
            ),
        ] {
            let mut l = lease(fencing, ttl, now);
            assert_eq!(l.fencing_token(), fencing);
            assert_eq!(l.ttl(), ttl);
            assert_eq!(l.acquired_at(), now);
            assert_eq!(l.local_deadline(), local_deadline(now, ttl));
            // A renewal sent before the grant (a shared keepalive's send time): the deadline
            // falls before `acquired_at` when the TTL is short enough, and stays exact.
            let before = now.checked_sub(Duration::from_secs(5)).unwrap_or(now);
            l.renewed(Duration::from_millis(10), before);
            assert_eq!(
                l.local_deadline(),
                local_deadline(before, Duration::from_millis(10))
            );
            assert_eq!(l.ttl(), Duration::from_millis(10));
            assert_eq!(l.fencing_token(), fencing, "a renewal keeps the fence");
            l.extend_local_deadline(now + Duration::from_secs(3));
            assert_eq!(l.local_deadline(), now + Duration::from_secs(3));
            l.extend_local_deadline(now);
            assert_eq!(
                l.local_deadline(),
                now + Duration::from_secs(3),
                "never moved back"
            );
        }
        // A TTL past 292 years is capped there (no backend grants one).
        let huge = Duration::from_secs(1 << 40);
        let l = lease(None, huge, now);
        assert_eq!(l.ttl(), Duration::from_nanos(u64::MAX >> 1));
        // Its deadline saturates 292 years out: earlier, never later, than asked.
        assert!(l.local_deadline() <= local_deadline(now, huge));
        assert!(l.local_deadline() > now + Duration::from_secs(290 * 365 * 86_400));
    }
}
