//! The secured brokers of the test run (`scripts/services start kafka-secure pulsar`): Kafka with an
//! SSL listener that requires client certificates, a SASL_SSL listener (PLAIN, SCRAM, OAUTHBEARER)
//! and ACLs; Pulsar with token authentication and a TLS port. Keys, certificates, passwords and
//! tokens are made afresh for each start.

use super::{Fixture, KillOnDrop, relay_command};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

/// Where the secured brokers are and the credentials they accept.
pub struct Secure {
    /// The plaintext listener, for the tests' own admin and reads (the broker's super user).
    pub internal: String,
    /// The SSL listener (client certificates required).
    pub ssl: String,
    /// The SASL_SSL listener.
    pub sasl_ssl: String,
    /// The SASL user, and its password (PLAIN and SCRAM alike).
    pub user: String,
    pub password: String,
    /// The folder of ca.pem, other-ca.pem, client.crt and client.key.
    pub tls: PathBuf,
    /// ca.pem, the CA that signed the brokers' certificates.
    pub ca: String,
    /// The password of client.key.
    pub key_password: String,
    /// Pulsar's TLS service URL, pulsar+ssl://…
    pub pulsar_tls_url: String,
    /// A token Pulsar accepts, one that expired, and one signed with another key.
    pub pulsar_token: String,
    pub pulsar_expired_token: String,
    pub pulsar_foreign_token: String,
}

fn var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!(
            "{name} is not set: this test needs the secured Kafka and Pulsar. Run `scripts/test`, \
             which starts them (scripts/services start kafka-secure pulsar) and sets it."
        )
    })
}

/// The secured brokers, or a panic that says how to get them.
pub fn secure() -> Secure {
    Secure {
        internal: var("OUTBOX_SECURE_KAFKA_INTERNAL"),
        ssl: var("OUTBOX_SECURE_KAFKA_SSL"),
        sasl_ssl: var("OUTBOX_SECURE_KAFKA_SASL_SSL"),
        user: var("OUTBOX_SECURE_KAFKA_USER"),
        password: var("OUTBOX_SECURE_KAFKA_PASSWORD"),
        tls: PathBuf::from(var("OUTBOX_TLS_DIR")),
        ca: format!("{}/ca.pem", var("OUTBOX_TLS_DIR")),
        key_password: var("OUTBOX_TLS_KEY_PASSWORD"),
        pulsar_tls_url: var("OUTBOX_PULSAR_TLS_URL"),
        pulsar_token: var("OUTBOX_PULSAR_TOKEN"),
        pulsar_expired_token: var("OUTBOX_PULSAR_EXPIRED_TOKEN"),
        pulsar_foreign_token: var("OUTBOX_PULSAR_FOREIGN_TOKEN"),
    }
}

impl Secure {
    /// A file of the throwaway TLS material.
    pub fn file(&self, name: &str) -> String {
        self.tls.join(name).display().to_string()
    }

    /// Creates topics (auto-creation is off on this broker), through the admin listener.
    pub async fn create_topics(&self, topics: &[&str]) {
        use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
        use rdkafka::client::DefaultClientContext;
        let admin: AdminClient<DefaultClientContext> = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &self.internal)
            .create()
            .expect("kafka admin client");
        let new: Vec<NewTopic<'_>> = topics
            .iter()
            .map(|t| NewTopic::new(t, 4, TopicReplication::Fixed(1)))
            .collect();
        for result in admin
            .create_topics(&new, &AdminOptions::new())
            .await
            .expect("create topics")
        {
            result.unwrap_or_else(|(topic, e)| panic!("create topic {topic}: {e}"));
        }
    }
}

/// A relay binary whose stderr goes to a file, read by the test.
pub struct Relay {
    child: KillOnDrop,
    pub port: u16,
}

impl Relay {
    /// Starts `outbox-relay run` on the fixture with `args` (sink and more) and extra
    /// environment variables, logging at `level`.
    pub fn start(f: &Fixture, args: &[String], env: &[(String, String)], level: &str) -> Relay {
        Relay::start_on(&f.url, &f.template, args, env, level)
    }

    /// [`start`](Relay::start) on the database at `url`.
    pub fn start_on(
        url: &str,
        template: &str,
        args: &[String],
        env: &[(String, String)],
        level: &str,
    ) -> Relay {
        let port = super::free_port();
        let child = KillOnDrop::spawn_logged(
            relay_command()
                .args(["run", "--database-url", url])
                .args(["--topic-template", template, "--poll-interval", "20ms"])
                .args(["--http-addr", &format!("127.0.0.1:{port}")])
                .args(args)
                .envs(env.iter().map(|(k, v)| (k, v)))
                .env("OUTBOX_LOG", level)
                .stdout(Stdio::null()),
        );
        Relay { child, port }
    }

    /// What the relay logged so far.
    pub fn log(&self) -> String {
        self.child.log()
    }

    /// Waits until the log contains `needle`, or panics with the log after `timeout`.
    pub async fn wait_for_log(&self, needle: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while !self.log().contains(needle) {
            assert!(
                Instant::now() < deadline,
                "the relay did not log {needle:?} within {timeout:?}:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until the fixture's outbox is drained; on timeout, panics with the relay's log.
    pub async fn wait_until_drained(&self, f: &Fixture, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while f.backlog().await > 0 {
            assert!(
                Instant::now() < deadline,
                "{} events still unpublished after {timeout:?}; the relay's log:\n{}",
                f.backlog().await,
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until the log contains `needle` at least `count` times.
    pub async fn wait_for_log_count(&self, needle: &str, count: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while self.log().matches(needle).count() < count {
            assert!(
                Instant::now() < deadline,
                "the relay did not log {needle:?} {count} times within {timeout:?}:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Stops it with SIGTERM; returns its log.
    pub fn stop(mut self) -> String {
        assert_eq!(super::terminate(&mut self.child), Some(0), "{}", self.log());
        self.log()
    }
}

/// `bytes` in standard base64, with padding.
pub fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// `bytes` in base64url without padding, as JWTs are.
pub fn base64url(bytes: &[u8]) -> String {
    base64(bytes)
        .trim_end_matches('=')
        .replace('+', "-")
        .replace('/', "_")
}

/// An OpenID Connect provider on loopback, for the client-credentials flow: discovery
/// (`/.well-known/openid-configuration`, `/jwks`) and a token endpoint (`/token`) that checks the
/// client's id and secret (HTTP Basic) and issues `access_token`, or, without one, an unsecured JWT
/// for `subject` (which the test Kafka's OAUTHBEARER validator accepts). Returns the issuer URL and
/// how many tokens it issued.
pub async fn oidc_provider(
    client_id: &str,
    client_secret: &str,
    subject: &str,
    access_token: Option<String>,
) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    // With the trailing slash: URL parsers add it, and discovery compares issuers exactly.
    let issuer = format!("http://{}/", listener.local_addr().unwrap());
    let expected = format!(
        "Basic {}",
        base64(format!("{client_id}:{client_secret}").as_bytes())
    );
    let subject = subject.to_owned();
    let (client_id, client_secret) = (client_id.to_owned(), client_secret.to_owned());
    let issued = std::sync::Arc::new(AtomicUsize::new(0));
    let counter = issued.clone();
    let base = issuer.trim_end_matches('/').to_owned();
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            let mut request = Vec::new();
            let mut buf = [0u8; 4096];
            // Headers, then as much body as Content-Length says.
            while let Ok(n) = stream.read(&mut buf).await {
                if n == 0 {
                    break;
                }
                request.extend_from_slice(&buf[..n]);
                let text = String::from_utf8_lossy(&request).to_ascii_lowercase();
                if let Some(end) = text.find("\r\n\r\n") {
                    let length = text
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse::<usize>().ok())
                        .unwrap_or(0);
                    if request.len() >= end + 4 + length {
                        break;
                    }
                }
            }
            let text = String::from_utf8_lossy(&request);
            let path = text.split_whitespace().nth(1).unwrap_or("/").to_owned();
            // Client credentials as HTTP Basic (librdkafka) or in the form body (the pulsar crate).
            let form = text.split_once("\r\n\r\n").map_or("", |(_, body)| body);
            let in_form = form
                .split('&')
                .any(|p| p == format!("client_id={client_id}"))
                && form
                    .split('&')
                    .any(|p| p == format!("client_secret={client_secret}"));
            let authorized = in_form
                || text.lines().any(|line| {
                    line.split_once(':').is_some_and(|(name, value)| {
                        name.eq_ignore_ascii_case("authorization") && value.trim() == expected
                    })
                });
            let body = match path.as_str() {
                "/.well-known/openid-configuration" => Some(format!(
                    r#"{{"issuer":"{base}/","authorization_endpoint":"{base}/authorize","token_endpoint":"{base}/token","jwks_uri":"{base}/jwks","response_types_supported":["code"],"subject_types_supported":["public"],"id_token_signing_alg_values_supported":["RS256"]}}"#
                )),
                "/jwks" => Some(r#"{"keys":[]}"#.to_owned()),
                "/token" if authorized => {
                    counter.fetch_add(1, Ordering::Relaxed);
                    let token = access_token
                        .clone()
                        .unwrap_or_else(|| unsecured_jwt(&subject));
                    Some(format!(
                        r#"{{"access_token":"{token}","token_type":"Bearer","expires_in":3600}}"#
                    ))
                }
                _ => None,
            };
            let response = match body {
                Some(body) => format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                ),
                None => {
                    "HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                        .into()
                }
            };
            let _ = stream.write_all(response.as_bytes()).await;
        }
    });
    (issuer, issued)
}

/// A JWT with no signature (`alg: none`) for `subject`, valid for an hour.
fn unsecured_jwt(subject: &str) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    format!(
        "{}.{}.",
        base64url(br#"{"alg":"none"}"#),
        base64url(format!(r#"{{"sub":"{subject}","iat":{now},"exp":{}}}"#, now + 3600).as_bytes())
    )
}
