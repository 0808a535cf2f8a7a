//! Safe access to one file of a shared directory that anything may have written: a
//! path is opened only as a regular file (never a symlink, a FIFO, a socket or a
//! device, so no open or read can block), and read for exactly the length its `fstat`
//! gave.

use std::fs::{self, File, OpenOptions};
use std::io::{self, ErrorKind, Read};
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

/// Whether the regular file `f` of length `len` holds exactly `payload`.
pub(super) fn holds(f: &mut File, len: u64, payload: &[u8]) -> bool {
    len == payload.len() as u64 && matches!(read_exact_len(f, len), Ok(Some(b)) if b == payload)
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
