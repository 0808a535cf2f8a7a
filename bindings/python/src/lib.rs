//! The PyO3 bindings of kvrs: the `kvrs._kvrs` extension module of the Python package,
//! built by maturin (the root `pyproject.toml`). They are written over the core crate's
//! supported API and its `kvrs::unstable` internals (the dtype-erased cores).

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
mod masks;
mod output;
mod page_bytes;
mod pages;
mod pool;
mod pool_args;
mod pool_stats;
mod quant;
mod rope;
mod sequence;
mod shared_pool;
mod states;
mod suffix;
mod tiers;
mod views;

use crate::errors::ToPython;
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
    kvrs::unstable::cuda::device_count().is_ok_and(|n| n > 0)
}

/// The vector instructions the attention core runs with on this CPU
/// ("avx512f+bw+vl+dq+bf16", "avx512f+bw+vl+dq", "avx2+fma+f16c" or "portable").
#[pyfunction]
fn attention_simd() -> &'static str {
    kvrs::unstable::simd_level()
}

/// Sets the vector level attention runs with (`None`: the detected one; a level above
/// the CPU's is capped) and returns it: for tests and benchmarks comparing the kernels.
#[pyfunction]
#[pyo3(signature = (level=None))]
fn _set_attention_simd(level: Option<&str>) -> PyResult<&'static str> {
    kvrs::unstable::set_simd_level(level).ok_or_else(|| {
        pyo3::exceptions::PyValueError::new_err(format!(
            "level={:?}: not one of portable, avx2, avx512, avx512bf16",
            level.unwrap_or_default()
        ))
    })
}

/// The most blocks of `block_size` positions one sequence holds in a pool of these
/// layer kinds while it grows to `seq_len` positions in forward passes of at most
/// `max_chunk` new tokens (default `seq_len`: a whole prompt at once). Full-attention
/// tables need every block; sliding and chunked tables their window (with
/// `swa_memory`) plus what one pass adds. `num_blocks` for `n` such sequences at once
/// is `n` times this.
#[pyfunction]
#[pyo3(signature = (seq_len, *, block_size = 16, layer_types = None, sliding_window = None, chunk_size = None, swa_memory = 0, max_chunk = None))]
fn blocks_per_sequence(
    seq_len: i64,
    block_size: i64,
    layer_types: Option<Vec<String>>,
    sliding_window: Option<i64>,
    chunk_size: Option<i64>,
    swa_memory: i64,
    max_chunk: Option<i64>,
) -> PyResult<usize> {
    let seq_len = kvrs::unstable::check_count("seq_len", seq_len).py()?;
    let block_size = kvrs::unstable::check_size("block_size", block_size).py()?;
    let max_chunk = match max_chunk {
        None => seq_len,
        Some(c) => kvrs::unstable::check_size("max_chunk", c).py()?,
    };
    let layers = layer_types.as_ref().map_or(1, Vec::len);
    let attention =
        pool_args::attention(layers, layer_types, sliding_window, chunk_size, swa_memory)?;
    Ok(kvrs::unstable::LayerGroups::new(attention)
        .blocks_per_sequence(seq_len, max_chunk, block_size))
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
    m.add_class::<pages::PyPageStore>()?;
    m.add_class::<suffix::PySuffixIndex>()?;
    m.add_function(wrap_pyfunction!(cuda_available, m)?)?;
    m.add_function(wrap_pyfunction!(attention_simd, m)?)?;
    m.add_function(wrap_pyfunction!(_set_attention_simd, m)?)?;
    m.add_function(wrap_pyfunction!(blocks_per_sequence, m)?)?;
    m.add_function(wrap_pyfunction!(dlpack_export::host_array_capsule, m)?)?;
    m.add_function(wrap_pyfunction!(tiers::_flush_tiers_at_exit, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
