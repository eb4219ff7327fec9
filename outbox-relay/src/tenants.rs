//! Tenant databases: one relay process publishing the outboxes of several databases (a database
//! per tenant). Each tenant's tables get pumps of their own, as each table of one database does, so
//! a tenant whose database is down, or refuses the relay's credentials, holds only its own pumps.

use crate::redact::redact_url;
use seaorm_outbox::TableName;

/// One tenant's database, published by the relay beside the others ([`RelayConfig::tenants`](crate::RelayConfig::tenants)).
/// Its name labels its metrics and its pumps' log lines, so it should be short and stable.
///
/// ```
/// use seaorm_outbox_relay::{RelayConfig, Tenant, Tenants};
///
/// let mut config = RelayConfig::new("postgres://relay@catalogue/tenants");
/// config.tenants = Tenants::List(vec![
///     Tenant::new("acme", "postgres://relay:s3cret@db-1/acme"),
///     Tenant::new("globex", "postgres://relay:s3cret@db-2/globex"),
/// ]);
/// assert!(!format!("{config:?}").contains("s3cret"));
/// ```
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Tenant {
    /// The tenant's name, for metrics and logs.
    pub name: String,
    /// Its database (`postgres://…` or `mysql://…`).
    pub database_url: String,
}

impl Tenant {
    /// The tenant `name`, whose outbox is in the database at `database_url`.
    pub fn new(name: impl Into<String>, database_url: impl Into<String>) -> Self {
        Tenant {
            name: name.into(),
            database_url: database_url.into(),
        }
    }
}

/// The URL's password is masked.
impl std::fmt::Debug for Tenant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tenant")
            .field("name", &self.name)
            .field("database_url", &redact_url(&self.database_url))
            .finish()
    }
}

/// Where the relay finds its tenant databases ([`RelayConfig::tenants`](crate::RelayConfig::tenants)).
///
/// ```
/// use seaorm_outbox_relay::{RelayConfig, Tenants};
///
/// let mut config = RelayConfig::new("postgres://relay@catalogue/tenants");
/// // One tenant per line, `name url`; edited while the relay runs.
/// config.tenants = Tenants::File("/etc/outbox/tenants".into());
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Tenants {
    /// None: the relay publishes its own database, `database_url`. The default.
    #[default]
    None,
    /// These tenants, for the relay's whole run.
    List(Vec<Tenant>),
    /// The tenants listed in this file, one per line as `name url` (blank lines and lines
    /// starting with `#` are skipped), read again every [`RelayConfig::tenants_reread`](crate::RelayConfig::tenants_reread): a
    /// tenant added is served, one removed is released, without a restart. A file that cannot
    /// be read at start stops the relay; later, the relay keeps the tenants it has and says why.
    File(std::path::PathBuf),
    /// The tenants this query returns, run on the relay's own database (`database_url`, a
    /// catalogue) at start and again every [`RelayConfig::tenants_reread`](crate::RelayConfig::tenants_reread): each row a tenant's
    /// name and its database's URL, such as `SELECT name, database_url FROM tenants WHERE
    /// active`. A query that fails later leaves the relay with the tenants it has.
    Query(String),
}

impl Tenants {
    /// The tenants now; `None` when the relay publishes its own database. A query runs on
    /// `database_url`, the relay's own database.
    pub(crate) async fn read(&self, database_url: &str) -> Result<Option<Vec<Tenant>>, String> {
        match self {
            Tenants::None => Ok(None),
            Tenants::List(tenants) => Ok(Some(tenants.clone())),
            Tenants::File(path) => {
                let text = tokio::fs::read_to_string(path)
                    .await
                    .map_err(|e| format!("cannot read the tenants file {}: {e}", path.display()))?;
                parse(&text)
                    .map(Some)
                    .map_err(|e| format!("the tenants file {}: {e}", path.display()))
            }
            Tenants::Query(query) => {
                let rows = crate::database::answered_within(QUERY_LIMIT, async {
                    crate::database::query_pairs(database_url, query).await
                })
                .await
                .map_err(|e| format!("the tenants query on {}: {e}", redact_url(database_url)))?;
                let mut tenants: Vec<Tenant> = Vec::new();
                for (number, (name, url)) in (1..).zip(rows) {
                    add(&mut tenants, &name, &url)
                        .map_err(|e| format!("the tenants query, row {number}: {e}"))?;
                }
                Ok(Some(tenants))
            }
        }
    }

    /// Reads a tenants file now, for a configuration checked before the relay starts: what
    /// [`read`](Self::read) would say of it.
    #[cfg(feature = "cli")]
    pub(crate) fn read_file(path: &std::path::Path) -> Result<Vec<Tenant>, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read the tenants file {}: {e}", path.display()))?;
        parse(&text).map_err(|e| format!("the tenants file {}: {e}", path.display()))
    }

    /// Whether the list can change while the relay runs.
    pub(crate) fn rereads(&self) -> bool {
        matches!(self, Tenants::File(_) | Tenants::Query(_))
    }
}

/// How long the tenants query may take.
const QUERY_LIMIT: std::time::Duration = std::time::Duration::from_secs(30);

/// A tenants file's lines: `name url`. An error names the line, never its text (the URL may
/// carry a password).
fn parse(text: &str) -> Result<Vec<Tenant>, String> {
    let mut tenants: Vec<Tenant> = Vec::new();
    for (number, line) in (1..).zip(text.lines()) {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut words = line.split_whitespace();
        let (Some(name), Some(url), None) = (words.next(), words.next(), words.next()) else {
            return Err(format!("line {number}: expected `name url`"));
        };
        add(&mut tenants, name, url).map_err(|e| format!("line {number}: {e}"))?;
    }
    Ok(tenants)
}

/// Adds the tenant `name` at `url` to `tenants`, if its name and URL will do. An error never
/// shows the URL (it may carry a password).
fn add(tenants: &mut Vec<Tenant>, name: &str, url: &str) -> Result<(), String> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || "_-.".contains(c);
    if name.is_empty() || name.len() > 63 || !name.chars().all(allowed) {
        return Err("a tenant's name is 1 to 63 letters, digits, `_`, `-` or `.`".into());
    }
    if !["postgres://", "postgresql://", "mysql://", "mariadb://"]
        .iter()
        .any(|scheme| url.starts_with(scheme))
    {
        return Err(format!(
            "tenant {name}'s URL is not a PostgreSQL or MySQL URL"
        ));
    }
    if tenants.iter().any(|t| t.name == name) {
        return Err(format!("tenant {name} is listed twice"));
    }
    tenants.push(Tenant::new(name, url));
    Ok(())
}

/// What one pump publishes: one outbox table in one database, a tenant's or the relay's own.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Outbox {
    /// The tenant whose database it is; `None` for the relay's own database.
    pub tenant: Option<String>,
    pub database_url: String,
    pub table: TableName,
}

impl Outbox {
    /// Every outbox to publish: each of `tables` in each of `tenants`' databases, or in the
    /// relay's own database (`database_url`) without tenants.
    pub fn all(
        database_url: &str,
        tables: &[TableName],
        tenants: Option<&[Tenant]>,
    ) -> Vec<Outbox> {
        let databases: Vec<(Option<String>, &str)> = match tenants {
            None => vec![(None, database_url)],
            Some(tenants) => tenants
                .iter()
                .map(|t| (Some(t.name.clone()), t.database_url.as_str()))
                .collect(),
        };
        databases
            .into_iter()
            .flat_map(|(tenant, url)| {
                tables.iter().map(move |table| Outbox {
                    tenant: tenant.clone(),
                    database_url: url.to_owned(),
                    table: table.clone(),
                })
            })
            .collect()
    }

    /// What the commands call it: `tenant acme, table outbox`, or `table outbox`.
    #[cfg(feature = "cli")]
    pub fn describe(&self) -> String {
        match &self.tenant {
            Some(tenant) => format!("tenant {tenant}, table {}", self.table),
            None => format!("table {}", self.table),
        }
    }

    /// Its tenant's name, or nothing for the relay's own database: for log lines.
    pub fn tenant_name(&self) -> &str {
        self.tenant.as_deref().unwrap_or_default()
    }

    /// The labels of its metrics: its table, and its tenant when it has one.
    pub fn labels(&self) -> Vec<(&'static str, String)> {
        let mut labels = vec![("table", self.table.to_string())];
        if let Some(tenant) = &self.tenant {
            labels.push(("tenant", tenant.clone()));
        }
        labels
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_table_of_each_tenant_is_one_outbox() {
        let own_url = "postgres://relay@catalogue/tenants";
        let tables = [
            TableName::DEFAULT,
            TableName::new("billing_outbox").unwrap(),
        ];
        let own = Outbox::all(own_url, &tables, None);
        assert_eq!(own.len(), 2);
        assert!(
            own.iter()
                .all(|o| o.tenant.is_none() && o.database_url == own_url)
        );
        assert_eq!(own[0].labels(), [("table", "outbox".to_owned())]);
        let tenants = [
            Tenant::new("a", "postgres://db/a"),
            Tenant::new("b", "postgres://db/b"),
        ];
        let outboxes = Outbox::all(own_url, &tables, Some(&tenants));
        assert_eq!(
            outboxes[3].labels(),
            [
                ("table", "billing_outbox".to_owned()),
                ("tenant", "b".to_owned())
            ]
        );
        let pumped: Vec<_> = outboxes
            .into_iter()
            .map(|o| (o.tenant.unwrap(), o.database_url, o.table.to_string()))
            .collect();
        assert_eq!(pumped.len(), 4);
        assert!(pumped.contains(&(
            "b".into(),
            "postgres://db/b".into(),
            "billing_outbox".into()
        )));
    }

    #[test]
    fn a_tenants_file_is_name_and_url_per_line_and_its_errors_never_show_a_url() {
        let tenants = parse(
            "# tenants\n\nacme postgres://relay:s3cret@db-1/acme\n  globex  mysql://db-2/globex  \n",
        )
        .unwrap();
        assert_eq!(
            tenants,
            [
                Tenant::new("acme", "postgres://relay:s3cret@db-1/acme"),
                Tenant::new("globex", "mysql://db-2/globex")
            ]
        );
        for (text, expected) in [
            (
                "acme postgres://relay:s3cret@db/a extra",
                "line 1: expected `name url`",
            ),
            ("\nacme", "line 2: expected `name url`"),
            (
                "a/b postgres://relay:s3cret@db/a",
                "line 1: a tenant's name",
            ),
            (
                "acme sqlite://s3cret.db",
                "line 1: tenant acme's URL is not",
            ),
            (
                "a postgres://s3cret@db/a\na postgres://s3cret@db/b",
                "line 2: tenant a is listed twice",
            ),
        ] {
            let error = parse(text).unwrap_err();
            assert!(error.starts_with(expected), "{text:?}: {error}");
            assert!(!error.contains("s3cret"), "{error}");
        }
    }
}
