//! One connection to a Redis server, owned here rather than by the `redis` crate, so that
//! a request's deadline bounds all of it: the connect, the login (`AUTH`, `SELECT`), the
//! write and every byte of every reply. The `redis` crate encodes the commands and parses
//! the replies; this module moves the bytes.
//!
//! A reply is read through [`Bounded`], which before each read sets the socket's read
//! timeout to the time left until the deadline, fails once the deadline has passed, and
//! fails once the request has read more bytes than its cap, so a server trickling a reply
//! or announcing a huge value can neither hold a caller past the deadline nor make it
//! buffer more than the cap.

use std::io::{self, BufReader, IoSlice, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
#[cfg(unix)]
use std::os::unix::net::UnixStream;
#[cfg(unix)]
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use redis::{ConnectionAddr, ConnectionInfo, Value};

use super::options::TlsOptions;
use super::tls::{self, TlsStream};

/// Where a server is and how to log in to it.
pub(super) struct Target {
    addr: Addr,
    username: Option<String>,
    password: Option<String>,
    db: i64,
    /// TLS (`rediss://`), set up by [`Target::with_tls`].
    tls: Option<tls::Client>,
}

/// A server's address.
enum Addr {
    Tcp(String, u16),
    #[cfg(unix)]
    Unix(PathBuf),
}

impl Target {
    /// The target of a URL the `redis` crate parsed; an error names what is unsupported.
    pub(super) fn new(info: &ConnectionInfo) -> Result<Self, String> {
        let addr = match info.addr() {
            ConnectionAddr::Tcp(host, port) => Addr::Tcp(host.clone(), *port),
            #[cfg(unix)]
            ConnectionAddr::Unix(path) => Addr::Unix(path.clone()),
            _ => return Err("this kind of address is not supported".into()),
        };
        let r = info.redis_settings();
        Ok(Target {
            addr,
            username: r.username().map(str::to_string),
            password: r.password().map(str::to_string),
            db: r.db(),
            tls: None,
        })
    }

    /// The same login on another server (a cluster node), over TCP (cluster seeds are
    /// plain TCP: no TLS).
    pub(super) fn at(&self, host: &str, port: u16) -> Target {
        Target {
            addr: Addr::Tcp(host.to_string(), port),
            username: self.username.clone(),
            password: self.password.clone(),
            db: self.db,
            tls: None,
        }
    }

    /// The host and port of a TCP target (`None`: a Unix socket).
    pub(super) fn tcp(&self) -> Option<(&str, u16)> {
        match &self.addr {
            Addr::Tcp(host, port) => Some((host, *port)),
            #[cfg(unix)]
            Addr::Unix(_) => None,
        }
    }

    /// The database number the login selects.
    pub(super) fn db(&self) -> i64 {
        self.db
    }

    /// The target over TLS when `on` (the URL was `rediss://`), with `opts`' files read
    /// now; an error names the argument at fault.
    pub(super) fn with_tls(mut self, on: bool, opts: &TlsOptions) -> crate::error::Result<Self> {
        let host = match &self.addr {
            Addr::Tcp(host, _) => Some(host.as_str()),
            #[cfg(unix)]
            Addr::Unix(_) => None,
        };
        self.tls = tls::Client::new(on, host, opts)?;
        Ok(self)
    }

    /// `rediss` over TLS, else `redis`.
    fn scheme(&self) -> &'static str {
        if self.tls.is_some() {
            "rediss"
        } else {
            "redis"
        }
    }

    /// `redis://{host}:{port}/{db}` (or the socket's path): no credentials.
    pub(super) fn name(&self) -> String {
        match &self.addr {
            Addr::Tcp(host, port) => format!("{}://{host}:{port}/{}", self.scheme(), self.db),
            #[cfg(unix)]
            Addr::Unix(path) => format!("redis+unix://{}?db={}", path.display(), self.db),
        }
    }

    /// The URL with the password replaced by `***`: `redis://user:***@host:port/db`.
    pub(super) fn redacted_url(&self) -> String {
        let user = self.username.as_deref().unwrap_or("");
        let auth = match (&self.username, &self.password) {
            (_, Some(_)) => format!("{user}:***@"),
            (Some(u), None) => format!("{u}@"),
            (None, None) => String::new(),
        };
        match &self.addr {
            Addr::Tcp(host, port) => {
                format!("{}://{auth}{host}:{port}/{}", self.scheme(), self.db)
            }
            #[cfg(unix)]
            Addr::Unix(path) => {
                let mut s = format!("redis+unix://{}?db={}", path.display(), self.db);
                if let Some(u) = &self.username {
                    s += &format!("&user={u}");
                }
                if self.password.is_some() {
                    s += "&pass=***";
                }
                s
            }
        }
    }

    /// What a new connection sends first (`AUTH`, `SELECT`) and how many replies it gets.
    fn login(&self) -> (Vec<u8>, usize) {
        let mut p = redis::pipe();
        let mut n = 0;
        if let Some(pw) = &self.password {
            let c = p.cmd("AUTH");
            if let Some(u) = &self.username {
                c.arg(u);
            }
            c.arg(pw);
            n += 1;
        }
        if self.db != 0 {
            p.cmd("SELECT").arg(self.db);
            n += 1;
        }
        (p.get_packed_pipeline(), n)
    }
}

/// `url` with whatever may be a password replaced by `***`: for messages about a URL that
/// did not parse.
pub(super) fn redact_text(url: &str) -> String {
    let (scheme, rest) = match url.find("://") {
        Some(i) => url.split_at(i + 3),
        None => ("", url),
    };
    let mut out = match rest.rfind('@') {
        Some(at) => {
            let user = match rest[..at].find(':') {
                Some(colon) => format!("{}:***", &rest[..colon]),
                None => "***".to_string(),
            };
            format!("{scheme}{user}{}", &rest[at..])
        }
        None => url.to_string(),
    };
    // redis+unix://path?pass=...
    if let Some(i) = out.find("pass=") {
        let end = out[i..].find('&').map_or(out.len(), |e| i + e);
        out.replace_range(i + 5..end, "***");
    }
    out
}

/// The time left until `deadline`; a `TimedOut` error once it has passed.
pub(super) fn left(deadline: Instant) -> io::Result<Duration> {
    match deadline.checked_duration_since(Instant::now()) {
        Some(d) if !d.is_zero() => Ok(d),
        _ => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "request deadline passed",
        )),
    }
}

/// A TCP or Unix socket, or TLS over TCP.
enum Stream {
    Tcp(TcpStream),
    Tls(Box<TlsStream>),
    #[cfg(unix)]
    Unix(UnixStream),
}

impl Stream {
    fn set_read_timeout(&self, t: Duration) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_read_timeout(Some(t)),
            Stream::Tls(s) => {
                s.set_deadline(t);
                Ok(())
            }
            #[cfg(unix)]
            Stream::Unix(s) => s.set_read_timeout(Some(t)),
        }
    }

    fn set_write_timeout(&self, t: Duration) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_write_timeout(Some(t)),
            Stream::Tls(s) => {
                s.set_deadline(t);
                Ok(())
            }
            #[cfg(unix)]
            Stream::Unix(s) => s.set_write_timeout(Some(t)),
        }
    }

    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Tls(s) => s.read(buf),
            #[cfg(unix)]
            Stream::Unix(s) => s.read(buf),
        }
    }

    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Tls(s) => s.write(buf),
            #[cfg(unix)]
            Stream::Unix(s) => s.write(buf),
        }
    }

    /// Writes from `bufs` in order (`writev` on a socket; into TLS records, then sent,
    /// over TLS); how many bytes were taken.
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write_vectored(bufs),
            Stream::Tls(s) => s.write_vectored(bufs),
            #[cfg(unix)]
            Stream::Unix(s) => s.write_vectored(bufs),
        }
    }
}

/// A socket's reads for one request: each bounded by the time left until the deadline,
/// all together by `left` bytes.
struct Bounded<'a> {
    stream: &'a mut Stream,
    deadline: Instant,
    left: usize,
}

impl Read for Bounded<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let rest = left(self.deadline)?;
        if self.left == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "reply larger than the request can take",
            ));
        }
        self.stream.set_read_timeout(rest)?;
        let n = buf.len().min(self.left);
        match self.stream.read(&mut buf[..n]) {
            Ok(got) => {
                self.left -= got;
                Ok(got)
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "request deadline passed",
            )),
            Err(e) => Err(e),
        }
    }
}

/// How much of a reply is read from the socket at once.
const READ_CHUNK: usize = 64 << 10;

/// An open connection, and the process that opened it.
pub(super) struct Conn {
    stream: Stream,
    pid: u32,
    /// The login a new connection sends before its first request (and its reply count).
    login: Option<(Vec<u8>, usize)>,
}

impl Conn {
    /// Connects to `target` before `deadline` (the login goes with the first request).
    pub(super) fn open(target: &Target, deadline: Instant) -> io::Result<Conn> {
        let stream = match &target.addr {
            Addr::Tcp(host, port) => {
                let mut last = None;
                let mut found = None;
                for addr in resolve(host, *port, deadline)? {
                    match TcpStream::connect_timeout(&addr, left(deadline)?) {
                        Ok(s) => {
                            found = Some(s);
                            break;
                        }
                        Err(e) => last = Some(e),
                    }
                }
                let s = match found {
                    Some(s) => s,
                    None => return Err(last.unwrap_or_else(|| io::Error::other("no address"))),
                };
                s.set_nodelay(true)?;
                match &target.tls {
                    Some(tls) => Stream::Tls(Box::new(tls.connect(s, deadline)?)),
                    None => Stream::Tcp(s),
                }
            }
            #[cfg(unix)]
            Addr::Unix(path) => Stream::Unix(UnixStream::connect(path)?),
        };
        let (packed, n) = target.login();
        Ok(Conn {
            stream,
            pid: std::process::id(),
            login: (n > 0).then_some((packed, n)),
        })
    }

    /// The process that opened the connection: another process (a parent before `fork`)
    /// shares the socket, and only the opener may use it.
    pub(super) fn pid(&self) -> u32 {
        self.pid
    }

    /// Sends `commands` (encoded; each one write, or a pipeline of several commands) and
    /// reads `replies` replies, handing each to `each` as soon as it is parsed, all before
    /// `deadline` and reading at most `cap` bytes; `each` returning `false` ends the
    /// exchange with an error. The first `window` commands go in one write, then one
    /// more as each reply arrives, before that reply is handed to `each`: the server
    /// builds the next replies while the caller works on the last one (a server builds
    /// the replies of all the commands it has read before it sends any). A new
    /// connection logs in first, in the same write; a refused login is an error.
    pub(super) fn exchange(
        &mut self,
        commands: &[&[u8]],
        window: usize,
        replies: usize,
        cap: usize,
        deadline: Instant,
        mut each: impl FnMut(Value) -> bool,
    ) -> io::Result<()> {
        if commands.is_empty() {
            return Ok(());
        }
        let login = self.login.take();
        let first = window.clamp(1, commands.len());
        // The login and the first commands in one vectored write, each from where it lies.
        let mut out: Vec<IoSlice<'_>> = Vec::with_capacity(first + 1);
        if let Some((l, _)) = &login {
            out.push(IoSlice::new(l));
        }
        out.extend(commands[..first].iter().map(|c| IoSlice::new(c)));
        write_all_vectored(&mut self.stream, &mut out, deadline)?;
        let mut next = first;
        let bounded = Bounded {
            stream: &mut self.stream,
            deadline,
            left: cap,
        };
        let mut reader = BufReader::with_capacity(READ_CHUNK.min(cap.max(1)), bounded);
        let mut parser = redis::Parser::new();
        if let Some((_, n)) = login {
            for _ in 0..n {
                match parser.parse_value(&mut reader).map_err(io::Error::other)? {
                    Value::Okay => {}
                    Value::ServerError(e) => {
                        return Err(io::Error::other(format!("login refused: {e}")))
                    }
                    _ => return Err(io::Error::other("login: unexpected reply")),
                }
            }
        }
        for _ in 0..replies {
            let value = parser.parse_value(&mut reader).map_err(io::Error::other)?;
            if let Some(c) = commands.get(next) {
                write_all(reader.get_mut().stream, c, deadline)?;
                next += 1;
            }
            if !each(value) {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "reply of an unexpected shape",
                ));
            }
        }
        Ok(())
    }
}

/// Writes all of `buf` to `stream` before `deadline`.
fn write_all(stream: &mut Stream, mut buf: &[u8], deadline: Instant) -> io::Result<()> {
    while !buf.is_empty() {
        stream.set_write_timeout(left(deadline)?)?;
        match stream.write(buf) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes all of `bufs`, in order, to `stream` before `deadline`, with vectored writes
/// (the slices are advanced past what each write took).
fn write_all_vectored(
    stream: &mut Stream,
    mut bufs: &mut [IoSlice<'_>],
    deadline: Instant,
) -> io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        stream.set_write_timeout(left(deadline)?)?;
        match stream.write_vectored(bufs) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The addresses of `host`: at once for an IP address; otherwise the system's resolver,
/// asked on a helper thread so that a slow resolver costs no more than the deadline.
fn resolve(host: &str, port: u16, deadline: Instant) -> io::Result<Vec<SocketAddr>> {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = bare.parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    let (tx, rx) = mpsc::channel();
    let host = host.to_string();
    std::thread::Builder::new()
        .name("kvrs-resolve".into())
        .spawn(move || {
            let _ = tx.send((host.as_str(), port).to_socket_addrs().map(Vec::from_iter));
        })?;
    rx.recv_timeout(left(deadline)?)
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "name lookup timed out"))?
}
