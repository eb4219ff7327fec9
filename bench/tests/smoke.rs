//! The harness's smoke mode runs with the tests, so it cannot rot. Its numbers are not asserted.

#[test]
fn the_benchmark_harness_runs_end_to_end() {
    let json = std::env::temp_dir().join(format!("outbox-bench-smoke-{}.json", std::process::id()));
    let relay =
        std::path::Path::new(env!("CARGO_BIN_EXE_outbox-bench")).with_file_name("outbox-relay");
    assert!(
        relay.exists(),
        "{} is missing: build the workspace first (scripts/test does)",
        relay.display()
    );
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_outbox-bench"))
        .args(["--smoke", "--json"])
        .arg(&json)
        .arg("--relay-bin")
        .arg(&relay)
        .output()
        .expect("run outbox-bench");
    assert!(
        output.status.success(),
        "outbox-bench --smoke failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let table = String::from_utf8(output.stdout).unwrap();
    for section in [
        "Draining a backlog",
        "Latency",
        "record()",
        "The relay binary",
        "Pulsar",
        "The WAL source",
        "Debezium's Kafka Connect worker",
        "As users run it",
        "Other sinks",
    ] {
        assert!(
            table.contains(section),
            "the report lacks {section}:\n{table}"
        );
    }
    let results: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(results["smoke"], true);
    assert!(
        results["drain"][0]["relay"][0]["events_per_second"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    assert!(results["relay_binary"]["peak_rss_mib"].as_f64().unwrap() > 0.0);
    assert!(results["pulsar"]["relay"].as_f64().unwrap() > 0.0);
    // MariaDB: the relay and both null pipelines (bare, and with the contract's headers) drained.
    let mariadb = &results["mariadb"]["drain"][0];
    for run in [
        "raw_sql",
        "pipelined_null_pipeline",
        "pipelined_null_pipeline_with_headers",
        "relay",
    ] {
        assert!(mariadb[run][0].as_f64().unwrap() > 0.0, "{run}: {mariadb}");
    }
    // NATS, RabbitMQ and SQS: each raw client and the relay (mark and delete mode) drained, with
    // the CPU the publisher, PostgreSQL and the broker used (a few clock ticks in a smoke run, so
    // only their presence is asserted: the broker's is missing when its process is not found).
    let sinks = results["sinks"].as_array().unwrap();
    assert_eq!(sinks.len(), 3, "{sinks:?}");
    for sink in sinks {
        for run in ["raw_client", "relay", "relay_delete", "relay_no_broker"] {
            assert!(
                sink[run]["per_second"].as_f64().unwrap() > 0.0,
                "{run}: {sink}"
            );
            assert!(sink[run]["cores_busy"].is_f64(), "{run}: {sink}");
        }
        for run in ["raw_client", "relay", "relay_delete"] {
            assert!(
                sink[run]["broker_cpu_us_per_event"].is_f64(),
                "{run}: the broker's CPU: {sink}"
            );
        }
    }
    // Both WAL backlogs and Debezium's drained.
    let wal_drains = results["wal_drain"].as_array().unwrap();
    assert_eq!(wal_drains.len(), 3, "{wal_drains:?}");
    assert!(
        wal_drains
            .iter()
            .all(|d| d["events_per_second"].as_f64().unwrap() > 0.0)
    );
    assert!(results["debezium_worker"]["peak_rss_mib"].as_f64().unwrap() > 0.0);
    // The binary's drains, the null WAL pipeline and Debezium, each counted on its topic.
    let as_run = results["as_run"].as_array().unwrap();
    assert_eq!(as_run.len(), 6, "{as_run:?}");
    assert!(
        as_run
            .iter()
            .all(|d| d["events_per_second"].as_f64().unwrap() > 0.0)
    );
}
