//! Renewal: renewals batched per client (one statement, one durable commit for up to
//! [`MAX_RENEW_BATCH`] leases), each lease's new local deadline counted from before it was
//! queued.

use std::{collections::HashSet, sync::Arc, time::Duration};

use lock_core::raw::{Error, Lease, LockKey, OwnershipToken, Result};
use sqlx::Row;
use tokio::time::Instant;

use crate::{
    client::{Failure, PgError},
    lock::{BACKEND, Inner, lease_fence, micros},
};

impl Inner {
    /// Renews through the client's [`Batcher`](lock_core::raw::Batcher): a lone renewal is sent at once; renewals that
    /// arrive while one is in flight go together in the next statement (one transaction, one
    /// durable commit for up to [`MAX_RENEW_BATCH`] leases).
    pub(crate) async fn renew(self: &Arc<Self>, lease: &mut Lease, ttl: Duration) -> Result<()> {
        const OP: &str = "renew";
        let key = lease.key().clone();
        let item = Renewal {
            name: key.clone(),
            token: *lease.token(),
            fence: lease_fence(lease, OP)?,
            ttl_micros: micros(ttl),
        };
        // Taken before queueing: the statement can only start later, so the local deadline
        // computed from it is conservative.
        let sent_at = Instant::now();
        let inner = Arc::clone(self);
        let answer = self
            .renewals
            .submit(item, move |batch| {
                let inner = Arc::clone(&inner);
                async move { inner.renew_batch(batch).await }
            })
            .await;
        match answer {
            Some(Ok(true)) => {
                lease.renewed(ttl, sent_at);
                Ok(())
            }
            Some(Ok(false)) => Err(Error::not_held(&key)),
            Some(Err(failure)) => Err(failure.into_error(OP, &key)),
            // The batch task died (panic, runtime shutdown): it may have been applied.
            None => Err(Error::Indeterminate {
                backend: BACKEND,
                op: OP,
                key: key.as_str().to_owned(),
                message: "the renewal batch ended without an answer".to_owned(),
            }),
        }
    }

    /// Renews a batch of leases, one statement per group of distinct names (normally one),
    /// and answers per lease: renewed, no longer held, or the statement's failure.
    async fn renew_batch(&self, batch: Vec<Renewal>) -> Vec<RenewAnswer> {
        // Every index is in exactly one group, so each answer is set below.
        let mut answers: Vec<RenewAnswer> = vec![Ok(false); batch.len()];
        for mut group in distinct_name_groups(&batch) {
            // Bound in name order (the statement also locks in name order).
            group.sort_by(|&a, &b| batch[a].name.as_str().cmp(batch[b].name.as_str()));
            let names: Vec<&str> = group.iter().map(|&i| batch[i].name.as_str()).collect();
            // Every owner's 32 hex digits in one buffer, bound as slices of it (ASCII, so each
            // slice exists; were one missing, the empty owner would match no row: not renewed).
            let hex: String = group
                .iter()
                .flat_map(|&i| batch[i].token.expose_hex_bytes())
                .map(char::from)
                .collect();
            let owners: Vec<&str> = (0..group.len())
                .map(|k| hex.get(32 * k..32 * (k + 1)).unwrap_or_default())
                .collect();
            let fences: Vec<i64> = group.iter().map(|&i| batch[i].fence).collect();
            let ttls: Vec<i64> = group.iter().map(|&i| batch[i].ttl_micros).collect();
            let outcome = self
                .fetch_all_idempotent(
                    || {
                        sqlx::query(self.sql().renew.clone())
                            .bind(&names)
                            .bind(&owners)
                            .bind(&fences)
                            .bind(&ttls)
                    },
                    self.request_deadline(),
                )
                .await
                .map(|(rows, _)| rows);
            let renewed = outcome
                .map_err(Failure::from)
                .and_then(|rows| renewed_in_group(&rows, group.len()));
            for (k, &i) in group.iter().enumerate() {
                answers[i] = match &renewed {
                    Ok(renewed) => Ok(renewed[k]),
                    Err(failure) => Err(failure.clone()),
                };
            }
        }
        answers
    }
}

/// Which of a group's `len` leases the renew statement's `rows` renewed: each row is one
/// lease's 1-based position in the bound arrays. A position outside them (never written by
/// our statement) fails the group: no renewal is confirmed on an answer that cannot be read.
fn renewed_in_group(
    rows: &[sqlx::postgres::PgRow],
    len: usize,
) -> std::result::Result<Vec<bool>, Failure> {
    let mut renewed = vec![false; len];
    for row in rows {
        let at = row
            .try_get::<i64, _>(0)
            .map_err(|e| Failure::refused(PgError::new(e)))?;
        let slot = usize::try_from(at)
            .ok()
            .and_then(|at| at.checked_sub(1))
            .and_then(|k| renewed.get_mut(k))
            .ok_or_else(|| {
                Failure::refused(PgError::new(sqlx::Error::Protocol(format!(
                    "the renew statement answered position {at} for {len} leases"
                ))))
            })?;
        *slot = true;
    }
    Ok(renewed)
}

/// The most leases renewed by one statement.
pub(crate) const MAX_RENEW_BATCH: usize = 1000;

/// One lease to renew, as bound into the batch statement.
pub(crate) struct Renewal {
    /// The lock's name (its table row); shared with the lease, not copied.
    name: LockKey,
    /// Its owner column is the token's hex, written when the batch is bound.
    token: OwnershipToken,
    fence: i64,
    ttl_micros: i64,
}

/// Renewed (`true`), no longer held (`false`), or the batch statement's failure.
pub(crate) type RenewAnswer = std::result::Result<bool, Failure>;

/// Splits a batch into groups of distinct names (indices into `batch`, in submission order).
/// The same lease renewed twice at once (say, by its watchdog and by hand) lands in a second
/// group, run after the first, so each renewal applies its own TTL and is answered on its own.
fn distinct_name_groups(batch: &[Renewal]) -> Vec<Vec<usize>> {
    let mut groups: Vec<(HashSet<&str>, Vec<usize>)> = Vec::new();
    for (i, item) in batch.iter().enumerate() {
        let name = item.name.as_str();
        // The first group the name is new to takes it (one hash per group tried: normally one).
        match groups
            .iter_mut()
            .find_map(|(names, indices)| names.insert(name).then_some(indices))
        {
            Some(indices) => indices.push(i),
            None => groups.push((HashSet::from([name]), vec![i])),
        }
    }
    groups.into_iter().map(|(_, indices)| indices).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_splits_into_groups_of_distinct_names() {
        let item = |name: &str| Renewal {
            name: LockKey::new(name).unwrap(),
            token: OwnershipToken::generate(),
            fence: 1,
            ttl_micros: 1,
        };
        let batch: Vec<Renewal> = ["a", "b", "a", "c", "a", "b"].map(item).into();
        assert_eq!(
            distinct_name_groups(&batch),
            vec![vec![0, 1, 3], vec![2, 5], vec![4]]
        );
        assert!(distinct_name_groups(&[]).is_empty());
    }
}
