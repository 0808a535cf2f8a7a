//! The Python exception hierarchy and the mapping from the core's error: [`to_py`], and
//! [`ToPython::py`] for `?` on the core's results (the orphan rule keeps `From<KvError> for
//! PyErr` out of this crate: neither type is its own).

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyIndexError, PyMemoryError, PyTypeError, PyValueError};
use pyo3::prelude::*;

use kvrs::KvError;

create_exception!(
    kvrs,
    KvrsError,
    PyException,
    "Base class of every kvrs-specific error."
);
create_exception!(
    kvrs,
    CacheFullError,
    KvrsError,
    "The cache (or pool) has no room for what was asked."
);
create_exception!(
    kvrs,
    NotSupportedError,
    KvrsError,
    "The operation is valid but not supported in this configuration."
);
create_exception!(
    kvrs,
    DeviceError,
    KvrsError,
    "A device is unknown, unavailable or unusable."
);

/// The Python exception for a core error: `IndexError`, `ValueError`, `TypeError`,
/// `OSError`, `MemoryError` or one of kvrs's own ([`CacheFullError`],
/// [`NotSupportedError`], [`DeviceError`]), with the error's message.
pub fn to_py(e: KvError) -> PyErr {
    let msg = e.to_string();
    match e {
        KvError::CacheFull { .. } => CacheFullError::new_err(msg),
        KvError::OutOfRange { .. } => PyIndexError::new_err(msg),
        KvError::Io { .. } => pyo3::exceptions::PyOSError::new_err(msg),
        KvError::Shape { .. }
        | KvError::UnknownDType(_)
        | KvError::InvalidArgument { .. }
        | KvError::BadFile { .. } => PyValueError::new_err(msg),
        KvError::UnsupportedDType { .. } => PyTypeError::new_err(msg),
        KvError::NotSupported(_) => NotSupportedError::new_err(msg),
        KvError::OutOfMemory { .. } => PyMemoryError::new_err(msg),
        KvError::Device(ref m) if m.starts_with("cannot allocate") => PyMemoryError::new_err(msg),
        KvError::Device(_) => DeviceError::new_err(msg),
    }
}

/// The core's errors as Python's: `.py()` on a core result in a function that returns
/// `PyResult` (`core_call().py()?`, where `?` alone would need `From<KvError> for
/// PyErr`), or on a [`KvError`] (`Err(KvError::...{ .. }.py())`).
pub trait ToPython {
    /// [`PyResult`] for a core result, [`PyErr`] for a core error.
    type Output;
    /// The value, or the error as its Python exception ([`to_py`]).
    fn py(self) -> Self::Output;
}

impl<T> ToPython for Result<T, KvError> {
    type Output = PyResult<T>;
    fn py(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}

impl ToPython for KvError {
    type Output = PyErr;
    fn py(self) -> PyErr {
        to_py(self)
    }
}

/// Adds the exception classes to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("KvrsError", py.get_type::<KvrsError>())?;
    m.add("CacheFullError", py.get_type::<CacheFullError>())?;
    m.add("NotSupportedError", py.get_type::<NotSupportedError>())?;
    m.add("DeviceError", py.get_type::<DeviceError>())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use pyo3::exceptions::{PyIndexError, PyMemoryError, PyOSError, PyTypeError, PyValueError};
    use pyo3::prelude::*;

    use super::{CacheFullError, DeviceError, KvrsError, NotSupportedError, ToPython};
    use kvrs::{KvError, Unit};

    /// Every core error raises its Python exception, with the core's message.
    #[test]
    fn core_errors_raise_their_python_exceptions() {
        Python::initialize();
        Python::attach(|py| {
            let full = KvError::CacheFull {
                what: "append".into(),
                needed: 2,
                free: 1,
                capacity: 4,
                unit: Unit::Blocks,
            };
            let message = full.to_string();
            let e = full.py();
            assert!(e.is_instance_of::<CacheFullError>(py));
            assert!(e.is_instance_of::<KvrsError>(py));
            assert_eq!(e.value(py).to_string(), message);
            let range = kvrs::unstable::check_index("layer", 4, 4);
            assert!(range.py().unwrap_err().is_instance_of::<PyIndexError>(py));
            let io = || KvError::Io {
                path: "p".into(),
                reason: "r".into(),
            };
            assert!(io().py().is_instance_of::<PyOSError>(py));
            let dtype = KvError::UnknownDType("f64".into());
            assert!(dtype.py().is_instance_of::<PyValueError>(py));
            let unsupported = KvError::UnsupportedDType {
                name: "k",
                got: "int8".into(),
            };
            assert!(unsupported.py().is_instance_of::<PyTypeError>(py));
            let not_supported = KvError::NotSupported("x".into());
            assert!(not_supported.py().is_instance_of::<NotSupportedError>(py));
            let oom = KvError::OutOfMemory {
                what: "pool",
                bytes: 1,
            };
            assert!(oom.py().is_instance_of::<PyMemoryError>(py));
            let alloc = KvError::Device("cannot allocate 8 bytes".into());
            assert!(alloc.py().is_instance_of::<PyMemoryError>(py));
            let device = KvError::Device("no driver".into());
            assert!(device.py().is_instance_of::<DeviceError>(py));
            assert_eq!(Ok::<_, KvError>(3).py().unwrap(), 3);
        });
    }
}
