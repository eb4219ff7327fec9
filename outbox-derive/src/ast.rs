//! The derive input reduced to what the macro needs: a struct with named fields.

use crate::attr::{self, Container};
use syn::{Data, DeriveInput, Fields, Ident, Type};

/// A struct the derive accepts.
pub(crate) struct Input<'a> {
    pub ident: &'a Ident,
    pub attrs: Container,
    pub fields: Vec<Field<'a>>,
    pub original: &'a DeriveInput,
}

pub(crate) struct Field<'a> {
    pub ident: &'a Ident,
    pub ty: &'a Type,
}

impl<'a> Input<'a> {
    /// Parses the input, pushing every problem found into `errors`.
    pub fn from_syn(input: &'a DeriveInput, errors: &mut Vec<syn::Error>) -> Input<'a> {
        let attrs = attr::parse_container(&input.attrs, errors);
        let fields = match &input.data {
            Data::Struct(data) => match &data.fields {
                Fields::Named(named) => named
                    .named
                    .iter()
                    .map(|f| Field {
                        ident: f.ident.as_ref().expect("named field"),
                        ty: &f.ty,
                    })
                    .collect(),
                Fields::Unnamed(_) => {
                    errors.push(syn::Error::new_spanned(
                        &input.ident,
                        "OutboxEvent needs a struct with named fields: `key` names the field \
                         that holds the aggregate id; tuple structs have none",
                    ));
                    Vec::new()
                }
                Fields::Unit => {
                    errors.push(syn::Error::new_spanned(
                        &input.ident,
                        "OutboxEvent needs a struct with named fields: `key` names the field \
                         that holds the aggregate id; a unit struct has none",
                    ));
                    Vec::new()
                }
            },
            Data::Enum(data) => {
                errors.push(syn::Error::new_spanned(
                    data.enum_token,
                    "OutboxEvent can only be derived for structs, not enums: derive it on one \
                     struct per event type",
                ));
                Vec::new()
            }
            Data::Union(data) => {
                errors.push(syn::Error::new_spanned(
                    data.union_token,
                    "OutboxEvent can only be derived for structs, not unions",
                ));
                Vec::new()
            }
        };
        Input {
            ident: &input.ident,
            attrs,
            fields,
            original: input,
        }
    }
}
