//! The shop's relay: `outbox-relay`, knowing the shop's event types and their topics.

// The linker drops a crate nothing references, and its event registrations with it.
use shop_events as _;

fn main() -> std::process::ExitCode {
    seaorm_outbox_relay::cli::main()
}
