//! HTTP webhooks: one signed POST per event, through `reqwest`, under the Standard Webhooks
//! specification (<https://www.standardwebhooks.com>).
//!
//! Each event is POSTed to the URL template with `{topic}` replaced by its routed topic. The body
//! is the event's JSON as recorded (`content-type: application/json`); the headers are
//! `webhook-id` = the event id (the receiver's idempotency key), `webhook-timestamp` (Unix
//! seconds) and `webhook-signature` = `v1,` and the base64 HMAC-SHA256 of `id.timestamp.body` under
//! the secret (`whsec_…`), then the contract's headers and `aggregate_id`.
//!
//! An aggregate's next event is POSTed only after the previous one was answered 2xx, so a receiver
//! gets each aggregate's events one at a time, in order; different aggregates go out concurrently.
//! What the receiver answers:
//! - 2xx: delivered;
//! - 408, 429, 5xx, or no answer in time: retried after a backoff, no sooner than its
//!   `Retry-After` (in seconds or as an HTTP date);
//! - 401 and 403: the receiver refuses the relay (its secret or credentials), not the event: rows
//!   untouched, `/readyz` says so; as when the receiver cannot be reached at all;
//! - any other status: parked with the status and the first bytes of the body as the reason.

use super::{Ack, Message, Sink, SinkError};
use base64::Engine;
use futures::future::{BoxFuture, FutureExt, Shared};
use hmac::{Hmac, Mac};
use seaorm_outbox::Secret;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{Semaphore, oneshot};

/// The webhook sink's settings.
///
/// ```
/// use seaorm_outbox::Secret;
/// use seaorm_outbox_relay::sink::webhook::WebhookConfig;
///
/// let config = WebhookConfig::new(
///     "https://hooks.example.com/events/{topic}",
///     Secret::new("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"),
/// );
/// let printed = format!("{config:?}");
/// assert!(!printed.contains("MfKQ9r8"), "{printed}");
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct WebhookConfig {
    /// Where each event is POSTed; `{topic}` is replaced by the event's routed topic. A secret:
    /// such URLs often carry a token.
    pub url_template: Secret,
    /// The signing secret: `whsec_` and the base64 of the key, as Standard Webhooks give it to the
    /// receiver.
    pub secret: Secret,
    /// How long a request may take, from connecting to the end of the answer.
    pub timeout: Duration,
    /// How many requests may be open at once.
    pub max_concurrent: usize,
    /// PEM file of the certificate authorities trusted for the receiver's certificate (https);
    /// without it, the system's.
    pub tls_ca_file: Option<PathBuf>,
}

impl WebhookConfig {
    /// A configuration POSTing to `url_template`, signed with `secret`.
    pub fn new(url_template: impl Into<String>, secret: Secret) -> Self {
        WebhookConfig {
            url_template: Secret::new(url_template),
            secret,
            timeout: Duration::from_secs(10),
            max_concurrent: 64,
            tls_ca_file: None,
        }
    }
}

/// POSTs events to a webhook receiver (see the module's documentation).
pub struct WebhookSink {
    client: reqwest::Client,
    url_template: String,
    key: Arc<Vec<u8>>,
    /// Bounds the requests open at once.
    open: Arc<Semaphore>,
    /// The last request of each aggregate still in flight: the next one waits for its answer.
    chains: Arc<Mutex<Chains>>,
    /// Why the receiver last refused the relay, until a request goes through.
    refused: Arc<Mutex<Option<String>>>,
}

/// Each aggregate's last request in flight, with a number telling requests apart.
#[derive(Default)]
struct Chains {
    next: u64,
    last: HashMap<String, (u64, Delivered)>,
}

/// Resolves to whether a request was answered 2xx.
type Delivered = Shared<BoxFuture<'static, bool>>;

impl WebhookSink {
    /// A sink for `config`. Fails on a secret that is not `whsec_` and base64, or a CA file that
    /// cannot be read.
    pub fn new(config: &WebhookConfig) -> Result<Self, SinkError> {
        let key = signing_key(config.secret.expose())?;
        let mut client = reqwest::Client::builder()
            .timeout(config.timeout)
            .user_agent("outbox-relay");
        if let Some(path) = &config.tls_ca_file {
            let pem = std::fs::read(path).map_err(|e| {
                SinkError::unavailable(format!("webhook CA file {}: {e}", path.display()))
            })?;
            for certificate in reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| {
                SinkError::unavailable(format!("webhook CA file {}: {e}", path.display()))
            })? {
                client = client.add_root_certificate(certificate);
            }
        }
        let client = client
            .build()
            .map_err(|e| SinkError::unavailable(format!("webhook client: {e}")))?;
        Ok(WebhookSink {
            client,
            url_template: config.url_template.expose().to_owned(),
            key: Arc::new(key),
            open: Arc::new(Semaphore::new(config.max_concurrent.max(1))),
            chains: Arc::new(Mutex::new(Chains::default())),
            refused: Arc::new(Mutex::new(None)),
        })
    }
}

/// The HMAC key of a Standard Webhooks secret (`whsec_` and base64).
fn signing_key(secret: &str) -> Result<Vec<u8>, SinkError> {
    let encoded = secret.strip_prefix("whsec_").unwrap_or(secret);
    base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .map_err(|_| {
            SinkError::unavailable(
                "the webhook secret must be `whsec_` and the base64 of the key".to_owned(),
            )
        })
}

/// The `webhook-signature` of a message: `v1,` and the base64 HMAC-SHA256 of `id.timestamp.body`.
fn signature(key: &[u8], id: &str, timestamp: u64, body: &[u8]) -> String {
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(key).expect("HMAC takes keys of any size");
    mac.update(id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    let digest = mac.finalize().into_bytes();
    format!(
        "v1,{}",
        base64::engine::general_purpose::STANDARD.encode(digest)
    )
}

/// Sorts a receiver's answer.
fn classify(status: reqwest::StatusCode, retry_after: Option<Duration>, body: &str) -> SinkError {
    let said: String = body.chars().take(200).collect();
    let reason = format!("HTTP {status}: {said}");
    match status.as_u16() {
        401 | 403 => {
            SinkError::unavailable(format!("the webhook receiver refuses the relay: {reason}"))
        }
        408 | 429 | 500..=599 => {
            let error = SinkError::new(reason);
            match retry_after {
                Some(after) => error.with_retry_after(after),
                None => error,
            }
        }
        _ => SinkError::permanent(reason),
    }
}

/// A `Retry-After`: seconds, or an HTTP date (`Wed, 21 Oct 2015 07:28:00 GMT`), which is read
/// against `now` (a date past is no wait at all).
fn retry_after(
    headers: &reqwest::header::HeaderMap,
    now: chrono::DateTime<chrono::Utc>,
) -> Option<Duration> {
    let value = headers
        .get(reqwest::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let date = chrono::DateTime::parse_from_rfc2822(value).ok()?;
    Some((date.to_utc() - now).to_std().unwrap_or_default())
}

/// The request for `message`, or why it can never be sent.
fn request(
    client: &reqwest::Client,
    url_template: &str,
    key: &[u8],
    message: &Message,
) -> Result<reqwest::RequestBuilder, SinkError> {
    let url = url_template.replace("{topic}", &message.topic);
    let id = message.event_id.to_string();
    let timestamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    let mut headers = reqwest::header::HeaderMap::new();
    let mut add = |name: &str, value: &str| -> Result<(), SinkError> {
        let name = reqwest::header::HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
            SinkError::permanent(format!("header `{name}` is not an HTTP header name"))
        })?;
        let value = reqwest::header::HeaderValue::from_str(value).map_err(|_| {
            SinkError::permanent(format!("header `{name}` has a value HTTP cannot carry"))
        })?;
        headers.insert(name, value);
        Ok(())
    };
    add("content-type", "application/json")?;
    for (name, value) in &message.headers {
        add(name, value)?;
    }
    add("aggregate_id", &message.key)?;
    add("webhook-id", &id)?;
    add("webhook-timestamp", &timestamp.to_string())?;
    add(
        "webhook-signature",
        &signature(key, &id, timestamp, &message.payload),
    )?;
    Ok(client
        .post(url)
        .headers(headers)
        .body(message.payload.clone()))
}

impl Sink for WebhookSink {
    fn name(&self) -> &str {
        "webhook"
    }

    /// Starts the event's request (after its aggregate's previous one is answered 2xx) and
    /// returns its answer as the acknowledgement.
    fn enqueue<'a>(&'a self, message: &'a Message) -> BoxFuture<'a, Result<Ack, SinkError>> {
        async move {
            let request = request(&self.client, &self.url_template, &self.key, message)?;
            let permit = self
                .open
                .clone()
                .acquire_owned()
                .await
                .map_err(|_| SinkError::new("the webhook sink is closed"))?;
            let (done, delivered) = oneshot::channel::<bool>();
            let delivered: Delivered = async move { delivered.await.unwrap_or(false) }
                .boxed()
                .shared();
            let (number, previous) = {
                let mut chains = self.chains.lock().unwrap_or_else(|e| e.into_inner());
                chains.next += 1;
                let number = chains.next;
                let previous = chains
                    .last
                    .insert(message.key.clone(), (number, delivered))
                    .map(|(_, previous)| previous);
                (number, previous)
            };
            let (chains, refused, key) = (
                self.chains.clone(),
                self.refused.clone(),
                message.key.clone(),
            );
            let answer = tokio::spawn(async move {
                let _permit = permit;
                let before_delivered = match previous {
                    Some(previous) => previous.await,
                    None => true,
                };
                let result = if before_delivered {
                    send(request, &refused).await
                } else {
                    Err(SinkError::new(
                        "an earlier event of its aggregate was not delivered",
                    ))
                };
                let _ = done.send(result.is_ok());
                let mut chains = chains.lock().unwrap_or_else(|e| e.into_inner());
                if chains.last.get(&key).is_some_and(|(n, _)| *n == number) {
                    chains.last.remove(&key);
                }
                result
            });
            let ack: Ack = async move {
                answer
                    .await
                    .unwrap_or_else(|e| Err(SinkError::new(format!("the request failed: {e}"))))
            }
            .boxed();
            Ok(ack)
        }
        .boxed()
    }

    /// Not ready while the receiver refuses the relay or cannot be reached (as the last request
    /// found).
    fn ready(&self) -> BoxFuture<'_, Result<(), SinkError>> {
        let refused = self
            .refused
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        futures::future::ready(refused.map_or(Ok(()), |reason| Err(SinkError::unavailable(reason))))
            .boxed()
    }

    /// The HTTP protocol binding's prefix for CloudEvents' headers.
    fn cloudevents_prefix(&self) -> &str {
        "ce-"
    }
}

/// Sends one request and sorts its answer; remembers a refusal for `/readyz`.
async fn send(
    request: reqwest::RequestBuilder,
    refused: &Mutex<Option<String>>,
) -> Result<(), SinkError> {
    let result = match request.send().await {
        Ok(response) if response.status().is_success() => Ok(()),
        Ok(response) => {
            let status = response.status();
            let after = retry_after(response.headers(), chrono::Utc::now());
            let body = response.text().await.unwrap_or_default();
            Err(classify(status, after, &body))
        }
        // Never reached the receiver: not the event's fault.
        Err(e) if e.is_connect() => Err(SinkError::unavailable(format!(
            "cannot reach the webhook receiver: {}",
            without_url(&e)
        ))),
        Err(e) => Err(SinkError::new(format!(
            "webhook request: {}",
            without_url(&e)
        ))),
    };
    let mut refused = refused.lock().unwrap_or_else(|e| e.into_inner());
    *refused = match &result {
        Err(e) if e.is_unavailable() => Some(e.message.clone()),
        _ => None,
    };
    result
}

/// A request's error without its URL, which may carry credentials (`https://user:token@…`).
fn without_url(e: &reqwest::Error) -> String {
    let mut text = e.to_string();
    if let Some(url) = e.url() {
        text = text.replace(url.as_str(), &crate::redact::redact_url(url.as_str()));
    }
    // The cause says what happened (refused, timed out, certificate).
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The signature example of the Standard Webhooks specification's reference libraries.
    #[test]
    fn signatures_are_the_standard_ones() {
        let key = signing_key("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        assert_eq!(
            signature(
                &key,
                "msg_p5jXN8AQM9LWM0D4loKWxJek",
                1614265330,
                br#"{"test": 2432232314}"#
            ),
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
        );
    }

    #[test]
    fn retry_after_is_read_in_seconds_and_as_an_http_date() {
        let now = chrono::DateTime::parse_from_rfc3339("2015-10-21T07:27:53Z")
            .unwrap()
            .to_utc();
        let read = |value: &str| {
            let mut headers = reqwest::header::HeaderMap::new();
            headers.insert(reqwest::header::RETRY_AFTER, value.parse().unwrap());
            retry_after(&headers, now)
        };
        assert_eq!(read("120"), Some(Duration::from_secs(120)));
        assert_eq!(
            read("Wed, 21 Oct 2015 07:28:00 GMT"),
            Some(Duration::from_secs(7))
        );
        assert_eq!(read("Wed, 21 Oct 2015 07:00:00 GMT"), Some(Duration::ZERO));
        assert_eq!(read("soon"), None);
        assert_eq!(retry_after(&reqwest::header::HeaderMap::new(), now), None);
    }

    #[test]
    fn answers_are_sorted_as_the_relay_acts_on_them() {
        use reqwest::StatusCode as S;
        let after = Some(Duration::from_secs(7));
        let busy = classify(S::TOO_MANY_REQUESTS, after, "slow down");
        assert_eq!((busy.is_permanent(), busy.retry_after), (false, after));
        assert!(!classify(S::SERVICE_UNAVAILABLE, None, "").is_permanent());
        assert!(!classify(S::REQUEST_TIMEOUT, None, "").is_permanent());
        assert!(classify(S::UNAUTHORIZED, None, "bad signature").is_unavailable());
        let bad = classify(S::UNPROCESSABLE_ENTITY, None, &"x".repeat(1000));
        assert!(bad.is_permanent());
        assert!(
            bad.message
                .starts_with("HTTP 422 Unprocessable Entity: xxx"),
            "{}",
            bad.message
        );
        assert!(bad.message.len() < 260, "the body is cut: {}", bad.message);
        assert!(
            signing_key("whsec_not base64!")
                .unwrap_err()
                .is_unavailable()
        );
    }
}
