//! `kvrs.SuffixIndex`: the cache-wide suffix index of speculative decoding
//! ([`kvrs::SuffixIndex`]) behind a lock, shared with the pool that holds it
//! (`BlockPool.suffix_index`, counted in `BlockPool.stats()`).

use std::sync::Arc;

use parking_lot::Mutex;
use pyo3::exceptions::{PyKeyError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::errors::to_py;
use super::input::read_token_ids;
use super::pool_args::key_bytes;
use kvrs::{SuffixIndex, SuffixParams, SuffixStats};

/// The index a pool holds and its Python handles share.
pub type SharedSuffix = Arc<Mutex<SuffixIndex>>;

/// Default token budget of an index (at most about 0.5 GiB at the default depth).
pub const DEFAULT_MAX_TOKENS: usize = 1 << 18;
/// Default longest window, match plus draft (vLLM's `suffix_decoding_max_tree_depth`).
pub const DEFAULT_MAX_DEPTH: usize = 24;

/// A new shared index of the default sizes.
pub fn default_index() -> SharedSuffix {
    Arc::new(Mutex::new(
        SuffixIndex::new(DEFAULT_MAX_TOKENS, DEFAULT_MAX_DEPTH).expect("valid default sizes"),
    ))
}

/// Token sequences by namespace, drafting what followed a request's last tokens in any
/// of them (SuffixDecoding): bounded to `max_tokens` tokens, least recently written
/// sequences evicted first; thread-safe.
#[pyclass(frozen, name = "SuffixIndex", module = "kvrs")]
pub struct PySuffixIndex {
    pub(crate) inner: SharedSuffix,
}

fn handle_of(handle: &Bound<'_, PyAny>) -> PyResult<u64> {
    let h: i128 = handle
        .extract()
        .map_err(|_| PyValueError::new_err(format!("handle={handle}: give an int from add()")))?;
    u64::try_from(h).map_err(|_| PyKeyError::new_err(format!("handle={h}: no such sequence")))
}

fn unknown(h: u64) -> PyErr {
    PyKeyError::new_err(format!(
        "handle={h}: the suffix index holds no such sequence (never added, removed or evicted)"
    ))
}

fn size(value: i64, name: &'static str, min: i64) -> PyResult<usize> {
    if value < min {
        return Err(PyValueError::new_err(format!(
            "{name}={value}: must be >= {min}"
        )));
    }
    usize::try_from(value).map_err(|_| PyValueError::new_err(format!("{name}={value}: too large")))
}

/// Puts an index's stats into `d`, each key prefixed with `prefix`.
pub fn put_stats(d: &Bound<'_, PyDict>, s: &SuffixStats, prefix: &str) -> PyResult<()> {
    d.set_item(format!("{prefix}sequences"), s.sequences)?;
    d.set_item(format!("{prefix}tokens"), s.tokens)?;
    d.set_item(format!("{prefix}max_tokens"), s.max_tokens)?;
    d.set_item(format!("{prefix}nodes"), s.nodes)?;
    d.set_item(format!("{prefix}bytes"), s.bytes)?;
    d.set_item(format!("{prefix}evictions"), s.evictions)?;
    d.set_item(format!("{prefix}lookups"), s.lookups)?;
    d.set_item(format!("{prefix}hits"), s.hits)?;
    Ok(())
}

#[pymethods]
impl PySuffixIndex {
    /// An empty index of at most `max_tokens` tokens, windows of at most `max_depth`.
    #[new]
    #[pyo3(signature = (max_tokens = 262_144, max_depth = 24))]
    fn new(max_tokens: i64, max_depth: i64) -> PyResult<Self> {
        let t = size(max_tokens, "max_tokens", 1)?;
        let d = size(max_depth, "max_depth", 2)?;
        Ok(PySuffixIndex {
            inner: Arc::new(Mutex::new(SuffixIndex::new(t, d).map_err(to_py)?)),
        })
    }

    /// The token budget.
    #[getter]
    fn max_tokens(&self) -> usize {
        self.inner.lock().max_tokens()
    }

    /// The longest window: match plus draft.
    #[getter]
    fn max_depth(&self) -> usize {
        self.inner.lock().max_depth()
    }

    /// Adds `tokens` as a new sequence of `namespace` (and `extra_key`); returns its
    /// handle. Least recently written sequences go when over `max_tokens`.
    #[pyo3(signature = (tokens, *, namespace = None, extra_key = None))]
    fn add(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        namespace: Option<&Bound<'_, PyAny>>,
        extra_key: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u64> {
        let t = read_token_ids(tokens, "tokens")?;
        let ns = key_bytes(namespace, "namespace")?;
        let extra = key_bytes(extra_key, "extra_key")?;
        Ok(py.detach(|| self.inner.lock().insert(&ns, &extra, &t)))
    }

    /// Appends `tokens` to sequence `handle` (KeyError when not retained); tokens past
    /// `max_tokens` of one sequence are not indexed.
    fn extend(
        &self,
        py: Python<'_>,
        handle: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let h = handle_of(handle)?;
        let t = read_token_ids(tokens, "tokens")?;
        py.detach(|| self.inner.lock().extend(h, &t))
            .map_err(|_| unknown(h))
    }

    /// Removes sequence `handle`; False when it was not retained.
    fn remove(&self, handle: &Bound<'_, PyAny>) -> bool {
        match handle_of(handle) {
            Ok(h) => self.inner.lock().remove(h),
            Err(_) => false,
        }
    }

    /// The retained tokens of sequence `handle` (KeyError when not retained).
    fn tokens(&self, handle: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let h = handle_of(handle)?;
        self.inner
            .lock()
            .tokens(h)
            .map(<[u32]>::to_vec)
            .ok_or_else(|| unknown(h))
    }

    /// Handles of the retained sequences, least recently written first.
    fn handles(&self) -> Vec<u64> {
        self.inner.lock().handles()
    }

    fn __contains__(&self, handle: &Bound<'_, PyAny>) -> bool {
        handle_of(handle).is_ok_and(|h| self.inner.lock().contains(h))
    }

    fn __len__(&self) -> usize {
        self.inner.lock().stats().sequences
    }

    /// The draft after `context` from the sequences of `namespace` (and `extra_key`):
    /// ``(tokens, probabilities, match_len)``; empty when nothing matches. At most
    /// `max_tokens` tokens, ``floor(match_len * max_spec_factor + max_spec_offset)``,
    /// each kept while its path probability is at least `min_token_prob`.
    #[pyo3(signature = (context, *, namespace = None, extra_key = None, max_tokens = 16, max_spec_factor = 1.0, max_spec_offset = 0.0, min_token_prob = 0.1))]
    #[allow(clippy::too_many_arguments)]
    fn speculate(
        &self,
        py: Python<'_>,
        context: &Bound<'_, PyAny>,
        namespace: Option<&Bound<'_, PyAny>>,
        extra_key: Option<&Bound<'_, PyAny>>,
        max_tokens: i64,
        max_spec_factor: f64,
        max_spec_offset: f64,
        min_token_prob: f64,
    ) -> PyResult<(Vec<u32>, Vec<f64>, usize)> {
        let ctx = read_token_ids(context, "context")?;
        let ns = key_bytes(namespace, "namespace")?;
        let extra = key_bytes(extra_key, "extra_key")?;
        let max_tokens = size(max_tokens, "max_tokens", 0)?;
        if !(max_spec_factor.is_finite() && max_spec_factor >= 0.0) {
            return Err(PyValueError::new_err(format!(
                "max_spec_factor={max_spec_factor}: must be a finite number >= 0"
            )));
        }
        if !max_spec_offset.is_finite() {
            return Err(PyValueError::new_err(format!(
                "max_spec_offset={max_spec_offset}: must be finite"
            )));
        }
        if !(0.0..=1.0).contains(&min_token_prob) {
            return Err(PyValueError::new_err(format!(
                "min_token_prob={min_token_prob}: must be in [0, 1]"
            )));
        }
        let params = SuffixParams {
            max_tokens,
            max_spec_factor,
            max_spec_offset,
            min_token_prob,
        };
        let d = py.detach(|| self.inner.lock().speculate(&ns, &extra, &ctx, &params));
        Ok((d.tokens, d.probs, d.match_len))
    }

    /// Removes every sequence (counters kept).
    fn clear(&self) {
        self.inner.lock().clear();
    }

    /// Size and counters: sequences, tokens, max_tokens, nodes, bytes, evictions,
    /// lookups, hits.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.lock().stats();
        let d = PyDict::new(py);
        put_stats(&d, &s, "")?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        let s = self.inner.lock().stats();
        format!(
            "SuffixIndex(sequences={}, tokens={}, max_tokens={}, max_depth={})",
            s.sequences,
            s.tokens,
            s.max_tokens,
            self.inner.lock().max_depth()
        )
    }
}
