//! The WAL source's two connections to PostgreSQL: a plain one (slot, publication, parking) and
//! the replication stream, both from the relay's database URL.

use super::Stop;
use crate::config::WalSource;
use crate::database::postgres_options;
use pgwire_replication::{ReplicationConfig, TlsConfig};
use std::time::Duration;

/// The replication connection's settings, from the relay's PostgreSQL URL (host, port, user,
/// password, database, `sslmode`, `sslrootcert`, `sslcert`, `sslkey`).
pub(super) fn replication_config(url: &str, source: &WalSource) -> Result<ReplicationConfig, Stop> {
    let (options, _) = postgres_options(url)?;
    let parsed = url::Url::parse(url).map_err(|e| Stop::Stream(format!("database URL: {e}")))?;
    let query = |name: &str| {
        parsed
            .query_pairs()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.into_owned())
    };
    let password = parsed.password().map(percent_decode).unwrap_or_default();
    let root = query("sslrootcert").map(std::path::PathBuf::from);
    let mut tls = match query("sslmode").as_deref() {
        Some("require") => TlsConfig::require(),
        Some("verify-ca") => TlsConfig::verify_ca(root),
        Some("verify-full") => TlsConfig::verify_full(root),
        _ => TlsConfig::disabled(),
    };
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
    .with_tls(tls)
    // Commit timestamps and `created_at` in one format whatever the server's defaults.
    .with_options("-c datestyle=ISO -c timezone=UTC")
    .with_application_name(format!("{}-wal", crate::database::APPLICATION_NAME))
    // A confirmed position reaches the server within a second: what a crash can send again.
    .with_status_interval(Duration::from_secs(1))
    .with_wakeup_interval(Duration::from_secs(1));
    Ok(config)
}

fn percent_decode(s: &str) -> String {
    url::form_urlencoded::parse(format!("p={}", s.replace('+', "%2B")).as_bytes())
        .next()
        .map(|(_, v)| v.into_owned())
        .unwrap_or_default()
}
