//! The lock's own small connection pool.
//!
//! `sqlx`'s pool pings every connection when it is returned, one extra round trip per
//! statement; for a lock whose operations are single statements that doubles the server work.
//! Here a connection goes back to the idle list only after its statement completed; one that
//! failed or whose future was dropped mid-statement is closed, so its state never leaks into the
//! next operation. A connection the server killed while idle is detected on its next use
//! (see `Inner::fetch_idempotent`).

use std::{
    sync::{Mutex, PoisonError},
    time::Duration,
};

use sqlx::{Connection, PgConnection, postgres::PgConnectOptions};
use tokio::{
    sync::{Semaphore, SemaphorePermit},
    time::timeout,
};

pub(crate) struct ConnPool {
    options: PgConnectOptions,
    idle: Mutex<Vec<PgConnection>>,
    permits: Semaphore,
    connect_timeout: Duration,
}

impl std::fmt::Debug for ConnPool {
    // Not derived: the connect options hold the password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnPool")
            .field("available", &self.permits.available_permits())
            .finish_non_exhaustive()
    }
}

/// A connection checked out of [`ConnPool`]. Dropped without [`PooledConn::put_back`], it is
/// closed.
pub(crate) struct PooledConn<'a> {
    pool: &'a ConnPool,
    conn: Option<PgConnection>,
    _permit: SemaphorePermit<'a>,
}

impl ConnPool {
    pub(crate) fn new(options: PgConnectOptions, size: u32, connect_timeout: Duration) -> Self {
        Self {
            options,
            idle: Mutex::new(Vec::new()),
            permits: Semaphore::new(usize::try_from(size).unwrap_or(1).max(1)),
            connect_timeout,
        }
    }

    /// An idle connection, or a new one; waits for a free slot up to the connect timeout.
    pub(crate) async fn get(&self) -> Result<PooledConn<'_>, sqlx::Error> {
        let permit = timeout(self.connect_timeout, self.permits.acquire())
            .await
            .map_err(|_| sqlx::Error::PoolTimedOut)?
            .map_err(|_| sqlx::Error::PoolClosed)?;
        let idle = self
            .idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop();
        let conn = match idle {
            Some(conn) => conn,
            None => timeout(
                self.connect_timeout,
                PgConnection::connect_with(&self.options),
            )
            .await
            .map_err(|_| sqlx::Error::PoolTimedOut)??,
        };
        Ok(PooledConn {
            pool: self,
            conn: Some(conn),
            _permit: permit,
        })
    }
}

impl PooledConn<'_> {
    pub(crate) fn conn(&mut self) -> Option<&mut PgConnection> {
        self.conn.as_mut()
    }

    /// Returns the connection to the idle list (call only after a completed statement).
    pub(crate) fn put_back(mut self) {
        if let Some(conn) = self.conn.take() {
            self.pool
                .idle
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(conn);
        }
    }
}
