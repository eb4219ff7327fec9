//! The NATS JetStream sink, through `async-nats`.
//!
//! Each event is published to the subject named by its routed topic, on one connection, with the
//! contract's headers, the aggregate id as header `aggregate_id` (NATS has no message key), and
//! `Nats-Msg-Id` = the event id. The stream's duplicate window (two minutes by default) drops a
//! second copy of an event: a batch the relay sends again after a crash, or a retry of a publish
//! whose acknowledgement was lost, reaches the stream once. A row is marked published only after
//! JetStream's publish acknowledgement (the event is stored in its stream).
//!
//! Order: the connection hands the server the messages in the order the relay enqueued them, and
//! the stream stores them in that order, so one aggregate's events are stored in `seq` order.
//! A connection lost with messages in flight is the one exception (`docs/design.md`, "NATS").

use super::{Ack, Message, Sink, SinkError};
use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use async_nats::{ConnectOptions, HeaderMap};
use futures::future::{BoxFuture, FutureExt};
use seaorm_outbox::Secret;
use std::path::PathBuf;
use std::time::Duration;
use tokio::sync::OnceCell;

/// The NATS sink's settings.
///
/// ```
/// use seaorm_outbox::Secret;
/// use seaorm_outbox_relay::sink::nats::NatsConfig;
///
/// let mut config = NatsConfig::new("tls://nats.example.com:4222");
/// config.token = Some(Secret::new("s3cret-token"));
/// config.tls_ca_file = Some("/etc/ssl/nats-ca.pem".into());
/// let printed = format!("{config:?}");
/// assert!(!printed.contains("s3cret-token"), "{printed}");
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct NatsConfig {
    /// The servers: `nats://host:port` or `tls://host:port`, comma-separated. A `user:password@`
    /// in the URL logs in with that user.
    pub url: Secret,
    /// A token to log in with.
    pub token: Option<Secret>,
    /// A credentials file (a user JWT and its NKey seed, as `nsc` writes them).
    pub credentials_file: Option<PathBuf>,
    /// An NKey seed to log in with.
    pub nkey_seed: Option<Secret>,
    /// PEM file of the certificate authorities trusted for the server's certificate.
    pub tls_ca_file: Option<PathBuf>,
    /// A client certificate and its key (PEM files), for servers that verify clients.
    pub tls_client_cert: Option<(PathBuf, PathBuf)>,
    /// How long a publish waits for JetStream's acknowledgement before it is retried.
    pub ack_timeout: Duration,
}

impl NatsConfig {
    /// A configuration for the servers at `url`, without credentials.
    pub fn new(url: impl Into<String>) -> Self {
        NatsConfig {
            url: Secret::new(url),
            token: None,
            credentials_file: None,
            nkey_seed: None,
            tls_ca_file: None,
            tls_client_cert: None,
            ack_timeout: Duration::from_secs(30),
        }
    }

    async fn options(&self) -> Result<ConnectOptions, SinkError> {
        let mut options = match &self.credentials_file {
            Some(path) => ConnectOptions::with_credentials_file(path)
                .await
                .map_err(|e| {
                    SinkError::unavailable(format!("NATS credentials file {}: {e}", path.display()))
                })?,
            None => ConnectOptions::new(),
        };
        if let Some(token) = &self.token {
            options = options.token(token.expose().to_owned());
        }
        if let Some(seed) = &self.nkey_seed {
            options = options.nkey(seed.expose().to_owned());
        }
        if let Some(ca) = &self.tls_ca_file {
            options = options.add_root_certificates(ca.clone());
        }
        if let Some((cert, key)) = &self.tls_client_cert {
            options = options.add_client_certificate(cert.clone(), key.clone());
        }
        Ok(options
            .name("outbox-relay")
            .connection_timeout(Duration::from_secs(10))
            // The relay retries what a lost connection left unacknowledged; the client keeps
            // reconnecting meanwhile instead of giving up after a few attempts.
            .max_reconnects(None))
    }
}

/// Publishes to NATS JetStream (see the module's documentation).
pub struct NatsSink {
    config: NatsConfig,
    /// Connected on first use, so that building the sink needs no server; a failed connection is
    /// tried again at the next publish.
    jetstream: OnceCell<async_nats::jetstream::Context>,
}

impl NatsSink {
    /// A sink for `config`; it connects when it first publishes.
    pub fn new(config: &NatsConfig) -> Result<Self, SinkError> {
        Ok(NatsSink {
            config: config.clone(),
            jetstream: OnceCell::new(),
        })
    }

    async fn context(&self) -> Result<&async_nats::jetstream::Context, SinkError> {
        self.jetstream.get_or_try_init(|| self.connect()).await
    }

    async fn connect(&self) -> Result<async_nats::jetstream::Context, SinkError> {
        // async-nats builds its TLS settings from rustls' process-wide provider, which rustls
        // cannot pick by itself when the dependency graph enables two (ring here, aws-lc-rs through
        // the WAL source's client): it panicked at the first tls:// connection. Installing one
        // does nothing if the application installed its own.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let (servers, login) = without_login(self.config.url.expose())?;
        let mut options = self.config.options().await?;
        if let Some(Login { user, password }) = login {
            options = options.user_and_password(user, password);
        }
        let client = options
            .connect(servers.as_slice())
            .await
            .map_err(|e| classify_connect(&e))?;
        let mut context = async_nats::jetstream::new(client);
        context.set_timeout(self.config.ack_timeout);
        Ok(context)
    }
}

/// A user and password taken out of a server's URL.
#[derive(Debug, PartialEq, Eq)]
struct Login {
    user: String,
    password: String,
}

/// The servers of `urls` (comma-separated) without the `user:password@` of any, and that login:
/// the client logs each server's URL as it connects, password included, so it never sees one.
fn without_login(urls: &str) -> Result<(Vec<url::Url>, Option<Login>), SinkError> {
    let mut login = None;
    let mut servers = Vec::new();
    for text in urls.split(',').map(str::trim).filter(|u| !u.is_empty()) {
        let text = if text.contains("://") {
            text.to_owned()
        } else {
            format!("nats://{text}")
        };
        let mut server = url::Url::parse(&text).map_err(|e| {
            SinkError::unavailable(format!(
                "bad NATS URL {}: {e}",
                crate::redact::redact_url(&text)
            ))
        })?;
        if !server.username().is_empty() {
            login = Some(Login {
                user: crate::redact::percent_decode(server.username()),
                password: crate::redact::percent_decode(server.password().unwrap_or_default()),
            });
            // Cannot fail on a URL with a host, which a NATS URL has.
            let _ = server.set_username("");
            let _ = server.set_password(None);
        }
        servers.push(server);
    }
    Ok((servers, login))
}

/// A failed connection is never the event's fault (a refused login or certificate, a server
/// away; the client's message says which): the relay leaves the rows untouched and backs off as a
/// whole, and `/readyz` says so.
fn classify_connect(e: &async_nats::ConnectError) -> SinkError {
    SinkError::unavailable(format!("cannot connect to NATS: {e}"))
}

/// Sorts a publish's failure: what retrying cannot fix is parked, the rest retried.
fn classify(e: &PublishError, subject: &str) -> SinkError {
    match e.kind() {
        // No stream takes the subject: an operator must create one (as a missing Kafka topic).
        PublishErrorKind::StreamNotFound => {
            SinkError::permanent(format!("no JetStream stream takes subject `{subject}`"))
        }
        PublishErrorKind::MaxPayloadExceeded => {
            SinkError::permanent(format!("the event is larger than the server accepts: {e}"))
        }
        _ => SinkError::new(format!("NATS publish to `{subject}`: {e}")),
    }
}

impl Sink for NatsSink {
    fn name(&self) -> &str {
        "nats"
    }

    fn enqueue<'a>(&'a self, message: &'a Message) -> BoxFuture<'a, Result<Ack, SinkError>> {
        async move {
            let context = self.context().await?;
            let mut headers = HeaderMap::new();
            for (name, value) in &message.headers {
                headers.insert(name.as_str(), value.as_str());
            }
            headers.insert("aggregate_id", message.key.as_str());
            let publish = PublishMessage::build()
                .payload(message.payload.clone())
                .headers(headers)
                .message_id(message.event_id.to_string());
            let subject = message.topic.clone();
            let ack = context
                .send_publish(subject.clone(), publish)
                .await
                .map_err(|e| classify(&e, &subject))?;
            let ack: Ack =
                async move { ack.await.map(|_| ()).map_err(|e| classify(&e, &subject)) }.boxed();
            Ok(ack)
        }
        .boxed()
    }

    /// The NATS protocol binding names CloudEvents' headers as HTTP's does.
    fn cloudevents_prefix(&self) -> &str {
        "ce-"
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), SinkError>> {
        async move {
            let context = self.context().await?;
            match context.client().connection_state() {
                async_nats::connection::State::Connected => Ok(()),
                state => Err(SinkError::new(format!("NATS connection is {state}"))),
            }
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_login_leaves_the_urls_and_is_decoded() {
        let (servers, login) =
            without_login("nats://relay:p%40ss%3Aword@a.example:4222, tls://b.example:4443")
                .unwrap();
        let servers: Vec<&str> = servers.iter().map(url::Url::as_str).collect();
        assert_eq!(servers, ["nats://a.example:4222", "tls://b.example:4443"]);
        let login = login.expect("the login");
        assert_eq!(
            (login.user.as_str(), login.password.as_str()),
            ("relay", "p@ss:word")
        );

        let (servers, login) = without_login("127.0.0.1:4222").unwrap();
        assert_eq!(servers[0].as_str(), "nats://127.0.0.1:4222");
        assert_eq!(login, None);
    }

    #[test]
    fn a_bad_url_is_reported_without_its_password() {
        let e = without_login("nats://relay:Zq9secret@[bad").unwrap_err();
        assert!(e.is_unavailable());
        assert!(!e.message.contains("Zq9secret"), "{}", e.message);
    }
}
