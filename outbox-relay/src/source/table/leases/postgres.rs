//! Shard leases on PostgreSQL: session-level advisory locks `(space, n)`, shard leases below
//! [`SHARDS`](super::SHARDS) and memberships from it up.
//!
//! `space` is a hash of the outbox table's OID: advisory locks are database-wide, and relays of
//! outbox tables in other schemas must not share leases with this one.

use super::SHARDS;
use crate::error::SourceError;
use seaorm_outbox::TableName;
use sqlx::postgres::PgConnection;

/// Whether this session holds the membership lock `($1, $2)`.
const HOLDS_MEMBERSHIP: &str = "SELECT 1 FROM pg_locks
    WHERE pid = pg_backend_pid() AND locktype = 'advisory' AND granted AND objsubid = 2
      AND classid = $1::int4::oid AND objid = $2::int4::oid";

/// This replica's advisory locks: the table's lock space and its membership key.
#[derive(Debug)]
pub(super) struct AdvisoryLocks {
    space: i32,
    member: i32,
}

/// The server session's process id, asked on the simple protocol.
async fn backend_pid(conn: &mut PgConnection) -> Result<i32, sqlx::Error> {
    use sqlx::Row;
    sqlx::raw_sql("SELECT pg_backend_pid()")
        .fetch_one(conn)
        .await?
        .try_get(0)
}

/// Why a relay behind a transaction-mode pooler must not run.
fn pooled() -> SourceError {
    SourceError::Refused(
        "the relay's database session does not keep the locks it takes: a pooler in transaction \
         mode (PgBouncer's pool_mode = transaction, say) hands its statements to other sessions, \
         so two replicas could publish one shard. Connect the relay to PostgreSQL directly, or \
         through a pool in session mode"
            .into(),
    )
}

impl AdvisoryLocks {
    /// Takes a membership lock under a random key >= 256.
    ///
    /// Refused when the session does not keep what it took: a pooler in transaction mode
    /// (PgBouncer's `pool_mode = transaction`) hands each statement to any server session, so
    /// session locks would not be the relay's and two replicas could own one shard.
    pub async fn join(conn: &mut PgConnection, table: &TableName) -> Result<Self, SourceError> {
        // First, on the simple protocol, which any pooler passes (prepared statements may not
        // survive one): do two statements run in one server session?
        if backend_pid(conn).await? != backend_pid(conn).await? {
            return Err(pooled());
        }
        let space: i32 =
            sqlx::query_scalar("SELECT hashtext('outbox-relay:' || $1::regclass::oid::text)")
                .bind(table.quoted('"'))
                .fetch_one(&mut *conn)
                .await?;
        let (member, backend) = loop {
            let candidate = rand::random_range(i32::from(SHARDS)..i32::MAX);
            let (taken, backend): (bool, i32) =
                sqlx::query_as("SELECT pg_try_advisory_lock($1, $2), pg_backend_pid()")
                    .bind(space)
                    .bind(candidate)
                    .fetch_one(&mut *conn)
                    .await?;
            if taken {
                break (candidate, backend);
            }
        };
        let (backend_now, holds): (i32, bool) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT pg_backend_pid(), EXISTS ({HOLDS_MEMBERSHIP})"
        )))
        .bind(space)
        .bind(member)
        .fetch_one(&mut *conn)
        .await?;
        if backend_now != backend || !holds {
            return Err(pooled());
        }
        Ok(AdvisoryLocks { space, member })
    }

    /// The live replicas: the membership locks held in this database. Refused when this session
    /// no longer holds its own (a pooler in transaction mode ran the statement elsewhere).
    pub async fn members(&self, conn: &mut PgConnection) -> Result<i64, SourceError> {
        let (members, holds): (i64, bool) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT count(*), EXISTS ({HOLDS_MEMBERSHIP}) FROM pg_locks
             WHERE locktype = 'advisory' AND granted AND objsubid = 2
               AND classid = $1::int4::oid AND objid >= $3::int4::oid
               AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )))
        .bind(self.space)
        .bind(self.member)
        .bind(i32::from(SHARDS))
        .fetch_one(&mut *conn)
        .await?;
        if !holds {
            return Err(pooled());
        }
        Ok(members)
    }

    /// Leases up to `want` of the free shards among `candidates`, in their order.
    pub async fn take(
        &self,
        conn: &mut PgConnection,
        candidates: &[i16],
        want: usize,
    ) -> Result<Vec<i16>, sqlx::Error> {
        // unnest yields the candidates in order and LIMIT stops the scan, so no lock is taken
        // past the share (an ORDER BY would evaluate the condition on every row first).
        sqlx::query_scalar(
            "SELECT s::int2 FROM unnest($1::int4[]) s WHERE pg_try_advisory_lock($2, s) LIMIT $3",
        )
        .bind(candidates.iter().map(|&s| i32::from(s)).collect::<Vec<_>>())
        .bind(self.space)
        .bind(i64::try_from(want).unwrap_or(0))
        .fetch_all(&mut *conn)
        .await
    }

    /// Releases the leases of `shards`.
    pub async fn release(
        &self,
        conn: &mut PgConnection,
        shards: &[i16],
    ) -> Result<(), sqlx::Error> {
        sqlx::query("SELECT pg_advisory_unlock($1, s) FROM unnest($2::int4[]) s")
            .bind(self.space)
            .bind(shards.iter().map(|&s| i32::from(s)).collect::<Vec<_>>())
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    /// Releases the membership.
    pub async fn leave(&self, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
        sqlx::query("SELECT pg_advisory_unlock($1, $2)")
            .bind(self.space)
            .bind(self.member)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }
}
