//! Shard leases: how many relay replicas share one PostgreSQL database without ever publishing one
//! aggregate's events from two places at once.
//!
//! Every row has a `shard` (0-255), a hash of its aggregate, so all events of an aggregate share a
//! shard. A replica publishes only rows of the shards it leases. A lease is a session-level
//! advisory lock `(space, shard)` held by the replica's one connection: PostgreSQL releases it the
//! moment that connection dies, together with the replica's open claim, so a dead replica's shards
//! are free at once and never owned twice.
//!
//! Each replica also holds a membership lock `(space, random id >= 256)`. Counting those gives the
//! number of live replicas; each replica aims for `ceil(256 / replicas)` shards, taking free ones
//! and releasing any above its share between batches. See `docs/design.md`.
//!
//! `space` is a hash of the outbox table's OID: advisory locks are database-wide, and relays of
//! outbox tables in other schemas must not share leases with this one.

use crate::error::SourceError;
use sqlx::postgres::PgConnection;
use std::time::{Duration, Instant};

/// Number of shards; the `shard` column is `hash & 255`. Second lock keys below it are shard
/// leases, keys from it up are memberships.
pub(crate) const SHARDS: i16 = 256;

/// Whether this session holds the membership lock `($1, $2)`.
const HOLDS_MEMBERSHIP: &str = "SELECT 1 FROM pg_locks
    WHERE pid = pg_backend_pid() AND locktype = 'advisory' AND granted AND objsubid = 2
      AND classid = $1::int4::oid AND objid = $2::int4::oid";

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

/// This replica's leases.
#[derive(Debug)]
pub(crate) struct Leases {
    /// The first advisory-lock key of every lock of this outbox table's relays.
    space: i32,
    member: i32,
    /// Where this replica starts looking for free shards, so replicas do not all race for shard 0.
    offset: i32,
    held: Vec<i16>,
    refresh_every: Duration,
    next_refresh: Instant,
}

impl Leases {
    /// Registers this replica as a member. Leases are taken by the first [`Leases::refresh`].
    ///
    /// Refused when the session does not keep what it took: a pooler in transaction mode
    /// (PgBouncer's `pool_mode = transaction`) hands each statement to any server session, so
    /// session locks would not be the relay's and two replicas could own one shard.
    pub async fn join(
        conn: &mut PgConnection,
        refresh_every: Duration,
    ) -> Result<Self, SourceError> {
        // First, on the simple protocol, which any pooler passes (prepared statements may not
        // survive one): do two statements run in one server session?
        if backend_pid(conn).await? != backend_pid(conn).await? {
            return Err(pooled());
        }
        let space: i32 =
            sqlx::query_scalar("SELECT hashtext('outbox-relay:' || 'outbox'::regclass::oid::text)")
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
        Ok(Leases {
            space,
            member,
            offset: rand::random_range(0..i32::from(SHARDS)),
            held: Vec::new(),
            refresh_every,
            next_refresh: Instant::now(),
        })
    }

    /// The shards this replica may publish.
    pub fn held(&self) -> &[i16] {
        &self.held
    }

    /// When the next refresh is due.
    pub fn next_refresh(&self) -> Instant {
        self.next_refresh
    }

    /// Whether a rebalance is due at `now`. The relay reads the clock once per turn and decides
    /// with that one reading both to settle the batch in flight and to rebalance: reading it twice,
    /// a refresh could fall due between the two and move shards with unsettled rows.
    pub fn due(&self, now: Instant) -> bool {
        now >= self.next_refresh
    }

    /// Rebalances: counts live replicas, releases shards above this replica's fair share, and
    /// tries to lease free shards up to it. Call it only with nothing in flight, when
    /// [`due`](Self::due).
    ///
    /// Refused when this session no longer holds its membership: a pooler in transaction mode
    /// ran the statement on another server session (see [`join`](Self::join)).
    pub async fn refresh(&mut self, conn: &mut PgConnection) -> Result<(), SourceError> {
        self.next_refresh = Instant::now() + self.refresh_every;
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
        let members_usize = usize::try_from(members.max(1)).unwrap_or(1);
        let fair = (SHARDS as usize).div_ceil(members_usize);

        if self.held.len() > fair {
            let surplus = self.held.split_off(fair);
            sqlx::query("SELECT pg_advisory_unlock($1, s) FROM unnest($2::int4[]) s")
                .bind(self.space)
                .bind(surplus.iter().map(|&s| i32::from(s)).collect::<Vec<_>>())
                .execute(&mut *conn)
                .await?;
            tracing::info!(
                released = surplus.len(),
                held = self.held.len(),
                members,
                "shards rebalanced"
            );
        } else if self.held.len() < fair {
            // Walks the shards from this replica's offset and stops at the share: LIMIT stops the
            // scan, so no lock is taken past it. CASE fixes the evaluation order: a held shard must
            // not be locked again (session locks are re-entrant and would need two unlocks).
            let taken: Vec<i32> = sqlx::query_scalar(
                "SELECT s FROM (SELECT ((g + $1) % 256)::int4 AS s FROM generate_series(0, 255) g) c
                 WHERE CASE WHEN s = ANY($2) THEN false ELSE pg_try_advisory_lock($3, s) END
                 LIMIT $4",
            )
            .bind(self.offset)
            .bind(self.held.iter().map(|&s| i32::from(s)).collect::<Vec<_>>())
            .bind(self.space)
            .bind(i64::try_from(fair - self.held.len()).unwrap_or(0))
            .fetch_all(&mut *conn)
            .await?;
            if !taken.is_empty() {
                self.held
                    .extend(taken.iter().filter_map(|&s| i16::try_from(s).ok()));
                self.held.sort_unstable();
                tracing::info!(
                    taken = taken.len(),
                    held = self.held.len(),
                    members,
                    "shards leased"
                );
            }
        }
        Ok(())
    }

    /// Releases every lease and the membership, so other replicas take over at once.
    pub async fn leave(self, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
        sqlx::query("SELECT pg_advisory_unlock($1, s) FROM unnest($2::int4[]) s")
            .bind(self.space)
            .bind(self.held.iter().map(|&s| i32::from(s)).collect::<Vec<_>>())
            .execute(&mut *conn)
            .await?;
        sqlx::query("SELECT pg_advisory_unlock($1, $2)")
            .bind(self.space)
            .bind(self.member)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }
}
