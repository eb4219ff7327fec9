//! `outbox-relay run`: publish until SIGINT or SIGTERM.

use super::UsageError;
use super::settings::Settings;
use crate::tasks::BackgroundTasks;
use crate::{Relay, endpoints};
use std::process::ExitCode;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

pub(super) async fn run(
    settings: &Settings,
    shutdown: CancellationToken,
) -> Result<ExitCode, UsageError> {
    let config = settings.relay_config()?;
    let sink_config = settings.sink_config()?;
    seaorm_outbox::check_registrations().map_err(|e| UsageError(e.to_string()))?;
    // The settings in effect, secrets masked: what an operator needs to see at start.
    tracing::debug!(relay = ?config, sink = ?sink_config, "settings");
    let sink = sink_config.build().map_err(|e| UsageError(e.to_string()))?;
    let relay = Arc::new(Relay::new(config, sink));
    if let Err(e) = relay.lock_sqlite() {
        return Ok(super::output::failure(&e));
    }
    // A database that is down now is waited for by `run`; a refusal stops here.
    if let Err(e) = relay.check_source().await
        && !e.is_temporary()
    {
        return Ok(super::output::failure(&e.to_string()));
    }
    let tasks = BackgroundTasks::new(&shutdown);
    if let Some(addr) = settings.http_addr() {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| UsageError(format!("cannot serve /metrics on {addr}: {e}")))?;
        let prometheus = crate::metrics::install_prometheus().map_err(UsageError)?;
        let bound = listener.local_addr().map_or(addr, |a| a);
        tracing::info!(address = %bound, "serving /metrics, /healthz and /readyz");
        let relay = Arc::clone(&relay);
        tasks.spawn("endpoints", move |stop| async move {
            if let Err(e) = endpoints::serve(listener, relay, prometheus, stop).await {
                tracing::error!(error = %e, "the endpoints stopped");
            }
        });
    }
    // A refusal after start (a dropped replication slot, say) was logged where it happened.
    let outcome = relay.run(shutdown).await;
    tasks.stop().await;
    Ok(match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(_) => ExitCode::FAILURE,
    })
}

/// Cancelled on the first SIGINT or SIGTERM: the relay settles its batch and stops. A second
/// signal abandons the batch in flight (nothing unacked was marked; it will be sent again) and exits.
/// The handlers are installed when this returns (call it inside the runtime).
pub(super) fn shutdown_on_signals() -> std::io::Result<CancellationToken> {
    let mut signals = Signals::install()?;
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        signals.next().await;
        tracing::info!("shutting down after the batch in flight (signal again to abandon it)");
        cancel.cancel();
        signals.next().await;
        tracing::warn!("abandoning the batch in flight; it will be published again");
        std::process::exit(0);
    });
    Ok(token)
}

/// SIGINT and SIGTERM, caught from the moment they are installed.
struct Signals {
    #[cfg(unix)]
    interrupt: tokio::signal::unix::Signal,
    #[cfg(unix)]
    terminate: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> std::io::Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            Ok(Signals {
                interrupt: signal(SignalKind::interrupt())?,
                terminate: signal(SignalKind::terminate())?,
            })
        }
        #[cfg(not(unix))]
        Ok(Signals {})
    }

    async fn next(&mut self) {
        #[cfg(unix)]
        tokio::select! {
            _ = self.interrupt.recv() => {}
            _ = self.terminate.recv() => {}
        }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
    }
}
