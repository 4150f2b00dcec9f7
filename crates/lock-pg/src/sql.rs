//! The SQL of the lease table, built once from the validated table name.
//!
//! Every value is a bind parameter; only the table name is formatted in, and it has been
//! validated as an identifier and is double-quoted ([`crate::TableName`]), which is why wrapping
//! these strings in [`sqlx::AssertSqlSafe`] is sound.
//!
//! # The waiter queue
//!
//! `waiters` holds the queue of a lock's listening waiters, oldest first, each entry
//! `<channel>:<number> <expiry>`: the waiting client's notification channel, the waiter's number
//! on that client, and when the entry lapses (milliseconds since the epoch, the database's
//! clock; a waiter refreshes its entry on every attempt, so only a gone waiter's entry lapses).
//! A statement that frees the lock notifies the first live entry's channel with its number,
//! so one release wakes one waiter. The queue lives in the lock row because a release and a
//! waiter's registration both write that row: whichever comes second waits for the other's
//! row lock and then sees its result (a release sees the new entry; a registration sees the
//! lock free and takes it), so no wake-up falls between them. Grants are decided exactly as
//! before, by the upsert's check of `owner` and `expires_at` under the row lock; the queue only
//! decides whom to wake.

use std::sync::Arc;

use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};

use crate::TableName;

/// The most entries a lock's queue takes; waiters beyond it poll (bounded by `poll_interval`).
const MAX_QUEUE: i32 = 256;

/// The statements of one table.
#[derive(Debug)]
pub(crate) struct Statements {
    pub(crate) create: SqlStr,
    /// Adds the `waiters` column to a table created by an older version.
    pub(crate) add_waiters: SqlStr,
    /// `$1` name, `$2` owner, `$3` ttl µs → `fence` when granted, no row when held.
    pub(crate) acquire: SqlStr,
    /// `$1` name, `$2` owner, `$3` ttl µs → one row: `fence` when granted, else `remaining` µs
    /// of the live holder seen (both null: taken by a grant that committed meanwhile).
    pub(crate) acquire_polling: SqlStr,
    /// `$1` name, `$2` owner, `$3` ttl µs, `$4` queue entry, `$5` entry lifetime ms → one row:
    /// `fence` when granted; else `remaining` µs of the holder and whether the entry is
    /// `queued` (added or refreshed; not when the queue is full).
    pub(crate) acquire_queued: SqlStr,
    /// `$1` names, `$2` owners, `$3` fences, `$4` ttls µs (arrays of one length, names distinct)
    /// → the `name` of every row renewed; rows are locked in name order.
    pub(crate) renew: SqlStr,
    /// `$1` name, `$2` owner, `$3` fence → one row when released (and the next waiter woken).
    pub(crate) release: SqlStr,
    /// As `release`, with `synchronous_commit = off` for this statement's transaction only.
    pub(crate) release_async: SqlStr,
    /// `$1` name, `$2` owner: undoes a grant whose reply was lost (fence unknown).
    pub(crate) release_token: SqlStr,
    /// `$1` name, `$2` queue entry: removes a waiter that gave up (waking the next one when
    /// the lock is free, in case the wake-up went to the one leaving).
    pub(crate) dequeue: SqlStr,
    /// `$1` name → `owner`, `fence`, remaining µs of a live holder, live queue entries.
    pub(crate) inspect: SqlStr,
    /// `$1` name, `$2` fence or NULL: the operator override, whoever holds it (or only the
    /// grant with that fence).
    pub(crate) force_release: SqlStr,
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

/// The expiry (ms since the epoch) of queue entry `w`.
fn expiry(w: &str) -> String {
    format!("split_part({w}, ' ', 2)::bigint")
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

/// Notifies the first live waiter of row `l` (a scalar subquery: null when nobody waits).
fn wake_first() -> String {
    format!(
        "(SELECT pg_notify(split_part(h.id, ':', 1), split_part(h.id, ':', 2)) FROM (\
             SELECT {} AS id FROM {} ORDER BY q.o LIMIT 1\
         ) AS h)",
        id("q.w"),
        live_entries()
    )
}

impl Statements {
    pub(crate) fn new(table: &TableName) -> Self {
        let t = table.quoted();
        // Rows are never deleted: `fence` only grows, across every grant of a name.
        let create = format!(
            "CREATE TABLE IF NOT EXISTS {t} (\n\
                 name text PRIMARY KEY,\n\
                 owner text,\n\
                 fence bigint NOT NULL,\n\
                 expires_at timestamptz NOT NULL,\n\
                 waiters text[] NOT NULL DEFAULT '{{}}'\n\
             )"
        );
        let add_waiters = format!(
            "ALTER TABLE {t} ADD COLUMN IF NOT EXISTS waiters text[] NOT NULL DEFAULT '{{}}'"
        );
        // One statement, on the database's clock: insert a first grant, or take over a free or
        // expired row while bumping its fence. A held row is left alone (no row returned), but
        // locked until the statement's transaction commits.
        let acquire = format!(
            "INSERT INTO {t} AS l (name, owner, fence, expires_at) \
             VALUES ($1, $2, 1, clock_timestamp() + $3::bigint * interval '1 microsecond') \
             ON CONFLICT (name) DO UPDATE \
             SET owner = excluded.owner, fence = l.fence + 1, \
                 expires_at = clock_timestamp() + $3::bigint * interval '1 microsecond' \
             WHERE l.owner IS NULL OR l.expires_at <= clock_timestamp() \
             RETURNING l.fence"
        );
        let remaining = "GREATEST(0, floor(extract(epoch FROM l.expires_at - clock_timestamp()) \
                         * 1000000))::bigint";
        // A waiter's first look (and every look of a waiter that is not queued): the same
        // upsert, whose WHERE, evaluated on the latest version of the locked row, is what makes
        // grants exclusive; when the statement's snapshot already shows a live holder, nothing
        // is attempted (no row lock, no durable commit) and its remaining time is returned.
        let acquire_polling = format!(
            "WITH cur AS MATERIALIZED (\
                 SELECT {remaining} AS remaining \
                 FROM {t} AS l WHERE name = $1 AND owner IS NOT NULL \
                     AND expires_at > clock_timestamp()\
             ), granted AS (\
                 INSERT INTO {t} AS l (name, owner, fence, expires_at) \
                 SELECT $1, $2, 1, clock_timestamp() + $3::bigint * interval '1 microsecond' \
                 WHERE NOT EXISTS (SELECT 1 FROM cur) \
                 ON CONFLICT (name) DO UPDATE \
                 SET owner = excluded.owner, fence = l.fence + 1, \
                     expires_at = clock_timestamp() + $3::bigint * interval '1 microsecond' \
                 WHERE l.owner IS NULL OR l.expires_at <= clock_timestamp() \
                 RETURNING l.fence\
             ) \
             SELECT (SELECT fence FROM granted) AS fence, (SELECT remaining FROM cur) AS remaining"
        );
        // A queued waiter's attempt: one upsert that always writes the row, under its lock,
        // with one reading of the clock (`d`): a free row is granted (fence bumped, this entry
        // and lapsed ones dropped from the queue); a held row keeps its holder, and this entry
        // is refreshed in place or appended. Only a grant waits for a durable commit: a lost
        // queue entry costs a poll, a lost grant could cost a fence.
        let (qid, qexpiry, mine) = (id("q.w"), expiry("q.w"), has_entry("$4"));
        let acquire_queued = format!(
            "INSERT INTO {t} AS l (name, owner, fence, expires_at) \
             VALUES ($1, $2, 1, clock_timestamp() + $3::bigint * interval '1 microsecond') \
             ON CONFLICT (name) DO UPDATE \
             SET (owner, fence, expires_at, waiters) = (\
                 SELECT CASE WHEN d.free THEN $2 ELSE l.owner END, \
                     CASE WHEN d.free THEN l.fence + 1 ELSE l.fence END, \
                     CASE WHEN d.free THEN d.ts + $3::bigint * interval '1 microsecond' \
                         ELSE l.expires_at END, \
                     CASE WHEN d.free THEN ARRAY(\
                         SELECT q.w FROM unnest(l.waiters) WITH ORDINALITY AS q(w, o) \
                         WHERE {qexpiry} > d.now_ms AND {qid} <> $4 ORDER BY q.o) \
                     ELSE ARRAY(\
                         SELECT CASE WHEN {qid} = $4 \
                             THEN $4 || ' ' || (d.now_ms + $5::bigint) ELSE q.w END \
                         FROM unnest(l.waiters) WITH ORDINALITY AS q(w, o) \
                         WHERE {qexpiry} > d.now_ms OR {qid} = $4 ORDER BY q.o) \
                     || CASE WHEN d.mine OR d.live >= {MAX_QUEUE} THEN '{{}}'::text[] \
                         ELSE ARRAY[$4 || ' ' || (d.now_ms + $5::bigint)] END \
                     END \
                 FROM (SELECT c.ts, c.now_ms, \
                     l.owner IS NULL OR l.expires_at <= c.ts AS free, \
                     {mine} AS mine, \
                     (SELECT count(*) FROM unnest(l.waiters) AS q(w) \
                         WHERE {qexpiry} > c.now_ms) AS live \
                     FROM (SELECT t.ts, (extract(epoch FROM t.ts) * 1000)::bigint AS now_ms \
                         FROM (SELECT clock_timestamp() AS ts) AS t) AS c) AS d\
             ) \
             RETURNING CASE WHEN l.owner = $2 THEN l.fence END AS fence, \
                 {remaining} AS remaining, {mine} AS queued, \
                 set_config('synchronous_commit', CASE WHEN l.owner = $2 \
                     THEN current_setting('synchronous_commit') ELSE 'off' END, true)"
        );
        // Many leases in one statement (one transaction, one durable commit). The rows are
        // locked first, in name order, whatever join the planner picks, so two batches that
        // share rows lock them in the same order and cannot deadlock each other. A row that is
        // no longer this lease's (released, expired, taken over) is simply not returned.
        let renew = format!(
            "WITH r AS (\
                 SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::bigint[]) \
                     AS r(name, owner, fence, ttl)\
             ), mine AS MATERIALIZED (\
                 SELECT l.name, r.ttl FROM {t} AS l JOIN r ON l.name = r.name \
                 WHERE l.owner = r.owner AND l.fence = r.fence \
                     AND l.expires_at > clock_timestamp() \
                 ORDER BY l.name \
                 FOR NO KEY UPDATE OF l\
             ) \
             UPDATE {t} AS l SET expires_at = clock_timestamp() + mine.ttl * interval '1 microsecond' \
             FROM mine WHERE l.name = mine.name AND l.expires_at > clock_timestamp() \
             RETURNING l.name"
        );
        let wake = wake_first();
        let release_where = "l.name = $1 AND l.owner = $2 AND l.fence = $3 \
                             AND l.expires_at > clock_timestamp()";
        let release = format!(
            "UPDATE {t} AS l SET owner = NULL, expires_at = clock_timestamp() \
             WHERE {release_where} \
             RETURNING l.fence, {wake}"
        );
        // set_config(.., true) is local to the implicit transaction of this one statement; the
        // subquery in FROM makes sure it is evaluated before the commit reads the setting.
        let release_async = format!(
            "UPDATE {t} AS l SET owner = NULL, expires_at = clock_timestamp() \
             FROM (SELECT set_config('synchronous_commit', 'off', true)) AS cfg \
             WHERE {release_where} \
             RETURNING l.fence, {wake}"
        );
        let release_token = format!(
            "UPDATE {t} AS l SET owner = NULL, expires_at = clock_timestamp() \
             WHERE l.name = $1 AND l.owner = $2 \
             RETURNING l.fence, {wake}"
        );
        let leaving = has_entry("$2");
        let dequeue = format!(
            "UPDATE {t} AS l SET waiters = ARRAY(\
                 SELECT q.w FROM unnest(l.waiters) WITH ORDINALITY AS q(w, o) \
                 WHERE {qid} <> $2 ORDER BY q.o) \
             FROM (SELECT set_config('synchronous_commit', 'off', true)) AS cfg \
             WHERE l.name = $1 AND {leaving} \
             RETURNING CASE WHEN l.owner IS NULL OR l.expires_at <= clock_timestamp() \
                 THEN {wake} END"
        );
        let inspect = format!(
            "SELECT owner, fence, {remaining}, (SELECT count(*) FROM {live}) \
             FROM {t} AS l WHERE name = $1 AND owner IS NOT NULL AND expires_at > clock_timestamp()",
            live = live_entries()
        );
        let force_release = format!(
            "UPDATE {t} AS l SET owner = NULL, expires_at = clock_timestamp() \
             WHERE l.name = $1 AND l.owner IS NOT NULL AND l.expires_at > clock_timestamp() \
                 AND ($2::bigint IS NULL OR l.fence = $2) \
             RETURNING l.fence, {wake}"
        );
        Self {
            create: sql(create),
            add_waiters: sql(add_waiters),
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
