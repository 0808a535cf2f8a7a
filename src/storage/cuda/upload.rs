//! The launch path: a launch's small arrays ("launch words": slots, block tables, block
//! pairs, per-layer addresses) go to the kernel without stalling the host.
//!
//! - Up to [`Gpu::param_words`] words travel as a kernel parameter ([`CudaStorage::launch_words`]
//!   picks the `_w480` or `_w4000` instance): no copy precedes the launch, so it can be
//!   captured in a CUDA graph.
//! - More (and the arrays of other launches: [`CudaStorage::with_upload`]) are copied from
//!   page-locked host memory into the device staging buffer, asynchronously: a ring of
//!   [`RING`] page-locked buffers, each reused once the copy that last read it has run
//!   (an event per buffer), so the host waits only when it is [`RING`] uploads ahead of
//!   the device. Where no page-locked memory can be had, the copy goes from pageable
//!   memory (the driver stages it, and may wait).
//!
//! Invariants: the device staging buffer is written only in stream order (when
//! [`CudaStorage::set_stream`] changes the stream, the new one waits on the device for the
//! work queued on the old one: no host synchronisation); a page-locked buffer is
//! overwritten or freed only after its event (recorded after the copy that reads it) has
//! completed.

use super::gpu::{Args, DevicePtr, EventHandle, Gpu, StreamHandle, LARGE_WORDS, SMALL_WORDS};
use super::kernels::WordsKernel;
use super::storage::CudaStorage;
use crate::error::Result;

/// Page-locked upload buffers per storage.
const RING: usize = 4;

/// Smallest device staging buffer.
pub(super) const MIN_STAGING: usize = 64 << 10;

/// Smallest page-locked upload buffer.
const MIN_PINNED: usize = 4 << 10;

/// Device memory for a launch's small arguments and for host transfers, and the host
/// memory they are assembled and uploaded from; all grow when a call needs more, never
/// per call.
#[derive(Debug)]
pub(super) struct Staging {
    pub(super) ptr: DevicePtr,
    pub(super) bytes: usize,
    /// Where `fill` writes the words.
    host: Vec<u64>,
    /// The event that orders a new stream after the previous one ([`CudaStorage::set_stream`]).
    switch: Option<EventHandle>,
    ring: [Pinned; RING],
    next: usize,
}

/// One page-locked upload buffer and the event recorded after the copy that last read it.
#[derive(Debug, Default)]
struct Pinned {
    ptr: usize,
    bytes: usize,
    event: Option<EventHandle>,
    /// Whether `event` marks a copy still to be waited for.
    pending: bool,
}

impl Staging {
    /// A staging buffer of [`MIN_STAGING`] bytes at `ptr`.
    pub(super) fn new(ptr: DevicePtr) -> Self {
        Staging {
            ptr,
            bytes: MIN_STAGING,
            host: Vec::new(),
            switch: None,
            ring: Default::default(),
            next: 0,
        }
    }

    /// Frees the device buffer, the page-locked buffers and their events (after the
    /// copies still reading them).
    pub(super) fn release(&mut self, gpu: &dyn Gpu) {
        if let Some(e) = self.switch.take() {
            // SAFETY: an event of this gpu, freed once.
            unsafe { gpu.free_event(e) };
        }
        for p in &mut self.ring {
            // SAFETY: the events and buffers came from this gpu and are freed once; a
            // failed wait leaks the buffer rather than free memory a copy still reads.
            unsafe {
                if let Some(e) = p.event.take() {
                    let settled = !p.pending || gpu.wait_event(e).is_ok();
                    gpu.free_event(e);
                    if !settled {
                        continue;
                    }
                }
                if p.ptr != 0 {
                    gpu.free_pinned(p.ptr as *mut u8);
                }
            }
            p.ptr = 0;
        }
        // SAFETY: allocated by this gpu's alloc_zeroed, freed once.
        unsafe { gpu.free(self.ptr) };
    }
}

impl CudaStorage {
    /// Uploads the words `fill` writes (into the reused host buffer) to the staging
    /// buffer and runs `f` with its address while the buffer is held, so `f` can queue
    /// the kernels that read it.
    pub(super) fn with_upload<R>(
        &self,
        fill: impl FnOnce(&mut Vec<u64>),
        f: impl FnOnce(DevicePtr) -> Result<R>,
    ) -> Result<R> {
        self.with_upload_and_scratch(fill, 0, |base, _| f(base))
    }

    /// [`Self::with_upload`], with `scratch` more bytes of device memory for the
    /// launches' own use, passed to `f` after the upload's address (256-byte aligned;
    /// valid while `f` runs, and reused by later calls on the stream order).
    pub(super) fn with_upload_and_scratch<R>(
        &self,
        fill: impl FnOnce(&mut Vec<u64>),
        scratch: usize,
        f: impl FnOnce(DevicePtr, DevicePtr) -> Result<R>,
    ) -> Result<R> {
        let stream = self.stream();
        let mut st = self.staging.lock();
        let mut host = std::mem::take(&mut st.host);
        host.clear();
        fill(&mut host);
        let bytes = std::mem::size_of_val(host.as_slice());
        let scratch_at = bytes.next_multiple_of(256);
        let staged = self
            .reserve_staging(&mut st, scratch_at + scratch)
            .and_then(|()| self.upload(&mut st, &host, stream));
        st.host = host;
        staged?;
        f(st.ptr, st.ptr + scratch_at as u64)
    }

    /// Copies `words` to the start of the staging buffer (reserved), through the next
    /// page-locked buffer of the ring.
    fn upload(&self, st: &mut Staging, words: &[u64], stream: StreamHandle) -> Result<()> {
        let bytes = std::mem::size_of_val(words);
        if bytes == 0 {
            return Ok(());
        }
        let gpu = self.gpu.as_ref();
        let i = st.next;
        st.next = (i + 1) % RING;
        let dst = st.ptr;
        let p = &mut st.ring[i];
        if let Some(e) = p.event.filter(|_| p.pending) {
            // SAFETY: an event of this gpu.
            unsafe { gpu.wait_event(e)? };
            p.pending = false;
        }
        if p.bytes < bytes {
            if p.ptr != 0 {
                // SAFETY: allocated below by an earlier upload; its copy has run (above).
                unsafe { gpu.free_pinned(p.ptr as *mut u8) };
                p.ptr = 0;
                p.bytes = 0;
            }
            let size = bytes.next_power_of_two().max(MIN_PINNED);
            if let Ok(ptr) = gpu.alloc_pinned(size) {
                p.ptr = ptr as usize;
                p.bytes = size;
            }
        }
        if p.ptr == 0 || p.event.is_none() && p.event_failed(gpu) {
            // No page-locked memory (or no event to know when it is free again): the
            // driver stages the pageable words itself.
            // SAFETY: the staging buffer holds `bytes` (reserved by the caller).
            return unsafe { gpu.htod(dst, words.as_ptr() as *const u8, bytes, stream) };
        }
        let event = p.event.expect("made above");
        // SAFETY: `p.ptr` holds at least `bytes`, free to overwrite (its last copy has
        // run); the copy reads it asynchronously, and `event` marks when it has.
        unsafe {
            std::ptr::copy_nonoverlapping(words.as_ptr() as *const u8, p.ptr as *mut u8, bytes);
            gpu.htod(dst, p.ptr as *const u8, bytes, stream)?;
            gpu.record_event(event, stream)?;
        }
        p.pending = true;
        Ok(())
    }

    /// Makes the staging buffer at least `bytes` long (it is safe to overwrite on the
    /// current stream: see the invariants above).
    pub(super) fn reserve_staging(&self, st: &mut Staging, bytes: usize) -> Result<()> {
        if bytes > st.bytes {
            let size = bytes.max(2 * st.bytes);
            let fresh = self.gpu.alloc_zeroed(size)?;
            // SAFETY: the old buffer came from alloc_zeroed; free waits for queued work.
            unsafe { self.gpu.free(st.ptr) };
            st.ptr = fresh;
            st.bytes = size;
        }
        Ok(())
    }

    /// Launches `kernel` with `words` as its launch words and `args` after them: in a
    /// kernel parameter when they fit ([`Gpu::param_words`]), else uploaded.
    pub(super) fn launch_words(
        &self,
        kernel: WordsKernel,
        words: Vec<u64>,
        args: Args,
        grid: [u32; 3],
        block: [u32; 3],
    ) -> Result<()> {
        let n = words.len();
        let inline = match n {
            _ if n <= SMALL_WORDS => Some((kernel.small, SMALL_WORDS)),
            _ if n <= LARGE_WORDS && self.gpu.param_words() >= LARGE_WORDS => {
                Some((kernel.large, LARGE_WORDS))
            }
            _ => None,
        };
        // SAFETY (each launch): the callers checked every address the words and
        // arguments hold (see each), and the kernel instance matches how the words go.
        if let Some((name, capacity)) = inline {
            let args = args.after(Args::new().words(words, capacity));
            return unsafe { self.gpu.launch(name, grid, block, &args, self.stream()) };
        }
        self.with_upload(
            |w| w.extend_from_slice(&words),
            |base| {
                let args = args.after(Args::new().u64(base));
                unsafe {
                    self.gpu
                        .launch(kernel.pointer, grid, block, &args, self.stream())
                }
            },
        )
    }
}

impl Pinned {
    /// Makes the buffer's event; true when that fails.
    fn event_failed(&mut self, gpu: &dyn Gpu) -> bool {
        match gpu.new_event() {
            Ok(e) => {
                self.event = Some(e);
                false
            }
            Err(_) => true,
        }
    }
}

impl CudaStorage {
    /// Orders the work later queued on `to` after the work queued on `from` so far, on the
    /// device (an event recorded on `from` that `to` waits for): the host does not wait.
    pub(super) fn order_streams(&self, from: StreamHandle, to: StreamHandle) -> Result<()> {
        let mut st = self.staging.lock();
        let e = match st.switch {
            Some(e) => e,
            None => *st.switch.insert(self.gpu.new_event()?),
        };
        // SAFETY: an event of this gpu, not freed while the staging lock is held.
        unsafe {
            self.gpu.record_event(e, from)?;
            self.gpu.stream_wait_event(to, e)
        }
    }
}
