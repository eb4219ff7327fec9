//! An HTTP receiver for the webhook sink's tests: an axum server on a free loopback port that
//! answers as it is told and records every request.

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode, Uri};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A request the receiver got, and when it started and was answered.
#[derive(Debug, Clone)]
pub struct Call {
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub started: Instant,
    pub answered: Instant,
    pub status: u16,
}

impl Call {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap()
    }
}

/// How the receiver answers a request: status, extra headers, body, and how long it takes.
pub type Answer =
    Arc<dyn Fn(&Call, usize) -> (u16, Vec<(&'static str, String)>, String, Duration) + Send + Sync>;

/// An HTTP receiver on a free loopback port, recording every request.
pub struct Receiver {
    port: u16,
    calls: Arc<Mutex<Vec<Call>>>,
}

impl Receiver {
    /// Starts a receiver answering with `answer` (given the request and how many came before).
    pub async fn start(answer: Answer) -> Receiver {
        let calls: Arc<Mutex<Vec<Call>>> = Arc::default();
        let seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let app = axum::Router::new().fallback({
            let calls = calls.clone();
            move |uri: Uri, headers: HeaderMap, body: Bytes| {
                let (calls, answer, seen) = (calls.clone(), answer.clone(), seen.clone());
                async move {
                    let mut call = Call {
                        path: uri.path().to_owned(),
                        headers: headers
                            .iter()
                            .map(|(n, v)| (n.to_string(), v.to_str().unwrap_or("").to_owned()))
                            .collect(),
                        body: body.to_vec(),
                        started: Instant::now(),
                        answered: Instant::now(),
                        status: 0,
                    };
                    let before = seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let (status, extra, text, delay) = answer(&call, before);
                    tokio::time::sleep(delay).await;
                    call.answered = Instant::now();
                    call.status = status;
                    calls.lock().unwrap().push(call);
                    let mut response = axum::response::Response::new(axum::body::Body::from(text));
                    *response.status_mut() = StatusCode::from_u16(status).unwrap();
                    for (name, value) in extra {
                        response.headers_mut().insert(name, value.parse().unwrap());
                    }
                    response
                }
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Receiver { port, calls }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}/hooks/{{topic}}", self.port)
    }

    pub fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    /// The requests answered 2xx.
    pub fn delivered(&self) -> Vec<Call> {
        self.calls()
            .into_iter()
            .filter(|c| (200..300).contains(&c.status))
            .collect()
    }
}

/// Answers 200 after `delay`.
pub fn ok_after(delay: Duration) -> Answer {
    Arc::new(move |_, _| (200, vec![], String::new(), delay))
}

/// The signing secret the tests give the relay.
pub const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

/// The relay binary's arguments to post to `receiver`, signing with [`SECRET`] from a file.
pub fn relay_args(receiver: &Receiver) -> Vec<String> {
    let secret = outbox_tests::temp_dir().join("webhook-secret");
    std::fs::write(&secret, SECRET).unwrap();
    vec![
        "--sink".into(),
        "webhook".into(),
        "--webhook-url".into(),
        receiver.url(),
        "--webhook-secret-file".into(),
        secret.display().to_string(),
    ]
}
