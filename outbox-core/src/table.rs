//! Which outbox table events go to: `outbox` unless the application names another, for example one
//! per bounded context (`billing_outbox`) or one per schema on PostgreSQL (`billing.outbox`).
//!
//! The schema's SQL ([`schema`](crate::schema)), `record` and the relay are written for a table
//! called `outbox`; [`TableName::rewrite`] turns that SQL into the same statements on another
//! table, and the objects that belong to it (its indexes, MySQL's lock table) get the table's name
//! as their prefix: `billing_outbox_unpublished` beside `outbox_unpublished`.

use std::borrow::Cow;
use std::fmt;

/// The name of an outbox table: `name` or, on PostgreSQL, `schema.name`. Each part is lower-case
/// ASCII letters, digits and `_`, not starting with a digit (so the name means the same quoted or
/// not, on every backend); the name is at most [`TableName::MAX_NAME_CHARS`] characters, so that
/// its objects' names (`<name>_unpublished`) fit every backend's 64.
///
/// ```
/// use seaorm_outbox::TableName;
///
/// let table = TableName::new("billing.outbox")?;
/// assert_eq!(table.schema(), Some("billing"));
/// assert_eq!(table.name(), "outbox");
/// assert_eq!(table.to_string(), "billing.outbox");
/// assert!(TableName::new("Billing").is_err());
/// assert_eq!(TableName::default().to_string(), "outbox");
/// # Ok::<(), seaorm_outbox::InvalidTableName>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TableName {
    /// `schema.name` or `name`, checked.
    qualified: Cow<'static, str>,
}

/// A table name [`TableName::new`] refused, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{name}` is not an outbox table name: {reason}")]
#[non_exhaustive]
pub struct InvalidTableName {
    /// The name given.
    pub name: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl TableName {
    /// The table `record` and the relay use unless told otherwise.
    pub const DEFAULT: TableName = TableName {
        qualified: Cow::Borrowed("outbox"),
    };

    /// The longest table name (without its schema), in characters.
    pub const MAX_NAME_CHARS: usize = 48;

    /// Checks `name` (`name` or `schema.name`).
    ///
    /// ```
    /// use seaorm_outbox::TableName;
    /// assert!(TableName::new("orders_outbox").is_ok());
    /// assert!(TableName::new("1outbox").is_err());
    /// assert!(TableName::new("a.b.c").is_err());
    /// ```
    pub fn new(name: impl Into<Cow<'static, str>>) -> Result<Self, InvalidTableName> {
        let qualified = name.into();
        match check(&qualified) {
            None => Ok(TableName { qualified }),
            Some(reason) => Err(InvalidTableName {
                name: qualified.into_owned(),
                reason,
            }),
        }
    }

    /// The schema, when the name has one.
    pub fn schema(&self) -> Option<&str> {
        self.qualified.split_once('.').map(|(schema, _)| schema)
    }

    /// The table's name without its schema: the prefix of its objects' names.
    pub fn name(&self) -> &str {
        self.qualified
            .split_once('.')
            .map_or(&*self.qualified, |(_, name)| name)
    }

    /// Whether this is the default table, `outbox`, whose SQL is the SQL as written.
    pub fn is_default(&self) -> bool {
        self.qualified == "outbox"
    }

    /// `sql`, written for the table `outbox`, on this table: the identifier `outbox` becomes this
    /// table (schema-qualified when it has a schema), and an identifier `outbox_<suffix>` (one of
    /// the table's objects: an index, a constraint, MySQL's lock table) becomes `<name>_<suffix>`,
    /// in the table's schema as indexes are. Each is quoted with `quote` (`"` on PostgreSQL and
    /// SQLite, `` ` `` on MySQL). String literals and comments are left alone. The default table's
    /// SQL comes back as it was.
    ///
    /// ```
    /// use seaorm_outbox::TableName;
    ///
    /// let table = TableName::new("billing.outbox")?;
    /// assert_eq!(
    ///     table.rewrite("CREATE INDEX outbox_held ON outbox (id) -- outbox", '"'),
    ///     r#"CREATE INDEX "outbox_held" ON "billing"."outbox" (id) -- outbox"#,
    /// );
    /// assert_eq!(TableName::default().rewrite("SELECT 'outbox' FROM outbox", '"'), "SELECT 'outbox' FROM outbox");
    /// # Ok::<(), seaorm_outbox::InvalidTableName>(())
    /// ```
    pub fn rewrite<'s>(&self, sql: &'s str, quote: char) -> Cow<'s, str> {
        if self.is_default() {
            return Cow::Borrowed(sql);
        }
        let mut out = String::with_capacity(sql.len() + 64);
        let mut rest = sql;
        while let Some(c) = rest.chars().next() {
            let token_len = if c == '\'' || c == '"' || c == '`' {
                // A literal or a quoted identifier, with its doubled quotes.
                let mut end = 1;
                let bytes = rest.as_bytes();
                while end < bytes.len() {
                    if bytes[end] == c as u8 {
                        if bytes.get(end + 1) == Some(&(c as u8)) {
                            end += 2;
                            continue;
                        }
                        end += 1;
                        break;
                    }
                    end += 1;
                }
                end.min(bytes.len())
            } else if rest.starts_with("--") {
                rest.find('\n').unwrap_or(rest.len())
            } else if rest.starts_with("/*") {
                rest.find("*/").map_or(rest.len(), |end| end + 2)
            } else if c.is_ascii_alphabetic() || c == '_' {
                let len = rest
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '$'))
                    .unwrap_or(rest.len());
                let word = &rest[..len];
                // Not a column or alias that happens to be `outbox` (`o.outbox`): none exists.
                if word.eq_ignore_ascii_case("outbox") {
                    self.push_qualified(&mut out, quote);
                    rest = &rest[len..];
                    continue;
                }
                if let Some(suffix) = word
                    .get(..7)
                    .filter(|p| p.eq_ignore_ascii_case("outbox_"))
                    .map(|_| &word[7..])
                {
                    push_quoted(&mut out, &format!("{}_{suffix}", self.name()), quote);
                    rest = &rest[len..];
                    continue;
                }
                len
            } else {
                c.len_utf8()
            };
            out.push_str(&rest[..token_len]);
            rest = &rest[token_len..];
        }
        Cow::Owned(out)
    }

    /// This table, quoted with `quote`: `"billing"."outbox"`.
    pub fn quoted(&self, quote: char) -> String {
        let mut out = String::new();
        self.push_qualified(&mut out, quote);
        out
    }

    fn push_qualified(&self, out: &mut String, quote: char) {
        if let Some(schema) = self.schema() {
            push_quoted(out, schema, quote);
            out.push('.');
        }
        push_quoted(out, self.name(), quote);
    }
}

fn push_quoted(out: &mut String, identifier: &str, quote: char) {
    out.push(quote);
    out.push_str(identifier);
    out.push(quote);
}

impl Default for TableName {
    /// [`TableName::DEFAULT`], `outbox`.
    fn default() -> Self {
        TableName::DEFAULT
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.qualified)
    }
}

impl std::str::FromStr for TableName {
    type Err = InvalidTableName;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        TableName::new(name.to_owned())
    }
}

/// What is wrong with `qualified` as a table name, if anything. The derive macro checks
/// `#[outbox(table = "...")]` by the same rules at compile time.
fn check(qualified: &str) -> Option<&'static str> {
    let mut parts = qualified.split('.');
    let (schema, name) = match (parts.next(), parts.next(), parts.next()) {
        (Some(name), None, _) => (None, name),
        (Some(schema), Some(name), None) => (Some(schema), name),
        _ => return Some("at most one `.`, between a schema and the table's name"),
    };
    for part in schema.into_iter().chain([name]) {
        if part.is_empty() {
            return Some("an empty part");
        }
        if part.starts_with(|c: char| c.is_ascii_digit()) {
            return Some("a part starts with a digit");
        }
        if !part
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        {
            return Some("only lower-case ASCII letters, digits and `_`");
        }
    }
    if name.len() > TableName::MAX_NAME_CHARS {
        return Some("the name is longer than 48 characters");
    }
    if schema.is_some_and(|s| s.len() > 63) {
        return Some("the schema is longer than 63 characters");
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(name: &'static str) -> TableName {
        TableName::new(name).unwrap()
    }

    #[test]
    fn names_are_checked() {
        for good in ["outbox", "billing_outbox", "_x", "billing.outbox", "s1.o2"] {
            assert!(TableName::new(good).is_ok(), "{good}");
        }
        for bad in [
            "", "Outbox", "1x", "a.b.c", ".x", "x.", "out-box", "out box", "o\"x",
        ] {
            assert!(TableName::new(bad).is_err(), "{bad}");
        }
        assert!(TableName::new("a".repeat(48)).is_ok());
        assert!(TableName::new("a".repeat(49)).is_err());
    }

    #[test]
    fn the_table_and_its_objects_are_renamed_and_nothing_else() {
        let t = table("billing.orders_outbox");
        assert_eq!(
            t.rewrite(
                "UPDATE outbox o SET x = 'outbox' FROM outbox_lock -- outbox\nWHERE \"outbox\" = outboxes",
                '`'
            ),
            "UPDATE `billing`.`orders_outbox` o SET x = 'outbox' FROM `orders_outbox_lock` -- outbox\n\
             WHERE \"outbox\" = outboxes"
        );
        assert_eq!(
            t.rewrite(
                "CREATE INDEX IF NOT EXISTS outbox_unpublished ON outbox (seq);",
                '"'
            ),
            "CREATE INDEX IF NOT EXISTS \"orders_outbox_unpublished\" ON \"billing\".\"orders_outbox\" (seq);"
        );
        assert_eq!(
            t.rewrite("a /* outbox */ 'it''s outbox' b", '"'),
            "a /* outbox */ 'it''s outbox' b"
        );
        // Unterminated literals and comments end the text without a panic.
        assert_eq!(t.rewrite("x 'outbox", '"'), "x 'outbox");
        assert_eq!(t.rewrite("x /* outbox", '"'), "x /* outbox");
        assert_eq!(
            t.rewrite("é outbox", '"'),
            "é \"billing\".\"orders_outbox\""
        );
    }

    #[test]
    fn the_default_table_keeps_its_sql() {
        let sql = "SELECT * FROM outbox";
        assert!(matches!(TableName::default().rewrite(sql, '"'), Cow::Borrowed(s) if s == sql));
    }
}
