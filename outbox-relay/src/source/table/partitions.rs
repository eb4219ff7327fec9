//! The partitioned layout (PostgreSQL, opt-in at `migrate --partitioned`): the outbox table ranged
//! by `created_at`, one partition per interval. The relay keeps the partitions of the next few
//! intervals made, and retention drops a partition whose rows are all published instead of
//! deleting its rows: no dead rows, no vacuum of them, no index bloat, whatever the event rate.
//!
//! A partition is dropped only when its interval ended before the retention window and none of
//! its rows is unpublished (waiting, backing off, held or parked): checked again after the
//! partition is detached, in the transaction that drops it, so a row a `failed retry` released a
//! moment before is never lost. Rows that found no partition of their interval went to the
//! default partition, which is pruned row by row as the plain layout is.
//!
//! Each change takes the parent's lock for a moment (PostgreSQL's `CREATE TABLE … PARTITION OF`
//! and `DETACH PARTITION` lock it against writes), waiting for it at most [`LOCK_WAIT`]: an
//! application's insert never queues behind the relay longer than that, and a change that could
//! not get the lock is made at the next tick.

use chrono::{DateTime, TimeDelta, Utc};
use seaorm_outbox::TableName;
use sqlx::postgres::PgConnection;
use sqlx::{Acquire, Row};
use std::time::Duration;

/// How many intervals after the current one have their partition made ahead of time: recording
/// goes on into partitions for that long with the relay stopped (after it, into the default one).
pub(crate) const AHEAD: i32 = 3;

/// The width of new partitions when the table has none to copy it from.
const DEFAULT_EVERY: Duration = Duration::from_secs(24 * 3600);

/// How long a change of partitions waits for the table's lock before it gives up until the next
/// tick; writers wait behind it meanwhile.
pub(crate) const LOCK_WAIT: &str = "SET LOCAL lock_timeout = '200ms'";

/// One partition of an interval: `[lower, upper)` of `created_at`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Partition {
    /// Its name, schema-qualified and quoted.
    pub name: String,
    pub lower: DateTime<Utc>,
    pub upper: DateTime<Utc>,
}

/// A partitioned outbox table: its partitions of intervals (the default one aside), oldest first.
#[derive(Debug, Clone)]
pub(crate) struct Partitioned {
    /// The parent table, quoted.
    table: String,
    /// The parent's schema, quoted: every partition is made in it.
    schema: String,
    /// The table's name without its schema: the prefix of its partitions' names.
    prefix: String,
    pub partitions: Vec<Partition>,
}

/// The partitions of `$1` with ranges of two timestamps, as written by `pg_get_expr`, whose
/// timestamps the same session reads back.
const LIST: &str = r"
SELECT format('%I.%I', n.nspname, c.relname) AS name,
       b[1]::timestamptz AS lower, b[2]::timestamptz AS upper
FROM pg_inherits i
JOIN pg_class c ON c.oid = i.inhrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
CROSS JOIN LATERAL regexp_match(pg_get_expr(c.relpartbound, c.oid),
                                'FROM \(''([^'']*)''\) TO \(''([^'']*)''\)') AS b
WHERE i.inhparent = to_regclass($1) AND b IS NOT NULL
ORDER BY 2";

impl Partitioned {
    /// `table` as partitioned, or `None` when it is not (the plain layout).
    pub async fn of(
        conn: &mut PgConnection,
        table: &TableName,
    ) -> Result<Option<Partitioned>, sqlx::Error> {
        let quoted = table.quoted('"');
        let schema: Option<String> = sqlx::query_scalar(
            "SELECT format('%I', n.nspname) FROM pg_class c \
             JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE c.oid = to_regclass($1) AND c.relkind = 'p'",
        )
        .bind(&quoted)
        .fetch_optional(&mut *conn)
        .await?;
        let Some(schema) = schema else {
            return Ok(None);
        };
        let partitions = sqlx::query(LIST)
            .bind(&quoted)
            .fetch_all(&mut *conn)
            .await?
            .iter()
            .map(|row| {
                Ok(Partition {
                    name: row.try_get("name")?,
                    lower: row.try_get("lower")?,
                    upper: row.try_get("upper")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()?;
        Ok(Some(Partitioned {
            table: quoted,
            schema,
            prefix: table.name().to_owned(),
            partitions,
        }))
    }

    /// The width of the next partitions: `every` when given, else the newest partition's, else a
    /// day.
    fn every(&self, every: Option<Duration>) -> TimeDelta {
        every
            .and_then(|every| TimeDelta::from_std(every).ok())
            .or_else(|| self.partitions.last().map(|p| p.upper - p.lower))
            .filter(|every| *every > TimeDelta::zero())
            .unwrap_or_else(|| TimeDelta::from_std(DEFAULT_EVERY).unwrap_or(TimeDelta::MAX))
    }

    /// The partitions to make so that the interval of `now` and the [`AHEAD`] after it have one:
    /// `every` wide (see [`Partitioned::every`]), aligned on multiples of it since the epoch, each
    /// that no existing partition overlaps (one that covers part of it keeps that part).
    pub fn missing(&self, now: DateTime<Utc>, every: Option<Duration>) -> Vec<Partition> {
        let every = self.every(every);
        let width = every.num_milliseconds().max(1);
        let current =
            DateTime::from_timestamp_millis(now.timestamp_millis().div_euclid(width) * width)
                .unwrap_or(now);
        (0..=AHEAD)
            .map(|k| (current + every * k, current + every * (k + 1)))
            .filter(|(lower, upper)| {
                !self
                    .partitions
                    .iter()
                    .any(|p| p.lower < *upper && *lower < p.upper)
            })
            .map(|(lower, upper)| Partition {
                name: format!(
                    "{}.\"{}_p{}\"",
                    self.schema,
                    self.prefix,
                    lower.format("%Y%m%d_%H%M")
                ),
                lower,
                upper,
            })
            .collect()
    }

    /// The partitions whose whole interval ended `retention` before `now`: the ones retention
    /// drops once their rows are all published.
    pub fn past(&self, now: DateTime<Utc>, retention: Duration) -> Vec<Partition> {
        let cutoff = now - TimeDelta::from_std(retention).unwrap_or(TimeDelta::MAX);
        self.partitions
            .iter()
            .filter(|p| p.upper <= cutoff)
            .cloned()
            .collect()
    }

    /// Makes `partition` unless it exists (another replica made it meanwhile) or the default
    /// partition holds rows of its interval; whether it is there now. An error when the table's
    /// lock was not had within [`LOCK_WAIT`].
    pub async fn make(
        &self,
        conn: &mut PgConnection,
        partition: &Partition,
    ) -> Result<bool, sqlx::Error> {
        let mut txn = self.upkeep(conn).await?;
        let made: bool = exists(&mut txn, &partition.name).await?;
        // PostgreSQL refuses a partition whose interval has rows in the default partition: they
        // were recorded while it was missing, and stay there, pruned row by row.
        let has_default = exists(&mut txn, &self.default_partition()).await?;
        let in_default = has_default
            && sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT EXISTS (SELECT 1 FROM {} WHERE created_at >= $1 AND created_at < $2)",
                self.default_partition()
            )))
            .bind(partition.lower)
            .bind(partition.upper)
            .fetch_one(&mut *txn)
            .await?;
        if in_default {
            return Ok(false);
        }
        if !made {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "CREATE TABLE {} PARTITION OF {} FOR VALUES FROM ('{}') TO ('{}')",
                partition.name,
                self.table,
                partition.lower.to_rfc3339(),
                partition.upper.to_rfc3339(),
            )))
            .execute(&mut *txn)
            .await?;
        }
        txn.commit().await?;
        Ok(true)
    }

    /// How many rows the default partition holds (0 without one): those recorded while their
    /// interval had no partition.
    pub async fn in_default(&self, conn: &mut PgConnection) -> Result<i64, sqlx::Error> {
        let default = self.default_partition();
        let has_default: bool = exists(&mut *conn, &default).await?;
        if !has_default {
            return Ok(0);
        }
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM {default}"
        )))
        .fetch_one(&mut *conn)
        .await
    }

    /// A transaction for one change of partitions: it waits at most [`LOCK_WAIT`] for a lock,
    /// and holds the table's `SHARE UPDATE EXCLUSIVE` lock, so replicas' upkeep goes one at a
    /// time while writers are not kept out.
    async fn upkeep<'c>(
        &self,
        conn: &'c mut PgConnection,
    ) -> Result<sqlx::Transaction<'c, sqlx::Postgres>, sqlx::Error> {
        let mut txn = conn.begin().await?;
        sqlx::query(LOCK_WAIT).execute(&mut *txn).await?;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "LOCK TABLE {} IN SHARE UPDATE EXCLUSIVE MODE",
            self.table
        )))
        .execute(&mut *txn)
        .await?;
        Ok(txn)
    }

    /// The default partition's name, schema-qualified and quoted.
    fn default_partition(&self) -> String {
        format!("{}.\"{}_default\"", self.schema, self.prefix)
    }

    /// Drops `partition` if none of its rows is unpublished; whether it did. The check is made
    /// again after the partition is detached, with the table locked, so nothing unpublished is
    /// ever dropped.
    pub async fn drop_published(
        &self,
        conn: &mut PgConnection,
        partition: &Partition,
    ) -> Result<bool, sqlx::Error> {
        let unpublished = || {
            sqlx::AssertSqlSafe(format!(
                "SELECT EXISTS (SELECT 1 FROM {} WHERE published_at IS NULL)",
                partition.name
            ))
        };
        // Most ticks find a partition kept by a parked row as it was: no lock taken for that.
        let attached = exists(&mut *conn, &partition.name).await?;
        if !attached
            || sqlx::query_scalar(unpublished())
                .fetch_one(&mut *conn)
                .await?
        {
            return Ok(false);
        }
        let mut txn = self.upkeep(conn).await?;
        let attached = exists(&mut txn, &partition.name).await?;
        if !attached {
            return Ok(false);
        }
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "ALTER TABLE {} DETACH PARTITION {}",
            self.table, partition.name
        )))
        .execute(&mut *txn)
        .await?;
        if sqlx::query_scalar(unpublished())
            .fetch_one(&mut *txn)
            .await?
        {
            txn.rollback().await?;
            return Ok(false);
        }
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP TABLE {}",
            partition.name
        )))
        .execute(&mut *txn)
        .await?;
        txn.commit().await?;
        Ok(true)
    }

    /// Deletes up to `limit` rows of the default partition published more than `retention` ago:
    /// the plain layout's pruning, on the rows recorded while their partition was missing.
    pub async fn prune_default(
        &self,
        conn: &mut PgConnection,
        retention: Duration,
        limit: i64,
    ) -> Result<u64, sqlx::Error> {
        let default = self.default_partition();
        let sql = format!(
            "DELETE FROM {default} WHERE ctid IN (
                 SELECT ctid FROM {default} WHERE published_at < now() - make_interval(secs => $1)
                 ORDER BY published_at LIMIT $2 FOR UPDATE SKIP LOCKED)"
        );
        let has_default = exists(&mut *conn, &default).await?;
        if !has_default {
            return Ok(0);
        }
        Ok(sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(retention.as_secs_f64())
            .bind(limit)
            .execute(&mut *conn)
            .await?
            .rows_affected())
    }
}

/// Whether the table `name` (schema-qualified, quoted) exists.
async fn exists(conn: &mut PgConnection, name: &str) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(name)
        .fetch_one(conn)
        .await
}

/// Keeps `table`'s partitions if it is partitioned: makes the missing ones ahead (`every` wide
/// when given, see [`Partitioned::missing`]) and, with a `retention`, drops the published ones past
/// it. Returns the table as it found it (`None`: not partitioned). A partition that could not be
/// made or dropped is logged and tried again at the next call.
pub(crate) async fn keep(
    conn: &mut PgConnection,
    table: &TableName,
    every: Option<Duration>,
    retention: Option<Duration>,
) -> Result<Option<Partitioned>, sqlx::Error> {
    let Some(partitioned) = Partitioned::of(conn, table).await? else {
        return Ok(None);
    };
    let now = Utc::now();
    for partition in partitioned.missing(now, every) {
        match partitioned.make(conn, &partition).await {
            Ok(true) => tracing::debug!(partition = %partition.name, "partition ready"),
            Ok(false) => tracing::debug!(
                partition = %partition.name,
                "the default partition holds rows of this interval: they stay there"
            ),
            Err(e) => tracing::warn!(
                partition = %partition.name, error = %e,
                "could not make the partition; trying again at the next tick (until it is made, \
                 rows of its interval go to the default partition)"
            ),
        }
    }
    if let Some(retention) = retention {
        for partition in partitioned.past(now, retention) {
            match partitioned.drop_published(conn, &partition).await {
                Ok(true) => {
                    tracing::info!(partition = %partition.name, "dropped a partition past retention");
                }
                Ok(false) => {}
                Err(e) => tracing::warn!(
                    partition = %partition.name, error = %e,
                    "could not drop the partition; trying again at the next tick"
                ),
            }
        }
    }
    Ok(Some(partitioned))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    fn table(partitions: Vec<Partition>) -> Partitioned {
        Partitioned {
            table: "\"public\".\"outbox\"".into(),
            schema: "public".into(),
            prefix: "outbox".into(),
            partitions,
        }
    }

    #[test]
    fn the_current_interval_and_those_ahead_are_made_aligned_on_the_width() {
        let missing =
            table(vec![]).missing(at("2026-12-07T13:41:00Z"), Some(Duration::from_secs(3600)));
        let ranges: Vec<_> = missing.iter().map(|p| (p.lower, p.upper)).collect();
        assert_eq!(ranges.len(), 1 + AHEAD as usize);
        assert_eq!(
            ranges[0],
            (at("2026-12-07T13:00:00Z"), at("2026-12-07T14:00:00Z"))
        );
        assert_eq!(ranges[3].1, at("2026-12-07T17:00:00Z"));
        assert_eq!(missing[0].name, "public.\"outbox_p20261207_1300\"");
    }

    #[test]
    fn a_gap_before_the_newest_partition_is_filled() {
        let hour = |h: u32| Partition {
            name: format!("h{h}"),
            lower: at(&format!("2026-12-07T{h:02}:00:00Z")),
            upper: at(&format!("2026-12-07T{:02}:00:00Z", h + 1)),
        };
        let missing = table(vec![hour(13), hour(15)]).missing(at("2026-12-07T13:41:00Z"), None);
        let lowers: Vec<_> = missing.iter().map(|p| p.lower).collect();
        assert_eq!(
            lowers,
            [at("2026-12-07T14:00:00Z"), at("2026-12-07T16:00:00Z")]
        );
    }

    #[test]
    fn new_partitions_follow_the_newest_and_take_its_width() {
        let newest = Partition {
            name: "x".into(),
            lower: at("2026-12-07T00:00:00Z"),
            upper: at("2026-12-08T00:00:00Z"),
        };
        let missing = table(vec![newest]).missing(at("2026-12-07T13:41:00Z"), None);
        assert_eq!(missing.len(), AHEAD as usize);
        assert_eq!(missing[0].lower, at("2026-12-08T00:00:00Z"));
        assert_eq!(missing[2].upper, at("2026-12-11T00:00:00Z"));
    }

    #[test]
    fn only_partitions_wholly_before_the_retention_window_are_past() {
        let day = |d: u32| Partition {
            name: format!("d{d}"),
            lower: at(&format!("2026-12-{d:02}T00:00:00Z")),
            upper: at(&format!("2026-12-{:02}T00:00:00Z", d + 1)),
        };
        let partitioned = table(vec![day(1), day(2), day(3)]);
        let past = partitioned.past(at("2026-12-04T12:00:00Z"), Duration::from_secs(36 * 3600));
        // The cutoff is 3 December, 00:00: the 2nd ended then, the 3rd not.
        let names: Vec<_> = past.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["d1", "d2"]);
    }
}
