//! The SQL of the lease table, built once from the validated table name.
//!
//! Every value is a bind parameter; only the table name is formatted in, and it has been
//! validated as an identifier and is double-quoted ([`crate::TableName`]), which is why wrapping
//! these strings in [`sqlx::AssertSqlSafe`] is sound.

use std::sync::Arc;

use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};

use crate::TableName;

/// The statements of one table.
#[derive(Debug)]
pub(crate) struct Statements {
    pub(crate) create: SqlStr,
    /// `$1` name, `$2` owner, `$3` ttl µs → `fence` when granted, no row when held.
    pub(crate) acquire: SqlStr,
    /// `$1` name, `$2` owner, `$3` ttl µs, `$4` gate class, `$5` gated → one row: `fence` when
    /// granted; else `remaining` µs of the live holder seen, or `tried` = false when another
    /// acquire of the name was in progress (gated only), or `tried` = true when the grant was
    /// lost to a holder that committed during the statement.
    pub(crate) acquire_waiting: SqlStr,
    /// The advisory-lock class of this table's acquire gates.
    pub(crate) gate_class: i32,
    /// `$1` names, `$2` owners, `$3` fences, `$4` ttls µs (arrays of one length, names distinct)
    /// → the `name` of every row renewed; rows are locked in name order.
    pub(crate) renew: SqlStr,
    /// `$1` name, `$2` owner, `$3` fence, `$4` channel → one row when released (and notified).
    pub(crate) release: SqlStr,
    /// As `release`, with `synchronous_commit = off` for this statement's transaction only.
    pub(crate) release_async: SqlStr,
    /// `$1` name, `$2` owner, `$3` channel: undoes a grant whose reply was lost (fence unknown).
    pub(crate) release_token: SqlStr,
    /// `$1` name → `owner`, `fence`, remaining µs of a live holder.
    pub(crate) inspect: SqlStr,
    /// `$1` name, `$2` channel, `$3` fence or NULL: the operator override, whoever holds it (or
    /// only the grant with that fence).
    pub(crate) force_release: SqlStr,
}

/// The advisory-lock class (first key) of a table's acquire gates: a hash of the table name, so
/// that the two-key advisory locks an application takes are unlikely to collide with them (a
/// collision only makes an acquire wait for a notification or its fallback poll).
fn gate_class(table: &TableName) -> i32 {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(format!("distlock gate {}", table.quoted()).as_bytes());
    i32::from_be_bytes([digest[0], digest[1], digest[2], digest[3]])
}

fn sql(s: String) -> SqlStr {
    AssertSqlSafe(Arc::<str>::from(s)).into_sql_str()
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
                 expires_at timestamptz NOT NULL\n\
             )"
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
        // The waiter's statement: the same upsert, whose WHERE, evaluated on the latest
        // version of the locked row, is what makes grants exclusive. Two shortcuts spare a
        // loser the row lock (a durable commit) and the wait behind a concurrent grant:
        // * `cur`: when the statement's snapshot shows a live holder, nothing is attempted and
        //   its remaining time is returned instead (no separate inspect needed);
        // * `gate` (when `$5`): a transaction-scoped advisory lock on the name, so that of the
        //   waiters woken by one release only the first runs the upsert; the others learn
        //   `tried = false` at once, without blocking on the row until the winner commits.
        let acquire_waiting = format!(
            "WITH cur AS MATERIALIZED (\
                 SELECT GREATEST(0, floor(extract(epoch FROM expires_at - clock_timestamp()) \
                     * 1000000))::bigint AS remaining \
                 FROM {t} WHERE name = $1 AND owner IS NOT NULL \
                     AND expires_at > clock_timestamp()\
             ), gate AS MATERIALIZED (\
                 SELECT CASE WHEN $5::bool \
                     THEN pg_try_advisory_xact_lock($4::int, hashtext($1)) ELSE true END AS open \
                 WHERE NOT EXISTS (SELECT 1 FROM cur)\
             ), granted AS (\
                 INSERT INTO {t} AS l (name, owner, fence, expires_at) \
                 SELECT $1, $2, 1, clock_timestamp() + $3::bigint * interval '1 microsecond' \
                 FROM gate WHERE gate.open \
                 ON CONFLICT (name) DO UPDATE \
                 SET owner = excluded.owner, fence = l.fence + 1, \
                     expires_at = clock_timestamp() + $3::bigint * interval '1 microsecond' \
                 WHERE l.owner IS NULL OR l.expires_at <= clock_timestamp() \
                 RETURNING l.fence\
             ) \
             SELECT (SELECT fence FROM granted) AS fence, \
                 (SELECT remaining FROM cur) AS remaining, \
                 (SELECT open FROM gate) AS tried"
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
        let release_where = "l.name = $1 AND l.owner = $2 AND l.fence = $3 \
                             AND l.expires_at > clock_timestamp()";
        let release = format!(
            "UPDATE {t} AS l SET owner = NULL, expires_at = clock_timestamp() \
             WHERE {release_where} \
             RETURNING l.fence, pg_notify($4, '')"
        );
        // set_config(.., true) is local to the implicit transaction of this one statement; the
        // subquery in FROM makes sure it is evaluated before the commit reads the setting.
        let release_async = format!(
            "UPDATE {t} AS l SET owner = NULL, expires_at = clock_timestamp() \
             FROM (SELECT set_config('synchronous_commit', 'off', true)) AS cfg \
             WHERE {release_where} \
             RETURNING l.fence, pg_notify($4, '')"
        );
        let release_token = format!(
            "UPDATE {t} AS l SET owner = NULL, expires_at = clock_timestamp() \
             WHERE l.name = $1 AND l.owner = $2 \
             RETURNING l.fence, pg_notify($3, '')"
        );
        let inspect = format!(
            "SELECT owner, fence, \
                 GREATEST(0, floor(extract(epoch FROM expires_at - clock_timestamp()) * 1000000))::bigint \
             FROM {t} WHERE name = $1 AND owner IS NOT NULL AND expires_at > clock_timestamp()"
        );
        let force_release = format!(
            "UPDATE {t} AS l SET owner = NULL, expires_at = clock_timestamp() \
             WHERE l.name = $1 AND l.owner IS NOT NULL AND l.expires_at > clock_timestamp() \
                 AND ($3::bigint IS NULL OR l.fence = $3) \
             RETURNING l.fence, pg_notify($2, '')"
        );
        Self {
            create: sql(create),
            force_release: sql(force_release),
            acquire: sql(acquire),
            acquire_waiting: sql(acquire_waiting),
            gate_class: gate_class(table),
            renew: sql(renew),
            release: sql(release),
            release_async: sql(release_async),
            release_token: sql(release_token),
            inspect: sql(inspect),
        }
    }
}
