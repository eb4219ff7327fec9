//! `outbox-relay routes`: the event types linked into this binary, and their topics.

use super::settings::Settings;
use crate::routing::Router;
use std::process::ExitCode;

pub(super) fn routes(settings: &Settings) -> ExitCode {
    let template = settings.topic_template();
    let router = Router::new(&template, false);
    let mut routes: Vec<_> = router.registered().collect();
    routes.sort_by_key(|r| r.event_type);
    if routes.is_empty() {
        println!(
            "no event types are linked into this binary: every event goes to its row's topic or to {template}"
        );
        return ExitCode::SUCCESS;
    }
    println!(
        "{:<28} {:<16} {:>7}  {:<32} RUST TYPE",
        "EVENT TYPE", "AGGREGATE", "VERSION", "TOPIC"
    );
    for r in routes {
        let topic = router
            .topic_for(r.aggregate_type, r.event_type, None)
            .unwrap_or_else(|reason| reason);
        println!(
            "{:<28} {:<16} {:>7}  {:<32} {}",
            r.event_type, r.aggregate_type, r.version, topic, r.rust_type
        );
    }
    ExitCode::SUCCESS
}
