//! `#[derive(OutboxEvent)]`: the derive macro of the [seaorm-outbox] crate.
//!
//! Use it through `seaorm_outbox`, which re-exports it under the trait's name:
//!
//! ```
//! use seaorm_outbox::OutboxEvent;
//!
//! #[derive(serde::Serialize, OutboxEvent)]
//! #[outbox(aggregate = "order", key = "order_id")]
//! struct OrderCreated { order_id: u64, total_cents: i64 }
//! ```
//!
//! The crate is laid out like serde's derive: `ast.rs` parses the input, `attr.rs` reads the
//! `#[outbox(...)]` attributes, `check.rs` validates them together, and `expand.rs` generates code.
//! Every attribute error of an input is reported at once, each spanned on its token.
//!
//! [seaorm-outbox]: https://docs.rs/seaorm-outbox

mod ast;
mod attr;
mod check;
mod expand;

use proc_macro::TokenStream;

/// Derives `seaorm_outbox::OutboxEvent`; see the `seaorm_outbox` documentation for the attributes.
#[proc_macro_derive(OutboxEvent, attributes(outbox))]
pub fn derive_outbox_event(input: TokenStream) -> TokenStream {
    let input = syn::parse_macro_input!(input as syn::DeriveInput);
    expand::derive(&input).into()
}
