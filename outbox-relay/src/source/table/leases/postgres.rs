//! Shard leases on PostgreSQL: session-level advisory locks `(space, n)`, shard leases below
//! [`SHARDS`](super::SHARDS) and the 256 membership slots from it up.
//!
//! `space` is a hash of the outbox table's OID: advisory locks are database-wide, and relays of
//! outbox tables in other schemas must not share leases with this one.
//!
//! The live replicas are counted by probing each membership slot with a shared lock (taken and
//! dropped at once), not by reading `pg_locks`: that view copies every lock of the whole server,
//! so with many tenant databases on one server each refresh would cost as much as all their
//! leases together.

use super::SHARDS;
use crate::error::SourceError;
use seaorm_outbox::TableName;
use sqlx::postgres::PgConnection;

/// Whether the slot `($1, k)` is held by another session. A slot held by this one probes free,
/// as a session never conflicts with itself. `CASE` fixes the order: probe, then drop the probe.
const SLOT_USED: &str = "CASE WHEN pg_try_advisory_lock_shared($1, k) \
     THEN NOT pg_advisory_unlock_shared($1, k) ELSE true END";

/// The first membership slot; slots are `FIRST_SLOT .. FIRST_SLOT + SHARDS`.
const FIRST_SLOT: i32 = SHARDS as i32;
/// The last membership slot: as many as shards, since a replica beyond that would lease none.
const LAST_SLOT: i32 = FIRST_SLOT + SHARDS as i32 - 1;

/// This replica's advisory locks: the table's lock space, its membership slot and the server
/// session that holds them.
#[derive(Debug)]
pub(super) struct AdvisoryLocks {
    space: i32,
    member: i32,
    backend: i32,
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
    /// Takes the first free membership slot.
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
        let slot: Option<(i32, i32)> = sqlx::query_as(
            // generate_series yields the slots in order and LIMIT stops at the first one taken.
            "SELECT k, pg_backend_pid() FROM generate_series($2, $3) k \
             WHERE pg_try_advisory_lock($1, k) LIMIT 1",
        )
        .bind(space)
        .bind(FIRST_SLOT)
        .bind(LAST_SLOT)
        .fetch_optional(&mut *conn)
        .await?;
        let Some((member, backend)) = slot else {
            return Err(SourceError::Refused(format!(
                "{SHARDS} relays already publish this outbox, one per shard"
            )));
        };
        let locks = AdvisoryLocks {
            space,
            member,
            backend,
        };
        locks.members(conn).await?;
        Ok(locks)
    }

    /// The live replicas: the membership slots held in this database. Refused when the statement
    /// did not run in the session that holds this replica's slot (a pooler in transaction mode
    /// ran it elsewhere): another session, or one where the slot is held by someone else.
    pub async fn members(&self, conn: &mut PgConnection) -> Result<i64, SourceError> {
        let (backend, others, own_slot_used): (i32, i64, bool) =
            sqlx::query_as(sqlx::AssertSqlSafe(format!(
                // MATERIALIZED: each slot probed once, however often `used` is read.
                "WITH slots AS MATERIALIZED (SELECT k, {SLOT_USED} AS used FROM generate_series($2, $3) k) \
                 SELECT pg_backend_pid(), count(*) FILTER (WHERE used AND k <> $4), \
                        coalesce(bool_or(used) FILTER (WHERE k = $4), true) FROM slots"
            )))
            .bind(self.space)
            .bind(FIRST_SLOT)
            .bind(LAST_SLOT)
            .bind(self.member)
            .fetch_one(&mut *conn)
            .await?;
        if backend != self.backend || own_slot_used {
            return Err(pooled());
        }
        Ok(others + 1)
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
