//! Renewal groups: leases that one coordinator request renews together (an etcd lease every
//! lock entry of a session is attached to, a ZooKeeper session every ephemeral node belongs
//! to). A guard whose lease belongs to a group is renewed by the group's renewal alone, so a
//! tick of any number of such guards costs one request and a constant amount of work in
//! lock-core's scheduler, not a renewal per lock (issue 24).
//!
//! A driver offers a group with [`Driver::renewal_group`](super::Driver::renewal_group). The
//! contract that keeps the lease invariant — a local deadline is never later than the earliest
//! moment the coordinator could grant the key to someone else — is on [`RenewalGroup`].

use std::{fmt, sync::Arc, time::Duration};

use futures::future::BoxFuture;
use tokio::time::Instant;

use crate::{Error, Lease, LossReason, raw::LostSink};

/// One renewal shared by many leases.
///
/// # The contract
/// - **One proof for all.** [`RenewalGroup::renew`] answering `Ok(sent_at)` proves that every
///   member — every lease [`joined`](RenewalGroup::join) and not [left](RenewalGroup::leave)
///   whose loss the driver has not pushed through its
///   [`watch_lost`](crate::DistributedLock::watch_lost) — is held by the coordinator until at
///   least `sent_at + ttl` by the coordinator's clock, `ttl` being the one the group was asked to
///   renew with (every member's lease has that TTL). lock-core moves every member's local
///   deadline to `sent_at + ttl - drift_margin(ttl)`.
/// - **A member's own deadline speaks for the group.** A lease's local deadline when it joins
///   is a proof about the whole group (it was counted from a request that kept the group's
///   shared lease or session alive), so lock-core may move the group's deadline to it.
/// - **Per-member losses are pushed.** A member whose grant is gone while the group lives (an
///   operator's `release --force`, a node deleted) must be reported — to the [`LostSink`] it
///   joined with when [`RenewalGroup::join`] took it, else by its `watch_lost` — and, when a
///   renewal finds it gone, reported before that renewal answers: a group renewal never
///   answers for one member.
/// - **While a lease is a member, the driver expects no renewal of it of its own**: it must
///   not expire it for lack of one (a reaper deleting entries nobody renewed). After
///   [`RenewalGroup::leave`] the lease is the driver's again, with the deadline the group's
///   renewals gave it.
///
/// `id` says which handles are the same group: two handles with one id are one group.
pub trait RenewalGroup: Send + Sync + fmt::Debug + 'static {
    /// The group's identity (equal for every handle of one group, for as long as any handle
    /// lives).
    fn id(&self) -> usize;

    /// `lease` is renewed by this group from now on. Answers whether the driver pushes the
    /// member's loss to `lost` (keeping a clone until [`RenewalGroup::leave`]); if not,
    /// lock-core keeps and polls the lease's
    /// [`watch_lost`](crate::DistributedLock::watch_lost) future instead. Pushing saves that
    /// future per held lock.
    ///
    /// Called under the scheduler's lock: it must not block or wait, and may call nothing of
    /// lock-core's but `lost` (which it may, at once, for a lease it knows gone).
    fn join(&self, lease: &Lease, lost: &LostSink) -> bool;

    /// `lease` is no longer renewed by this group (released, or its guard gone).
    fn leave(&self, lease: &Lease);

    /// `lease` was lost while a member — its group's loss decided (which may come before its
    /// deadline, while the coordinator still holds it), or its own loss pushed — and leaves the
    /// group as [`RenewalGroup::leave`]. Nobody holds it any more: a driver whose coordinator
    /// keeps a lost member's entry for as long as its session lives removes it here. The
    /// default is `leave`.
    fn leave_lost(&self, lease: &Lease) {
        self.leave(lease);
    }

    /// Renews every member with `ttl`; `until` bounds the wait. Answers when the proof's
    /// request was sent.
    ///
    /// # Errors
    /// [`GroupRenewError::Lost`] when every member is gone (the shared lease or session
    /// ended); [`GroupRenewError::Failed`] otherwise (retried until the members' deadline when
    /// [`Error::is_temporary`]).
    fn renew(
        &self,
        ttl: Duration,
        until: Instant,
    ) -> BoxFuture<'static, Result<Instant, GroupRenewError>>;
}

/// Why a group's renewal did not renew it.
#[derive(Debug)]
pub enum GroupRenewError {
    /// Every member is gone, for this reason.
    Lost(LossReason),
    /// The renewal failed; the members may still be held.
    Failed(Error),
}

/// A shared handle of a [`RenewalGroup`].
pub type SharedGroup = Arc<dyn RenewalGroup>;
