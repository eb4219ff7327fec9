//! The generic `outbox-relay` binary. It knows no event types of yours: rows are routed by their
//! `topic` column or the topic template. Build your own three-line binary to link your events.

fn main() -> std::process::ExitCode {
    seaorm_outbox_relay::cli::main()
}
