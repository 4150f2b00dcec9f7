//! The wire: the Lua scripts (each step is atomic on the server) and the values they store,
//! take and answer (owner prefixes, TTLs in ms, fences, holder keys). Sent with EVALSHA; the
//! `redis` crate reloads a script (SCRIPT LOAD) when the server answers NOSCRIPT (after a
//! restart or SCRIPT FLUSH).
//!
//! # Waiter queue members
//!
//! A waiting `acquire` registers as
//! `<client id>:<waiter id>:<seq>:<ttl ms>:<grant token hex>:<holder identity>`: its client's
//! wake channel, its number there, the number of the attempt that wrote the member, the TTL a
//! release grants it (its first lease: min(its TTL, 1.5 s), see `queue::HANDOFF_LEASE`), the
//! random token it would hold the lock with and the identity recorded with its
//! grant. A release hands the lock to the oldest live member directly (see [`grant_next!`]);
//! a member without the identity (a client from before identities) is granted too, without one.
//! Members of the older form `<client id>:<waiter id>` (a client from before grants, in a
//! rolling upgrade) are only woken.
//!
//! # The holder key
//!
//! Every grant made by these scripts also writes the lock's holder key (see
//! [`crate::keys::KeyNames::holder`]) with `<token hex>:<fence> <holder identity>`, in the same
//! step and with the same TTL; a renewal extends both and a release deletes both. `inspect`
//! shows the identity only when its `<token hex>:<fence>` is the lock's current value (less a
//! `:w` mark), so a grant by a client that writes no holder key (an older version, another
//! library) never shows a previous holder's identity.

use std::time::Duration;

use lock_core::raw::{FencingToken, HolderIdentity, OwnershipToken};
use redis::Script;

/// KEYS: lock, fence counter, the attempt's undo marker, the holder key, and when the caller
/// waits: the waiter queue and the undo marker of its grant prefix. ARGV: owner prefix
/// (`<token hex>:`), ttl in ms, the holder identity, and when the caller waits: its new member,
/// the registration's lifetime in ms, its grant prefix (`<grant token hex>:`) and then its
/// earlier members that may still be queued (a bounded number).
///
/// A lock already held by this very attempt's prefix is its own grant, re-sent (the cluster
/// client re-sends a request whose connection dropped before the reply): its fence is
/// returned again, so the re-sent attempt is not mistaken for a refusal that leaves its own
/// grant stranded until the TTL.
///
/// An undo marker (see [`RELEASE`]) says that the clean-up of this attempt (or of the whole
/// waiting `acquire`) has already run: the attempt arrived late, after its sender gave up on
/// it, and does nothing at all (no grant, no registration; an error reply nobody reads).
/// Returns the fence (a string of decimal digits) when granted to the owner prefix; `{fence}`
/// (an array of one string) when a release had already granted the lock to the waiter's grant
/// token (the wake-up was missed or crossed this attempt; the lock's TTL is then restarted, so
/// the attempt's send time starts the lease); the holder's pttl (an integer) when held (one
/// scalar reply instead of an array: measurably cheaper to build and to parse).
///
/// The counter is incremented first, in the same atomic step as the `SET NX` that grants, and
/// the grant stores `<token hex>:<fence>` so `inspect` can tell our holders (and their fence)
/// from other clients', and writes the holder key with the same TTL. A grant already made to the
/// waiter by a release restarts the holder key's TTL with the lock's. The fence is the counter's own string, read back after `INCR`: Redis
/// hands `INCR`'s integer to Lua as a double, exact only up to 2^53, so neither the stored
/// value nor the reply ever goes through a Lua number (fences are exact up to `i64::MAX`, where
/// `INCR` fails). A refused attempt also consumes a number: grants' fences still strictly
/// increase, with gaps (one command less than checking `EXISTS` first). An unusable counter
/// (wrong type, overflow) fails the script before anything is written.
///
/// A waiter that finds the lock held registers in the queue (score: its registration's expiry,
/// server time; its earlier members are removed in the same step; the queue key's TTL only ever
/// grows, `PEXPIRE … GT` (Redis 7), so it lives as long as its longest registration and a
/// client with a short lifetime never expires the others') and marks the holder's value
/// with the suffix `:w` (only a value in our format, never another client's; `APPEND` keeps the
/// TTL), so that the release hands over. A waiter that gets the lock leaves the queue in the same
/// step, and marks its own value when others are still queued.
const ACQUIRE: &str = r"
if redis.call('EXISTS', KEYS[3]) == 1 or (KEYS[6] and redis.call('EXISTS', KEYS[6]) == 1) then
  return redis.error_reply('distlock: a late attempt, already undone by its clean-up')
end
local incr = redis.pcall('INCR', KEYS[2])
if type(incr) == 'table' then
  return redis.error_reply('distlock fence counter: ' .. tostring(incr.err))
end
local fence = redis.call('GET', KEYS[2])
if redis.call('SET', KEYS[1], ARGV[1] .. fence, 'NX', 'PX', ARGV[2]) then
  redis.call('SET', KEYS[4], ARGV[1] .. fence .. ' ' .. ARGV[3], 'PX', ARGV[2])
  if KEYS[5] then
    redis.call('ZREM', KEYS[5], ARGV[4], unpack(ARGV, 7))
    if redis.call('ZCARD', KEYS[5]) > 0 then
      redis.call('APPEND', KEYS[1], ':w')
    end
  end
  return fence
end
local value = redis.pcall('GET', KEYS[1])
if type(value) == 'string' and string.sub(value, 1, #ARGV[1]) == ARGV[1] then
  return string.match(value, '^%x+:(%d+)')
end
if KEYS[5] then
  if type(value) == 'string' then
    if string.sub(value, 1, #ARGV[6]) == ARGV[6] then
      redis.call('PEXPIRE', KEYS[1], ARGV[2])
      redis.call('PEXPIRE', KEYS[4], ARGV[2])
      redis.call('ZREM', KEYS[5], ARGV[4], unpack(ARGV, 7))
      return {string.match(value, '^%x+:(%d+)')}
    end
    if string.find(value, '^%x+:%d+$') and string.sub(value, 33, 33) == ':'
        and not string.find(value, '%u') then
      redis.call('APPEND', KEYS[1], ':w')
    end
  end
  if #ARGV > 6 then
    redis.call('ZREM', KEYS[5], unpack(ARGV, 7))
  end
  local now = redis.call('TIME')
  local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
  redis.call('ZADD', KEYS[5], ms + tonumber(ARGV[5]), ARGV[4])
  if redis.call('PEXPIRE', KEYS[5], ARGV[5], 'NX') == 0 then
    redis.call('PEXPIRE', KEYS[5], ARGV[5], 'GT')
  end
end
return redis.call('PTTL', KEYS[1])
";

/// Hands a just-freed lock to the oldest live waiter. Expects the locals `lock`, `queue`,
/// `counter`, `holder` (key names) and `channel` (the wake channel prefix: the client-wide
/// `distlock\x1fwake:` with `PUBLISH`, or on a Cluster the lock's own prefix in its slot with
/// `SPUBLISH`, see [`crate::wake`]; `$publish` names the command).
///
/// Does nothing when the queue key is not a sorted set (none of our waiters can be queued
/// there), so that a release that already deleted the lock never fails after it. Otherwise it
/// drops expired registrations and pops the one that expires first. A member with a grant
/// token gets the lock in this same atomic step: a new fence from the counter (its string, read
/// back after `INCR`, never a Lua number: see [`ACQUIRE`]), its value
/// `<grant token hex>:<fence>` (marked `:w` when others still wait) with the member's TTL — the
/// waiter's short first lease (`queue::HANDOFF_LEASE`), which the waiter renews to its own TTL
/// when it takes the grant, so a dead waiter blocks the lock that long at most — the holder
/// key with the member's identity (deleted for a member without one), and the message `<waiter id>:<seq>:<fence>` on its client's channel; the waiter holds the lock from
/// that message alone. An old-form member (or any member when the counter is unusable) gets
/// the message `<waiter id>`, a wake-up, and tries by itself.
macro_rules! grant_next {
    ($publish:literal) => {
        concat!(
            r"
  local first = {}
  if redis.call('TYPE', queue).ok == 'zset' then
    local now = redis.call('TIME')
    local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
    redis.call('ZREMRANGEBYSCORE', queue, '-inf', ms)
    first = redis.call('ZPOPMIN', queue)
  end
  if first[1] then
    local client, waiter, seq, ttl, owner, rest =
      string.match(first[1], '^(%x+):(%d+):(%d+):(%d+):(%x+)(.*)$')
    local identity = nil
    if rest and rest ~= '' then
      identity = string.match(rest, '^:(.+)$')
      if not identity then
        client = nil
      end
    end
    local fence = nil
    if client and #ttl <= 12 and tonumber(ttl) > 0 and #owner == 32 then
      if type(redis.pcall('INCR', counter)) == 'number' then
        fence = redis.call('GET', counter)
      end
    else
      client, waiter = string.match(first[1], '^(%x+):(%d+)')
    end
    if fence then
      local value = owner .. ':' .. fence
      if identity then
        redis.call('SET', holder, value .. ' ' .. identity, 'PX', ttl)
      else
        redis.call('DEL', holder)
      end
      if redis.call('ZCARD', queue) > 0 then
        value = value .. ':w'
      end
      redis.call('SET', lock, value, 'PX', ttl)
      redis.call('",
            $publish,
            r"', channel .. client,
        waiter .. ':' .. seq .. ':' .. fence)
    elseif client then
      redis.call('",
            $publish,
            r"', channel .. client, waiter)
    end
  end
"
        )
    };
}

/// KEYS: the locks to renew, then their holder keys in the same order. ARGV: for each lock in
/// order, its owner prefix and its ttl in ms. Returns one value per lock: 1 when extended (its
/// holder key too), 0 when not ours (missing, another owner's value, not a string). One call renews a whole batch of a client's locks; the driver caps the number
/// of keys per call so that one script never keeps the server busy for long.
const RENEW: &str = r"
local out = {}
local n = #KEYS / 2
for i = 1, n do
  local prefix = ARGV[2 * i - 1]
  local value = redis.pcall('GET', KEYS[i])
  if type(value) == 'string' and string.sub(value, 1, #prefix) == prefix then
    out[i] = redis.call('PEXPIRE', KEYS[i], ARGV[2 * i])
    redis.call('PEXPIRE', KEYS[n + i], ARGV[2 * i])
  else
    out[i] = 0
  end
end
return out
";

/// KEYS: lock, waiter queue, fence counter, holder key, and for the clean-up of a request whose
/// outcome is unknown, the undo marker of the owner prefix. ARGV: owner prefix, wake channel prefix, the
/// marker's lifetime in ms (ignored without the marker), then waiter queue members to remove
/// first (a waiter that gives up passes its members and its grant prefix, so a grant that
/// crossed its leaving is passed on). Returns 1 when deleted, 0 when not ours. Never deletes
/// another owner's lock. Hands over only when a waiter marked the value (`:w`, see
/// [`ACQUIRE`]): without waiters a release costs no more than `GET` + two `DEL`s (the lock and
/// its holder key).
///
/// The marker makes a clean-up final once answered: a request it undoes that reaches the
/// server only afterwards (delayed on a connection the client has since replaced) finds the
/// marker and does nothing, so one answer, on whichever connection, is enough.
macro_rules! release_script {
    ($publish:literal) => {
        concat!(
            r"
local lock, queue, counter, holder, channel = KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[2]
if KEYS[5] then
  redis.call('SET', KEYS[5], '1', 'PX', ARGV[3])
end
if #ARGV > 3 then
  redis.pcall('ZREM', queue, unpack(ARGV, 4))
end
local value = redis.pcall('GET', lock)
if type(value) == 'string' and string.sub(value, 1, #ARGV[1]) == ARGV[1] then
  redis.call('DEL', lock, holder)
  if string.sub(value, -2) == ':w' then
",
            grant_next!($publish),
            r"
  end
  return 1
end
return 0
"
        )
    };
}

const RELEASE: &str = release_script!("PUBLISH");
/// `RELEASE` with the Cluster's sharded `SPUBLISH` (the channel prefix ARGV[2] is then the
/// lock's own, in its slot: see [`crate::wake`]).
const RELEASE_SHARDED: &str = release_script!("SPUBLISH");

/// KEYS: lock, waiter queue, fence counter, holder key. ARGV: the holder's fence (empty: any
/// holder), wake channel prefix. The operator override: deletes whoever holds the lock (any client's value)
/// — or, with a fence, only our grant with that fence — and hands it to the next waiter.
/// Returns 1 when something was deleted.
///
/// A removed grant of ours (a value `<token hex>:<fence>`) is announced on
/// [`crate::wake::LOST_CHANNEL`] as `<fence>:<lock key>` (`$lost`: the `PUBLISH` that does it, or
/// nothing on a Cluster, whose holders do not watch), so its holder learns of the loss now rather
/// than at its next renewal; the holder reads the lock before it believes the message.
macro_rules! force_release_script {
    ($publish:literal, $lost:literal) => {
        concat!(
            r"
local lock, queue, counter, holder, channel = KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[2]
local value = redis.pcall('GET', lock)
local removed = nil
if type(value) == 'string' then
  removed = string.match(value, '^%x+:(%d+)')
end
if ARGV[1] ~= '' and removed ~= ARGV[1] then
  return 0
end
if redis.call('DEL', lock) == 1 then
  redis.call('DEL', holder)
",
            $lost,
            grant_next!($publish),
            r"
  return 1
end
return 0
"
        )
    };
}

const FORCE_RELEASE: &str = force_release_script!(
    "PUBLISH",
    r"
  if removed then
    redis.call('PUBLISH', 'distlock\31lost', removed .. ':' .. lock)
  end
"
);
/// `FORCE_RELEASE` with the Cluster's sharded `SPUBLISH` (and no loss announcement).
const FORCE_RELEASE_SHARDED: &str = force_release_script!("SPUBLISH", "");

/// KEYS: lock, fence counter, waiter queue, holder key. Returns nil when free, else `{value,
/// pttl, counter, waiters, holder}` (value is empty when the key is not a string, counter and
/// holder empty when unset or not strings; waiters counts the live registrations of this
/// driver's waiters). The caller matches the holder key's grant against the value.
const INSPECT: &str = r"
local kind = redis.call('TYPE', KEYS[1]).ok
if kind == 'none' then
  return false
end
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local waiters = 0
if redis.call('TYPE', KEYS[3]).ok == 'zset' then
  waiters = redis.call('ZCOUNT', KEYS[3], '(' .. ms, '+inf')
end
local value = ''
if kind == 'string' then
  value = redis.call('GET', KEYS[1])
end
local fence = redis.pcall('GET', KEYS[2])
if type(fence) ~= 'string' then
  fence = ''
end
local holder = redis.pcall('GET', KEYS[4])
if type(holder) ~= 'string' then
  holder = ''
end
return {value, redis.call('PTTL', KEYS[1]), fence, waiters, holder}
";

/// KEYS: lock, holder key. ARGV: the owner prefix (`<token hex>:`), the new holder identity.
/// `Leadership::proclaim`'s relabel: only while the lock's value is this grant's (a compare on the
/// ownership token) and it has a TTL, the holder key is rewritten as `<token hex>:<fence>
/// <identity>` with the lock's remaining TTL; the grant, its fence and its TTL are untouched.
/// Returns 1 when relabelled, 0 when the grant no longer holds the lock (nothing written).
const RELABEL: &str = r"
local lock, holder = KEYS[1], KEYS[2]
local prefix, identity = ARGV[1], ARGV[2]
local value = redis.pcall('GET', lock)
if type(value) ~= 'string' or string.sub(value, 1, #prefix) ~= prefix then
  return 0
end
local pttl = redis.call('PTTL', lock)
if pttl <= 0 then
  return 0
end
if string.sub(value, -2) == ':w' then
  value = string.sub(value, 1, -3)
end
redis.call('SET', holder, value .. ' ' .. identity, 'PX', pttl)
return 1
";

/// The compiled scripts (each carries its SHA1).
#[derive(Debug)]
pub(crate) struct Scripts {
    pub(crate) acquire: Script,
    pub(crate) renew: Script,
    pub(crate) release: Script,
    pub(crate) inspect: Script,
    pub(crate) force_release: Script,
    /// On a Cluster: the same with `SPUBLISH` to the lock's shard channel.
    pub(crate) release_sharded: Script,
    pub(crate) force_release_sharded: Script,
    pub(crate) relabel: Script,
}

impl Scripts {
    pub(crate) fn new() -> Self {
        Self {
            acquire: Script::new(ACQUIRE),
            renew: Script::new(RENEW),
            release: Script::new(RELEASE),
            inspect: Script::new(INSPECT),
            force_release: Script::new(FORCE_RELEASE),
            release_sharded: Script::new(RELEASE_SHARDED),
            force_release_sharded: Script::new(FORCE_RELEASE_SHARDED),
            relabel: Script::new(RELABEL),
        }
    }

    /// The release script for a connection (`sharded`: a Cluster's).
    pub(crate) fn release(&self, sharded: bool) -> &Script {
        if sharded {
            &self.release_sharded
        } else {
            &self.release
        }
    }

    /// The force-release script for a connection (`sharded`: a Cluster's).
    pub(crate) fn force_release(&self, sharded: bool) -> &Script {
        if sharded {
            &self.force_release_sharded
        } else {
            &self.force_release
        }
    }
}

/// The value we store is `<token hex>:<fence>`; every compare matches the `<token hex>:` prefix
/// (128 random bits), which is also all an unknown-outcome cleanup knows.
pub(crate) fn owner_prefix(token: &OwnershipToken) -> String {
    let mut s = token.expose_hex();
    s.push(':');
    s
}

/// A TTL in whole milliseconds as the scripts take it (`PX`, `PEXPIRE`): rounded up, so a
/// key never expires before the TTL asked for.
pub(crate) fn ttl_millis(ttl: Duration) -> u64 {
    u64::try_from(ttl.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX)
}

/// A fence as the scripts send it: the counter's decimal digits (never a Lua number, which is
/// exact only up to 2^53).
pub(crate) fn parse_fence(digits: &[u8]) -> Option<u64> {
    std::str::from_utf8(digits).ok()?.parse().ok()
}

/// Parses a stored value `<32 hex>:<fence>` written by this driver (with the suffix `:w` once
/// a waiter marked it).
pub(crate) fn parse_owner(value: &[u8]) -> Option<(OwnershipToken, FencingToken)> {
    let value = std::str::from_utf8(value).ok()?;
    let value = value.strip_suffix(":w").unwrap_or(value);
    let (hex, fence) = value.split_once(':')?;
    let token = OwnershipToken::from_hex(hex).ok()?;
    if hex.bytes().any(|b| b.is_ascii_uppercase()) {
        return None;
    }
    Some((token, FencingToken(fence.parse().ok()?)))
}

/// The identity in a holder key `<token hex>:<fence> <identity>`, when that grant is the lock's
/// current value `value` (less its `:w` mark): never a previous holder's, nor one next to a
/// grant by a client that writes no holder key.
pub(crate) fn holder_of(value: &[u8], holder: &[u8]) -> Option<HolderIdentity> {
    let grant = value.strip_suffix(b":w").unwrap_or(value);
    let identity = holder.strip_prefix(grant)?.strip_prefix(b" ")?;
    // Only our format: a foreign value is never matched (not even by a prefix of it).
    parse_owner(grant)?;
    HolderIdentity::from_stored(identity)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttl_is_rounded_up_to_whole_milliseconds() {
        assert_eq!(ttl_millis(Duration::from_millis(300)), 300);
        assert_eq!(ttl_millis(Duration::from_micros(1500)), 2);
        assert_eq!(ttl_millis(Duration::from_nanos(1)), 1);
    }

    #[test]
    fn the_identity_shows_only_next_to_its_own_grant() {
        let t = OwnershipToken::generate();
        let grant = format!("{}7", owner_prefix(&t));
        let holder = format!("{grant} host=a pid=1 since=2 label=x:w");
        let shown = |value: &str| holder_of(value.as_bytes(), holder.as_bytes());
        let id = shown(&grant).unwrap();
        assert_eq!(id.as_str(), "host=a pid=1 since=2 label=x:w");
        assert_eq!(shown(&format!("{grant}:w")), Some(id));
        // A later grant (another fence, another token), a foreign value, an empty value.
        assert_eq!(shown(&format!("{}8", owner_prefix(&t))), None);
        assert_eq!(shown(&format!("{}70", owner_prefix(&t))), None);
        let other = OwnershipToken::generate();
        assert_eq!(shown(&format!("{}7", owner_prefix(&other))), None);
        assert_eq!(shown("foreign"), None);
        assert_eq!(shown(""), None);
        assert_eq!(holder_of(b"foreign", b"foreign x"), None);
        assert_eq!(holder_of(grant.as_bytes(), grant.as_bytes()), None);
        assert_eq!(holder_of(grant.as_bytes(), b""), None);
    }

    #[test]
    fn owner_values_parse_only_in_our_format() {
        let t = OwnershipToken::generate();
        let value = format!("{}7", owner_prefix(&t));
        assert_eq!(parse_owner(value.as_bytes()), Some((t, FencingToken(7))));
        let marked = format!("{}7:w", owner_prefix(&t));
        assert_eq!(parse_owner(marked.as_bytes()), Some((t, FencingToken(7))));
        assert_eq!(parse_owner(t.expose_hex().as_bytes()), None);
        assert_eq!(parse_owner(b"some-other-client"), None);
        assert_eq!(
            parse_owner(format!("{}x", owner_prefix(&t)).as_bytes()),
            None
        );
    }
}
