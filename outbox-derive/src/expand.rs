//! Code generation. Generated code names everything through `<crate>::__private`, so users need
//! no dependency besides `seaorm_outbox`.

use crate::ast::Input;
use crate::check;
use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;

pub(crate) fn derive(input: &syn::DeriveInput) -> TokenStream {
    let mut errors = Vec::new();
    let parsed = Input::from_syn(input, &mut errors);
    let key_field = check::check(&parsed, &mut errors);
    let krate = parsed
        .attrs
        .crate_path
        .clone()
        .unwrap_or_else(|| syn::parse_quote!(::seaorm_outbox));

    let errors = errors.into_iter().reduce(|mut all, e| {
        all.combine(e);
        all
    });
    match (errors, key_field) {
        (None, Some(key)) => expand(&parsed, key, &krate),
        (errors, _) => {
            let errors = errors.map(|e| e.to_compile_error());
            // A stub impl stops the one real error from cascading into "trait not implemented"
            // errors wherever the type is used.
            let stub = stub(&parsed, &krate);
            quote! { #errors #stub }
        }
    }
}

fn expand(input: &Input<'_>, key: &crate::ast::Field<'_>, krate: &syn::Path) -> TokenStream {
    let ident = input.ident;
    let attrs = &input.attrs;
    let aggregate = &attrs.aggregate.as_ref().expect("checked").value;
    let event_type = attrs
        .event_type
        .as_ref()
        .map_or_else(|| ident.to_string(), |e| e.value.clone());
    let version = attrs.version.as_ref().map_or(1, |v| v.value);
    let topic = match &attrs.topic {
        Some(t) => {
            let t = &t.value;
            quote!(::core::option::Option::Some(#t))
        }
        None => quote!(::core::option::Option::None),
    };
    let table = match &attrs.table {
        Some(t) => {
            let t = &t.value;
            quote!(::core::option::Option::Some(#t))
        }
        None => quote!(::core::option::Option::None),
    };
    let key_ident = key.ident;
    // Spanned on the field's type, so "doesn't implement Display" points at it.
    let key_expr = quote_spanned! {key.ty.span()=>
        #krate::__private::aggregate_id_of(&self.#key_ident)
    };

    quote! {
        #[automatically_derived]
        impl #krate::OutboxEvent for #ident {
            const AGGREGATE_TYPE: &'static str = #aggregate;
            const EVENT_TYPE: &'static str = #event_type;
            const EVENT_VERSION: i32 = #version;
            const TOPIC: ::core::option::Option<&'static str> = #topic;
            const TABLE: ::core::option::Option<&'static str> = #table;

            fn aggregate_id(&self) -> #krate::__private::String {
                #key_expr
            }
        }

        const _: () = {
            #krate::__private::inventory::submit! {
                #krate::EventRegistration {
                    event_type: #event_type,
                    aggregate_type: #aggregate,
                    topic: #topic,
                    version: #version,
                    rust_type: ::core::concat!(::core::module_path!(), "::", ::core::stringify!(#ident)),
                }
            }
        };
    }
}

fn stub(input: &Input<'_>, krate: &syn::Path) -> TokenStream {
    // A generic type would need bounds we cannot guess, and serde cannot serialize a union, so a
    // stub for either would only add errors.
    let generic = !input.original.generics.params.is_empty();
    let union = matches!(input.original.data, syn::Data::Union(_));
    if generic || union {
        return TokenStream::new();
    }
    let ident = input.ident;
    quote! {
        impl #krate::OutboxEvent for #ident {
            const AGGREGATE_TYPE: &'static str = "";
            const EVENT_TYPE: &'static str = "";
            const EVENT_VERSION: i32 = 0;
            const TOPIC: ::core::option::Option<&'static str> = ::core::option::Option::None;
            fn aggregate_id(&self) -> #krate::__private::String {
                ::core::unreachable!("stub emitted beside a compile error")
            }
        }
    }
}
