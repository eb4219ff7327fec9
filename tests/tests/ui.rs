//! Compile-time behaviour of `#[derive(OutboxEvent)]`: every misuse gets a spanned error
//! (`tests/ui/<case>.rs` with its expected `.stderr`), and the valid forms compile.
//!
//! The expected `.stderr` files were made with the rustc in `tests/ui/RUSTC_VERSION`; compiler
//! wording can change between releases. After checking a difference is only wording, regenerate them
//! with `TRYBUILD=overwrite cargo test -p outbox-tests --test ui` and update that file.

#[test]
fn ui() {
    let cases = trybuild::TestCases::new();
    cases.pass("tests/ui/pass/*.rs");
    cases.compile_fail("tests/ui/*.rs");
}
