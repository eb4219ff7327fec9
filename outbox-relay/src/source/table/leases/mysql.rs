//! Shard leases on MySQL and MariaDB: named locks (`GET_LOCK`, which belongs to the session, as a
//! lease must), `<prefix>shard:<n>` for shard `n` and `<prefix>member:<k>` for membership slot `k`
//! of 256. The prefix names the database ([`MYSQL_LOCK_PREFIX`]) and, for another table than
//! `outbox`, the table, as named locks are server-wide.
//!
//! MySQL lists no named locks that MariaDB lists too (`performance_schema.metadata_locks` is
//! MySQL's, `metadata_lock_info` a MariaDB plugin), so the live replicas are counted by asking
//! `IS_USED_LOCK` of each membership slot.

use super::SHARDS;
use crate::error::SourceError;
use seaorm_outbox::TableName;
use sqlx::mysql::MySqlConnection;

/// The prefix of every named lock of the relays of this database's outbox: `outbox-relay:`, the
/// database's name (its first 19 characters, `~` and 12 hex digits of its MD5 when longer than 32,
/// so every name stays within MySQL's 64), and `:`. For operators: `SELECT IS_USED_LOCK(CONCAT(
/// <this>, 'shard:', 7))` names the connection that publishes shard 7.
pub const MYSQL_LOCK_PREFIX: &str = "SELECT CONCAT('outbox-relay:', IF(CHAR_LENGTH(DATABASE()) <= 32, \
     DATABASE(), CONCAT(LEFT(DATABASE(), 19), '~', LEFT(MD5(DATABASE()), 12))), ':')";

/// [`MYSQL_LOCK_PREFIX`] for an outbox table other than `outbox`: the database's name, `.` and the
/// table's (`?`) take the database's place, shortened the same way.
const MYSQL_TABLE_LOCK_PREFIX: &str = "SELECT CONCAT('outbox-relay:', IF(CHAR_LENGTH(s) <= 32, s, \
     CONCAT(LEFT(s, 19), '~', LEFT(MD5(s), 12))), ':') FROM (SELECT CONCAT(DATABASE(), '.', ?) AS s) scope";

/// The numbers 0 to 255, for the membership slots and the shards.
const UP_TO_255: &str =
    "WITH RECURSIVE n(k) AS (SELECT 0 UNION ALL SELECT k + 1 FROM n WHERE k < 255)";

/// This replica's named locks: their prefix and its membership slot.
#[derive(Debug)]
pub(super) struct NamedLocks {
    prefix: String,
    member: i64,
}

/// A JSON array of shard numbers, for `JSON_TABLE`.
fn json(shards: &[i16]) -> String {
    serde_json::to_string(shards).expect("integers serialize")
}

impl NamedLocks {
    /// Takes a free membership slot.
    pub async fn join(conn: &mut MySqlConnection, table: &TableName) -> Result<Self, SourceError> {
        let prefix: Option<String> = if table.is_default() {
            sqlx::query_scalar(MYSQL_LOCK_PREFIX)
                .fetch_one(&mut *conn)
                .await?
        } else {
            sqlx::query_scalar(MYSQL_TABLE_LOCK_PREFIX)
                .bind(table.name())
                .fetch_one(&mut *conn)
                .await?
        };
        let prefix = prefix.ok_or_else(|| {
            SourceError::Refused("the database URL names no database (mysql://…/DATABASE)".into())
        })?;
        let free: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "{UP_TO_255} SELECT k FROM n WHERE IS_FREE_LOCK(CONCAT(?, 'member:', k)) = 1"
        )))
        .bind(&prefix)
        .fetch_all(&mut *conn)
        .await?;
        for member in free {
            // Another replica may take the slot between the two statements: then the next.
            let taken: Option<i64> =
                sqlx::query_scalar("SELECT GET_LOCK(CONCAT(?, 'member:', ?), 0)")
                    .bind(&prefix)
                    .bind(member)
                    .fetch_one(&mut *conn)
                    .await?;
            if taken == Some(1) {
                return Ok(NamedLocks { prefix, member });
            }
        }
        Err(SourceError::Refused(format!(
            "{SHARDS} relays already publish this database's outbox, one per shard"
        )))
    }

    /// The live replicas: the membership slots taken. Refused when this session no longer holds
    /// its own (a proxy that multiplexes sessions ran the statement on another one).
    pub async fn members(&self, conn: &mut MySqlConnection) -> Result<i64, SourceError> {
        let (members, holds): (i64, i64) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "{UP_TO_255}
             SELECT CAST(SUM(IS_USED_LOCK(CONCAT(?, 'member:', k)) IS NOT NULL) AS SIGNED),
                    CAST(COALESCE(IS_USED_LOCK(CONCAT(?, 'member:', ?)) = CONNECTION_ID(), 0) AS SIGNED)
             FROM n"
        )))
        .bind(&self.prefix)
        .bind(&self.prefix)
        .bind(self.member)
        .fetch_one(&mut *conn)
        .await?;
        if holds != 1 {
            return Err(SourceError::Refused(
                "the relay's database session does not keep the locks it takes: a proxy that \
                 multiplexes sessions hands its statements to other sessions, so two replicas \
                 could publish one shard. Connect the relay to the server directly"
                    .into(),
            ));
        }
        Ok(members)
    }

    /// Leases up to `want` of the free shards among `candidates`, in their order: the free ones
    /// first found, then exactly those asked for (a shard another replica takes meanwhile is left
    /// to the next refresh), so no lock is taken that the replica does not know it holds.
    pub async fn take(
        &self,
        conn: &mut MySqlConnection,
        candidates: &[i16],
        want: usize,
    ) -> Result<Vec<i16>, sqlx::Error> {
        let free: Vec<i16> = sqlx::query_scalar(
            "SELECT CAST(c.s AS SIGNED) FROM JSON_TABLE(?, '$[*]' COLUMNS (i FOR ORDINALITY, s INT PATH '$')) c
             WHERE IS_FREE_LOCK(CONCAT(?, 'shard:', c.s)) = 1 ORDER BY c.i",
        )
        .bind(json(candidates))
        .bind(&self.prefix)
        .fetch_all(&mut *conn)
        .await?
        .into_iter()
        .filter_map(|s: i64| i16::try_from(s).ok())
        .take(want)
        .collect();
        if free.is_empty() {
            return Ok(free);
        }
        let taken: Vec<(i64, Option<i64>)> = sqlx::query_as(
            "SELECT CAST(c.s AS SIGNED), GET_LOCK(CONCAT(?, 'shard:', c.s), 0)
             FROM JSON_TABLE(?, '$[*]' COLUMNS (s INT PATH '$')) c",
        )
        .bind(&self.prefix)
        .bind(json(&free))
        .fetch_all(&mut *conn)
        .await?;
        Ok(taken
            .into_iter()
            .filter(|(_, got)| *got == Some(1))
            .filter_map(|(s, _)| i16::try_from(s).ok())
            .collect())
    }

    /// Releases the leases of `shards`.
    pub async fn release(
        &self,
        conn: &mut MySqlConnection,
        shards: &[i16],
    ) -> Result<(), sqlx::Error> {
        sqlx::query(
            "SELECT RELEASE_LOCK(CONCAT(?, 'shard:', c.s))
             FROM JSON_TABLE(?, '$[*]' COLUMNS (s INT PATH '$')) c",
        )
        .bind(&self.prefix)
        .bind(json(shards))
        .execute(&mut *conn)
        .await?;
        Ok(())
    }

    /// Releases the membership.
    pub async fn leave(&self, conn: &mut MySqlConnection) -> Result<(), sqlx::Error> {
        sqlx::query("SELECT RELEASE_LOCK(CONCAT(?, 'member:', ?))")
            .bind(&self.prefix)
            .bind(self.member)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }
}
