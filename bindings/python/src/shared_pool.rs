//! What a pool, its sequences and its forward batches share: the guarded core pool with
//! its fixed description, the sequences dropped while another thread held the lock, and
//! the arrays they hand out. The bindings of all three hold an `Arc` of it, so none of
//! them needs another's class.

use std::sync::atomic::{AtomicBool, Ordering};

use numpy::{PyArray1, PyArrayMethods};
use parking_lot::Mutex;
use pyo3::prelude::*;

use super::errors::ToPython;
use super::guarded::Guarded;
use super::input::Target;
use super::states::StateLayout;
use super::views::borrowed_view;
use kvrs::unstable::PoolCore;
use kvrs::{DType, Device, PagedShape, SeqId};

/// A pool's state behind `kvrs.BlockPool`, its `Sequence`s and its `ForwardBatch`es.
///
/// The core is reached only through [`SharedPool::read`] and [`SharedPool::write`]
/// (see [`super::guarded`]): no Python object is built or dropped while it is locked,
/// and no thread waits for it holding the GIL.
pub struct SharedPool {
    core: Guarded<PoolCore>,
    /// Sequences whose Python objects were dropped while the lock was held elsewhere:
    /// the next call that takes the lock frees them first.
    dropped: Mutex<Vec<SeqId>>,
    /// Whether `dropped` may be non-empty (checked without its lock).
    has_dropped: AtomicBool,
    /// Its sizes and layout (fixed).
    pub(crate) shape: PagedShape,
    /// Its storage dtype.
    pub(crate) dtype: DType,
    /// Where its storage lives.
    pub(crate) device: Device,
    /// Address of its storage (never reallocated).
    pub(crate) data: usize,
    /// Its storage's allocations: what no input may overlap.
    pub(crate) target: Target,
    /// Where its recurrent states live (pools with state layers).
    pub(crate) states: Option<StateLayout>,
}

impl SharedPool {
    /// Shares `core`.
    pub fn new(core: PoolCore) -> Self {
        let target = Target {
            device: core.device(),
            spans: core.storage_spans(),
        };
        SharedPool {
            shape: core.shape(),
            dtype: core.dtype(),
            device: core.device(),
            data: core.data_ptr() as usize,
            target,
            states: StateLayout::of(&core),
            core: Guarded::new(core),
            dropped: Mutex::new(Vec::new()),
            has_dropped: AtomicBool::new(false),
        }
    }

    /// Runs `f` on the pool under a shared lock (see [`Guarded::read`]).
    pub fn read<R: Send>(&self, py: Python<'_>, f: impl FnOnce(&PoolCore) -> R + Send) -> R {
        self.read_moving(py, 0, f)
    }

    /// Runs `f` on the pool under the exclusive lock (see [`Guarded::write`]).
    pub fn write<R: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut PoolCore) -> R + Send) -> R {
        self.write_moving(py, 0, f)
    }

    /// [`SharedPool::read`] for a call that moves `bytes` bytes (the GIL is released
    /// for large ones).
    pub fn read_moving<R: Send>(
        &self,
        py: Python<'_>,
        bytes: usize,
        f: impl FnOnce(&PoolCore) -> R + Send,
    ) -> R {
        if self.has_dropped.load(Ordering::Acquire) {
            return self.write_moving(py, bytes, |c| f(c));
        }
        self.core.read_moving(py, bytes, f)
    }

    /// [`SharedPool::write`] for a call that moves `bytes` bytes (the GIL is released
    /// for large ones).
    pub fn write_moving<R: Send>(
        &self,
        py: Python<'_>,
        bytes: usize,
        f: impl FnOnce(&mut PoolCore) -> R + Send,
    ) -> R {
        self.core.write_moving(py, bytes, |c| {
            self.free_dropped(c);
            f(c)
        })
    }

    /// [`SharedPool::write`] with the GIL released for the whole call: for calls that may
    /// wait on a disk or a server, or hash long prompts.
    pub fn write_detached<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut PoolCore) -> R + Send,
    ) -> R {
        self.write_moving(py, usize::MAX, f)
    }

    /// Frees sequence `id`, whose Python object is being dropped: at once when the lock is
    /// free, else by the next call that takes it. Never waits, so it is safe from a
    /// garbage collection that runs anywhere.
    pub fn release(&self, id: SeqId) {
        if let Some(mut c) = self.core.try_write_now() {
            self.free_dropped(&mut c);
            let _ = c.free_sequence(id);
            return;
        }
        self.dropped.lock().push(id);
        self.has_dropped.store(true, Ordering::Release);
    }

    /// Frees the sequences [`SharedPool::release`] queued (the caller holds the lock).
    fn free_dropped(&self, core: &mut PoolCore) {
        if !self.has_dropped.swap(false, Ordering::AcqRel) {
            return;
        }
        let ids = std::mem::take(&mut *self.dropped.lock());
        for id in ids {
            // Already gone (freed explicitly before its object was dropped): nothing to do.
            let _ = core.free_sequence(id);
        }
    }

    /// The pool's state layout; a ValueError for a pool without state layers.
    pub(crate) fn state_layout(&self) -> PyResult<&StateLayout> {
        self.states.as_ref().ok_or_else(|| {
            kvrs::KvError::InvalidArgument {
                name: "state_layers",
                value: "0".into(),
                reason: "this pool has no state layers: make it with state_layers, \
                         state_shapes and state_slots"
                    .into(),
            }
            .py()
        })
    }

    /// A read-only (or writable) view over `[...]` elements of the storage, owned by the
    /// `base` (the Python pool object): a NumPy array, or a `DeviceTensor` for a CUDA pool.
    pub(crate) fn view<'py>(
        &self,
        base: &Bound<'py, PyAny>,
        offset: usize,
        shape: &[usize],
        strides: &[usize],
        writeable: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let es = self.dtype.size();
        let byte_strides: Vec<isize> = strides.iter().map(|&s| (s * es) as isize).collect();
        // SAFETY: the pool's storage is never reallocated and lives as long as `base`.
        unsafe {
            borrowed_view(
                base,
                self.device,
                (self.data + offset * es) as *mut u8,
                self.dtype,
                shape,
                &byte_strides,
                writeable,
            )
        }
    }
}

/// An int32 NumPy array owning `v`.
pub(crate) fn i32_array<'py>(py: Python<'py>, v: Vec<i32>) -> Bound<'py, PyArray1<i32>> {
    PyArray1::from_vec(py, v)
}

/// Slots as an int64 array: `[n]` for one layer group, `[groups, n]` for several.
pub(crate) fn slot_array(
    py: Python<'_>,
    slots: Vec<i64>,
    groups: usize,
) -> PyResult<Bound<'_, PyAny>> {
    let n = slots.len() / groups.max(1);
    let arr = PyArray1::from_vec(py, slots);
    if groups == 1 {
        Ok(arr.into_any())
    } else {
        Ok(arr.reshape([groups, n])?.into_any())
    }
}
