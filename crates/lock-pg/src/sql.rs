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
    /// `$1` name, `$2` channel: the operator override, whoever holds it.
    pub(crate) force_release: SqlStr,
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
        // expired row while bumping its fence. A held row is left alone (no row returned).
        let acquire = format!(
            "INSERT INTO {t} AS l (name, owner, fence, expires_at) \
             VALUES ($1, $2, 1, clock_timestamp() + $3::bigint * interval '1 microsecond') \
             ON CONFLICT (name) DO UPDATE \
             SET owner = excluded.owner, fence = l.fence + 1, \
                 expires_at = clock_timestamp() + $3::bigint * interval '1 microsecond' \
             WHERE l.owner IS NULL OR l.expires_at <= clock_timestamp() \
             RETURNING l.fence"
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
             RETURNING l.fence, pg_notify($2, '')"
        );
        Self {
            create: sql(create),
            force_release: sql(force_release),
            acquire: sql(acquire),
            renew: sql(renew),
            release: sql(release),
            release_async: sql(release_async),
            release_token: sql(release_token),
            inspect: sql(inspect),
        }
    }
}
