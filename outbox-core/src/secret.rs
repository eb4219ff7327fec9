//! A value that must never be printed: a password, a token, a client secret.

use std::fmt;

/// A secret string. `Debug` and `Display` print `***`; only [`Secret::expose`] gives the value,
/// so a secret cannot reach a log line or an error message by accident.
///
/// ```
/// use seaorm_outbox::Secret;
///
/// let token = Secret::new("eyJhbGciOi...");
/// assert_eq!(format!("{token} {token:?}"), "*** Secret(***)");
/// assert_eq!(token.expose(), "eyJhbGciOi...");
/// ```
///
/// It deserializes from a plain string. It also serializes to one: settings are merged as data
/// before they are used, never printed.
#[derive(Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    /// Wraps `value`.
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    /// The secret itself, to hand to the client that needs it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl From<String> for Secret {
    fn from(value: String) -> Self {
        Secret(value)
    }
}

impl std::str::FromStr for Secret {
    type Err = std::convert::Infallible;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        Ok(Secret(value.to_owned()))
    }
}
