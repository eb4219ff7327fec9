//! Reading the container attribute `#[outbox(...)]`.

use proc_macro2::Span;
use syn::meta::ParseNestedMeta;
use syn::{Attribute, LitInt, LitStr, Path};

/// An attribute value with the span of its literal, for errors that point at it.
pub(crate) struct Spanned<T> {
    pub value: T,
    pub span: Span,
}

/// The parsed `#[outbox(...)]` attributes of one struct.
#[derive(Default)]
pub(crate) struct Container {
    pub aggregate: Option<Spanned<String>>,
    pub key: Option<Spanned<String>>,
    pub event_type: Option<Spanned<String>>,
    pub topic: Option<Spanned<String>>,
    pub table: Option<Spanned<String>>,
    pub version: Option<Spanned<i32>>,
    pub crate_path: Option<Path>,
    /// Names written by the user, valid or not: an invalid value already has its error, so
    /// [`crate::check`] must not also call the attribute missing.
    pub written: Vec<String>,
}

/// Parses every `#[outbox(...)]`, pushing all errors into `errors` rather than stopping at the
/// first, so the user sees them all in one compile.
pub(crate) fn parse_container(attrs: &[Attribute], errors: &mut Vec<syn::Error>) -> Container {
    let mut container = Container::default();
    for attr in attrs.iter().filter(|a| a.path().is_ident("outbox")) {
        if let Err(e) = attr.parse_nested_meta(|meta| parse_one(&mut container, &meta, errors)) {
            errors.push(e);
        }
    }
    container
}

const KNOWN: [&str; 7] = [
    "aggregate",
    "key",
    "event_type",
    "topic",
    "table",
    "version",
    "crate",
];

fn parse_one(
    c: &mut Container,
    meta: &ParseNestedMeta<'_>,
    errors: &mut Vec<syn::Error>,
) -> syn::Result<()> {
    let name = meta
        .path
        .get_ident()
        .map(ToString::to_string)
        .unwrap_or_default();
    if !KNOWN.contains(&name.as_str()) {
        errors.push(syn::Error::new_spanned(
            &meta.path,
            format!(
                "unknown outbox attribute `{}`; expected one of: {}",
                quote::ToTokens::to_token_stream(&meta.path),
                KNOWN.join(", ")
            ),
        ));
        // Skip its value, if any, so the attributes after it are still read.
        if meta.input.peek(syn::Token![=]) {
            meta.value()?.parse::<syn::Expr>()?;
        }
        return Ok(());
    }
    let Some(value) = value_expr(meta, &name, errors)? else {
        c.written.push(name);
        return Ok(());
    };
    if c.written.contains(&name) {
        errors.push(syn::Error::new_spanned(
            &meta.path,
            format!("duplicate outbox attribute `{name}`"),
        ));
        return Ok(());
    }
    c.written.push(name.clone());
    let stored = match name.as_str() {
        "aggregate" => string(&name, &value).map(|v| c.aggregate = Some(v)),
        "key" => string(&name, &value).map(|v| c.key = Some(v)),
        "event_type" => string(&name, &value).map(|v| c.event_type = Some(v)),
        "topic" => string(&name, &value).map(|v| c.topic = Some(v)),
        "table" => table(&value).map(|v| c.table = Some(v)),
        "version" => version(&value).map(|v| c.version = Some(v)),
        _ => crate_path(&value).map(|v| c.crate_path = Some(v)),
    };
    if let Err(e) = stored {
        errors.push(e);
    }
    Ok(())
}

/// The expression after `=`, or `None` (with an error pushed) when there is no `=`.
fn value_expr(
    meta: &ParseNestedMeta<'_>,
    name: &str,
    errors: &mut Vec<syn::Error>,
) -> syn::Result<Option<syn::Expr>> {
    if !meta.input.peek(syn::Token![=]) {
        errors.push(syn::Error::new_spanned(
            &meta.path,
            format!("`{name}` needs a value, as in `{name} = ...`"),
        ));
        return Ok(None);
    }
    Ok(Some(meta.value()?.parse()?))
}

/// `table = "..."`: a name `TableName::new` accepts (the same rules, checked here so that a bad
/// one is an error at the literal, not a failure when the first event is recorded).
fn table(value: &syn::Expr) -> syn::Result<Spanned<String>> {
    let table = string("table", value)?;
    let parts: Vec<&str> = table.value.split('.').collect();
    let reason = if parts.len() > 2 {
        Some("at most one `.`, between a schema and the table's name")
    } else if parts.iter().any(|p| p.is_empty()) {
        Some("an empty part")
    } else if parts
        .iter()
        .any(|p| p.starts_with(|c: char| c.is_ascii_digit()))
    {
        Some("a part starts with a digit")
    } else if !parts.iter().all(|p| {
        p.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    }) {
        Some("only lower-case ASCII letters, digits and `_`")
    } else if parts.last().is_some_and(|name| name.len() > 48) {
        Some("the name is longer than 48 characters")
    } else if parts.len() == 2 && parts[0].len() > 63 {
        Some("the schema is longer than 63 characters")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(syn::Error::new(
            table.span,
            format!(
                "`{}` is not an outbox table name: {reason} (as in `table = \"billing_outbox\"` \
                 or `table = \"billing.outbox\"`)",
                table.value
            ),
        )),
        None => Ok(table),
    }
}

fn string(name: &str, value: &syn::Expr) -> syn::Result<Spanned<String>> {
    let lit: LitStr = literal(value).ok_or_else(|| {
        syn::Error::new_spanned(
            value,
            format!("`{name}` expects a string, as in `{name} = \"...\"`"),
        )
    })?;
    if lit.value().trim().is_empty() {
        return Err(syn::Error::new(
            lit.span(),
            format!("`{name}` must not be empty"),
        ));
    }
    Ok(Spanned {
        value: lit.value(),
        span: lit.span(),
    })
}

fn version(value: &syn::Expr) -> syn::Result<Spanned<i32>> {
    let lit: LitInt = literal(value).ok_or_else(|| {
        syn::Error::new_spanned(value, "`version` expects an integer, as in `version = 2`")
    })?;
    match lit.base10_parse::<i32>() {
        Ok(v) if v >= 1 => Ok(Spanned {
            value: v,
            span: lit.span(),
        }),
        _ => Err(syn::Error::new(
            lit.span(),
            "`version` must be a positive integer that fits in i32",
        )),
    }
}

fn crate_path(value: &syn::Expr) -> syn::Result<Path> {
    let lit = string("crate", value)?;
    syn::parse_str::<Path>(&lit.value)
        .map_err(|_| syn::Error::new(lit.span, "`crate` must be a path such as \"seaorm_outbox\""))
}

fn literal<T: syn::parse::Parse>(value: &syn::Expr) -> Option<T> {
    syn::parse2(quote::ToTokens::to_token_stream(value)).ok()
}
