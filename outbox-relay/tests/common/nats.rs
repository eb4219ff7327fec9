//! Reading what actually reached NATS JetStream, as a consumer would.
//!
//! The server comes from `NATS_URL` and `OUTBOX_NATS_TOKEN`, which `scripts/services start nats`
//! sets (`scripts/test` does).

use super::Fixture;
use async_nats::jetstream::{self, stream};

/// The NATS server of the test run, or a panic that says how to get it.
pub fn url() -> String {
    std::env::var("NATS_URL").expect(
        "NATS_URL is not set: start the NATS server with `scripts/services start nats` \
         (scripts/test does)",
    )
}

/// The token the test server takes.
pub fn token() -> String {
    std::env::var("OUTBOX_NATS_TOKEN").expect("OUTBOX_NATS_TOKEN is not set (scripts/services)")
}

/// The second test server, which takes a user with a password and a user with an NKey.
pub fn users_url() -> String {
    std::env::var("OUTBOX_NATS_USERS_URL")
        .expect("OUTBOX_NATS_USERS_URL is not set (scripts/services start nats)")
}

/// The password of user `relay` on [`users_url`]'s server.
pub fn user_password() -> String {
    std::env::var("OUTBOX_NATS_USER_PASSWORD")
        .expect("OUTBOX_NATS_USER_PASSWORD is not set (scripts/services start nats)")
}

/// The NKey seed of the NKey user on [`users_url`]'s server.
pub fn nkey_seed() -> String {
    std::env::var("OUTBOX_NATS_NKEY_SEED")
        .expect("OUTBOX_NATS_NKEY_SEED is not set (scripts/services start nats)")
}

/// The third server, in operator mode (JWT authentication).
pub fn jwt_url() -> String {
    std::env::var("OUTBOX_NATS_JWT_URL")
        .expect("OUTBOX_NATS_JWT_URL is not set (scripts/services start nats)")
}

/// The credentials file of user `relay` on [`jwt_url`]'s server: its JWT and NKey seed.
pub fn credentials_file() -> std::path::PathBuf {
    std::env::var("OUTBOX_NATS_CREDS_FILE")
        .expect("OUTBOX_NATS_CREDS_FILE is not set (scripts/services start nats)")
        .into()
}

/// The relay binary's arguments to publish to the test server.
pub fn relay_args() -> Vec<String> {
    [
        "--sink",
        "nats",
        "--nats-url",
        &url(),
        "--nats-token",
        &token(),
    ]
    .map(String::from)
    .to_vec()
}

/// A JetStream stream taking `subjects`, named after the fixture.
pub async fn create_stream(f: &Fixture, subjects: Vec<String>) -> stream::Stream {
    let client = async_nats::ConnectOptions::with_token(token())
        .connect(url())
        .await
        .expect("connect to NATS");
    create_stream_with(client, f, subjects).await
}

/// [`create_stream`] on the server `client` is connected to.
pub async fn create_stream_with(
    client: async_nats::Client,
    f: &Fixture,
    subjects: Vec<String>,
) -> stream::Stream {
    jetstream::new(client)
        .create_stream(stream::Config {
            name: f.prefix.clone(),
            subjects,
            ..Default::default()
        })
        .await
        .expect("create the stream")
}

/// Every message of the stream, in stream order.
pub async fn stored(stream: &mut stream::Stream) -> Vec<jetstream::message::StreamMessage> {
    let last = stream
        .info()
        .await
        .expect("stream info")
        .state
        .last_sequence;
    let mut messages = Vec::new();
    for sequence in 1..=last {
        messages.push(stream.get_raw_message(sequence).await.expect("a message"));
    }
    messages
}

/// A header of a stored message.
pub fn header<'m>(m: &'m jetstream::message::StreamMessage, name: &str) -> Option<&'m str> {
    m.headers.get(name).map(|v| v.as_str())
}
