//! The device operations the CUDA storage needs, behind one trait so that the same
//! storage code runs on the driver and on the host simulator; and kernel arguments, packed
//! the way `cuLaunchKernel` takes them.

use std::ffi::c_void;
use std::fmt;

use smallvec::SmallVec;

use crate::error::Result;

/// A device address.
pub type DevicePtr = u64;

/// A CUDA stream handle as an integer (0: the legacy default stream), as PyTorch's
/// `torch.cuda.current_stream().cuda_stream` and CuPy's `Stream.ptr` give it.
pub type StreamHandle = u64;

/// Threads per block of the element-wise kernels.
pub const THREADS: u32 = 256;

/// Launch words the `_w480` kernel instances take in a parameter (3,840 bytes: within the
/// 4 KB every driver takes).
pub const SMALL_WORDS: usize = 480;

/// Launch words the `_w4000` instances take in a parameter (32,000 bytes: CUDA 12.1's
/// large kernel parameters, Volta and later).
pub const LARGE_WORDS: usize = 4000;

/// A CUDA event handle as an integer.
pub type EventHandle = u64;

/// Device memory, copies and kernel launches on one CUDA device.
///
/// Every launch and copy is ordered on the stream it is given. Copies from the host
/// return once the host memory may be reused; copies to the host return once the data
/// is there.
pub trait Gpu: Send + Sync + fmt::Debug {
    /// The device ordinal.
    fn ordinal(&self) -> usize;
    /// The device's streaming multiprocessors (the attention split aims at a few blocks
    /// per SM).
    fn sm_count(&self) -> usize;
    /// The stream kvrs uses when a caller names none.
    fn default_stream(&self) -> StreamHandle;
    /// `bytes` of zeroed device memory.
    fn alloc_zeroed(&self, bytes: usize) -> Result<DevicePtr>;
    /// Frees memory from [`Gpu::alloc_zeroed`], after the work queued on every stream.
    ///
    /// # Safety
    /// `ptr` came from this device's `alloc_zeroed` and is freed once.
    unsafe fn free(&self, ptr: DevicePtr);
    /// `bytes` of page-locked host memory: the device copies to and from it at full
    /// bus speed, and copies from it are asynchronous (see [`Gpu::htod`]).
    fn alloc_pinned(&self, bytes: usize) -> Result<*mut u8>;
    /// Frees memory from [`Gpu::alloc_pinned`].
    ///
    /// # Safety
    /// `ptr` came from this device's `alloc_pinned`, no queued copy still uses it, and it
    /// is freed once.
    unsafe fn free_pinned(&self, ptr: *mut u8);
    /// Copies `bytes` from host memory `src` to `dst`. From pageable memory it returns
    /// once `src` may be reused; from [`Gpu::alloc_pinned`] memory it returns at once,
    /// and `src` may be reused when `stream` has reached the copy.
    ///
    /// # Safety
    /// Both ranges are valid.
    unsafe fn htod(
        &self,
        dst: DevicePtr,
        src: *const u8,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<()>;
    /// Copies `bytes` from `src` to host memory `dst`, waiting for them.
    ///
    /// # Safety
    /// Both ranges are valid.
    unsafe fn dtoh(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<()>;
    /// Launches kernel `name` of `kernels/kvrs.cu` without dynamic shared memory.
    ///
    /// # Safety
    /// `args` match the kernel's parameters and every address they hold is valid for
    /// what the kernel does with it.
    unsafe fn launch(
        &self,
        name: &str,
        grid: [u32; 3],
        block: [u32; 3],
        args: &Args,
        stream: StreamHandle,
    ) -> Result<()> {
        self.launch_shared(name, grid, block, 0, args, stream)
    }
    /// Launches kernel `name` of `kernels/kvrs.cu` with `shared_bytes` of dynamic shared
    /// memory per block (`KVRS_DYNAMIC_SHARED`).
    ///
    /// # Safety
    /// As [`Gpu::launch`].
    unsafe fn launch_shared(
        &self,
        name: &str,
        grid: [u32; 3],
        block: [u32; 3],
        shared_bytes: u32,
        args: &Args,
        stream: StreamHandle,
    ) -> Result<()>;
    /// Waits for the work queued on `stream`.
    fn synchronize(&self, stream: StreamHandle) -> Result<()>;
    /// The most launch words a kernel parameter may hold here: `LARGE_WORDS` where the
    /// driver takes 32 KB of parameters (CUDA 12.1 and later), else `SMALL_WORDS`.
    fn param_words(&self) -> usize;
    /// A new event (no timing), for [`Gpu::record_event`] and [`Gpu::wait_event`].
    fn new_event(&self) -> Result<EventHandle>;
    /// Marks the point `stream` has reached now with `event`.
    ///
    /// # Safety
    /// `event` came from this device's `new_event` and was not freed.
    unsafe fn record_event(&self, event: EventHandle, stream: StreamHandle) -> Result<()>;
    /// Makes the work later queued on `stream` wait, on the device, until the point
    /// `event` last marked (the host does not wait).
    ///
    /// # Safety
    /// As for [`Gpu::record_event`].
    unsafe fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> Result<()>;
    /// Waits until the stream reached the point `event` last marked.
    ///
    /// # Safety
    /// As for [`Gpu::record_event`].
    unsafe fn wait_event(&self, event: EventHandle) -> Result<()>;
    /// Frees an event (no wait).
    ///
    /// # Safety
    /// `event` came from this device's `new_event` and is freed once.
    unsafe fn free_event(&self, event: EventHandle);
}

/// Kernel arguments, each held in 8 bytes; the kernels read 4-byte ones from the low
/// half (every supported platform is little-endian). Launch words passed in a parameter
/// ([`Args::words`]) come first.
#[derive(Default, Debug)]
pub struct Args {
    words: Vec<u64>,
    values: SmallVec<[u64; 16]>,
}

impl Args {
    /// No arguments yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The launch words as the first parameter, a struct of `capacity` words (the
    /// kernel instance's; the rest zero).
    pub fn words(mut self, mut words: Vec<u64>, capacity: usize) -> Self {
        debug_assert!(words.len() <= capacity);
        words.resize(capacity, 0);
        self.words = words;
        self
    }

    /// `self`'s arguments after `other`'s.
    pub fn after(self, mut other: Args) -> Self {
        other.values.extend(self.values);
        other
    }

    /// A pointer or 64-bit integer argument.
    pub fn u64(mut self, v: u64) -> Self {
        self.values.push(v);
        self
    }

    /// A 64-bit signed integer argument.
    pub fn i64(self, v: i64) -> Self {
        self.u64(v as u64)
    }

    /// A 32-bit `float` argument.
    pub fn f32(self, v: f32) -> Self {
        self.u64(v.to_bits() as u64)
    }

    /// Appends a rank-3 region's element strides (three int64).
    pub fn strides(self, s: [isize; 3]) -> Self {
        self.i64(s[0] as i64).i64(s[1] as i64).i64(s[2] as i64)
    }

    /// Appends a rank-3 shape (three int64).
    pub fn dims(self, d: [usize; 3]) -> Self {
        self.i64(d[0] as i64).i64(d[1] as i64).i64(d[2] as i64)
    }

    /// A 32-bit `int` argument.
    pub fn i32(self, v: i32) -> Self {
        self.u64(v as u32 as u64)
    }

    /// The parameter array `cuLaunchKernel` takes: one pointer per argument, valid
    /// while `self` is.
    pub fn params(&self) -> SmallVec<[*mut c_void; 16]> {
        let words = (!self.words.is_empty()).then_some(self.words.as_ptr() as *mut c_void);
        words
            .into_iter()
            .chain(self.values.iter().map(|v| v as *const u64 as *mut c_void))
            .collect()
    }
}

/// Blocks of [`THREADS`] for a grid-stride loop over `n` elements (at least one block;
/// at most 65535, after which each thread takes several elements).
pub fn blocks_for(n: usize) -> u32 {
    n.div_ceil(THREADS as usize).clamp(1, 65535) as u32
}
