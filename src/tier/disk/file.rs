//! Safe access to one file of a shared directory that anything may have written: a
//! path is opened only as a regular file (never a symlink, a FIFO, a socket or a
//! device, so no open or read can block), and read for exactly the length its `fstat`
//! gave.

use std::cell::RefCell;
use std::fs::{self, File, OpenOptions};
use std::io::{self, ErrorKind, IoSlice, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// What is at a path.
#[derive(Debug)]
pub(super) enum Opened {
    /// Nothing.
    Missing,
    /// Something that is not a regular file: a symlink, FIFO, socket, device or directory.
    NotRegular,
    /// A regular file, open read-only, and its length.
    File(File, u64),
}

/// Opens `path` read-only if it is a regular file: `O_NOFOLLOW` refuses a symlink,
/// `O_NONBLOCK` makes opening a FIFO return at once, and `fstat` on the open descriptor
/// (not the path, which may change meanwhile) tells what it is.
pub(super) fn open_regular(path: &Path) -> io::Result<Opened> {
    let opened = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path);
    let f = match opened {
        Ok(f) => f,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Opened::Missing),
        // ELOOP: a symlink; ENXIO: a socket or a device without a driver.
        Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENXIO)) => {
            return Ok(Opened::NotRegular)
        }
        Err(e) => return Err(e),
    };
    let meta = f.metadata()?;
    Ok(if meta.is_file() {
        Opened::File(f, meta.len())
    } else {
        Opened::NotRegular
    })
}

/// Whether this process may open `path` for reading (`faccessat` with the effective
/// ids, as `open` checks them), without opening it.
pub(super) fn readable(path: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: `c` is a valid NUL-terminated path for the duration of the call.
    unsafe { libc::faccessat(libc::AT_FDCWD, c.as_ptr(), libc::R_OK, libc::AT_EACCESS) == 0 }
}

/// The `len` bytes of `f`, or `None` when the file turns out shorter or longer than
/// `len` (it changed while read): never more than `len + 1` bytes are read.
pub(super) fn read_exact_len(f: &mut File, len: u64) -> io::Result<Option<Vec<u8>>> {
    let Ok(len) = usize::try_from(len) else {
        return Ok(None);
    };
    let mut buf = vec![0u8; len];
    match f.read_exact(&mut buf) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let mut extra = [0u8; 1];
    loop {
        match f.read(&mut extra) {
            Ok(0) => return Ok(Some(buf)),
            Ok(_) => return Ok(None),
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Reads the `len` bytes of `f` into `buf` (grown to `len` if shorter; its bytes past
/// `len` are left as they are) and returns them, or `None` when the file turns out
/// shorter or longer than `len` (it changed while read): then nothing of `buf` is
/// handed out, whatever an earlier read left in it. Never more than `len + 1` bytes are
/// read.
pub(super) fn read_exact_len_into<'b>(
    f: &mut File,
    len: u64,
    buf: &'b mut Vec<u8>,
) -> io::Result<Option<&'b [u8]>> {
    let Ok(len) = usize::try_from(len) else {
        return Ok(None);
    };
    if buf.len() < len {
        // Zeroed once, when the buffer grows; reused as it is after that.
        buf.resize(len, 0);
    }
    match f.read_exact(&mut buf[..len]) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let mut extra = [0u8; 1];
    loop {
        match f.read(&mut extra) {
            Ok(0) => return Ok(Some(&buf[..len])),
            Ok(_) => return Ok(None),
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
}

/// The longest payload a thread's scratch buffer keeps between reads: a longer one is
/// read into a buffer of its own, freed after.
pub(super) const SCRATCH_KEEP: usize = 64 << 20;

thread_local! {
    /// The thread's buffer for payloads being read: its length (the longest payload it
    /// read, up to [`SCRATCH_KEEP`]) persists, so the pages under it are neither faulted
    /// in nor zeroed again per payload.
    static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with this thread's scratch buffer (a fresh one when the thread's is in use
/// further up its stack, or when `len` passes [`SCRATCH_KEEP`]).
pub(super) fn with_scratch<R>(len: usize, f: impl FnOnce(&mut Vec<u8>) -> R) -> R {
    if len > SCRATCH_KEEP {
        return f(&mut Vec::new());
    }
    SCRATCH.with(|s| match s.try_borrow_mut() {
        Ok(mut buf) => f(&mut buf),
        Err(_) => f(&mut Vec::new()),
    })
}

/// Whether the regular file `f` of length `len` holds exactly the concatenation of
/// `parts` (read into this thread's scratch buffer).
pub(super) fn holds(f: &mut File, len: u64, parts: &[&[u8]]) -> bool {
    let total: usize = parts.iter().map(|p| p.len()).sum();
    if len != total as u64 {
        return false;
    }
    with_scratch(total, |buf| match read_exact_len_into(f, len, buf) {
        Ok(Some(mut b)) => parts.iter().all(|p| {
            let (head, rest) = b.split_at(p.len());
            b = rest;
            head == *p
        }),
        _ => false,
    })
}

/// Writes the concatenation of `parts` to `f` at its position, with vectored writes
/// (`writev`): the parts are written from where they lie, never joined.
pub(super) fn write_parts(f: &mut File, parts: &[&[u8]]) -> io::Result<()> {
    let mut slices: [IoSlice<'_>; 4] = [IoSlice::new(&[]); 4];
    assert!(parts.len() <= slices.len(), "at most 4 parts");
    for (s, p) in slices.iter_mut().zip(parts) {
        *s = IoSlice::new(p);
    }
    let mut bufs = &mut slices[..parts.len()];
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        match f.write_vectored(bufs) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Marks the open file as used now (its modification time is the LRU clock) through
/// its descriptor, so nothing is opened for writing and a path swapped meanwhile is
/// not touched. `futimens` with no times needs write permission on the file, not a
/// writable descriptor. A failure only ages the file.
pub(super) fn touch(f: &File) {
    // SAFETY: the descriptor is open for the call; a null `times` means "now".
    unsafe {
        libc::futimens(f.as_raw_fd(), std::ptr::null());
    }
}

/// Creates the file `path` (never following a symlink, never reusing a file) with
/// length `len` (sparse: the bytes are written later), for writing.
pub(super) fn create_sized(path: &Path, len: u64) -> io::Result<File> {
    let f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    if let Err(e) = f.set_len(len) {
        drop(f);
        let _ = fs::remove_file(path);
        return Err(e);
    }
    Ok(f)
}

/// Whether process `pid` may be alive (`kill(pid, 0)` does not say `ESRCH`). Only
/// meaningful for processes of this host and PID namespace.
pub(super) fn pid_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    // SAFETY: signal 0 only checks that the process exists.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}
