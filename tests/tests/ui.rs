//! Compile-time behaviour of `#[derive(OutboxEvent)]`: every misuse gets a spanned error
//! (`tests/ui/<case>.rs` with its expected `.stderr`), and the valid forms compile.
//!
//! The expected `.stderr` files were made with the rustc in `tests/ui/RUSTC_VERSION`; compiler
//! wording can change between releases. After checking a difference is only wording, regenerate them
//! with `TRYBUILD=overwrite cargo test -p outbox-tests --test ui` and update that file.

#[test]
fn ui() {
    // On another compiler a failure may be only its wording: say so next to trybuild's diff.
    let made_with = std::fs::read_to_string("tests/ui/RUSTC_VERSION").expect("RUSTC_VERSION");
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let running = std::process::Command::new(rustc)
        .arg("--version")
        .output()
        .map(|out| String::from_utf8_lossy(&out.stdout).into_owned())
        .unwrap_or_default();
    if running.trim() != made_with.trim() {
        eprintln!(
            "note: the expected messages were made with {}; this is {}: a difference below may be \
             only the compiler's wording (see the top of tests/ui.rs)",
            made_with.trim(),
            running.trim()
        );
    }
    let cases = trybuild::TestCases::new();
    cases.pass("tests/ui/pass/*.rs");
    cases.compile_fail("tests/ui/*.rs");
}
