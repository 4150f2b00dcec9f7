//! Renewal: one lease's compare-and-extend, its local-deadline accounting (counted from the
//! renewal's send time, moved only by a confirmed answer), and the batching of the renewals of
//! one client (one multi-key script call per [`RENEW_CHUNK`] locks, per slot on a Cluster).

use std::{sync::Arc, time::Duration};

use lock_core::raw::{Error, Lease, LockKey, OwnershipToken, Result};
use tokio::time::{Instant, timeout};

use crate::{
    client::{Acked, Failure, classify, map_failure},
    keys::{KeyNames, key_slot},
    lock::Inner,
    scripts::ttl_millis,
};

/// At most this many renewals are handed to one run of the batch function (its chunks are
/// sent concurrently on the multiplexed connection).
pub(crate) const RENEW_BATCH: usize = 16 * RENEW_CHUNK;
/// At most this many keys per renew script call, so that one call keeps the server busy for
/// well under a millisecond and other clients' commands interleave between chunks.
pub(crate) const RENEW_CHUNK: usize = 500;

/// One lock's part in a batched renewal: no allocation of its own (the key is shared, the
/// token copied); its key names and owner prefix are written straight into the batch's
/// request ([`renew_chunk`]).
pub(crate) struct RenewItem {
    key: LockKey,
    token: OwnershipToken,
    ttl_ms: u64,
}

/// Renewals are batched: while one batch is in flight, the renewals that arrive are queued
/// and go out together in the next (a lone renewal is sent at once).
pub(crate) async fn renew(inner: &Arc<Inner>, lease: &mut Lease, ttl: Duration) -> Result<()> {
    let item = RenewItem {
        key: lease.key().clone(),
        token: *lease.token(),
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
    let mut lock = Vec::new();
    for (i, item) in items.iter().enumerate() {
        lock.clear();
        KeyNames::write_lock(&inner.config.namespace, &item.key, &mut lock);
        by_slot.entry(key_slot(&lock)).or_default().push(i);
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

/// The renew script's `EVALSHA` for `chunk`, written straight into one command buffer: KEYS
/// the locks then their holder keys, ARGV each lock's owner prefix and TTL in ms. (Through
/// `redis::ScriptInvocation` every name and argument would be a vector of its own, copied
/// again into the command: at 100,000 held locks that was most of a tick's allocations.)
fn renew_command(namespace: &str, sha: &str, chunk: &[RenewItem]) -> redis::Cmd {
    let names: usize = chunk
        .iter()
        .map(|item| namespace.len() + item.key.as_str().len())
        .sum();
    // Per lock: its name, the holder's (the name and ~16 bytes), the prefix (33) and the TTL.
    let mut cmd = redis::Cmd::with_capacity(3 + 4 * chunk.len(), 2 * names + 80 * chunk.len());
    cmd.arg("EVALSHA").arg(sha).arg(2 * chunk.len());
    // The lock names, written once: each is a key and then derives its holder key.
    let mut locks = Vec::with_capacity(names);
    let mut ends = Vec::with_capacity(chunk.len());
    for item in chunk {
        let start = locks.len();
        KeyNames::write_lock(namespace, &item.key, &mut locks);
        cmd.arg(&locks[start..]);
        ends.push(locks.len());
    }
    let mut holder = Vec::new();
    let mut start = 0;
    for end in ends {
        holder.clear();
        KeyNames::write_holder(&locks[start..end], &mut holder);
        cmd.arg(&holder[..]);
        start = end;
    }
    let mut prefix = [0u8; 33];
    prefix[32] = b':';
    for item in chunk {
        prefix[..32].copy_from_slice(&item.token.expose_hex_bytes());
        cmd.arg(&prefix[..]).arg(item.ttl_ms);
    }
    cmd
}

/// Sends `cmd` (an `EVALSHA` of `script`); when the server does not know the script (a restart
/// or `SCRIPT FLUSH`: the script did not run), loads it and sends `cmd` again, as
/// `redis::Script::invoke_async` does.
async fn evalsha<T: redis::FromRedisValue>(
    script: &redis::Script,
    cmd: &redis::Cmd,
    conn: &mut impl redis::aio::ConnectionLike,
) -> redis::RedisResult<T> {
    match cmd.query_async(conn).await {
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            script.load_async(conn).await?;
            cmd.query_async(conn).await
        }
        other => other,
    }
}

async fn renew_chunk(inner: &Inner, chunk: &[RenewItem]) -> Vec<Result<bool, Failure>> {
    let script = &inner.scripts.renew;
    let cmd = renew_command(&inner.config.namespace, script.get_hash(), chunk);
    let budget = inner.config.request_budget();
    let mut conn = Acked::new(&inner.conn, &inner.config);
    let reply = if inner.config.replicas > 0 {
        timeout(budget, evalsha::<Vec<i64>>(script, &cmd, &mut conn)).await
    } else {
        timeout(
            budget,
            evalsha::<Vec<i64>>(script, &cmd, &mut inner.conn.clone()),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scripts::owner_prefix;

    /// The command written straight into one buffer is, byte for byte, the one built from
    /// the key names' own functions: plain keys, a key with a hash tag, and one with a `}` but
    /// no tag (whose derived keys take a computed tag).
    #[test]
    fn the_renew_command_names_each_lock_its_holder_key_prefix_and_ttl() {
        let namespace = "distlock:";
        let chunk: Vec<RenewItem> = ["orders/1", "user:{42}:cart", "odd}key", "x"]
            .iter()
            .enumerate()
            .map(|(i, k)| RenewItem {
                key: LockKey::new(*k).unwrap(),
                token: OwnershipToken::generate(),
                ttl_ms: 1_000 * (i as u64 + 1),
            })
            .collect();
        let names: Vec<KeyNames> = chunk
            .iter()
            .map(|item| KeyNames::new(namespace, &item.key))
            .collect();
        let mut expected = redis::cmd("EVALSHA");
        expected.arg("0123abcd").arg(2 * chunk.len());
        for n in &names {
            expected.arg(&n.lock);
        }
        for n in &names {
            expected.arg(n.holder());
        }
        for item in &chunk {
            expected.arg(owner_prefix(&item.token)).arg(item.ttl_ms);
        }
        assert_eq!(
            renew_command(namespace, "0123abcd", &chunk).get_packed_command(),
            expected.get_packed_command()
        );
    }
}
