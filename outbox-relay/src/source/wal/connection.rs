//! The WAL source's two connections to PostgreSQL: a plain one (slot, publication, parking) and
//! the replication stream, both from the relay's database URL.

use crate::config::WalSource;
use crate::database::postgres_options;
use crate::error::SourceError;
use pgwire_replication::{ReplicationConfig, SslMode, TlsConfig};
use sqlx::postgres::PgSslMode;
use std::time::Duration;

/// Bounds of the replication client's queue of messages, between its reader and the source.
const MIN_BUFFERED: usize = 16;
const MAX_BUFFERED: usize = 8192;

/// The replication connection's settings, from the relay's PostgreSQL URL as sqlx reads it for
/// the relay's other connections: host, port, user, database and the TLS mode (`sslmode` or its
/// alias `ssl-mode`, else `PGSSLMODE`) from the parsed options; the password (the URL's, its
/// `password` parameter, else `PGPASSWORD`) and the certificate paths (`sslrootcert` or
/// `PGSSLROOTCERT`, `sslcert`, `sslkey`), which sqlx does not hand back, from the URL. `prefer`
/// (sqlx's default, as libpq's) uses TLS when the server offers it, as sqlx does; so does `allow`
/// here (libpq would try without TLS first).
pub(super) fn replication_config(
    url: &str,
    source: &WalSource,
    max_payload_bytes: usize,
) -> Result<ReplicationConfig, SourceError> {
    let (options, _) = postgres_options(url)?;
    let parsed =
        url::Url::parse(url).map_err(|e| SourceError::Refused(format!("database URL: {e}")))?;
    let query = |name: &str| {
        parsed
            .query_pairs()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.into_owned())
    };
    let password = parsed
        .password()
        .map(crate::redact::percent_decode)
        .or_else(|| query("password"))
        .or_else(|| std::env::var("PGPASSWORD").ok())
        .unwrap_or_default();
    let root = query("sslrootcert")
        .or_else(|| std::env::var("PGSSLROOTCERT").ok())
        .map(std::path::PathBuf::from);
    let mut tls = match options.get_ssl_mode() {
        PgSslMode::Require => TlsConfig::require(),
        PgSslMode::VerifyCa => TlsConfig::verify_ca(root),
        PgSslMode::VerifyFull => TlsConfig::verify_full(root),
        PgSslMode::Allow | PgSslMode::Prefer => TlsConfig {
            mode: SslMode::Prefer,
            ..TlsConfig::disabled()
        },
        PgSslMode::Disable => TlsConfig::disabled(),
    };
    // An IP address is verified against the certificate's IP addresses, as sqlx does on the
    // other connections; the replication client wants it named for that.
    if options.get_host().parse::<std::net::IpAddr>().is_ok() {
        tls.sni_hostname = Some(options.get_host().to_owned());
    }
    if let (Some(cert), Some(key)) = (query("sslcert"), query("sslkey")) {
        tls = tls.with_client_cert(
            std::path::PathBuf::from(cert),
            std::path::PathBuf::from(key),
        );
    }
    let config = ReplicationConfig::new(
        options.get_host(),
        options.get_username(),
        password,
        options.get_database().unwrap_or(options.get_username()),
        &source.slot,
        source.publication.as_str(),
    )
    .with_port(options.get_port())
    // The client's own queue, ahead of the source's window: as many of the largest events as
    // fit in the window, so it adds at most about the window again.
    .with_buffer_size(
        (source.window_bytes / max_payload_bytes.max(1)).clamp(MIN_BUFFERED, MAX_BUFFERED),
    )
    .with_tls(tls)
    // Commit timestamps and `created_at` in one format whatever the server's defaults; the
    // keepalives of every relay session, so the server frees the slot within about 30 s of the
    // relay's host vanishing (for a standby to take it).
    .with_options(format!(
        "-c datestyle=ISO -c timezone=UTC {}",
        crate::database::replication_options(options.get_options())
    ))
    .with_application_name(format!("{}-wal", crate::database::APPLICATION_NAME))
    // A confirmed position reaches the server within a second: what a crash can send again.
    .with_status_interval(Duration::from_secs(1))
    .with_wakeup_interval(Duration::from_secs(1));
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(url: &str) -> ReplicationConfig {
        replication_config(url, &WalSource::default(), 1_000_000).unwrap()
    }

    #[test]
    fn the_replication_connection_reads_the_url_as_the_relays_other_connections_do() {
        let c = config(
            "postgres://relay:p%40ss@db.example.com:6432/shop?ssl-mode=verify-full&sslrootcert=/ca.pem",
        );
        assert_eq!(
            (c.host.as_str(), c.port, c.user.as_str()),
            ("db.example.com", 6432, "relay")
        );
        assert_eq!((c.password.as_str(), c.database.as_str()), ("p@ss", "shop"));
        assert_eq!(c.tls.mode, SslMode::VerifyFull);
        assert_eq!(
            c.tls.ca_pem_path.as_deref(),
            Some(std::path::Path::new("/ca.pem"))
        );
        let c = config("postgres://relay@10.0.0.5/shop?sslmode=verify-full");
        assert_eq!(c.tls.sni_hostname.as_deref(), Some("10.0.0.5"));
        let c = config("postgres://relay@db/shop?sslmode=require&password=secret");
        assert_eq!(
            (c.tls.mode, c.password.as_str()),
            (SslMode::Require, "secret")
        );
        // sqlx's default, prefer: TLS when the server offers it, on both connections.
        assert_eq!(config("postgres://relay@db/shop").tls.mode, SslMode::Prefer);
        assert_eq!(
            config("postgres://relay@db/shop?sslmode=disable").tls.mode,
            SslMode::Disable
        );
    }
}
