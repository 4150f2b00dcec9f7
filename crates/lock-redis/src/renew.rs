//! Renewal: one lease's compare-and-extend, its local-deadline accounting (counted from the
//! renewal's send time, moved only by a confirmed answer), and the batching of the renewals of
//! one client (one multi-key script call per [`RENEW_CHUNK`] locks, per slot on a Cluster).

use std::{sync::Arc, time::Duration};

use lock_core::raw::{Error, Lease, Result};
use tokio::time::{Instant, timeout};

use crate::{
    client::{Acked, Failure, classify, map_failure},
    keys::{KeyNames, key_slot},
    lock::Inner,
    scripts::{owner_prefix, ttl_millis},
};

/// At most this many renewals are handed to one run of the batch function (its chunks are
/// sent concurrently on the multiplexed connection).
pub(crate) const RENEW_BATCH: usize = 16 * RENEW_CHUNK;
/// At most this many keys per renew script call, so that one call keeps the server busy for
/// well under a millisecond and other clients' commands interleave between chunks.
pub(crate) const RENEW_CHUNK: usize = 500;

/// One lock's part in a batched renewal.
pub(crate) struct RenewItem {
    lock: Vec<u8>,
    holder: Vec<u8>,
    prefix: String,
    ttl_ms: u64,
}

/// Renewals are batched: while one batch is in flight, the renewals that arrive are queued
/// and go out together in the next (a lone renewal is sent at once).
pub(crate) async fn renew(inner: &Arc<Inner>, lease: &mut Lease, ttl: Duration) -> Result<()> {
    let names = KeyNames::new(&inner.config.namespace, lease.key());
    let item = RenewItem {
        holder: names.holder(),
        lock: names.lock,
        prefix: owner_prefix(lease.token()),
        ttl_ms: ttl_millis(ttl),
    };
    // Taken before queueing: time spent waiting for an earlier batch only makes the new
    // local deadline earlier (conservative).
    let sent_at = Instant::now();
    let batch = inner.clone();
    let answer = inner
        .renewals
        .submit(item, move |items| renew_batch(batch.clone(), items))
        .await;
    match answer {
        Some(Ok(true)) => {
            lease.renewed(ttl, sent_at);
            Ok(())
        }
        Some(Ok(false)) => Err(Error::not_held(lease.key())),
        Some(Err(failure)) => Err(map_failure(&inner.config, "renew", lease.key(), failure)),
        // The batch task died (runtime shutdown): the request may have been sent.
        None => Err(map_failure(
            &inner.config,
            "renew",
            lease.key(),
            Failure::Unknown("the renewal batch ended without an answer".to_owned()),
        )),
    }
}

/// Renews a batch: one script call per [`RENEW_CHUNK`] locks, all in flight together on the
/// multiplexed connection. Every item of a failed call gets that call's failure; the other
/// chunks are unaffected.
async fn renew_batch(inner: Arc<Inner>, items: Vec<RenewItem>) -> Vec<Result<bool, Failure>> {
    if !inner.conn.is_cluster() {
        let chunks = items
            .chunks(RENEW_CHUNK)
            .map(|chunk| renew_chunk(&inner, chunk));
        return futures::future::join_all(chunks)
            .await
            .into_iter()
            .flatten()
            .collect();
    }
    // On a Cluster one script call may only touch one slot: group by slot, answer in order.
    let mut by_slot: std::collections::BTreeMap<u16, Vec<usize>> = Default::default();
    for (i, item) in items.iter().enumerate() {
        by_slot.entry(key_slot(&item.lock)).or_default().push(i);
    }
    let mut groups: Vec<(Vec<usize>, Vec<RenewItem>)> = Vec::new();
    let mut items: Vec<Option<RenewItem>> = items.into_iter().map(Some).collect();
    for indices in by_slot.into_values() {
        for part in indices.chunks(RENEW_CHUNK) {
            let chunk = part.iter().filter_map(|i| items[*i].take()).collect();
            groups.push((part.to_vec(), chunk));
        }
    }
    let answers =
        futures::future::join_all(groups.iter().map(|(_, chunk)| renew_chunk(&inner, chunk))).await;
    let mut out: Vec<Result<bool, Failure>> = (0..items.len())
        .map(|_| Err(Failure::Unknown("the renewal was not sent".to_owned())))
        .collect();
    for ((indices, _), answer) in groups.iter().zip(answers) {
        for (i, a) in indices.iter().zip(answer) {
            out[*i] = a;
        }
    }
    out
}

async fn renew_chunk(inner: &Inner, chunk: &[RenewItem]) -> Vec<Result<bool, Failure>> {
    let mut invocation = inner.scripts.renew.prepare_invoke();
    for item in chunk {
        invocation.key(&item.lock);
    }
    for item in chunk {
        invocation.key(&item.holder);
    }
    for item in chunk {
        invocation.arg(&item.prefix).arg(item.ttl_ms);
    }
    let budget = inner.config.request_budget();
    let mut conn = Acked::new(&inner.conn, &inner.config);
    let reply = if inner.config.replicas > 0 {
        timeout(budget, invocation.invoke_async::<Vec<i64>>(&mut conn)).await
    } else {
        timeout(
            budget,
            invocation.invoke_async::<Vec<i64>>(&mut inner.conn.clone()),
        )
        .await
    };
    let failure = match reply {
        Ok(Ok(replies)) if replies.len() == chunk.len() => {
            let confirmed = if inner.config.replicas > 0 {
                conn.confirmed()
            } else {
                Ok(())
            };
            // A renewal the replicas did not all acknowledge may be lost on a failover: its
            // outcome is unknown (a lock that is no longer ours stays `NotHeld`).
            return replies
                .into_iter()
                .map(|n| match (&confirmed, n == 1) {
                    (Err(message), true) => Err(Failure::Unknown(message.clone())),
                    (_, held) => Ok(held),
                })
                .collect();
        }
        // Cannot happen with our script; whatever it did, the renewals are not confirmed.
        Ok(Ok(replies)) => Failure::Unknown(format!(
            "the renew script answered {} values for {} locks",
            replies.len(),
            chunk.len()
        )),
        Ok(Err(e)) => classify(e),
        Err(_) => Failure::Unknown(format!("no reply within {budget:?}")),
    };
    vec![Err(failure); chunk.len()]
}
