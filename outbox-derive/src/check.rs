//! Checks across attributes and fields, after parsing.

use crate::ast::{Field, Input};
use quote::ToTokens;

/// Pushes an error for every rule the input breaks.
pub(crate) fn check<'a>(
    input: &'a Input<'a>,
    errors: &mut Vec<syn::Error>,
) -> Option<&'a Field<'a>> {
    let generics = &input.original.generics;
    if !generics.params.is_empty() {
        errors.push(syn::Error::new_spanned(
            &generics.params,
            "OutboxEvent cannot be derived for a generic struct: each event type is registered \
             once, under one concrete Rust type; define a concrete struct per event",
        ));
    }
    let is_struct_with_fields = matches!(&input.original.data, syn::Data::Struct(s)
        if matches!(s.fields, syn::Fields::Named(_)));
    let written = |name: &str| input.attrs.written.iter().any(|w| w == name);
    if !written("aggregate") {
        errors.push(missing(input, "aggregate", "aggregate = \"order\""));
    }
    match &input.attrs.key {
        None if written("key") => None,
        None => {
            errors.push(missing(input, "key", "key = \"order_id\""));
            None
        }
        Some(key) if is_struct_with_fields => {
            let found = input.fields.iter().find(|f| *f.ident == key.value.as_str());
            if found.is_none() {
                let names: Vec<String> = input.fields.iter().map(|f| f.ident.to_string()).collect();
                errors.push(syn::Error::new(
                    key.span,
                    format!(
                        "`key` names no field of `{}`: there is no field `{}` (fields: {})",
                        input.ident,
                        key.value,
                        if names.is_empty() {
                            "none".to_owned()
                        } else {
                            names.join(", ")
                        }
                    ),
                ));
            }
            found
        }
        Some(_) => None,
    }
}

fn missing(input: &Input<'_>, name: &str, example: &str) -> syn::Error {
    let span_source = input
        .original
        .attrs
        .iter()
        .find(|a| a.path().is_ident("outbox"))
        .map(ToTokens::to_token_stream)
        .unwrap_or_else(|| input.ident.to_token_stream());
    syn::Error::new_spanned(
        span_source,
        format!(
            "OutboxEvent on `{}` needs `#[outbox({example})]`: `{name}` is required",
            input.ident
        ),
    )
}
