//! The resource side of fencing in PostgreSQL: accept a write only with a newer token.

use std::sync::Arc;

use lock_core::raw::{Error, FencingToken, Result, StaleFencingToken};
use sqlx::{AssertSqlSafe, Encode, PgConnection, Postgres, Row, SqlSafeStr, SqlStr, Type};

use crate::TableName;
use crate::config::check_identifier;

/// A table whose rows remember the highest fencing token that wrote them — the article's
/// `scheduled_jobs.last_fencing_token` — and the check-and-bump that protects them.
///
/// [`FencedTable::fence`] runs, inside the caller's own transaction,
///
/// ```sql
/// UPDATE <table> SET <token_column> = $token
/// WHERE <key_column> = $key AND (<token_column> IS NULL OR <token_column> < $token)
/// ```
///
/// The `UPDATE` locks the row until the transaction ends, so the caller's writes that follow
/// in the same transaction are fenced too, and a concurrent writer with another token waits and
/// then re-checks against the committed value. A stale token is reported as
/// [`FenceError::Stale`], a missing row as [`FenceError::NotFound`]; either way nothing was
/// changed and the caller should roll back. Under `REPEATABLE READ` or `SERIALIZABLE`, a
/// concurrent writer makes the later one fail with a serialization error instead
/// ([`FenceError::Database`], SQLSTATE 40001): retry its transaction.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool, token: lock_core::raw::FencingToken) -> Result<(), Box<dyn std::error::Error>> {
/// use lock_pg::FencedTable;
/// let jobs = FencedTable::new("scheduled_jobs", "id", "last_fencing_token")?;
/// let mut tx = pool.begin().await?;
/// jobs.fence(&mut tx, 42_i64, token).await?; // Err(FenceError::Stale(..)) for a paused old holder
/// sqlx::query("UPDATE scheduled_jobs SET status = 'closed' WHERE id = $1")
///     .bind(42_i64)
///     .execute(&mut *tx)
///     .await?;
/// tx.commit().await?;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct FencedTable {
    table: TableName,
    bump: SqlStr,
    current: SqlStr,
}

/// Why a fenced write was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FenceError {
    /// A newer (or the same) token has already written this row: the writer's lease is stale.
    #[error(transparent)]
    Stale(#[from] StaleFencingToken),
    /// No row has this key.
    #[error("no row with this key in the fenced table")]
    NotFound,
    /// The token does not fit PostgreSQL's `bigint`.
    #[error("fencing token {0} does not fit a bigint column")]
    TokenOutOfRange(FencingToken),
    /// The database failed; the caller's transaction is aborted.
    #[error("fenced write failed: {0}")]
    Database(#[from] sqlx::Error),
}

impl FenceError {
    /// `true` for [`FenceError::Stale`].
    pub fn is_stale(&self) -> bool {
        matches!(self, FenceError::Stale(_))
    }
}

impl FencedTable {
    /// Describes `table` (optionally `schema.table`) keyed by `key_column`, whose
    /// `token_column` (a `bigint`, `NULL` meaning "never written with a token") holds the
    /// highest accepted fencing token.
    ///
    /// # Errors
    /// [`Error::Config`] when a name is not a plain identifier.
    pub fn new(table: &str, key_column: &str, token_column: &str) -> Result<Self> {
        let table = TableName::new(table)?;
        check_identifier(key_column)?;
        check_identifier(token_column)?;
        let t = table.quoted();
        let (k, c) = (format!("\"{key_column}\""), format!("\"{token_column}\""));
        let bump = format!(
            "UPDATE {t} SET {c} = $2 WHERE {k} = $1 AND ({c} IS NULL OR {c} < $2) RETURNING {c}"
        );
        let current = format!("SELECT {c} FROM {t} WHERE {k} = $1");
        // Identifiers validated and quoted above; values are bind parameters.
        Ok(Self {
            table,
            bump: AssertSqlSafe(Arc::<str>::from(bump)).into_sql_str(),
            current: AssertSqlSafe(Arc::<str>::from(current)).into_sql_str(),
        })
    }

    /// The table.
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// Records `token` on the row `key` iff it is newer than every token that wrote it, inside
    /// the caller's transaction (pass `&mut *tx`, or a plain connection for a one-statement
    /// write).
    ///
    /// # Errors
    /// [`FenceError::Stale`] (with the highest token seen), [`FenceError::NotFound`],
    /// [`FenceError::TokenOutOfRange`], [`FenceError::Database`].
    pub async fn fence<K>(
        &self,
        conn: &mut PgConnection,
        key: K,
        token: FencingToken,
    ) -> std::result::Result<(), FenceError>
    where
        K: for<'q> Encode<'q, Postgres> + Type<Postgres> + Clone + Send + Sync,
    {
        let presented =
            i64::try_from(token.get()).map_err(|_| FenceError::TokenOutOfRange(token))?;
        let bumped = sqlx::query(self.bump.clone())
            .bind(key.clone())
            .bind(presented)
            .fetch_optional(&mut *conn)
            .await?;
        if bumped.is_some() {
            return Ok(());
        }
        let current = sqlx::query(self.current.clone())
            .bind(key)
            .fetch_optional(&mut *conn)
            .await?;
        match current {
            None => Err(FenceError::NotFound),
            Some(row) => Err(FenceError::Stale(StaleFencingToken {
                presented: token,
                highest: FencingToken(
                    row.try_get::<Option<i64>, _>(0)?
                        .and_then(|h| u64::try_from(h).ok())
                        .unwrap_or(0),
                ),
            })),
        }
    }
}

impl From<FenceError> for Error {
    fn from(e: FenceError) -> Self {
        Error::backend(crate::lock::BACKEND, "fenced write", e)
    }
}
