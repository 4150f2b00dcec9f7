//! The SQL of the lease table, built once from the validated table name.
//!
//! Every value is a bind parameter; only the table name is formatted in, and it has been
//! validated as an identifier and is double-quoted ([`crate::TableName`]), which is why wrapping
//! these strings in [`sqlx::AssertSqlSafe`] is sound.
//!
//! # The waiter queue
//!
//! `waiters` holds the queue of a lock's listening waiters, oldest first, each entry
//! `<channel>:<number> <expiry> <seq> <ttl> <grant owner> [<holder>]`: the waiting client's notification
//! channel, the waiter's number on that client, when the entry lapses (milliseconds since the
//! epoch, the database's clock; a waiter refreshes its entry on every attempt, so only a gone
//! waiter's entry lapses), the number of the attempt that wrote the entry (one more per attempt
//! of that `acquire`), the TTL a release grants it (µs: its first lease, min(its TTL, 1.5 s), which
//! it renews to its TTL when it takes the grant), and the owner token a release hands the lock to
//! (one per `acquire`, a secret like every owner token; distinct from the per-attempt tokens of
//! its own grants), and the waiting client's holder identity, hex-encoded (printable ASCII
//! only, so decoding it never fails), for a direct grant to record. Entries of older clients
//! have only the first two (or five) fields.
//!
//! # The holder identity
//!
//! `holder` is the current grant's [`lock_core::raw::HolderIdentity`] and `holder_fence` the fence
//! of the grant that wrote it: every grant of this version writes both in the statement that
//! grants (an attempt its own identity, a direct grant the one in the granted entry); a release
//! clears them. `inspect` shows `holder` only while `holder_fence` is the row's `fence`, so a
//! grant by an older client (which leaves both columns alone but bumps the fence) shows no
//! identity rather than the previous holder's. On a table of an older version that this role
//! may not `ALTER`, the statements are built without the two columns (identity then `None`).
//!
//! # Direct grant on release
//!
//! Every statement that frees the lock (release, undo of an unknown acquire, force release, a
//! waiter leaving while the lock is free) looks at the first live entry of the row's latest
//! version (see `free_and_grant`). An entry with a grant owner gets the lock **in the same
//! statement**: `owner` = its grant owner, `fence + 1`, `expires_at` = `clock_timestamp()` + its
//! TTL (read while the statement writes a version of the row that holds the entry, so after the
//! attempt that wrote it was sent), the entry (and lapsed ones) leave the queue, and its channel
//! is notified with `<number>:<seq>:<fence>`; such a statement always commits durably (a grant
//! lost in a crash could hand its fence out twice). An entry of an older client is only woken
//! (payload `<number>`, lock left free), as before. A waiter takes a grant message only for the
//! `seq` of its latest attempt that queued; a grant it did not hear (a lost notification, a
//! `LISTEN` reconnect) is found by its next attempt, which recognises its grant owner in `owner`
//! and extends that grant instead of queueing; a waiter that gives up frees a grant made to it
//! (and hands it on). A waiter that crashed after queueing may be granted the lock and then
//! holds it until its TTL runs out.
//!
//! The queue lives in the lock row because a release and a waiter's registration both write
//! that row: whichever comes second waits for the other's row lock and then sees its result (a
//! release sees the new entry; a registration sees the lock free and takes it), so no hand-off
//! falls between them. Every grant, direct or by an attempt, is decided under the row lock on
//! the latest version of the row.

use std::{sync::Arc, time::Duration};

use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};

use crate::TableName;

/// The longest first lease a release grants a queued waiter (the TTL in its entry, see
/// the statement below): a waiter that died after its last attempt — while its entry was still live,
/// up to two poll intervals — holds the lock this long at most, not for the TTL it asked for. A
/// live waiter extends it at once (one renewal to its TTL, before `acquire` returns), so this
/// only needs to outlast the notification's delivery and one statement.
pub(crate) const HANDOFF_LEASE: Duration = Duration::from_millis(1500);

/// The most entries a lock's queue takes; waiters beyond it poll (bounded by `poll_interval`).
const MAX_QUEUE: i32 = 256;

/// The statements of one table.
#[derive(Debug)]
pub(crate) struct Statements {
    pub(crate) create: SqlStr,
    /// Adds the `waiters` (and holder) columns to a table created by an older version.
    pub(crate) add_waiters: SqlStr,
    /// Adds the `holder` and `holder_fence` columns to a table created by an older version.
    pub(crate) add_holder: SqlStr,
    /// `$1` name, `$2` owner, `$3` ttl µs(, `$4` holder identity) → `fence` when granted, no
    /// row when held.
    pub(crate) acquire: SqlStr,
    /// `$1` name, `$2` owner, `$3` ttl µs, `$4` grant owner or NULL → one row: `fence` when
    /// granted (to `$2`, or a grant to `$4` found live and extended), else `remaining` µs of the
    /// live holder seen (both null: taken by a grant that committed meanwhile); whether the
    /// grant is `$4`'s. With holders, `$5` is the holder identity.
    pub(crate) acquire_polling: SqlStr,
    /// `$1` name, `$2` owner, `$3` ttl µs, `$4` queue entry id, `$5` entry lifetime ms, `$6`
    /// grant owner, `$7` attempt seq → one row: `fence` when granted (to `$2`, or a grant to
    /// `$6` found live and extended); else `remaining` µs of the holder and whether the entry
    /// is `queued` (added or refreshed; not when the queue is full); whether the grant is
    /// `$6`'s. With holders, `$8` is the holder identity.
    pub(crate) acquire_queued: SqlStr,
    /// `$1` names, `$2` owners, `$3` fences, `$4` ttls µs (arrays of one length, names distinct)
    /// → the `name` of every row renewed; rows are locked in name order.
    pub(crate) renew: SqlStr,
    /// `$1` name, `$2` owner, `$3` fence → one row when released (and the lock granted to the
    /// first waiter, or the waiter woken).
    pub(crate) release: SqlStr,
    /// As `release`, with `synchronous_commit = off` for this statement's transaction only,
    /// unless it granted the lock.
    pub(crate) release_async: SqlStr,
    /// `$1` name, `$2` owner: undoes a grant whose reply was lost (fence unknown).
    pub(crate) release_token: SqlStr,
    /// `$1` name, `$2` queue entry id, `$3` grant owner: removes a waiter that gave up, and
    /// frees a grant made to it; when the lock is (then) free, grants it to (or wakes) the
    /// next waiter, in case the hand-off went to the one leaving.
    pub(crate) dequeue: SqlStr,
    /// `$1` name → `owner`, `fence`, remaining µs of a live holder, live queue entries, the
    /// holder identity recorded by this grant (or NULL).
    pub(crate) inspect: SqlStr,
    /// `$1` name, `$2` fence or NULL: the operator override, whoever holds it (or only the
    /// grant with that fence); the lock goes to the first waiter, as on a release.
    pub(crate) force_release: SqlStr,
    /// `$1` name, `$2` owner, `$3` fence, `$4` holder identity → one row when the grant still
    /// holds the lock and now records that identity (a relabel: `Leadership::proclaim`). `None`
    /// without the holder columns.
    pub(crate) relabel: Option<SqlStr>,
}

/// The `synchronous_commit` a grant, renewal or durable release commits with: the session's
/// own setting unless that is `off`, then `on` — so a role or database default of `off` (or a
/// pooler's session) never makes a grant an asynchronous commit that a crash could lose (its
/// fence then handed out twice). `local`, `remote_write` and `remote_apply` all flush the WAL
/// locally before the commit returns.
const DURABLE: &str = "CASE current_setting('synchronous_commit') WHEN 'off' THEN 'on' \
                       ELSE current_setting('synchronous_commit') END";

/// A `RETURNING`/`SELECT` column that makes the statement's transaction commit durably
/// (`SET LOCAL synchronous_commit`, evaluated before the implicit transaction commits).
fn durable() -> String {
    format!("set_config('synchronous_commit', {DURABLE}, true)")
}

fn sql(s: String) -> SqlStr {
    AssertSqlSafe(Arc::<str>::from(s)).into_sql_str()
}

/// The database's clock in milliseconds since the epoch (the unit of queue entry expiries).
const NOW_MS: &str = "(extract(epoch FROM clock_timestamp()) * 1000)::bigint";

/// The `<channel>:<number>` part of queue entry `w`.
fn id(w: &str) -> String {
    format!("split_part({w}, ' ', 1)")
}

/// The shape of a well-formed entry's `<channel>:<number>`: a channel `pg_notify` accepts (ASCII
/// letters, digits or `_`; 1 to 63 of them, see [`within_bounds`]) and a waiter number.
///
/// No pattern here has a bounded repetition (`{1,63}`): PostgreSQL's regex engine spends about
/// 0.3 ms on each match of one with such bounds (measured: 100 matches of the old entry pattern
/// took 31–38 ms, of this one 1.2–1.9 ms), and a contended release matches each entry several
/// times, which made it 1.5–2 ms of server time instead of 0.1–0.3 ms. The bounds are `length`
/// checks of the fields beside the pattern ([`within_bounds`]); a fixed count (`{32}`) is cheap.
const ENTRY_ID: &str = "[A-Za-z0-9_]+:[0-9]+";

/// The optional sixth field of a queue entry: the waiting client's holder identity, hex of
/// printable ASCII bytes (0x20 to 0x7f), at most `HolderIdentity::MAX_LEN` (200) of them (400
/// hex digits, see [`within_bounds`]).
const HOLDER_HEX: &str = "(?:[2-7][0-9a-f])+";

/// The most characters of each field of a well-formed entry: the channel, the waiter number,
/// the expiry (18 digits: always a `bigint`), the sequence, the TTL µs, and the holder hex.
fn within_bounds(w: &str) -> String {
    let field = |n: u8| format!("split_part({w}, ' ', {n})");
    let (channel, number) = (
        format!("split_part({}, ':', 1)", field(1)),
        format!("split_part({}, ':', 2)", field(1)),
    );
    format!(
        "length({channel}) <= 63 AND length({number}) <= 20 AND length({}) <= 18 \
         AND length({}) <= 19 AND length({}) <= 14 AND length({}) <= 400",
        field(2),
        field(3),
        field(4),
        field(6)
    )
}

/// A well-formed queue entry: an older client's two fields, or five (or six, with a holder
/// identity) of ours; the expiry and the TTL short enough to be a `bigint`.
fn well_formed(w: &str) -> String {
    format!(
        "({w} ~ '^{ENTRY_ID} [0-9]+( [0-9]+ [0-9]+ [0-9a-f]{{32}}( {HOLDER_HEX})?)?$' AND {})",
        within_bounds(w)
    )
}

/// The expiry (ms since the epoch) of queue entry `w`; 0 (lapsed) for a malformed one — an entry
/// some other tool wrote, a lapsed grant marker — so every reader skips it and the next write of
/// the row drops it. Checked before the cast: one foreign entry must never make the row's
/// statements fail.
fn expiry(w: &str) -> String {
    format!(
        "CASE WHEN {} THEN split_part({w}, ' ', 2)::bigint ELSE 0 END",
        well_formed(w)
    )
}

/// Whether row `l`'s queue has an entry with id `param`.
fn has_entry(param: &str) -> String {
    format!(
        "EXISTS (SELECT 1 FROM unnest(l.waiters) AS e(w) WHERE {} = {param})",
        id("e.w")
    )
}

/// The live entries of row `l`'s queue with their positions (`q.w`, `q.o`).
fn live_entries() -> String {
    format!(
        "unnest(l.waiters) WITH ORDINALITY AS q(w, o) WHERE {} > {NOW_MS}",
        expiry("q.w")
    )
}

/// Whether queue entry `w` can take a direct grant (all five fields, well formed). Older
/// clients' entries (two fields) cannot, nor can a malformed one, which a release must never
/// fail on.
fn grantable(w: &str) -> String {
    format!(
        "({w} ~ '^{ENTRY_ID} [0-9]+ [0-9]+ [0-9]+ [0-9a-f]{{32}}( {HOLDER_HEX})?$' AND {})",
        within_bounds(w)
    )
}

/// The holder identity in the sixth field of queue entry `w`, decoded; NULL when it has none
/// (checked first, so a malformed field never makes a release fail).
fn entry_holder(w: &str) -> String {
    let field = format!("split_part({w}, ' ', 6)");
    format!(
        "CASE WHEN {field} ~ '^{HOLDER_HEX}$' AND length({field}) <= 400 \
             THEN convert_from(decode({field}, 'hex'), 'UTF8') END"
    )
}

/// A statement that frees row `l` where `cond` holds: one `UPDATE`, whose `SET` is computed
/// on the latest version of the row (re-evaluated on it, under the row lock, when a concurrent
/// writer changed the row first): when `frees`, the first live entry among those `keep` keeps
/// is granted the lock (see the module docs) or, for an older client's entry, woken while the
/// lock is left free. Lapsed entries and those `keep` rejects leave the queue. `async_commit`:
/// commit with `synchronous_commit = off` unless the statement granted. Returns one row
/// (`fence`) when a row matched `cond`.
///
/// `RETURNING` sees only the new row, so a grant leaves the granted entry's address behind as
/// a lapsed marker `<channel>:<number> 0 <seq>` at the head of the queue, from which the
/// notification is addressed; every reader skips it (expiry 0, too few fields to be granted)
/// and the next write of the row drops it.
fn free_and_grant(
    t: &str,
    cond: &str,
    frees: &str,
    keep: &str,
    async_commit: bool,
    holders: bool,
) -> String {
    let (qexpiry, can_grant) = (expiry("q.w"), grantable("x.live[1]"));
    let (head, head_id) = ("l.waiters[1]", id("l.waiters[1]"));
    // Whether the new row records a grant made by this statement.
    let granted =
        format!("COALESCE(l.owner IS NOT NULL AND split_part({head}, ' ', 2) = '0', false)");
    let durability = if async_commit {
        format!(
            ", set_config('synchronous_commit', CASE WHEN {granted} \
                 THEN {DURABLE} ELSE 'off' END, true)"
        )
    } else {
        format!(", {}", durable())
    };
    // A direct grant records the granted entry's identity with its fence; a release clears it.
    let (hcols, hvals) = if holders {
        (
            ", holder, holder_fence",
            format!(
                ", CASE WHEN h.granting THEN {} WHEN h.frees THEN NULL ELSE l.holder END, \
                 CASE WHEN h.granting THEN l.fence + 1 WHEN h.frees THEN NULL \
                     ELSE l.holder_fence END",
                entry_holder("h.head")
            ),
        )
    } else {
        ("", String::new())
    };
    format!(
        "UPDATE {t} AS l SET (owner, fence, expires_at, waiters{hcols}) = (\
             SELECT CASE WHEN h.granting THEN split_part(h.head, ' ', 5) \
                     WHEN h.frees THEN NULL ELSE l.owner END, \
                 CASE WHEN h.granting THEN l.fence + 1 ELSE l.fence END, \
                 CASE WHEN h.granting THEN clock_timestamp() \
                         + split_part(h.head, ' ', 4)::bigint * interval '1 microsecond' \
                     WHEN h.frees THEN clock_timestamp() ELSE l.expires_at END, \
                 CASE WHEN h.granting THEN ARRAY[split_part(h.head, ' ', 1) || ' 0 ' \
                         || split_part(h.head, ' ', 3)] || h.live[2:] \
                     ELSE h.live END{hvals} \
             FROM (SELECT x.frees, x.live, x.live[1] AS head, \
                     x.frees AND COALESCE({can_grant}, false) AS granting \
                 FROM (SELECT {frees} AS frees, ARRAY(\
                     SELECT q.w FROM unnest(l.waiters) WITH ORDINALITY AS q(w, o) \
                     WHERE {qexpiry} > {NOW_MS} AND {keep} ORDER BY q.o) AS live) AS x) AS h\
         ) \
         WHERE {cond} \
         RETURNING l.fence, CASE \
             WHEN {granted} THEN pg_notify(split_part({head_id}, ':', 1), \
                 split_part({head_id}, ':', 2) || ':' || split_part({head}, ' ', 3) \
                 || ':' || l.fence) \
             WHEN l.owner IS NULL AND {head} IS NOT NULL \
                 THEN pg_notify(split_part({head_id}, ':', 1), split_part({head_id}, ':', 2)) \
             END{durability}"
    )
}

impl Statements {
    /// `holders`: the table has the `holder` and `holder_fence` columns.
    pub(crate) fn new(table: &TableName, holders: bool) -> Self {
        let t = table.quoted();
        // Rows are never deleted: `fence` only grows, across every grant of a name.
        let create = format!(
            "CREATE TABLE IF NOT EXISTS {t} (\n\
                 name text PRIMARY KEY,\n\
                 owner text,\n\
                 fence bigint NOT NULL,\n\
                 expires_at timestamptz NOT NULL,\n\
                 waiters text[] NOT NULL DEFAULT '{{}}',\n\
                 holder text,\n\
                 holder_fence bigint\n\
             )"
        );
        let add_holder_columns =
            "ADD COLUMN IF NOT EXISTS holder text, ADD COLUMN IF NOT EXISTS holder_fence bigint";
        let add_waiters = format!(
            "ALTER TABLE {t} ADD COLUMN IF NOT EXISTS waiters text[] NOT NULL DEFAULT '{{}}', \
             {add_holder_columns}"
        );
        let add_holder = format!("ALTER TABLE {t} {add_holder_columns}");
        // Every grant by an attempt records this client's identity ($hid) with its fence.
        let grant_holder = |hid: &str| {
            if holders {
                (
                    ", holder, holder_fence".to_owned(),
                    format!(", {hid}::text, 1"),
                    format!(", holder = {hid}::text, holder_fence = l.fence + 1"),
                )
            } else {
                (String::new(), String::new(), String::new())
            }
        };
        // One statement, on the database's clock: insert a first grant, or take over a free or
        // expired row while bumping its fence. A held row is left alone (no row returned), but
        // locked until the statement's transaction commits.
        let (hcols, hvals, hset) = grant_holder("$4");
        let acquire = format!(
            "INSERT INTO {t} AS l (name, owner, fence, expires_at{hcols}) \
             VALUES ($1, $2, 1, clock_timestamp() + $3::bigint * interval '1 microsecond'{hvals}) \
             ON CONFLICT (name) DO UPDATE \
             SET owner = excluded.owner, fence = l.fence + 1, \
                 expires_at = clock_timestamp() + $3::bigint * interval '1 microsecond'{hset} \
             WHERE l.owner IS NULL OR l.expires_at <= clock_timestamp() \
             RETURNING l.fence, {durable}",
            durable = durable()
        );
        let remaining = "GREATEST(0, floor(extract(epoch FROM l.expires_at - clock_timestamp()) \
                         * 1000000))::bigint";
        // A waiter's first look (and every look of a waiter that is not queued): the same
        // upsert, whose WHERE, evaluated on the latest version of the locked row, is what makes
        // grants exclusive; when the statement's snapshot already shows a live holder, nothing
        // is attempted (no row lock, no durable commit) and its remaining time is returned. A
        // waiter that has queued passes its grant owner: a live grant to it is extended (under
        // the row lock, durably) and returned, as it may not have heard of it.
        let (hcols, hvals, hset) = grant_holder("$5");
        // A grant to this client found live and extended is this client's: its identity again.
        let hkept = if holders {
            ", holder = $5::text, holder_fence = l.fence"
        } else {
            ""
        };
        let acquire_polling = format!(
            "WITH cur AS MATERIALIZED (\
                 SELECT {remaining} AS remaining, COALESCE(l.owner = $4, false) AS mine \
                 FROM {t} AS l WHERE name = $1 AND owner IS NOT NULL \
                     AND expires_at > clock_timestamp()\
             ), granted AS (\
                 INSERT INTO {t} AS l (name, owner, fence, expires_at{hcols}) \
                 SELECT $1, $2, 1, clock_timestamp() + $3::bigint * interval '1 microsecond'{hvals} \
                 WHERE NOT EXISTS (SELECT 1 FROM cur) \
                 ON CONFLICT (name) DO UPDATE \
                 SET owner = excluded.owner, fence = l.fence + 1, \
                     expires_at = clock_timestamp() + $3::bigint * interval '1 microsecond'{hset} \
                 WHERE l.owner IS NULL OR l.expires_at <= clock_timestamp() \
                 RETURNING l.fence\
             ), kept AS (\
                 UPDATE {t} AS l \
                 SET expires_at = clock_timestamp() + $3::bigint * interval '1 microsecond'{hkept} \
                 WHERE l.name = $1 AND l.owner = $4 AND l.expires_at > clock_timestamp() \
                     AND EXISTS (SELECT 1 FROM cur WHERE mine) \
                 RETURNING l.fence\
             ) \
             SELECT COALESCE((SELECT fence FROM granted), (SELECT fence FROM kept)) AS fence, \
                 (SELECT remaining FROM cur WHERE NOT mine) AS remaining, \
                 EXISTS (SELECT 1 FROM kept) AS granted, \
                 CASE WHEN EXISTS (SELECT 1 FROM granted) OR EXISTS (SELECT 1 FROM kept) \
                     THEN {durable} END",
            durable = durable()
        );
        // A queued waiter's attempt: one upsert that always writes the row, under its lock,
        // with one reading of the clock (`d`): a free row is granted (fence bumped, this entry
        // and lapsed ones dropped from the queue); a live grant to this waiter's grant owner
        // (made by a release it has not heard of) is extended, fence unchanged, and the entry
        // dropped; a row held by another keeps its holder, and this entry is refreshed in place
        // or appended. Only a grant waits for a durable commit: a lost queue entry costs a poll,
        // a lost grant could cost a fence.
        let (qid, qexpiry, mine) = (id("q.w"), expiry("q.w"), has_entry("$4"));
        // The entry's TTL is the short first lease a release grants from it (the waiter
        // extends it when it takes the grant; see [`HANDOFF_LEASE`]).
        let mut entry = format!(
            "$4 || ' ' || (d.now_ms + $5::bigint) || ' ' || $7::bigint || ' ' \
             || LEAST($3::bigint, {}) || ' ' || $6",
            crate::lock::micros(HANDOFF_LEASE)
        );
        let (hcols, hvals, _) = grant_holder("$8");
        // A free row granted, or a grant to this waiter extended: this client's identity.
        let hqueued = if holders {
            entry.push_str(" || ' ' || encode(convert_to($8::text, 'UTF8'), 'hex')");
            ", CASE WHEN d.free OR d.granted THEN $8::text ELSE l.holder END, \
             CASE WHEN d.free THEN l.fence + 1 WHEN d.granted THEN l.fence \
                 ELSE l.holder_fence END"
        } else {
            ""
        };
        let acquire_queued = format!(
            "INSERT INTO {t} AS l (name, owner, fence, expires_at{hcols}) \
             VALUES ($1, $2, 1, clock_timestamp() + $3::bigint * interval '1 microsecond'{hvals}) \
             ON CONFLICT (name) DO UPDATE \
             SET (owner, fence, expires_at, waiters{hcols}) = (\
                 SELECT CASE WHEN d.free THEN $2 ELSE l.owner END, \
                     CASE WHEN d.free THEN l.fence + 1 ELSE l.fence END, \
                     CASE WHEN d.free OR d.granted \
                         THEN d.ts + $3::bigint * interval '1 microsecond' \
                         ELSE l.expires_at END, \
                     CASE WHEN d.free OR d.granted THEN ARRAY(\
                         SELECT q.w FROM unnest(l.waiters) WITH ORDINALITY AS q(w, o) \
                         WHERE {qexpiry} > d.now_ms AND {qid} <> $4 ORDER BY q.o) \
                     ELSE ARRAY(\
                         SELECT CASE WHEN {qid} = $4 THEN {entry} ELSE q.w END \
                         FROM unnest(l.waiters) WITH ORDINALITY AS q(w, o) \
                         WHERE {qexpiry} > d.now_ms OR {qid} = $4 ORDER BY q.o) \
                     || CASE WHEN d.mine OR d.live >= {MAX_QUEUE} THEN '{{}}'::text[] \
                         ELSE ARRAY[{entry}] END \
                     END{hqueued} \
                 FROM (SELECT c.ts, c.now_ms, \
                     l.owner IS NULL OR l.expires_at <= c.ts AS free, \
                     COALESCE(l.owner = $6 AND l.expires_at > c.ts, false) AS granted, \
                     {mine} AS mine, \
                     (SELECT count(*) FROM unnest(l.waiters) AS q(w) \
                         WHERE {qexpiry} > c.now_ms) AS live \
                     FROM (SELECT t.ts, (extract(epoch FROM t.ts) * 1000)::bigint AS now_ms \
                         FROM (SELECT clock_timestamp() AS ts) AS t) AS c) AS d\
             ) \
             RETURNING CASE WHEN l.owner IN ($2, $6) THEN l.fence END AS fence, \
                 {remaining} AS remaining, {mine} AS queued, \
                 COALESCE(l.owner = $6, false) AS granted, \
                 set_config('synchronous_commit', CASE WHEN l.owner IN ($2, $6) \
                     THEN {DURABLE} ELSE 'off' END, true)"
        );
        // Many leases in one statement (one transaction, one durable commit). The rows are
        // locked first, in name order, whatever join the planner picks, so two batches that
        // share rows lock them in the same order and cannot deadlock each other. A row that is
        // no longer this lease's (released, expired, taken over) is simply not returned.
        // Each renewed row answers with its lease's position in the arrays (1-based), which
        // the client maps back without decoding or hashing names.
        let renew = format!(
            "WITH r AS (\
                 SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::bigint[]) \
                     WITH ORDINALITY AS r(name, owner, fence, ttl, i)\
             ), mine AS MATERIALIZED (\
                 SELECT l.name, r.ttl, r.i FROM {t} AS l JOIN r ON l.name = r.name \
                 WHERE l.owner = r.owner AND l.fence = r.fence \
                     AND l.expires_at > clock_timestamp() \
                 ORDER BY l.name \
                 FOR NO KEY UPDATE OF l\
             ) \
             UPDATE {t} AS l SET expires_at = clock_timestamp() + mine.ttl * interval '1 microsecond' \
             FROM mine WHERE l.name = mine.name AND l.expires_at > clock_timestamp() \
             RETURNING mine.i, {durable}",
            durable = durable()
        );
        // Releases: each locks the row first and then hands it to the first waiter in the
        // same statement (see `free_and_grant`).
        let owned = "l.name = $1 AND l.owner = $2 AND l.fence = $3 \
                     AND l.expires_at > clock_timestamp()";
        let release = free_and_grant(&t, owned, "true", "true", false, holders);
        let release_async = free_and_grant(&t, owned, "true", "true", true, holders);
        let release_token = free_and_grant(
            &t,
            "l.name = $1 AND l.owner = $2",
            "true",
            "true",
            false,
            holders,
        );
        // A waiter that gave up: its entry leaves, a grant made to it is freed, and when the
        // lock is then free the next waiter is granted it (or woken).
        let dequeue = free_and_grant(
            &t,
            &format!("l.name = $1 AND ({} OR l.owner = $3)", has_entry("$2")),
            "l.owner IS NULL OR l.expires_at <= clock_timestamp() OR l.owner = $3",
            &format!("{qid} <> $2"),
            true,
            holders,
        );
        // Only the identity the current grant wrote (see the module docs).
        let holder = if holders {
            "CASE WHEN l.holder_fence = l.fence THEN l.holder END"
        } else {
            "NULL::text"
        };
        let inspect = format!(
            "SELECT owner, fence, {remaining}, (SELECT count(*) FROM {live}), {holder} \
             FROM {t} AS l WHERE name = $1 AND owner IS NOT NULL AND expires_at > clock_timestamp()",
            live = live_entries()
        );
        // The removed grant is announced to its holder (see `crate::wake::LOST_CHANNEL`):
        // `<fence>:<name>`, delivered when the statement commits.
        let force_release = format!(
            "{}, pg_notify('{}', $2::bigint::text || ':' || $1::text)",
            free_and_grant(
                &t,
                "l.name = $1 AND l.owner IS NOT NULL AND l.expires_at > clock_timestamp() \
                     AND ($2::bigint IS NULL OR l.fence = $2)",
                "true",
                "true",
                false,
                holders,
            ),
            crate::wake::LOST_CHANNEL
        );
        // Guarded like a release (name, owner token, fence, live): never a blind write. The
        // fence is the grant's own, so `inspect` keeps showing it as this grant's identity.
        let relabel = holders.then(|| {
            sql(format!(
                "UPDATE {t} AS l SET holder = $4::text, holder_fence = l.fence                  WHERE {owned} RETURNING l.fence"
            ))
        });
        Self {
            relabel,
            create: sql(create),
            add_waiters: sql(add_waiters),
            add_holder: sql(add_holder),
            force_release: sql(force_release),
            acquire: sql(acquire),
            acquire_polling: sql(acquire_polling),
            acquire_queued: sql(acquire_queued),
            renew: sql(renew),
            release: sql(release),
            release_async: sql(release_async),
            release_token: sql(release_token),
            dequeue: sql(dequeue),
            inspect: sql(inspect),
        }
    }
}
