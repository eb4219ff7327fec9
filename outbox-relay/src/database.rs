//! The relay's database: which backend a URL names, told in one place, and the one way every
//! relay connection to PostgreSQL is opened (its application name, connect timeout and
//! keepalives), and how long the relay waits for it.

use sqlx::{Connection, PgConnection};
use std::future::Future;
use std::time::Duration;

/// Which database a URL names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Backend {
    Postgres,
    Sqlite,
    /// MySQL 8.0.16+ or MariaDB 10.6+.
    MySql,
}

impl Backend {
    /// The backend `url` names (`postgres://`, `postgresql://`, `sqlite:` or `mysql://`), `None`
    /// for another.
    pub fn parse(url: &str) -> Option<Backend> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Some(Backend::Postgres)
        } else if url.starts_with("sqlite:") {
            Some(Backend::Sqlite)
        } else if url.starts_with("mysql://") {
            Some(Backend::MySql)
        } else {
            None
        }
    }

    /// The backend of a relay's URL: SQLite for `sqlite:`, else PostgreSQL (whose driver then
    /// says what is wrong with the URL).
    pub fn of(url: &str) -> Backend {
        Backend::parse(url).unwrap_or(Backend::Postgres)
    }
}

/// Opens a PostgreSQL connection of the relay, within the URL's connect timeout, with the
/// [`KEEPALIVE_SETTINGS`] the URL leaves unset.
pub(crate) async fn connect_postgres(url: &str) -> Result<PgConnection, sqlx::Error> {
    let (options, timeout) = postgres_options(url)?;
    let connect = async {
        let mut conn = PgConnection::connect_with(&options).await?;
        keep_alive(&mut conn, &options).await?;
        Ok(conn)
    };
    connected_within(timeout, connect).await
}

/// Runs `query`, an operator's (the tenants query), on the database at `url`: its rows' first
/// two columns, as text.
pub(crate) async fn query_pairs(
    url: &str,
    query: &str,
) -> Result<Vec<(String, String)>, sqlx::Error> {
    let query = sqlx::AssertSqlSafe(query.to_owned());
    match Backend::of(url) {
        Backend::Postgres => {
            sqlx::query_as(query)
                .fetch_all(&mut connect_postgres(url).await?)
                .await
        }
        Backend::MySql => {
            let (url, timeout) = connect_timeout(url);
            let mut conn = connected_within(timeout, sqlx::MySqlConnection::connect(&url)).await?;
            sqlx::query_as(query).fetch_all(&mut conn).await
        }
        Backend::Sqlite => {
            let mut conn = sqlx::SqliteConnection::connect(url).await?;
            sqlx::query_as(query).fetch_all(&mut conn).await
        }
    }
}

/// `connect`, given up after the URL's connect `timeout`.
pub(crate) async fn connected_within<T>(
    timeout: Duration,
    connect: impl Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, sqlx::Error> {
    tokio::time::timeout(timeout, connect)
        .await
        .unwrap_or_else(|_| {
            Err(sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("the database did not answer within {timeout:?} (connect_timeout)"),
            )))
        })
}

/// Sets the [`KEEPALIVE_SETTINGS`] that `options` (the URL's) leave unset on `conn`. With SET,
/// not startup options: a pooler such as PgBouncer refuses an `options` parameter.
pub(crate) async fn keep_alive(
    conn: &mut PgConnection,
    options: &sqlx::postgres::PgConnectOptions,
) -> Result<(), sqlx::Error> {
    let keepalives = keepalive_sql(options.get_options());
    if !keepalives.is_empty() {
        sqlx::raw_sql(sqlx::AssertSqlSafe(keepalives))
            .execute(conn)
            .await?;
    }
    Ok(())
}

/// How long a connection attempt may take by default.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Splits libpq's `connect_timeout` parameter (whole seconds) off a PostgreSQL URL: sqlx does not
/// know it, and the relay applies it itself. Without it, [`DEFAULT_CONNECT_TIMEOUT`].
pub(crate) fn connect_timeout(url: &str) -> (String, Duration) {
    let Some((base, query)) = url.split_once('?') else {
        return (url.to_owned(), DEFAULT_CONNECT_TIMEOUT);
    };
    let mut timeout = DEFAULT_CONNECT_TIMEOUT;
    let rest: Vec<&str> = query
        .split('&')
        .filter(|pair| match pair.strip_prefix("connect_timeout=") {
            Some(seconds) => {
                if let Ok(seconds) = seconds.parse::<u64>() {
                    timeout = Duration::from_secs(seconds.max(1));
                }
                false
            }
            None => true,
        })
        .collect();
    if rest.is_empty() {
        (base.to_owned(), timeout)
    } else {
        (format!("{base}?{}", rest.join("&")), timeout)
    }
}

/// The name the relay's connections show in `pg_stat_activity`, unless the URL sets one.
pub const APPLICATION_NAME: &str = "outbox-relay";

/// The server settings every relay connection sets once connected, unless the URL's `options`
/// parameter sets them: PostgreSQL probes an idle connection after 10 s, every 5 s, and ends it after 4
/// unanswered probes, or once data it sent stays unacknowledged for 30 s. So when a relay's host
/// vanishes without closing its sockets, its sessions end (and with them its shard leases) in
/// about 30 s, not after the kernel's two hours.
pub(crate) const KEEPALIVE_SETTINGS: [(&str, &str); 4] = [
    ("tcp_keepalives_idle", "10"),
    ("tcp_keepalives_interval", "5"),
    ("tcp_keepalives_count", "4"),
    ("tcp_user_timeout", "30000"),
];

/// The connection options of a PostgreSQL URL, named [`APPLICATION_NAME`] unless the URL (or
/// `PGAPPNAME`) names them, and the URL's connect timeout.
pub(crate) fn postgres_options(
    url: &str,
) -> Result<(sqlx::postgres::PgConnectOptions, Duration), sqlx::Error> {
    use std::str::FromStr;
    let (url, timeout) = connect_timeout(url);
    let mut options = sqlx::postgres::PgConnectOptions::from_str(&url)?;
    if options.get_application_name().is_none() {
        options = options.application_name(APPLICATION_NAME);
    }
    Ok((options, timeout))
}

/// The [`KEEPALIVE_SETTINGS`] that the URL's `options` (`set_by_url`) leave unset.
fn keepalives_unset(
    set_by_url: Option<&str>,
) -> impl Iterator<Item = &'static (&'static str, &'static str)> {
    let set_by_url = set_by_url.unwrap_or_default().to_owned();
    KEEPALIVE_SETTINGS
        .iter()
        .filter(move |(name, _)| !set_by_url.contains(name))
}

/// The `SET` statements of the [`KEEPALIVE_SETTINGS`] that the URL's `options` (`set_by_url`)
/// leave unset; empty when it sets them all.
fn keepalive_sql(set_by_url: Option<&str>) -> String {
    keepalives_unset(set_by_url)
        .map(|(name, value)| format!("SET {name} = {value}"))
        .collect::<Vec<_>>()
        .join("; ")
}

/// The startup options of a replication connection (which takes no `SET`): the URL's own
/// `options`, and the [`KEEPALIVE_SETTINGS`] they leave unset.
pub(crate) fn replication_options(set_by_url: Option<&str>) -> String {
    keepalives_unset(set_by_url)
        .map(|(name, value)| format!("-c {name}={value}"))
        .chain(set_by_url.map(str::to_owned))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Limits the relay's own statements on `conn` to `timeout` (`statement_timeout`).
pub(crate) async fn limit_statements(
    conn: &mut PgConnection,
    timeout: Duration,
) -> Result<(), sqlx::Error> {
    let set = format!("SET statement_timeout = {}", timeout.as_millis().max(1));
    sqlx::raw_sql(sqlx::AssertSqlSafe(set))
        .execute(conn)
        .await
        .map(drop)
}

/// `call`, given up with an error when the database has not answered within `limit`: its host
/// vanished, or the network between, and the connection would otherwise wait for the kernel to
/// give up (a quarter of an hour or more).
pub(crate) async fn answered_within<T, E: From<sqlx::Error>>(
    limit: Duration,
    call: impl Future<Output = Result<T, E>>,
) -> Result<T, E> {
    tokio::time::timeout(limit, call).await.unwrap_or_else(|_| {
        Err(E::from(sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no answer from the database within {limit:?}"),
        ))))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keepalives_are_set_unless_the_url_sets_them() {
        let all = keepalive_sql(None);
        for (name, value) in KEEPALIVE_SETTINGS {
            assert!(all.contains(&format!("SET {name} = {value}")), "{all}");
        }
        let (options, _) =
            postgres_options("postgres://db/shop?options=-c%20tcp_keepalives_idle%3D60").unwrap();
        let rest = keepalive_sql(options.get_options());
        assert!(!rest.contains("tcp_keepalives_idle"), "{rest}");
        let replication = replication_options(options.get_options());
        assert!(
            replication.contains("-c tcp_user_timeout=30000")
                && replication.ends_with("-c tcp_keepalives_idle=60")
                && replication.matches("tcp_keepalives_idle").count() == 1,
            "{replication}"
        );
        assert!(rest.contains("SET tcp_keepalives_count = 4"), "{rest}");
    }

    #[test]
    fn connect_timeout_is_taken_off_the_url() {
        assert_eq!(
            connect_timeout("postgres://db/shop?connect_timeout=2&sslmode=require"),
            (
                "postgres://db/shop?sslmode=require".into(),
                Duration::from_secs(2)
            )
        );
        assert_eq!(
            connect_timeout("postgres://db/shop?connect_timeout=9"),
            ("postgres://db/shop".into(), Duration::from_secs(9))
        );
        assert_eq!(
            connect_timeout("postgres://db/shop"),
            ("postgres://db/shop".into(), DEFAULT_CONNECT_TIMEOUT)
        );
    }

    #[test]
    fn a_url_names_its_backend() {
        assert_eq!(
            Backend::parse("postgresql://db/shop"),
            Some(Backend::Postgres)
        );
        assert_eq!(
            Backend::parse("sqlite:shop.db?mode=rwc"),
            Some(Backend::Sqlite)
        );
        assert_eq!(Backend::parse("mysql://db/shop"), Some(Backend::MySql));
        assert_eq!(Backend::parse("oracle://db/shop"), None);
        assert_eq!(Backend::of("oracle://db/shop"), Backend::Postgres);
    }
}
