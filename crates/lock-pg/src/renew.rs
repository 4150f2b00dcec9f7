//! Renewal: renewals batched per client (one statement, one durable commit for up to
//! [`MAX_RENEW_BATCH`] leases), each lease's new local deadline counted from before it was
//! queued.

use std::{collections::HashSet, sync::Arc, time::Duration};

use lock_core::raw::{Error, Lease, Result};
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
            name: key.as_str().to_owned(),
            owner: lease.token().expose_hex(),
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
            group.sort_by(|&a, &b| batch[a].name.cmp(&batch[b].name));
            let names: Vec<&str> = group.iter().map(|&i| batch[i].name.as_str()).collect();
            let owners: Vec<&str> = group.iter().map(|&i| batch[i].owner.as_str()).collect();
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
            let renewed = outcome.map_err(Failure::from).and_then(|rows| {
                rows.iter()
                    .map(|row| row.try_get::<String, _>(0))
                    .collect::<std::result::Result<HashSet<String>, _>>()
                    .map_err(|e| Failure::refused(PgError::new(e)))
            });
            for &i in &group {
                answers[i] = match &renewed {
                    Ok(names) => Ok(names.contains(&batch[i].name)),
                    Err(failure) => Err(failure.clone()),
                };
            }
        }
        answers
    }
}

/// The most leases renewed by one statement.
pub(crate) const MAX_RENEW_BATCH: usize = 1000;

/// One lease to renew, as bound into the batch statement.
pub(crate) struct Renewal {
    name: String,
    owner: String,
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
        match groups
            .iter_mut()
            .find(|(names, _)| !names.contains(item.name.as_str()))
        {
            Some((names, indices)) => {
                names.insert(&item.name);
                indices.push(i);
            }
            None => groups.push((HashSet::from([item.name.as_str()]), vec![i])),
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
            name: name.to_owned(),
            owner: String::new(),
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
