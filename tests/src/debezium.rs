//! Kafka Connect with Debezium, as `scripts/services start debezium` runs it: the deployed
//! connector (`deploy/debezium/outbox-connector.json`) pointed at one schema's outbox table, through
//! the worker's REST API. Shared by the end-to-end test and the benchmark.

use std::process::Command;

/// The deployed connector config, as committed.
pub const DEPLOYED: &str = include_str!("../../deploy/debezium/outbox-connector.json");

/// The worker's REST API, from `OUTBOX_DEBEZIUM_URL`; panics with how to start it.
pub fn url() -> String {
    std::env::var("OUTBOX_DEBEZIUM_URL").expect(
        "OUTBOX_DEBEZIUM_URL is not set: start Kafka Connect with Debezium by \
         `scripts/services start debezium` (scripts/test and scripts/bench do)",
    )
}

/// The worker's process id, from `OUTBOX_DEBEZIUM_PID`, for its CPU time and memory.
pub fn pid() -> Option<u32> {
    std::env::var("OUTBOX_DEBEZIUM_PID").ok()?.parse().ok()
}

/// `method path` on the worker through curl: the status code and the body.
pub fn rest(method: &str, path: &str, body: Option<&serde_json::Value>) -> (u16, String) {
    let mut curl = Command::new("curl");
    curl.args(["-s", "-X", method, "-w", "\n%{http_code}"])
        .arg(format!("{}{path}", url()));
    if let Some(body) = body {
        curl.args(["-H", "Content-Type: application/json", "--data-binary"])
            .arg(body.to_string());
    }
    let output = curl.output().expect("curl (scripts/setup installs it)");
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (code.trim().parse().unwrap_or(0), body.to_owned())
}

/// The deployed connector on `schema.outbox`, its slot, publication and topic prefix all named
/// `name`, its topics `name.<aggregate_type>`.
pub fn config(schema: &str, name: &str) -> serde_json::Value {
    let deployed: serde_json::Value =
        serde_json::from_str(DEPLOYED).expect("deploy/debezium/outbox-connector.json is JSON");
    let mut config = deployed["config"].clone();
    for (key, value) in [
        ("topic.prefix", name.to_owned()),
        ("table.include.list", format!("{schema}.outbox")),
        ("slot.name", name.to_owned()),
        ("publication.name", name.to_owned()),
        (
            "transforms.outbox.route.topic.replacement",
            format!("{name}.${{routedByValue}}"),
        ),
    ] {
        assert!(config.get(key).is_some(), "the deployed config sets {key}");
        config[key] = value.into();
    }
    config
}

/// Creates (or replaces) connector `name` with `config`.
pub fn put(name: &str, config: &serde_json::Value) {
    let (code, body) = rest("PUT", &format!("/connectors/{name}/config"), Some(config));
    assert!(
        code == 200 || code == 201,
        "creating connector {name}: {code} {body}"
    );
}

/// The state of the connector's task (`RUNNING`, `PAUSED`, `FAILED`, ...), and the whole status.
pub fn task_state(name: &str) -> (String, serde_json::Value) {
    let (_, body) = rest("GET", &format!("/connectors/{name}/status"), None);
    let status: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    let state = status["tasks"][0]["state"]
        .as_str()
        .unwrap_or("")
        .to_owned();
    assert_ne!(
        state, "FAILED",
        "the Debezium task failed: {}",
        status["tasks"][0]["trace"]
    );
    (state, status)
}

/// Stops connector `name`: its task shuts down and releases the slot, which keeps the WAL.
/// (Pausing would not: a paused Debezium task stays connected to its slot.)
pub fn stop(name: &str) {
    expect_success(
        "stop",
        rest("PUT", &format!("/connectors/{name}/stop"), None),
    );
}

/// Resumes connector `name` after [`stop`].
pub fn resume(name: &str) {
    expect_success(
        "resume",
        rest("PUT", &format!("/connectors/{name}/resume"), None),
    );
}

/// Deletes connector `name` (its slot and publication stay: drop them after its task stopped).
pub fn delete(name: &str) {
    let (code, body) = rest("DELETE", &format!("/connectors/{name}"), None);
    if code != 404 {
        expect_success("delete", (code, body));
    }
}

fn expect_success(action: &str, (code, body): (u16, String)) {
    assert!(
        (200..300).contains(&code),
        "{action} connector: {code} {body}"
    );
}
