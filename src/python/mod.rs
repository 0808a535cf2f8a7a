//! PyO3 bindings (feature `python`): the `kvrs._kvrs` extension module.

mod args;
mod errors;
mod input;
mod kv_cache;
mod views;

use pyo3::prelude::*;

/// The compiled core of kvrs; import the `kvrs` package instead.
#[pymodule]
fn _kvrs(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    m.add_class::<kv_cache::PyKVCache>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
