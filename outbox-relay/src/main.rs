//! The generic `outbox-relay` binary. It knows no event types of yours: rows are routed by their
//! `topic` column or the topic template. Build your own three-line binary to link your events.

// glibc's malloc and free (with `malloc_consolidate`) were a quarter of the relay's CPU in a
// profile of a drain: each batch allocates and frees its rows and messages.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    seaorm_outbox_relay::cli::main()
}
