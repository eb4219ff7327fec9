//! How a Pulsar client reaches its cluster: service URL, authentication and TLS. One type for the
//! relay's Pulsar sink and for the Pulsar consumer loop (`consumer::pulsar::PulsarConsumer`).

use crate::Secret;
use pulsar::{ConnectionRetryOptions, Pulsar, TokioExecutor};
use std::path::PathBuf;

/// Where and how to connect to Pulsar.
///
/// ```no_run
/// use seaorm_outbox::Secret;
/// use seaorm_outbox::pulsar_client::{PulsarAuth, PulsarConnection};
///
/// # async fn f() -> Result<(), pulsar::Error> {
/// let mut connection = PulsarConnection::new("pulsar+ssl://pulsar.example.com:6651");
/// connection.auth = Some(PulsarAuth::Token(Secret::new(std::env::var("PULSAR_TOKEN").unwrap())));
/// connection.tls_ca_file = Some("/etc/ssl/pulsar-ca.pem".into());
/// let client = connection.connect(None).await?;
/// # Ok(()) }
/// ```
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PulsarConnection {
    /// `pulsar://host:port`, or `pulsar+ssl://host:port` for TLS.
    pub url: String,
    /// How the client proves who it is; `None` connects anonymously.
    pub auth: Option<PulsarAuth>,
    /// PEM file of the certificate authorities that signed the broker's certificate; `None` trusts
    /// the system's.
    pub tls_ca_file: Option<PathBuf>,
    /// Check that the broker's certificate names the host connected to. Default true.
    pub tls_hostname_verification: bool,
    /// Accept any broker certificate, unverified. Default false; for tests only.
    pub tls_allow_insecure: bool,
}

/// Pulsar authentication.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PulsarAuth {
    /// A JWT, as issued by `pulsar tokens create` or a managed service.
    Token(Secret),
    /// OAuth 2.0 client credentials (the `pulsar-oauth2` feature), as StreamNative Cloud uses.
    #[cfg(feature = "pulsar-oauth2")]
    OAuth2 {
        /// The identity provider, such as `https://auth.streamnative.cloud/`.
        issuer_url: String,
        /// A `file://` URL of the JSON key file holding `client_id` and `client_secret`, or a
        /// `data:application/json;base64,...` URL of its contents.
        credentials_url: Secret,
        /// The audience the token is for (the cluster), if the provider needs one.
        audience: Option<String>,
        /// The scope to ask for, if any.
        scope: Option<String>,
    },
}

impl std::fmt::Debug for PulsarConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PulsarConnection")
            .field("url", &redact_userinfo(&self.url))
            .field("auth", &self.auth)
            .field("tls_ca_file", &self.tls_ca_file)
            .field("tls_hostname_verification", &self.tls_hostname_verification)
            .field("tls_allow_insecure", &self.tls_allow_insecure)
            .finish()
    }
}

/// `url` for logs and errors: any user information (`user:password@`) before the host masked.
///
/// ```
/// use seaorm_outbox::pulsar_client::redact_userinfo;
///
/// assert_eq!(redact_userinfo("pulsar://app:s3cret@broker:6650"), "pulsar://***@broker:6650");
/// assert_eq!(redact_userinfo("pulsar+ssl://broker:6651/x@y"), "pulsar+ssl://broker:6651/x@y");
/// ```
pub fn redact_userinfo(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    match authority.rfind('@') {
        Some(at) => format!("{scheme}://***{}", &rest[at..]),
        None => url.to_owned(),
    }
}

impl PulsarConnection {
    /// An anonymous connection to `url`, verifying TLS against the system's certificate
    /// authorities.
    pub fn new(url: impl Into<String>) -> Self {
        PulsarConnection {
            url: url.into(),
            auth: None,
            tls_ca_file: None,
            tls_hostname_verification: true,
            tls_allow_insecure: false,
        }
    }

    /// Connects. `retry` replaces the `pulsar` crate's default connection retries (12, backing
    /// off up to 30 s).
    pub async fn connect(
        &self,
        retry: Option<ConnectionRetryOptions>,
    ) -> Result<Pulsar<TokioExecutor>, pulsar::Error> {
        let mut builder = Pulsar::builder(&self.url, TokioExecutor)
            .with_tls_hostname_verification_enabled(self.tls_hostname_verification)
            .with_allow_insecure_connection(self.tls_allow_insecure);
        if let Some(retry) = retry {
            builder = builder.with_connection_retry_options(retry);
        }
        if let Some(path) = &self.tls_ca_file {
            builder = builder.with_certificate_chain_file(path).map_err(|e| {
                pulsar::Error::Custom(format!("cannot read tls_ca_file {}: {e}", path.display()))
            })?;
        }
        match &self.auth {
            None => {}
            Some(PulsarAuth::Token(token)) => {
                builder = builder.with_auth(pulsar::Authentication {
                    name: "token".into(),
                    data: token.expose().as_bytes().to_vec(),
                });
            }
            #[cfg(feature = "pulsar-oauth2")]
            Some(PulsarAuth::OAuth2 {
                issuer_url,
                credentials_url,
                audience,
                scope,
            }) => {
                builder = builder.with_auth_provider(
                    pulsar::authentication::oauth2::OAuth2Authentication::client_credentials(
                        pulsar::authentication::oauth2::OAuth2Params {
                            issuer_url: issuer_url.clone(),
                            credentials_url: credentials_url.expose().to_owned(),
                            audience: audience.clone(),
                            scope: scope.clone(),
                        },
                    ),
                );
            }
        }
        builder.build().await
    }
}
