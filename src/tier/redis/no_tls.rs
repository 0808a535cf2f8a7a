//! `tls` without the `redis-tls` feature: a `rediss://` URL is refused when the tier is
//! made, with an error that names the feature; plain connections are unchanged.

use std::io;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use super::options::{tls_host, TlsOptions};
use crate::error::{KvError, Result};

/// A TLS setup, which this build cannot make (no value exists).
pub(super) enum Client {}

impl Client {
    /// `None` without TLS; an error for a `rediss://` URL (or a TLS option without one).
    pub(super) fn new(tls: bool, host: Option<&str>, opts: &TlsOptions) -> Result<Option<Self>> {
        match tls_host(tls, host, opts)? {
            None => Ok(None),
            Some(_) => Err(KvError::NotSupported(
                "rediss:// (TLS) needs kvrs built with the `redis-tls` cargo feature".into(),
            )),
        }
    }

    /// Never called: no `Client` exists.
    pub(super) fn connect(&self, _sock: TcpStream, _deadline: Instant) -> io::Result<TlsStream> {
        match *self {}
    }
}

/// A TLS connection, which this build cannot open (no value exists).
pub(super) enum TlsStream {}

impl TlsStream {
    /// Never called: no `TlsStream` exists.
    pub(super) fn set_deadline(&self, _left: Duration) {
        match *self {}
    }

    /// Never called: no `TlsStream` exists.
    pub(super) fn read(&mut self, _buf: &mut [u8]) -> io::Result<usize> {
        match *self {}
    }

    /// Never called: no `TlsStream` exists.
    pub(super) fn write(&mut self, _buf: &[u8]) -> io::Result<usize> {
        match *self {}
    }

    /// Never called: no `TlsStream` exists.
    pub(super) fn write_vectored(&mut self, _bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match *self {}
    }
}
