//! The Python exception hierarchy and the mapping from the core's error.

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyIndexError, PyMemoryError, PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::error::KvError;

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

impl From<KvError> for PyErr {
    fn from(e: KvError) -> PyErr {
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
            KvError::Device(ref m) if m.starts_with("cannot allocate") => {
                PyMemoryError::new_err(msg)
            }
            KvError::Device(_) => DeviceError::new_err(msg),
        }
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
