//! The settings' layers: flags > environment > config file > defaults.
//!
//! Each layer becomes a TOML table; the tables are merged key by key, the upper over the lower,
//! and the result is read back into [`Settings`].
//!
//! Secrets never need the command line:
//! - the environment: `DATABASE_URL`, `PULSAR_TOKEN`, and any librdkafka option as
//!   `OUTBOX_KAFKA_OPTION_<KEY>` (`sasl.password` is `OUTBOX_KAFKA_OPTION_SASL_PASSWORD`);
//! - files, as Kubernetes and Docker mount secrets: `DATABASE_URL_FILE`, `PULSAR_TOKEN_FILE`,
//!   `OUTBOX_KAFKA_OPTION_<KEY>_FILE`, or the keys `database_url_file`, `token_file`,
//!   `oauth2_credentials_url_file`, `nats_token_file`, `nats_nkey_seed_file`, `rabbitmq_url_file`, `webhook_url_file`, `webhook_secret_file` (the file's content, less its final line breaks, is the value;
//!   when both forms are set in one layer, the file wins; a file every user of the host may read
//!   gets a warning);
//! - the config file expands `${NAME}` from the environment and `${file:PATH}` from a file in any
//!   string, so the file itself holds no secret (`$${` is a literal `${`).

use super::UsageError;
use super::output::one_line;
use super::settings::Settings;
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::sync::Mutex;
use toml::{Table, Value};

/// What loading found worth a warning, logged once logging is set up (it is set up by the
/// settings loaded here).
static WARNINGS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// The warnings loading found, each once.
pub(super) fn take_warnings() -> Vec<String> {
    std::mem::take(&mut *WARNINGS.lock().unwrap_or_else(|e| e.into_inner()))
}

fn warn(warning: String) {
    WARNINGS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(warning);
}

/// Settings that name a secret, and so also take a `_file` form.
const SECRET_FILE_KEYS: [&str; 8] = [
    "database_url",
    "sink.token",
    "sink.oauth2_credentials_url",
    "sink.nats_token",
    "sink.nats_nkey_seed",
    "sink.rabbitmq_url",
    "sink.webhook_url",
    "sink.webhook_secret",
];

/// The prefix of environment variables that set librdkafka options.
const KAFKA_OPTION_PREFIX: &str = "OUTBOX_KAFKA_OPTION_";

/// Reads the layers and merges them: `flags` (with their environment variables) over the
/// `OUTBOX_KAFKA_OPTION_*` variables over the file at `config` over the defaults.
pub(super) fn load(config: Option<&Path>, flags: &impl Serialize) -> Result<Settings, UsageError> {
    let mut merged = match config {
        Some(path) => file_layer(path)?,
        None => Table::new(),
    };
    merge(&mut merged, kafka_env_layer(std::env::vars())?);
    let mut flags = Table::try_from(flags)
        .map_err(|e| UsageError(format!("flags: {}", one_line(&e.to_string()))))?;
    read_secret_files(&mut flags)?;
    merge(&mut merged, flags);
    Settings::deserialize(merged)
        .map_err(|e| UsageError(format!("settings: {}", one_line(e.message()))))
}

/// The config file: checked against [`Settings`] (so a bad key or value is reported at its line),
/// then with `${…}` expanded and `_file` secrets read.
fn file_layer(path: &Path) -> Result<Table, UsageError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| UsageError(format!("cannot read config file {}: {e}", path.display())))?;
    let at = |e: toml::de::Error| {
        let message = one_line(e.message());
        match e.span() {
            Some(span) => {
                let line = text[..span.start].matches('\n').count() + 1;
                UsageError(format!(
                    "config file {}, line {line}: {message}",
                    path.display()
                ))
            }
            None => UsageError(format!("config file {}: {message}", path.display())),
        }
    };
    toml::from_str::<Settings>(&text).map_err(at)?;
    let mut table: Table = toml::from_str(&text).map_err(at)?;
    expand_table(&mut table, "")
        .map_err(|e| UsageError(format!("config file {}: {}", path.display(), e.0)))?;
    read_secret_files(&mut table)?;
    Ok(table)
}

/// `OUTBOX_KAFKA_OPTION_SASL_PASSWORD=x` is `sasl.password = "x"` in `[sink] options`; with
/// `_FILE`, the value is read from the file the variable names.
fn kafka_env_layer(vars: impl Iterator<Item = (String, String)>) -> Result<Table, UsageError> {
    let mut options = Table::new();
    for (name, value) in vars {
        let Some(key) = name.strip_prefix(KAFKA_OPTION_PREFIX) else {
            continue;
        };
        let (key, value) = match key.strip_suffix("_FILE") {
            Some(key) => (key, read_secret(Path::new(&value), &name)?),
            None => (key, value),
        };
        options.insert(
            key.to_ascii_lowercase().replace('_', "."),
            Value::String(value),
        );
    }
    let mut layer = Table::new();
    if !options.is_empty() {
        let mut sink = Table::new();
        sink.insert("options".into(), Value::Table(options));
        layer.insert("sink".into(), Value::Table(sink));
    }
    Ok(layer)
}

/// Puts `upper` over `lower`: tables merge key by key, anything else is replaced.
fn merge(lower: &mut Table, upper: Table) {
    for (key, value) in upper {
        match (lower.get_mut(&key), value) {
            (Some(Value::Table(lower)), Value::Table(upper)) => merge(lower, upper),
            (_, value) => {
                lower.insert(key, value);
            }
        }
    }
}

/// Replaces each `KEY_file` of [`SECRET_FILE_KEYS`] in `table` by `KEY` with the file's content.
fn read_secret_files(table: &mut Table) -> Result<(), UsageError> {
    for path in SECRET_FILE_KEYS {
        let (parent, key) = match path.split_once('.') {
            Some((parent, key)) => match table.get_mut(parent) {
                Some(Value::Table(parent)) => (parent, key),
                _ => continue,
            },
            None => (&mut *table, path),
        };
        let file_key = format!("{key}_file");
        if let Some(file) = parent.remove(&file_key) {
            let Value::String(file) = file else {
                return Err(UsageError(format!("`{file_key}` must be a file path")));
            };
            let secret = read_secret(Path::new(&file), &file_key)?;
            parent.insert(key.to_owned(), Value::String(secret));
        }
    }
    Ok(())
}

/// A secret kept in a file: its content less the final line breaks that editors, `echo` and
/// `kubectl create secret --from-file` leave. A file every user of the host may read is read, with
/// a warning (Kubernetes mounts secrets so by default).
fn read_secret(path: &Path, setting: &str) -> Result<String, UsageError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| UsageError(format!("{setting}: cannot read {}: {e}", path.display())))?;
    #[cfg(unix)]
    if let Ok(metadata) = std::fs::metadata(path) {
        use std::os::unix::fs::PermissionsExt;
        let mode = metadata.permissions().mode() & 0o777;
        if mode & 0o004 != 0 {
            warn(format!(
                "{setting}: secret file {} is readable by every user of this host (mode {mode:o}); `chmod o-r` it",
                path.display()
            ));
        }
    }
    Ok(text.trim_end_matches(['\n', '\r']).to_owned())
}

/// Expands `${NAME}` and `${file:PATH}` in every string of `table`.
fn expand_table(table: &mut Table, path: &str) -> Result<(), UsageError> {
    for (key, value) in table.iter_mut() {
        let at = if path.is_empty() {
            key.clone()
        } else {
            format!("{path}.{key}")
        };
        expand_value(value, &at)?;
    }
    Ok(())
}

fn expand_value(value: &mut Value, at: &str) -> Result<(), UsageError> {
    match value {
        Value::String(text) => *text = expand(text, at)?,
        Value::Table(table) => expand_table(table, at)?,
        Value::Array(items) => {
            for item in items {
                expand_value(item, at)?;
            }
        }
        _ => {}
    }
    Ok(())
}

/// `text` with `${NAME}` replaced by the environment variable, `${file:PATH}` by the file's
/// content, and `$${` by `${`.
fn expand(text: &str, at: &str) -> Result<String, UsageError> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find('$') {
        out.push_str(&rest[..start]);
        rest = &rest[start..];
        if let Some(after) = rest.strip_prefix("$${") {
            out.push_str("${");
            rest = after;
        } else if let Some(after) = rest.strip_prefix("${") {
            let end = after
                .find('}')
                .ok_or_else(|| UsageError(format!("`{at}`: `${{` without a closing `}}`")))?;
            let name = &after[..end];
            let value = match name.strip_prefix("file:") {
                Some(file) => read_secret(Path::new(file), at)?,
                None => std::env::var(name).map_err(|_| {
                    UsageError(format!("`{at}` uses ${{{name}}}, which is not set"))
                })?,
            };
            out.push_str(&value);
            rest = &after[end + 1..];
        } else {
            out.push('$');
            rest = &rest[1..];
        }
    }
    out.push_str(rest);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::config::Mode;

    #[test]
    fn upper_layers_win_key_by_key() {
        let mut lower: Table = toml::from_str(
            "batch_size = 10\nmode = \"mark\"\n[sink]\nbrokers = \"a:1\"\noptions = { \"linger.ms\" = \"5\", \"acks\" = \"all\" }",
        )
        .unwrap();
        let upper: Table =
            toml::from_str("batch_size = 20\n[sink]\noptions = { \"linger.ms\" = \"1\" }").unwrap();
        merge(&mut lower, upper);
        let settings = Settings::deserialize(lower).unwrap();
        assert_eq!(settings.batch_size, Some(20));
        assert_eq!(settings.mode, Some(Mode::Mark));
        assert_eq!(settings.sink.brokers.as_deref(), Some("a:1"));
        assert_eq!(
            settings.sink.options,
            vec![
                ("acks".into(), "all".into()),
                ("linger.ms".into(), "1".into())
            ]
        );
    }

    #[test]
    fn unset_flags_leave_lower_layers_alone() {
        let flags = Table::try_from(Settings::default()).unwrap();
        assert!(flags.is_empty(), "{flags:?}");
    }

    #[test]
    fn kafka_options_come_from_the_environment_and_files() {
        let file = std::env::temp_dir().join(format!("outbox-kafka-secret-{}", std::process::id()));
        std::fs::write(&file, "from-a-file\n").unwrap();
        let layer = kafka_env_layer(
            [
                (
                    "OUTBOX_KAFKA_OPTION_SASL_USERNAME".to_owned(),
                    "relay".to_owned(),
                ),
                (
                    "OUTBOX_KAFKA_OPTION_SASL_PASSWORD_FILE".to_owned(),
                    file.display().to_string(),
                ),
                ("OUTBOX_KAFKA_PID".to_owned(), "12".to_owned()),
            ]
            .into_iter(),
        )
        .unwrap();
        let options = &layer["sink"]["options"];
        assert_eq!(options["sasl.username"].as_str(), Some("relay"));
        assert_eq!(options["sasl.password"].as_str(), Some("from-a-file"));
        assert_eq!(options.as_table().unwrap().len(), 2);
        std::fs::remove_file(file).unwrap();
    }

    #[test]
    fn references_expand_and_dollars_escape() {
        let name = format!("OUTBOX_TEST_EXPAND_{}", std::process::id());
        assert!(expand(&format!("a ${{{name}}}"), "k").is_err());
        assert_eq!(
            expand("price: $5, $${HOME}", "k").unwrap(),
            "price: $5, ${HOME}"
        );
        let home = std::env::var("PATH").unwrap();
        assert_eq!(expand("${PATH}", "k").unwrap(), home);
        let missing = expand("${file:/nonexistent/secret}", "sink.token").unwrap_err();
        assert!(missing.0.contains("sink.token"), "{}", missing.0);
    }

    #[test]
    fn a_secret_file_loses_its_line_breaks_and_an_open_one_is_warned_of() {
        use std::os::unix::fs::PermissionsExt;
        let file = std::env::temp_dir().join(format!("outbox-secret-{}", std::process::id()));
        std::fs::write(&file, "pa ss\r\n\n").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read_secret(&file, "sink.token_file").unwrap(), "pa ss");
        let about_file = |w: &String| w.contains(&file.display().to_string());
        assert!(!take_warnings().iter().any(about_file));

        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        read_secret(&file, "sink.token_file").unwrap();
        let warnings: Vec<String> = take_warnings().into_iter().filter(about_file).collect();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].starts_with("sink.token_file: ") && warnings[0].contains("644"));
        assert!(!warnings[0].contains("pa ss"));
        std::fs::remove_file(file).unwrap();
    }

    #[test]
    fn a_secret_file_replaces_its_key() {
        let file = std::env::temp_dir().join(format!("outbox-token-{}", std::process::id()));
        std::fs::write(&file, "tok\n").unwrap();
        let mut table: Table = toml::from_str(&format!(
            "[sink]\ntoken = \"old\"\ntoken_file = \"{}\"",
            file.display()
        ))
        .unwrap();
        read_secret_files(&mut table).unwrap();
        assert_eq!(table["sink"]["token"].as_str(), Some("tok"));
        assert!(table["sink"].get("token_file").is_none());
        std::fs::remove_file(file).unwrap();
    }
}
