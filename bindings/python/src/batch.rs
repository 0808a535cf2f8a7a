//! `kvrs.ForwardBatch`: ollama's StartForward / Put / Get over a pool.

use std::sync::Arc;

use numpy::{PyArray1, PyArrayMethods};
use parking_lot::Mutex;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use super::attention::{self, AttnArgs};
use super::errors::ToPython;
use super::input::{read_stacked, read_tensor};
use super::masks::read_mask;
use super::output::new_output;
use super::quant::read_dtype;
use super::sequence::PySequence;
use super::shared_pool::{slot_array, SharedPool};
use kvrs::unstable::{ForwardPlan, PlanMask};
use kvrs::AttnOptions;

/// A batch of tokens placed in a pool by `BlockPool.start_forward`.
///
/// It owns what it was started with: its sequences (kept alive, so a garbage collection
/// cannot free them under it), the token ids the pool will record for its tokens, and
/// the plan, whose blocks the pool checks on every use: once a sequence of the batch was
/// freed, truncated, forked or its blocks changed holder, `put`, `get` and `attention`
/// raise instead of touching another sequence's blocks.
#[pyclass(frozen, name = "ForwardBatch", module = "kvrs")]
pub struct PyForwardBatch {
    pool: Arc<SharedPool>,
    plan: ForwardPlan,
    /// The batch's distinct sequences, in order of first appearance.
    seqs: Vec<Py<PySequence>>,
    /// None while open; then "finished" or "cancelled".
    closed: Mutex<Option<&'static str>>,
}

impl PyForwardBatch {
    /// Wraps a plan the pool has reserved for the sequences `seqs` (distinct, in order of
    /// first appearance).
    pub fn new(pool: Arc<SharedPool>, plan: ForwardPlan, seqs: Vec<Py<PySequence>>) -> Self {
        PyForwardBatch {
            pool,
            plan,
            seqs,
            closed: Mutex::new(None),
        }
    }

    fn check_open(&self) -> PyResult<()> {
        match *self.closed.lock() {
            None => Ok(()),
            Some(state) => Err(PyValueError::new_err(format!(
                "this batch is already {state}"
            ))),
        }
    }
}

#[pymethods]
impl PyForwardBatch {
    /// `ForwardBatch[np.ndarray]` or `ForwardBatch[kvrs.DeviceTensor]`: the type of its reads, for
    /// annotations (the stub's generic parameter).
    #[classmethod]
    #[pyo3(signature = (item, /))]
    fn __class_getitem__<'py>(
        cls: &Bound<'py, pyo3::types::PyType>,
        item: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        super::generic_alias(cls, item)
    }

    /// Tokens in the batch.
    #[getter]
    fn num_tokens(&self) -> usize {
        self.plan.num_tokens()
    }

    /// Each token's slot (int64, vLLM's convention), for kernels that write K/V
    /// themselves: [n_tokens], or [num_layer_groups, n_tokens] when the pool's layers
    /// have several block tables (row pool.layer_group(layer) serves that layer).
    #[getter]
    fn slot_mapping<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        slot_array(py, self.plan.slots.clone(), self.plan.num_groups())
    }

    /// Each token's position in its sequence.
    #[getter]
    fn positions<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        PyArray1::from_iter(py, self.plan.positions.iter().map(|&p| p as i64))
    }

    /// The batch's sequences (each once, in order of first appearance).
    #[getter]
    fn sequences<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.seqs.iter().map(|s| s.clone_ref(py)))
    }

    /// Where each sequence's tokens start in the batch, then the number of tokens (int32,
    /// FlashInfer's and vLLM's `qo_indptr`, `len(sequences) + 1` entries). ValueError when
    /// a sequence's tokens are not one contiguous run of the batch.
    #[getter]
    fn qo_indptr<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let indptr = self.plan.qo_indptr().ok_or_else(|| {
            PyValueError::new_err(
                "qo_indptr: the batch's tokens of one sequence are not one contiguous run; \
                 pass start_forward each sequence's tokens together",
            )
        })?;
        // A batch's tokens are bounded by its slots, far below i32::MAX.
        Ok(PyArray1::from_iter(
            py,
            indptr.into_iter().map(|i| i as i32),
        ))
    }

    /// The batch index of each sequence's last token (int64, `sequences` order): the rows
    /// whose logits a sampler reads (`forward_batch(..., logits_to_keep="last")`).
    #[getter]
    fn last_token_indices<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        PyArray1::from_iter(
            py,
            self.plan.last_token_indices().into_iter().map(|i| i as i64),
        )
    }

    /// Each token's id as the pool will record it (int64): the ids given to
    /// start_forward(tokens=...), else those its sequence already knows there (its
    /// prompt); -1 where the pool knows none. A model must compute the batch's K/V from
    /// exactly these ids: the blocks they complete are cached under them.
    #[getter]
    fn token_ids<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        PyArray1::from_iter(
            py,
            self.plan.token_ids.iter().map(|t| t.map_or(-1, i64::from)),
        )
    }

    /// Positions of history that get(layer) returns: what each sequence of the batch
    /// holds in that layer, concatenated.
    #[pyo3(signature = (layer = 0))]
    fn history_len(&self, py: Python<'_>, layer: i64) -> PyResult<usize> {
        let plan = &self.plan;
        self.pool
            .read(py, |c| c.forward_history_len(plan, layer))
            .py()
    }

    /// Writes this layer's K and V for the batch's tokens ([n_tokens, heads, head_dim]).
    fn put(
        &self,
        py: Python<'_>,
        layer: i64,
        k: &Bound<'_, PyAny>,
        v: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.check_open()?;
        let pool = &self.pool;
        let (k, v) = (
            read_tensor(k, "k", &pool.target)?,
            read_tensor(v, "v", &pool.target)?,
        );
        let (kt, vt, plan) = (k.tensor(), v.tensor(), &self.plan);
        pool.write_moving(py, kt.nbytes() + vt.nbytes(), |c| {
            c.forward_write(plan, layer, &kt, &vt)
        })
        .py()?;
        Ok(())
    }

    /// put() of every layer in one call (one launch on a CUDA pool): k, v
    /// [num_layers, n_tokens, num_kv_heads, head_dim] (any layer stride).
    fn put_layers(
        &self,
        py: Python<'_>,
        k: &Bound<'_, PyAny>,
        v: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.check_open()?;
        let pool = &self.pool;
        let (k, v) = (
            read_stacked(k, "k", &pool.target)?,
            read_stacked(v, "v", &pool.target)?,
        );
        let (kl, vl, plan) = (k.layers(), v.layers(), &self.plan);
        let bytes = kl.iter().chain(&vl).map(|t| t.nbytes()).sum();
        pool.write_moving(py, bytes, |c| c.forward_write_layers(plan, &kl, &vl))
            .py()?;
        Ok(())
    }

    /// (K, V, mask): K and V [heads, history_len, head_dim] (the storage dtype; float32,
    /// dequantized, for 8-bit pools) cover every sequence of the
    /// batch, concatenated in order of first appearance; mask float32 [n_tokens,
    /// history_len] is 0 where a token may attend (its own sequence, up to its own
    /// position, and where custom_mask / packed_custom_mask allow it, as in attention())
    /// and -inf elsewhere.
    #[pyo3(signature = (layer, *, custom_mask = None, packed_custom_mask = None))]
    fn get<'py>(
        &self,
        py: Python<'py>,
        layer: i64,
        custom_mask: Option<&Bound<'py, PyAny>>,
        packed_custom_mask: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        self.check_open()?;
        let custom = read_mask(&self.plan, custom_mask, packed_custom_mask)?;
        let pool = &self.pool;
        let (h, hist, n) = (
            pool.shape.num_kv_heads,
            self.history_len(py, layer)?,
            self.plan.num_tokens(),
        );
        let dtype = read_dtype(pool.dtype);
        let mut k = new_output(py, pool.device, dtype, &[h, hist, pool.shape.head_dim])?;
        let mut v = new_output(py, pool.device, dtype, &[h, hist, pool.shape.v_head_dim])?;
        let mask = PyArray1::<f32>::zeros(py, n * hist, false);
        {
            // SAFETY: a fresh array nothing else references yet.
            let mut m = unsafe { mask.as_array_mut() };
            let m = m.as_slice_mut().expect("fresh contiguous array");
            let (mut kt, mut vt, plan) = (k.tensor(), v.tensor(), &self.plan);
            pool.read_moving(py, 2 * kt.nbytes(), |c| {
                let custom = custom.as_ref().map(PlanMask::as_custom);
                c.forward_get_masked(plan, layer, &mut kt, &mut vt, m, custom.as_ref())
            })
            .py()?;
        }
        let mask = mask.reshape([n, hist])?;
        PyTuple::new(py, [k.into_object(), v.into_object(), mask.into_any()])
    }

    /// Attention of the batch's tokens over `layer` (after `put(layer, ...)`), read in
    /// place from the pool's blocks: q [n_tokens, num_q_heads, head_dim] in batch order;
    /// each token attends to its own sequence up to its own position, within the
    /// layer's window. Returns a new array of q's shape and dtype, or fills `out`.
    ///
    /// custom_mask (bool, FlashInfer's layout: each sequence's [query tokens x KV
    /// length] row-major, concatenated in batch order, True = may attend) or
    /// packed_custom_mask (uint8, each sequence's bits packed alone in little bit order,
    /// FlashInfer's segment_packbits) restricts it further (tree attention); the batch's
    /// positions are then drafts, kept out of the prefix cache until Sequence.accept.
    #[pyo3(signature = (layer, q, *, out = None, scale = None, softcap = None, sinks = None, alibi_slopes = None, latent = false, custom_mask = None, packed_custom_mask = None))]
    #[allow(clippy::too_many_arguments)]
    fn attention<'py>(
        &self,
        py: Python<'py>,
        layer: i64,
        q: &Bound<'py, PyAny>,
        out: Option<&Bound<'py, PyAny>>,
        scale: Option<f64>,
        softcap: Option<f64>,
        sinks: Option<&Bound<'py, PyAny>>,
        alibi_slopes: Option<&Bound<'py, PyAny>>,
        latent: bool,
        custom_mask: Option<&Bound<'py, PyAny>>,
        packed_custom_mask: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let args = AttnArgs::parse(scale, softcap, sinks, alibi_slopes, latent)?;
        self.check_open()?;
        let custom = read_mask(&self.plan, custom_mask, packed_custom_mask)?;
        let (pool, plan) = (&self.pool, &self.plan);
        let out_dim = args.out_dim(pool.shape.head_dim, pool.shape.v_head_dim);
        attention::run(py, q, out, &pool.target, out_dim, |q, o| {
            let opts = AttnOptions {
                mask: custom.as_ref().map(PlanMask::as_custom),
                ..args.options()
            };
            pool.read_moving(py, usize::MAX, |c| {
                c.forward_attention(plan, layer, q, o, &opts)
            })
        })
    }

    /// Commits the batch: each sequence's seq_len moves past its new tokens. Refused
    /// (ValueError) when put() wrote some layers but not all.
    fn finish(&self, py: Python<'_>) -> PyResult<()> {
        self.check_open()?;
        let plan = &self.plan;
        self.pool.write(py, |c| c.finish_forward(plan)).py()?;
        *self.closed.lock() = Some("finished");
        Ok(())
    }

    /// Abandons the batch: the reserved positions are dropped again (not those of a
    /// sequence cut, freed or committed past them since: a stale batch cuts nothing).
    fn cancel(&self, py: Python<'_>) -> PyResult<()> {
        self.check_open()?;
        let plan = &self.plan;
        self.pool.write(py, |c| c.cancel_forward(plan));
        *self.closed.lock() = Some("cancelled");
        Ok(())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Finishes the batch, or cancels it when the block raised.
    #[pyo3(signature = (exc_type, _exc = None, _tb = None))]
    fn __exit__(
        &self,
        py: Python<'_>,
        exc_type: Option<&Bound<'_, PyAny>>,
        _exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        if self.closed.lock().is_some() {
            return Ok(());
        }
        match exc_type {
            Some(t) if !t.is_none() => self.cancel(py),
            _ => self.finish(py),
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "ForwardBatch(num_tokens={}, sequences={}, state={})",
            self.plan.num_tokens(),
            self.plan.seqs.len(),
            self.closed.lock().unwrap_or("open")
        )
    }
}
