//! Reading the container attribute `#[outbox(...)]`.

use proc_macro2::Span;
use syn::{Attribute, LitInt, LitStr, Path};

/// A string attribute value with the span of its literal, for errors that point at it.
pub(crate) struct Spanned<T> {
    pub value: T,
    pub span: Span,
}

/// The parsed `#[outbox(...)]` attributes of one struct. Absent ones are `None`;
/// [`crate::check`] decides which absences are errors.
#[derive(Default)]
pub(crate) struct Container {
    pub aggregate: Option<Spanned<String>>,
    pub key: Option<Spanned<String>>,
    pub event_type: Option<Spanned<String>>,
    pub topic: Option<Spanned<String>>,
    pub version: Option<Spanned<i32>>,
    pub crate_path: Option<Path>,
}

/// Collects every error into `errors` rather than stopping at the first, so the user sees all of
/// them in one compile.
pub(crate) fn parse_container(attrs: &[Attribute], errors: &mut Vec<syn::Error>) -> Container {
    let mut container = Container::default();
    for attr in attrs.iter().filter(|a| a.path().is_ident("outbox")) {
        let result = attr.parse_nested_meta(|meta| {
            let path = &meta.path;
            let name = path
                .get_ident()
                .map(ToString::to_string)
                .unwrap_or_default();
            match name.as_str() {
                "aggregate" => set_string(&mut container.aggregate, &meta, "aggregate", errors),
                "key" => set_string(&mut container.key, &meta, "key", errors),
                "event_type" => set_string(&mut container.event_type, &meta, "event_type", errors),
                "topic" => set_string(&mut container.topic, &meta, "topic", errors),
                "version" => {
                    let lit: LitInt =
                        parse_value(&meta, "version", "an integer, as in `version = 2`")?;
                    let value = match lit.base10_parse::<i32>() {
                        Ok(v) if v >= 1 => v,
                        _ => {
                            errors.push(syn::Error::new(
                                lit.span(),
                                "`version` must be a positive integer that fits in i32",
                            ));
                            return Ok(());
                        }
                    };
                    set_once(
                        &mut container.version,
                        Spanned {
                            value,
                            span: lit.span(),
                        },
                        path,
                        errors,
                    );
                    Ok(())
                }
                "crate" => {
                    let lit: LitStr = parse_value(
                        &meta,
                        "crate",
                        "a string path, as in `crate = \"my_outbox\"`",
                    )?;
                    match lit.parse::<Path>() {
                        Ok(p) if container.crate_path.is_none() => container.crate_path = Some(p),
                        Ok(_) => errors.push(duplicate(path)),
                        Err(_) => errors.push(syn::Error::new(
                            lit.span(),
                            "`crate` must be a path such as \"outbox_core\"",
                        )),
                    }
                    Ok(())
                }
                _ => {
                    // Skip the value, if any, so parsing resumes at the next attribute.
                    if meta.input.peek(syn::Token![=]) {
                        let _: syn::Expr = meta.value()?.parse()?;
                    }
                    errors.push(syn::Error::new_spanned(
                        path,
                        format!(
                            "unknown outbox attribute `{}`; expected one of: aggregate, key, \
                             event_type, topic, version, crate",
                            quote::ToTokens::to_token_stream(path)
                        ),
                    ));
                    Ok(())
                }
            }
        });
        if let Err(e) = result {
            errors.push(e);
        }
    }
    container
}

fn set_string(
    slot: &mut Option<Spanned<String>>,
    meta: &syn::meta::ParseNestedMeta<'_>,
    name: &str,
    errors: &mut Vec<syn::Error>,
) -> syn::Result<()> {
    let lit: LitStr = parse_value(meta, name, &format!("a string, as in `{name} = \"...\"`"))?;
    let value = lit.value();
    if value.trim().is_empty() {
        errors.push(syn::Error::new(
            lit.span(),
            format!("`{name}` must not be empty"),
        ));
        return Ok(());
    }
    set_once(
        slot,
        Spanned {
            value,
            span: lit.span(),
        },
        &meta.path,
        errors,
    );
    Ok(())
}

/// Parses `= <literal>` of the expected kind, or explains what was expected.
fn parse_value<T: syn::parse::Parse>(
    meta: &syn::meta::ParseNestedMeta<'_>,
    name: &str,
    expected: &str,
) -> syn::Result<T> {
    let value = meta.value().map_err(|_| {
        syn::Error::new_spanned(&meta.path, format!("`{name}` needs a value: {expected}"))
    })?;
    let expr: syn::Expr = value.parse()?;
    syn::parse2(quote::ToTokens::to_token_stream(&expr))
        .map_err(|_| syn::Error::new_spanned(&expr, format!("`{name}` expects {expected}")))
}

fn set_once<T>(slot: &mut Option<T>, value: T, path: &Path, errors: &mut Vec<syn::Error>) {
    if slot.is_some() {
        errors.push(duplicate(path));
    } else {
        *slot = Some(value);
    }
}

fn duplicate(path: &Path) -> syn::Error {
    syn::Error::new_spanned(
        path,
        format!(
            "duplicate outbox attribute `{}`",
            quote::ToTokens::to_token_stream(path)
        ),
    )
}
