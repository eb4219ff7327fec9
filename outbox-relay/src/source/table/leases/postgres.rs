//! Shard leases on PostgreSQL: session-level advisory locks `(space, n)`, shard leases below
//! [`SHARDS`](super::SHARDS) and the 256 membership slots from it up.
//!
//! `space` is a hash of the outbox table's OID: advisory locks are database-wide, and relays of
//! outbox tables in other schemas must not share leases with this one.
//!
//! The live replicas are counted by probing each membership slot with a shared lock (taken and
//! dropped at once), not by reading `pg_locks`: that view copies every lock of the whole server,
//! so with many tenant databases on one server each refresh would cost as much as all their
//! leases together. And between counts a refresh probes only the slots last seen held and a
//! "joining" flag: the replicas change only when a known slot comes free (a replica left or
//! died) or a new one joins, and a new one holds the flag until it has its fair share.

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

/// The joining flag `($1, JOINING)`, held shared by every replica from its join until it holds
/// its fair share, so the others count the slots again.
const JOINING: i32 = LAST_SLOT + 1;

/// Whether another session holds the joining flag (`$4`): this one's shared hold does not refuse
/// its own exclusive probe.
const ANOTHER_JOINING: &str =
    "CASE WHEN pg_try_advisory_lock($1, $4) THEN NOT pg_advisory_unlock($1, $4) ELSE true END";

/// A full count at least every this many refreshes, in case a joining replica's flag came and
/// went between two of this one's refreshes (a long batch delays them).
const RECOUNT_EVERY: u32 = 60;

/// This replica's advisory locks: the table's lock space, its membership slot, the server
/// session that holds them, and the other replicas' slots as last counted.
#[derive(Debug)]
pub(super) struct AdvisoryLocks {
    space: i32,
    member: i32,
    backend: i32,
    others: Vec<i32>,
    joining: bool,
    since_count: u32,
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
        // Flagged before it holds a slot, so no replica counts it without counting again once
        // the flag is gone. Blocks only on another replica's probe, which drops it at once.
        sqlx::query("SELECT pg_advisory_lock_shared($1, $2)")
            .bind(space)
            .bind(JOINING)
            .execute(&mut *conn)
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
        let mut locks = AdvisoryLocks {
            space,
            member,
            backend,
            others: Vec::new(),
            joining: true,
            since_count: 0,
        };
        locks.count(conn).await?;
        Ok(locks)
    }

    /// The live replicas. Between counts it asks only whether a slot last seen held came free or
    /// a replica is joining, and counts again when one did. `settled`: this replica holds its
    /// fair share, so it drops its joining flag.
    ///
    /// Refused when the statement did not run in the session that holds this replica's slot (a
    /// pooler in transaction mode ran it elsewhere): another session, or one where the slot is
    /// held by someone else.
    pub async fn members(
        &mut self,
        conn: &mut PgConnection,
        settled: bool,
    ) -> Result<i64, SourceError> {
        if self.joining && settled {
            sqlx::query("SELECT pg_advisory_unlock_shared($1, $2)")
                .bind(self.space)
                .bind(JOINING)
                .execute(&mut *conn)
                .await?;
            self.joining = false;
        }
        let known: Vec<i32> = self.others.iter().copied().chain([self.member]).collect();
        let (backend, own_slot_used, known_freed, joining): (i32, bool, bool, bool) =
            sqlx::query_as(sqlx::AssertSqlSafe(format!(
                // MATERIALIZED: each slot probed once, however often `used` is read.
                "WITH known AS MATERIALIZED (SELECT k, {SLOT_USED} AS used FROM unnest($2::int4[]) k) \
                 SELECT pg_backend_pid(), coalesce(bool_or(used) FILTER (WHERE k = $3), true), \
                        coalesce(bool_or(NOT used) FILTER (WHERE k <> $3), false), \
                        {ANOTHER_JOINING} FROM known"
            )))
            .bind(self.space)
            .bind(known)
            .bind(self.member)
            .bind(JOINING)
            .fetch_one(&mut *conn)
            .await?;
        self.check_session(backend, own_slot_used)?;
        self.since_count += 1;
        if known_freed || joining || self.since_count >= RECOUNT_EVERY {
            self.count(conn).await?;
        }
        Ok(i64::try_from(self.others.len()).unwrap_or(i64::MAX) + 1)
    }

    /// Refused unless the statement ran in the session that holds this replica's slot: the same
    /// server process, where the slot probed free.
    fn check_session(&self, backend: i32, own_slot_used: bool) -> Result<(), SourceError> {
        if backend != self.backend || own_slot_used {
            return Err(pooled());
        }
        Ok(())
    }

    /// Probes every membership slot: which the other replicas hold.
    async fn count(&mut self, conn: &mut PgConnection) -> Result<(), SourceError> {
        let (backend, others, own_slot_used): (i32, Vec<i32>, bool) =
            sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "WITH slots AS MATERIALIZED (SELECT k, {SLOT_USED} AS used FROM generate_series($2, $3) k) \
                 SELECT pg_backend_pid(), coalesce(array_agg(k) FILTER (WHERE used AND k <> $4), '{{}}'), \
                        coalesce(bool_or(used) FILTER (WHERE k = $4), true) FROM slots"
            )))
            .bind(self.space)
            .bind(FIRST_SLOT)
            .bind(LAST_SLOT)
            .bind(self.member)
            .fetch_one(&mut *conn)
            .await?;
        self.check_session(backend, own_slot_used)?;
        self.others = others;
        self.since_count = 0;
        Ok(())
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

    /// Releases the membership, and the joining flag if still held.
    pub async fn leave(&self, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
        sqlx::query("SELECT pg_advisory_unlock($1, $2)")
            .bind(self.space)
            .bind(self.member)
            .execute(&mut *conn)
            .await?;
        if self.joining {
            sqlx::query("SELECT pg_advisory_unlock_shared($1, $2)")
                .bind(self.space)
                .bind(JOINING)
                .execute(&mut *conn)
                .await?;
        }
        Ok(())
    }
}
