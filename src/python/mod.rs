//! PyO3 bindings (feature `python`): the `kvrs._kvrs` extension module.

mod args;
mod attention;
mod batch;
mod device_tensor;
mod dlpack_export;
mod encoder_cache;
mod errors;
mod guarded;
mod input;
mod kv_cache;
mod output;
mod pool;
mod pool_args;
mod pool_stats;
mod quant;
mod rope;
mod sequence;
mod shared_pool;
mod states;
mod tiers;
mod views;

use pyo3::prelude::*;

/// `types.GenericAlias(cls, item)`: what `KVCache[np.ndarray]` evaluates to, so the
/// stub's generic classes can be subscripted at run time as in annotations.
fn generic_alias<'py>(
    cls: &Bound<'py, pyo3::types::PyType>,
    item: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    cls.py()
        .import("types")?
        .getattr("GenericAlias")?
        .call1((cls, item))
}

/// Whether a CUDA driver and at least one CUDA device are present.
#[pyfunction]
fn cuda_available() -> bool {
    crate::storage::cuda::device_count().is_ok_and(|n| n > 0)
}

/// The vector instructions the attention core runs with on this CPU
/// ("avx2+fma+f16c" or "portable").
#[pyfunction]
fn attention_simd() -> &'static str {
    crate::attention::simd_level()
}

/// The compiled core of kvrs; import the `kvrs` package instead.
#[pymodule]
fn _kvrs(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    m.add_class::<kv_cache::PyKVCache>()?;
    m.add_class::<pool::PyBlockPool>()?;
    m.add_class::<sequence::PySequence>()?;
    m.add_class::<batch::PyForwardBatch>()?;
    m.add_class::<rope::PyRope>()?;
    m.add_class::<encoder_cache::PyEncoderCache>()?;
    m.add_class::<device_tensor::PyDeviceTensor>()?;
    m.add_class::<tiers::PyHostTier>()?;
    m.add_class::<tiers::PyDiskTier>()?;
    m.add_class::<tiers::PyRedisTier>()?;
    m.add_function(wrap_pyfunction!(cuda_available, m)?)?;
    m.add_function(wrap_pyfunction!(attention_simd, m)?)?;
    m.add_function(wrap_pyfunction!(dlpack_export::host_array_capsule, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
