//! Where the events come from: the outbox table, claimed batch by batch (`table`), or the
//! write-ahead log, read through logical replication (`wal`). Each implements [`Source`], the one
//! interface the pump (`relay.rs`) drives; [`Opened`] is the source a relay's configuration names.

pub(crate) mod interface;
pub(crate) mod table;
pub mod wal;

use crate::batch::{Claim, Limits, Outcome};
use crate::config::{self, Mode, RelayConfig};
use crate::database::{Backend, answered_within};
use crate::error::SourceError;
use crate::tasks::BackgroundTasks;
use crate::tenants::{Outbox, Tenant};
use seaorm_outbox::TableName;
use std::sync::Arc;
use std::time::Duration;
use table::prune::{self, Pruned};
use table::{OutboxTable, SessionConfig, TableSource};
use tokio::time::Instant;
use wal::WalStream;

pub(crate) use interface::Source;

/// The source a relay's configuration names, opened on its own connections. A call that reaches
/// the database is given up when the database stays silent for twice the statement timeout (a
/// call runs a few statements, each limited by the server): its host vanished.
pub(crate) struct Opened {
    source: Kind,
    call_limit: Duration,
}

/// Each boxed: a pump holds one, and the two differ in size.
enum Kind {
    Table(Box<TableSource>),
    Wal(Box<WalStream>),
}

impl Opened {
    /// Connects the configured source of `outbox`; its connection-bound work (the table's
    /// listener) runs as one of `tasks`.
    pub async fn open(
        config: &RelayConfig,
        outbox: &Outbox,
        tasks: &BackgroundTasks,
    ) -> Result<Self, SourceError> {
        let source = match &config.source {
            config::Source::Table => {
                Kind::Table(Box::new(TableSource::open(config, outbox, tasks).await?))
            }
            config::Source::Wal(source) => {
                Kind::Wal(Box::new(WalStream::open(config, source).await?))
            }
        };
        Ok(Opened {
            source,
            call_limit: config.statement_timeout.saturating_mul(2),
        })
    }
}

impl Source for Opened {
    async fn claim(&mut self, limits: &Limits, in_flight: &[i64]) -> Result<Claim, SourceError> {
        answered_within(self.call_limit, async {
            match &mut self.source {
                Kind::Table(source) => source.claim(limits, in_flight).await,
                Kind::Wal(source) => source.claim(limits, in_flight).await,
            }
        })
        .await
    }

    async fn settle(&mut self, outcome: &Outcome) -> Result<(), SourceError> {
        answered_within(self.call_limit, async {
            match &mut self.source {
                Kind::Table(source) => source.settle(outcome).await,
                Kind::Wal(source) => source.settle(outcome).await,
            }
        })
        .await
    }

    async fn new_events(&mut self) {
        match &mut self.source {
            Kind::Table(source) => source.new_events().await,
            Kind::Wal(source) => source.new_events().await,
        }
    }

    fn wake_at(&self, until: Instant) -> Instant {
        match &self.source {
            Kind::Table(source) => source.wake_at(until),
            Kind::Wal(source) => source.wake_at(until),
        }
    }

    fn rebalance_due(&self) -> bool {
        match &self.source {
            Kind::Table(source) => source.rebalance_due(),
            Kind::Wal(source) => source.rebalance_due(),
        }
    }

    async fn rebalance(&mut self) -> Result<(), SourceError> {
        answered_within(self.call_limit, async {
            match &mut self.source {
                Kind::Table(source) => source.rebalance().await,
                Kind::Wal(source) => source.rebalance().await,
            }
        })
        .await
    }

    async fn leave(self) -> Result<(), SourceError> {
        answered_within(self.call_limit, async {
            match self.source {
                Kind::Table(source) => source.leave().await,
                Kind::Wal(source) => source.leave().await,
            }
        })
        .await
    }
}

/// Checks that the relay may publish the database's outbox tables from its configured source; see
/// [`Relay::check_source`](crate::relay::Relay::check_source).
pub(crate) async fn check(config: &RelayConfig) -> Result<(), SourceError> {
    let tables = &config.tables;
    if tables.is_empty() {
        return Err(SourceError::Refused("no outbox table to publish".into()));
    }
    if let Some(twice) = tables
        .iter()
        .enumerate()
        .find_map(|(i, t)| tables[..i].contains(t).then_some(t))
    {
        return Err(SourceError::Refused(format!(
            "the table {twice} is listed twice: one pump per table"
        )));
    }
    match config
        .tenants
        .read(&config.database_url)
        .await
        .map_err(SourceError::Refused)?
    {
        None => check_database(config, &config.database_url).await,
        Some(tenants) => check_tenants(config, &tenants).await,
    }
}

/// Checks the tenants' list. Each tenant's database is checked by its pumps, at each connection
/// ([`check_database`]): one tenant down or refused does not keep the others from starting.
async fn check_tenants(config: &RelayConfig, tenants: &[Tenant]) -> Result<(), SourceError> {
    if let Some(twice) = tenants
        .iter()
        .enumerate()
        .find_map(|(i, t)| tenants[..i].iter().any(|o| o.name == t.name).then_some(t))
    {
        return Err(SourceError::Refused(format!(
            "the tenant {} is listed twice: one name per tenant",
            twice.name
        )));
    }
    if let config::Source::Wal(_) = config.source {
        return Err(SourceError::Refused(
            "the WAL source reads one database; publish tenant databases by polling (--source table)"
                .into(),
        ));
    }
    for tenant in tenants {
        if Backend::of(&tenant.database_url) == Backend::Sqlite {
            return Err(SourceError::Refused(format!(
                "the tenant {} is a SQLite database, which allows one relay of its own: run one for it",
                tenant.name
            )));
        }
    }
    Ok(())
}

/// Checks that the relay may publish the outbox tables of the database at `url`: the relay's
/// own at start ([`check`]), and a tenant's at each connection of its pumps, so a tenant refused
/// holds only itself.
pub(crate) async fn check_database(config: &RelayConfig, url: &str) -> Result<(), SourceError> {
    let tables = &config.tables;
    let backend = Backend::of(url);
    let only_default = matches!(&tables[..], [table] if table.is_default());
    match &config.source {
        // The WAL source serves `outbox` alone, so only it can be in a publication of ours.
        config::Source::Table if backend != Backend::Postgres => Ok(()),
        config::Source::Table => {
            let Some(default) = tables.iter().find(|t| t.is_default()) else {
                return Ok(());
            };
            let mut table = OutboxTable::connect(url, default).await?;
            let conn = table.postgres().expect("a PostgreSQL URL");
            let publications = wal::publication::publications(conn).await?;
            let (ours, others): (Vec<_>, Vec<_>) = publications.iter().partition(|p| p.ours);
            if !ours.is_empty() {
                let ours: Vec<&str> = ours.iter().map(|p| p.name.as_str()).collect();
                return Err(SourceError::Refused(wal::publication::polling_refused(
                    &ours,
                )));
            }
            // Debezium's, a warehouse sync's: they read the table, the polling relay marks it.
            static WARNED: std::sync::Once = std::sync::Once::new();
            if !others.is_empty() {
                let others: Vec<&str> = others.iter().map(|p| p.name.as_str()).collect();
                WARNED.call_once(|| {
                    tracing::warn!(
                        publications = others.join(", "),
                        "the outbox table is in another tool's publication; polling beside it \
                         (each of its events is published by this relay too, and by whatever reads \
                         that publication)"
                    );
                });
            }
            Ok(())
        }
        config::Source::Wal(_) if !only_default => Err(SourceError::Refused(format!(
            "the WAL source reads the table `outbox` only; publish {} by polling (--source table)",
            list(tables)
        ))),
        config::Source::Wal(_) if backend != Backend::Postgres => Err(SourceError::Refused(
            "the WAL source needs PostgreSQL's logical replication; on SQLite and MySQL, poll the \
             table (--source table)"
                .into(),
        )),
        config::Source::Wal(source) => wal::check(url, source).await,
    }
}

/// `a, b`: tables for a message.
pub(crate) fn list(tables: &[TableName]) -> String {
    let names: Vec<String> = tables.iter().map(ToString::to_string).collect();
    names.join(", ")
}

/// Starts the source's background work, each on a connection of its own: sampling its backlog
/// (the table's unpublished rows, or the slot's lag) and pruning what it published from `table`.
pub(crate) fn spawn_background(
    config: &RelayConfig,
    outbox: &Outbox,
    tenant_sessions: &Arc<tokio::sync::Semaphore>,
    tasks: &BackgroundTasks,
) {
    let mut session = SessionConfig::of(config, outbox);
    // A tenant's background work keeps no connection open between ticks: with many tenants,
    // the relay's connections stay one per pump and a few.
    if outbox.tenant.is_some() {
        session.per_tick = Some(Arc::clone(tenant_sessions));
    }
    let every = config.metrics_interval;
    let pruned = match &config.source {
        config::Source::Table => {
            let (session, outbox) = (session.clone(), outbox.clone());
            tasks.spawn("backlog sampler", move |stop| {
                table::backlog::sample_backlog(session, outbox, every, stop)
            });
            (config.mode == Mode::Mark).then_some(Pruned::Published)
        }
        config::Source::Wal(source) => {
            let (session, slot) = (session.clone(), source.slot.clone());
            tasks.spawn("slot sampler", move |stop| {
                wal::slot::sample_slot(session, slot, every, stop)
            });
            Some(Pruned::Read)
        }
    };
    let retention = config.retention;
    // A partitioned table (PostgreSQL) needs its partitions made ahead even with nothing to prune.
    let partitions_possible = Backend::of(&outbox.database_url) == Backend::Postgres
        && matches!(config.source, config::Source::Table);
    if (pruned.is_some() && retention.is_some()) || partitions_possible {
        let every = config.prune_interval;
        let table = outbox.table.clone();
        tasks.spawn("pruner", move |stop| {
            prune::prune_periodically(session, table, pruned, retention, every, stop)
        });
    }
}
