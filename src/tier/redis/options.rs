//! What a `rediss://` URL and the TLS options ask for, read the same with or without the
//! `redis-tls` feature (which decides whether `tls` can then connect).

use std::borrow::Cow;
use std::path::PathBuf;

use crate::error::{KvError, Result};

/// Files a `rediss://` connection uses besides the system's trust roots.
#[derive(Clone, Debug, Default)]
pub struct TlsOptions {
    /// A PEM file of CA certificates trusted besides the system's.
    pub ca: Option<PathBuf>,
    /// A PEM file of the client's certificate (chain), for a server with
    /// `tls-auth-clients yes`; needs [`TlsOptions::key`].
    pub cert: Option<PathBuf>,
    /// A PEM file of the client certificate's private key (PKCS#8, PKCS#1 or SEC1).
    pub key: Option<PathBuf>,
}

impl TlsOptions {
    /// The name of the first option given, if any.
    fn first_given(&self) -> Option<&'static str> {
        [
            ("tls_ca", &self.ca),
            ("tls_cert", &self.cert),
            ("tls_key", &self.key),
        ]
        .into_iter()
        .find_map(|(name, v)| v.as_ref().map(|_| name))
    }
}

/// `url` as the `redis` crate parses it (a `rediss://` or `valkeys://` URL with the plain
/// scheme), and whether it asks for TLS. A fragment (`#insecure`) is refused: the server
/// is always verified.
pub(super) fn plain_url(url: &str) -> std::result::Result<(Cow<'_, str>, bool), String> {
    for (tls, plain) in [("rediss://", "redis://"), ("valkeys://", "valkey://")] {
        let Some(scheme) = url.get(..tls.len()) else {
            continue;
        };
        if scheme.eq_ignore_ascii_case(tls) {
            if url.contains('#') {
                return Err(
                    "a URL fragment (such as #insecure) is not supported: TLS always verifies the server"
                        .into(),
                );
            }
            return Ok((format!("{plain}{}", &url[tls.len()..]).into(), true));
        }
    }
    Ok((url.into(), false))
}

/// The host to verify when the connection is TLS (`tls`: the URL asked for it; `host`:
/// `None` for a Unix socket), `None` without TLS; a TLS option given without a
/// `rediss://` URL is an error that names it.
pub(super) fn tls_host<'a>(
    tls: bool,
    host: Option<&'a str>,
    opts: &TlsOptions,
) -> Result<Option<&'a str>> {
    match (tls, host) {
        (true, Some(h)) => Ok(Some(h)),
        _ => match opts.first_given() {
            None => Ok(None),
            Some(name) => Err(KvError::InvalidArgument {
                name,
                value: "given".into(),
                reason: "TLS options need a rediss:// URL".into(),
            }),
        },
    }
}
