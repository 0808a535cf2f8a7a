//! TLS for [`RedisTier`](super::RedisTier): `rediss://` URLs, with rustls (its `ring`
//! provider) over the tier's own sockets.
//!
//! The request's deadline bounds TLS as it bounds plain TCP: the socket under rustls is a
//! [`Deadline`], which before every read and write of the socket (rustls may make several
//! for one read of plaintext, e.g. for a record that arrives in pieces) sets the socket's
//! timeout to the time left and fails once the deadline has passed. The handshake runs
//! in [`Client::connect`], within the request's deadline, so a server that accepts TCP
//! and never completes the handshake costs at most `timeout`. The reply's byte cap
//! applies to the decrypted bytes (the plaintext is what the capped reader reads), and
//! rustls buffers at most a record or so of ciphertext.
//!
//! The server is always verified: its certificate must chain to the system's trust roots
//! (found by `rustls-native-certs`, which honours `SSL_CERT_FILE` and `SSL_CERT_DIR`) or
//! to the CAs of [`TlsOptions::ca`], and must name the URL's host (a DNS name, or an IP
//! address for `rediss://127.0.0.1`). There is no way to turn verification off.

use std::cell::Cell;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, ClientConnection, RootCertStore, StreamOwned};

use super::conn::left;
use super::options::{tls_host, TlsOptions};
use crate::error::{KvError, Result};

/// How to open TLS connections to one server: the configuration and the name verified.
pub(super) struct Client {
    config: Arc<ClientConfig>,
    name: ServerName<'static>,
}

/// An invalid TLS argument.
fn bad(name: &'static str, path: &Path, reason: impl std::fmt::Display) -> KvError {
    KvError::InvalidArgument {
        name,
        value: path.display().to_string(),
        reason: reason.to_string(),
    }
}

/// The system's trust roots, read once per process.
fn system_roots() -> &'static [CertificateDer<'static>] {
    static ROOTS: OnceLock<Vec<CertificateDer<'static>>> = OnceLock::new();
    ROOTS.get_or_init(|| rustls_native_certs::load_native_certs().certs)
}

/// The certificates of the PEM file `path`, at least one (argument `name`).
fn certificates(name: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| bad(name, path, format!("cannot read: {e}")))?
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| bad(name, path, format!("not a PEM certificate file: {e}")))?;
    if certs.is_empty() {
        return Err(bad(name, path, "no PEM certificate in the file"));
    }
    Ok(certs)
}

impl Client {
    /// The TLS setup for `host` (`tls`: the URL asked for it; `host`: `None` for a Unix
    /// socket), its files read and checked now; `None` without TLS. An error names the
    /// argument at fault: a TLS option without a `rediss://` URL, a file that is missing
    /// or holds no usable certificate or key, a certificate without its key.
    pub(super) fn new(tls: bool, host: Option<&str>, opts: &TlsOptions) -> Result<Option<Self>> {
        let Some(host) = tls_host(tls, host, opts)? else {
            return Ok(None);
        };
        let mut roots = RootCertStore::empty();
        roots.add_parsable_certificates(system_roots().iter().cloned());
        if let Some(path) = &opts.ca {
            for cert in certificates("tls_ca", path)? {
                roots
                    .add(cert)
                    .map_err(|e| bad("tls_ca", path, format!("not a CA certificate: {e}")))?;
            }
        }
        if roots.is_empty() {
            return Err(KvError::InvalidArgument {
                name: "tls_ca",
                value: "None".into(),
                reason: "the system has no trust roots: give the server's CA (a PEM file)".into(),
            });
        }
        let builder =
            ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .map_err(|e| KvError::NotSupported(format!("TLS: {e}")))?
                .with_root_certificates(roots);
        let config = match (&opts.cert, &opts.key) {
            (None, None) => builder.with_no_client_auth(),
            (Some(cert), Some(key)) => {
                let chain = certificates("tls_cert", cert)?;
                let der = PrivateKeyDer::from_pem_file(key)
                    .map_err(|e| bad("tls_key", key, format!("no PEM private key: {e}")))?;
                builder
                    .with_client_auth_cert(chain, der)
                    .map_err(|e| bad("tls_key", key, format!("unusable with tls_cert: {e}")))?
            }
            (Some(cert), None) => return Err(bad("tls_key", cert, "tls_cert needs tls_key")),
            (None, Some(key)) => return Err(bad("tls_cert", key, "tls_key needs tls_cert")),
        };
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        let name =
            ServerName::try_from(bare.to_string()).map_err(|e| KvError::InvalidArgument {
                name: "url",
                value: host.into(),
                reason: format!("not a host name TLS can verify: {e}"),
            })?;
        Ok(Some(Client {
            config: Arc::new(config),
            name,
        }))
    }

    /// A TLS connection over `sock`, its handshake (the server verified) done before
    /// `deadline`.
    pub(super) fn connect(&self, sock: TcpStream, deadline: Instant) -> io::Result<TlsStream> {
        let mut conn = ClientConnection::new(self.config.clone(), self.name.clone())
            .map_err(io::Error::other)?;
        let mut sock = Deadline {
            sock,
            deadline: Cell::new(deadline),
        };
        while conn.is_handshaking() {
            if conn.complete_io(&mut sock)? == (0, 0) {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
        }
        Ok(TlsStream(StreamOwned::new(conn, sock)))
    }
}

/// A TCP socket whose every read and write ends by `deadline`.
struct Deadline {
    sock: TcpStream,
    deadline: Cell<Instant>,
}

/// `r`, with a timed-out socket operation (`WouldBlock`) reported as `TimedOut`.
fn timed<T>(r: io::Result<T>) -> io::Result<T> {
    r.map_err(|e| match e.kind() {
        io::ErrorKind::WouldBlock => {
            io::Error::new(io::ErrorKind::TimedOut, "request deadline passed")
        }
        _ => e,
    })
}

impl Read for Deadline {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.sock
            .set_read_timeout(Some(left(self.deadline.get())?))?;
        timed(self.sock.read(buf))
    }
}

impl Write for Deadline {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.sock
            .set_write_timeout(Some(left(self.deadline.get())?))?;
        timed(self.sock.write(buf))
    }

    fn flush(&mut self) -> io::Result<()> {
        self.sock.flush()
    }
}

/// An open TLS connection (plaintext in and out), every socket operation under it
/// bounded by the deadline of [`TlsStream::set_deadline`].
pub(super) struct TlsStream(StreamOwned<ClientConnection, Deadline>);

impl TlsStream {
    /// Bounds the socket operations from now on by `now + left`.
    pub(super) fn set_deadline(&self, left: Duration) {
        self.0.sock.deadline.set(Instant::now() + left);
    }

    /// Reads plaintext (as many socket reads as a whole record takes, each bounded).
    pub(super) fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read(buf)
    }

    /// Writes plaintext and sends it (errors come out here, not at the next call).
    pub(super) fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.0.write(buf)?;
        self.0.flush()?;
        Ok(n)
    }

    /// Writes plaintext from `bufs`, in order, into records (as much as rustls buffers
    /// at once), and sends them (errors come out here, not at the next call).
    pub(super) fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        let owned = &mut self.0;
        let mut stream = rustls::Stream::new(&mut owned.conn, &mut owned.sock);
        let n = stream.write_vectored(bufs)?;
        stream.flush()?;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    //! TLS against a stand-in server (rustls' server side on a loopback listener, the
    //! committed test certificates of tests/redis/tls): a reply served, a server not
    //! trusted, a handshake never answered, a reply trickled a byte at a time.

    use std::io::{Read, Write};
    use std::net::TcpListener;
    use std::path::PathBuf;
    use std::sync::Arc;
    use std::thread;
    use std::time::{Duration, Instant};

    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    use rustls::{ServerConfig, ServerConnection};

    use super::super::options::plain_url;
    use super::TlsOptions;
    use crate::tier::redis::RedisTier;
    use crate::tier::Tier;

    fn file(name: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/redis/tls")
            .join(name)
    }

    fn trusting(ca: &str) -> TlsOptions {
        TlsOptions {
            ca: Some(file(ca)),
            ..TlsOptions::default()
        }
    }

    fn tier(url: &str, timeout_ms: u64, tls: &TlsOptions) -> RedisTier {
        let t = Duration::from_millis(timeout_ms);
        RedisTier::with_tls(url, t, None, 4, Duration::from_secs(5), tls).unwrap()
    }

    fn errors(t: &RedisTier) -> u64 {
        t.counters().snapshot()[6].1
    }

    /// A TLS server (server.pem, for 127.0.0.1) for one connection: handshakes, reads
    /// one request and sends `reply` encrypted, `pace` between its bytes.
    fn stand_in(reply: &'static [u8], pace: Duration) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("rediss://{}/0", listener.local_addr().unwrap());
        let certs = CertificateDer::pem_file_iter(file("server.pem"))
            .unwrap()
            .collect::<Result<Vec<_>, _>>()
            .unwrap();
        let key = PrivateKeyDer::from_pem_file(file("server.key")).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .unwrap();
        thread::spawn(move || {
            let (mut sock, _) = listener.accept().unwrap();
            sock.set_read_timeout(Some(Duration::from_secs(10)))
                .unwrap();
            let mut conn = ServerConnection::new(Arc::new(config)).unwrap();
            while conn.is_handshaking() {
                if conn.complete_io(&mut sock).is_err() {
                    return; // the client refused the server
                }
            }
            let mut buf = [0u8; 4096];
            while conn.reader().read(&mut buf).is_err() {
                if conn.complete_io(&mut sock).is_err() {
                    return;
                }
            }
            conn.writer().write_all(reply).unwrap();
            let mut wire = Vec::new();
            while conn.wants_write() {
                conn.write_tls(&mut wire).unwrap();
            }
            for chunk in wire.chunks(if pace.is_zero() { wire.len() } else { 1 }) {
                if sock.write_all(chunk).is_err() {
                    return;
                }
                thread::sleep(pace);
            }
            thread::sleep(Duration::from_millis(500));
        });
        url
    }

    #[test]
    fn rediss_urls_are_parsed_as_redis_urls_and_verification_stays_on() {
        assert_eq!(
            plain_url("rediss://h:1/2").unwrap(),
            ("redis://h:1/2".into(), true)
        );
        assert_eq!(
            plain_url("VALKEYS://h").unwrap(),
            ("valkey://h".into(), true)
        );
        assert_eq!(plain_url("redis://h").unwrap(), ("redis://h".into(), false));
        assert!(plain_url("rediss://h/0#insecure").is_err());
    }

    #[test]
    fn a_reply_is_served_over_tls_and_the_name_says_rediss() {
        let url = stand_in(b"*2\r\n$3\r\nabc\r\n$-1\r\n", Duration::ZERO);
        let t = tier(&url, 2000, &trusting("ca.pem"));
        assert!(t.name().starts_with("rediss://127.0.0.1:"));
        let got = t.get_many(&["a".into(), "b".into()], 0..=10);
        assert_eq!(got, vec![Some(b"abc".to_vec()), None]);
        assert_eq!(errors(&t), 0);
    }

    #[test]
    fn a_server_signed_by_another_ca_is_refused() {
        let url = stand_in(b"*1\r\n$3\r\nabc\r\n", Duration::ZERO);
        let t = tier(&url, 2000, &trusting("other-ca.pem"));
        assert_eq!(t.get_many(&["a".into()], 0..=10), vec![None]);
        assert_eq!(errors(&t), 1);
    }

    #[test]
    fn a_handshake_never_answered_costs_the_timeout() {
        // Accepted by the kernel (the backlog), never answered.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("rediss://{}/0", listener.local_addr().unwrap());
        let t = tier(&url, 200, &trusting("ca.pem"));
        let t0 = Instant::now();
        assert_eq!(t.get_many(&["a".into()], 0..=10), vec![None]);
        let took = t0.elapsed();
        assert!(
            took >= Duration::from_millis(190) && took < Duration::from_millis(400),
            "{took:?}"
        );
        assert_eq!(errors(&t), 1);
        drop(listener);
    }

    #[test]
    fn an_encrypted_reply_trickled_is_bounded_by_the_timeout() {
        // One TLS record, a byte every 20 ms: rustls reads on until the record is whole,
        // every read of the socket bounded by the time left.
        let url = stand_in(
            b"*2\r\n$3\r\nabc\r\n$3\r\nabc\r\n",
            Duration::from_millis(20),
        );
        let t = tier(&url, 300, &trusting("ca.pem"));
        let t0 = Instant::now();
        assert_eq!(
            t.get_many(&["a".into(), "b".into()], 0..=10),
            vec![None, None]
        );
        let took = t0.elapsed();
        assert!(took < Duration::from_millis(500), "{took:?}");
        assert_eq!(errors(&t), 1);
    }

    #[test]
    fn bad_tls_arguments_name_the_argument() {
        let err = |url: &str, opts: TlsOptions| {
            RedisTier::with_tls(
                url,
                Duration::from_secs(1),
                None,
                1,
                Duration::from_secs(1),
                &opts,
            )
            .unwrap_err()
            .to_string()
        };
        let url = "rediss://127.0.0.1:1/0";
        let cases = [
            (url, trusting("missing.pem"), "tls_ca"),
            (url, trusting("README.md"), "tls_ca"),
            ("redis://127.0.0.1:1/0", trusting("ca.pem"), "tls_ca"),
            (
                url,
                TlsOptions {
                    cert: Some(file("client.pem")),
                    ..trusting("ca.pem")
                },
                "tls_key",
            ),
            (
                url,
                TlsOptions {
                    key: Some(file("client.key")),
                    ..trusting("ca.pem")
                },
                "tls_cert",
            ),
            (
                url,
                TlsOptions {
                    cert: Some(file("client.pem")),
                    key: Some(file("client.pem")),
                    ..trusting("ca.pem")
                },
                "tls_key",
            ),
        ];
        for (url, opts, name) in cases {
            let e = err(url, opts);
            assert!(e.contains(name), "{name}: {e}");
        }
        let ok = TlsOptions {
            cert: Some(file("client.pem")),
            key: Some(file("client.key")),
            ..trusting("ca.pem")
        };
        RedisTier::with_tls(
            url,
            Duration::from_secs(1),
            None,
            1,
            Duration::from_secs(1),
            &ok,
        )
        .unwrap();
    }
}
