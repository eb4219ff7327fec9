//! Keeping secrets out of logs, errors and printed settings.

#[cfg(feature = "kafka")]
use std::collections::BTreeMap;

/// A URL's user or password as written there, `%XX` escapes decoded (a `+` stays a `+`).
pub(crate) fn percent_decode(s: &str) -> String {
    url::form_urlencoded::parse(format!("p={}", s.replace('+', "%2B")).as_bytes())
        .next()
        .map(|(_, v)| v.into_owned())
        .unwrap_or_default()
}

/// `url` with its password and any secret query parameter replaced by `***`, for logs and errors.
///
/// The URL is parsed with a real URL parser, so a password with any characters is masked, and so
/// are query parameters that carry secrets (`password=`, `sslpassword=`, ...), which sqlx accepts.
/// A URL that does not parse has everything before its last `@` masked.
///
/// ```
/// use seaorm_outbox_relay::redact_url;
///
/// assert_eq!(redact_url("postgres://app:s3cret@db:5432/shop"), "postgres://app:***@db:5432/shop");
/// assert_eq!(redact_url("postgres://app@db/shop?password=s3cret&sslmode=require"),
///            "postgres://app@db/shop?password=***&sslmode=require");
/// assert_eq!(redact_url("postgres://app:pa/ss@db/shop"), "postgres://***@db/shop");
/// assert_eq!(redact_url("sqlite:///tmp/x.db"), "sqlite:///tmp/x.db");
/// ```
pub fn redact_url(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut parsed) => {
            if parsed.password().is_some() {
                let _ = parsed.set_password(Some("***"));
            }
            if parsed.query().is_some() {
                let pairs: Vec<(String, String)> = parsed
                    .query_pairs()
                    .map(|(k, v)| {
                        let v = if is_secret_key(&k) {
                            "***".into()
                        } else {
                            v.into_owned()
                        };
                        (k.into_owned(), v)
                    })
                    .collect();
                parsed.query_pairs_mut().clear().extend_pairs(pairs);
            }
            // The serializer percent-encodes the mask; show it as written.
            parsed.as_str().replace("%2A%2A%2A", "***")
        }
        _ => redact_unparsed(url),
    }
}

/// A URL the parser refuses (a password with a `/`, say): mask all before the last `@` of the part
/// before the query, and secret query values.
fn redact_unparsed(url: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let base = match (base.find("://"), base.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            format!("{}://***{}", &base[..scheme_end], &base[at..])
        }
        _ => base.to_owned(),
    };
    match query {
        None => base,
        Some(query) => {
            let query: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((k, _)) if is_secret_key(k) => format!("{k}=***"),
                    _ => pair.to_owned(),
                })
                .collect();
            format!("{base}?{}", query.join("&"))
        }
    }
}

/// Whether a setting named `key` holds a secret: a librdkafka option such as `sasl.password`,
/// `ssl.key.password`, `sasl.oauthbearer.client.secret` or `ssl.key.pem`, or a URL query
/// parameter such as `password` or `sslpassword`.
///
/// ```
/// use seaorm_outbox_relay::is_secret_key;
///
/// assert!(is_secret_key("sasl.password"));
/// assert!(is_secret_key("sasl.oauthbearer.client.secret"));
/// assert!(!is_secret_key("sasl.username"));
/// ```
pub fn is_secret_key(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    [
        "password",
        "secret",
        "token",
        "jaas",
        "oauthbearer.config",
        "key.pem",
        "ssl_key",
    ]
    .iter()
    .any(|word| key.contains(word))
}

/// `options` with the values of secret keys replaced by `***`, for printing.
#[cfg(feature = "kafka")]
pub fn redact_options(options: &BTreeMap<String, String>) -> BTreeMap<&str, &str> {
    options
        .iter()
        .map(|(k, v)| {
            let v = if is_secret_key(k) { "***" } else { v.as_str() };
            (k.as_str(), v)
        })
        .collect()
}

/// `text` with every occurrence of each secret value replaced by `***`: for messages from clients
/// that may quote a setting back (librdkafka's "invalid value" errors do).
#[cfg(feature = "kafka")]
pub fn redact_values<'a>(text: &str, secrets: impl IntoIterator<Item = &'a str>) -> String {
    secrets
        .into_iter()
        .filter(|s| !s.is_empty())
        .fold(text.to_owned(), |text, secret| text.replace(secret, "***"))
}
