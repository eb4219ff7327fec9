//! Shard leases: how many relay replicas share one database without ever publishing one
//! aggregate's events from two places at once.
//!
//! Every row has a `shard` (0-255), a hash of its aggregate, so all events of an aggregate share a
//! shard. A replica publishes only rows of the shards it leases. A lease is a session-level lock
//! held by the replica's one connection (an advisory lock on PostgreSQL, `postgres.rs`; a named
//! lock on MySQL and MariaDB, `mysql.rs`): the server releases it the moment that connection
//! dies, together with the replica's open claim, so a dead replica's shards are free at once and
//! never owned twice.
//!
//! Each replica also holds a membership lock. Counting those gives the number of live replicas;
//! each replica aims for `ceil(256 / replicas)` shards, taking free ones and releasing any above
//! its share between batches. See `docs/design.md`.

mod mysql;
mod postgres;

pub use mysql::MYSQL_LOCK_PREFIX;

use super::{Connection, OutboxTable};
use crate::error::SourceError;
use std::time::{Duration, Instant};

/// Number of shards; the `shard` column is `hash & 255`.
pub(crate) const SHARDS: i16 = 256;

/// This replica's leases.
#[derive(Debug)]
pub(crate) struct Leases {
    locks: Locks,
    /// Where this replica starts looking for free shards, so replicas do not all race for shard 0.
    offset: i16,
    held: Vec<i16>,
    /// Whether the last refresh left this replica with its share (see [`Leases::refresh`]).
    settled: bool,
    refresh_every: Duration,
    next_refresh: Instant,
}

/// The locks of one backend.
#[derive(Debug)]
enum Locks {
    Postgres(postgres::AdvisoryLocks),
    MySql(mysql::NamedLocks),
}

/// The locks and the connection they live on, matched once.
enum Session<'a> {
    Postgres(&'a mut postgres::AdvisoryLocks, &'a mut sqlx::PgConnection),
    MySql(&'a mysql::NamedLocks, &'a mut sqlx::MySqlConnection),
}

impl Locks {
    fn on<'a>(&'a mut self, table: &'a mut OutboxTable) -> Result<Session<'a>, SourceError> {
        match (self, &mut table.conn) {
            (Locks::Postgres(locks), Connection::Postgres(conn)) => {
                Ok(Session::Postgres(locks, conn))
            }
            (Locks::MySql(locks), Connection::MySql(conn)) => Ok(Session::MySql(locks, conn)),
            _ => Err(SourceError::Refused(
                "shard leases held on another database's connection".into(),
            )),
        }
    }
}

impl Session<'_> {
    async fn members(self, settled: bool) -> Result<i64, SourceError> {
        match self {
            Session::Postgres(locks, conn) => locks.members(conn, settled).await,
            Session::MySql(locks, conn) => locks.members(conn).await,
        }
    }

    async fn take(self, candidates: &[i16], want: usize) -> Result<Vec<i16>, sqlx::Error> {
        match self {
            Session::Postgres(locks, conn) => locks.take(conn, candidates, want).await,
            Session::MySql(locks, conn) => locks.take(conn, candidates, want).await,
        }
    }

    async fn release(self, shards: &[i16]) -> Result<(), sqlx::Error> {
        match self {
            Session::Postgres(locks, conn) => locks.release(conn, shards).await,
            Session::MySql(locks, conn) => locks.release(conn, shards).await,
        }
    }

    async fn leave(self) -> Result<(), sqlx::Error> {
        match self {
            Session::Postgres(locks, conn) => locks.leave(conn).await,
            Session::MySql(locks, conn) => locks.leave(conn).await,
        }
    }
}

impl Leases {
    /// Registers this replica as a member; `None` on SQLite, which allows one relay per database.
    /// Leases are taken by the first [`Leases::refresh`].
    pub async fn join(
        table: &mut OutboxTable,
        refresh_every: Duration,
    ) -> Result<Option<Self>, SourceError> {
        let locks = match &mut table.conn {
            Connection::Postgres(conn) => {
                Locks::Postgres(postgres::AdvisoryLocks::join(conn, &table.name).await?)
            }
            Connection::MySql(conn) => {
                Locks::MySql(mysql::NamedLocks::join(conn, &table.name).await?)
            }
            Connection::Sqlite(_) => return Ok(None),
        };
        Ok(Some(Leases {
            locks,
            offset: rand::random_range(0..SHARDS),
            held: Vec::new(),
            settled: false,
            refresh_every,
            next_refresh: Instant::now(),
        }))
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
    /// tries to lease free shards up to it, walking the shards from this replica's offset. Call
    /// it only with nothing in flight, when [`due`](Self::due).
    ///
    /// Refused when this session no longer holds its membership: a pooler or proxy ran the
    /// statement on another server session.
    pub async fn refresh(&mut self, table: &mut OutboxTable) -> Result<(), SourceError> {
        // Jittered, so pumps started together (tenants) do not all refresh in the same instant.
        self.next_refresh =
            Instant::now() + self.refresh_every.mul_f64(rand::random_range(0.9..1.1));
        let members = self.locks.on(table)?.members(self.settled).await?;
        let members_usize = usize::try_from(members.max(1)).unwrap_or(1);
        let fair = (SHARDS as usize).div_ceil(members_usize);

        if self.held.len() > fair {
            let surplus = self.held.split_off(fair);
            self.locks.on(table)?.release(&surplus).await?;
            tracing::info!(
                released = surplus.len(),
                held = self.held.len(),
                members,
                "shards rebalanced"
            );
        } else if self.held.len() < fair {
            let candidates: Vec<i16> = (0..SHARDS)
                .map(|n| (n + self.offset) % SHARDS)
                .filter(|s| !self.held.contains(s))
                .collect();
            let taken = self
                .locks
                .on(table)?
                .take(&candidates, fair - self.held.len())
                .await?;
            if !taken.is_empty() {
                self.held.extend(&taken);
                self.held.sort_unstable();
                tracing::info!(
                    taken = taken.len(),
                    held = self.held.len(),
                    members,
                    "shards leased"
                );
            }
        }
        // Settled at the fair share, or at what is left when every other replica holds its own
        // (with 3 replicas, 86 + 86 leave 84): short of that, another replica still holds more
        // than its share, as it has not counted this one yet.
        let left = (SHARDS as usize).saturating_sub(fair * (members_usize - 1));
        self.settled = self.held.len() >= fair.min(left);
        Ok(())
    }

    /// Releases every lease and the membership, so other replicas take over at once.
    pub async fn leave(mut self, table: &mut OutboxTable) -> Result<(), SourceError> {
        self.locks.on(table)?.release(&self.held).await?;
        self.locks.on(table)?.leave().await?;
        Ok(())
    }
}
