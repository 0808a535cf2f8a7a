//! A simulated CUDA device for tests on machines without a GPU (feature `cuda-sim`):
//! device memory is host memory and a launch runs `kernels/kvrs.cu` compiled for the host
//! (`kernels/sim/sim.cpp`, built by `build.rs`), block after block, each block's threads
//! as fibers where the kernel cooperates (barriers, shared memory, warp collectives).
//! The storage code above it is the one that runs on a GPU; only the driver calls
//! differ. A deadlock or divergent barrier in a kernel is a [`KvError::Device`].

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::{HashMap, HashSet};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use super::gpu::{Args, DevicePtr, EventHandle, Gpu, StreamHandle, LARGE_WORDS};
use crate::error::{KvError, Result};

extern "C" {
    /// Runs a kernel of `kernels/kvrs.cu` (or the simulator's test kernels); returns 0
    /// or a negative status whose reason `kvrs_sim_last_error` gives.
    fn kvrs_sim_launch(
        name: *const c_char,
        grid: *const u32,
        block: *const u32,
        shared_bytes: u32,
        params: *mut *mut c_void,
    ) -> c_int;
    /// The reason for the calling thread's last failed `kvrs_sim_launch`.
    fn kvrs_sim_last_error() -> *const c_char;
}

/// What a failed launch's status (`kvrs_sim::Status` in `kernels/sim/scheduler.h`) means.
fn launch_failure(status: c_int) -> &'static str {
    match status {
        -1 => "unknown kernel",
        -2 => "deadlock",
        -3 => "divergent barrier",
        -4 => "misused cooperation",
        -5 => "invalid launch",
        -6 => "out of memory",
        _ => "failure",
    }
}

/// Alignment of simulated device allocations (cudaMalloc's is 256 bytes).
const ALIGN: usize = 256;

/// One simulated device.
#[derive(Debug)]
pub struct SimGpu {
    ordinal: usize,
    allocations: Mutex<HashMap<DevicePtr, Layout>>,
    /// The allocations that stand for page-locked host memory.
    pinned: Mutex<HashSet<DevicePtr>>,
    /// Launches per kernel (base name).
    launches: Mutex<HashMap<String, u64>>,
    /// Events handed out.
    events: AtomicU64,
}

impl SimGpu {
    /// The simulated device `ordinal`, one per process.
    pub fn shared(ordinal: usize) -> Arc<dyn Gpu> {
        Self::get(ordinal)
    }

    fn get(ordinal: usize) -> Arc<SimGpu> {
        static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<SimGpu>>>> = OnceLock::new();
        let mut devices = DEVICES.get_or_init(Default::default).lock();
        devices
            .entry(ordinal)
            .or_insert_with(|| {
                Arc::new(SimGpu {
                    ordinal,
                    allocations: Mutex::new(HashMap::new()),
                    pinned: Mutex::new(HashSet::new()),
                    launches: Mutex::new(HashMap::new()),
                    events: AtomicU64::new(0),
                })
            })
            .clone()
    }
}

impl Gpu for SimGpu {
    fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// An H100's count, so that launches are planned as on one.
    fn sm_count(&self) -> usize {
        132
    }

    fn default_stream(&self) -> StreamHandle {
        0
    }

    fn alloc_zeroed(&self, bytes: usize) -> Result<DevicePtr> {
        let layout = Layout::from_size_align(bytes.max(1), ALIGN)
            .map_err(|e| KvError::Device(format!("cannot allocate {bytes} bytes: {e}")))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(KvError::Device(format!(
                "cannot allocate {bytes} bytes of (simulated) device memory"
            )));
        }
        self.allocations.lock().insert(ptr as DevicePtr, layout);
        Ok(ptr as DevicePtr)
    }

    unsafe fn free(&self, ptr: DevicePtr) {
        let layout = self
            .allocations
            .lock()
            .remove(&ptr)
            .expect("freeing memory this device did not allocate");
        dealloc(ptr as *mut u8, layout);
    }

    fn alloc_pinned(&self, bytes: usize) -> Result<*mut u8> {
        let ptr = self.alloc_zeroed(bytes)?;
        self.pinned.lock().insert(ptr);
        Ok(ptr as *mut u8)
    }

    unsafe fn free_pinned(&self, ptr: *mut u8) {
        assert!(
            self.pinned.lock().remove(&(ptr as DevicePtr)),
            "freeing pinned memory this device did not allocate"
        );
        self.free(ptr as DevicePtr);
    }

    unsafe fn htod(
        &self,
        dst: DevicePtr,
        src: *const u8,
        bytes: usize,
        _stream: StreamHandle,
    ) -> Result<()> {
        std::ptr::copy_nonoverlapping(src, dst as *mut u8, bytes);
        Ok(())
    }

    unsafe fn dtoh(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        bytes: usize,
        _stream: StreamHandle,
    ) -> Result<()> {
        std::ptr::copy_nonoverlapping(src as *const u8, dst, bytes);
        Ok(())
    }

    unsafe fn launch_shared(
        &self,
        name: &str,
        grid: [u32; 3],
        block: [u32; 3],
        shared_bytes: u32,
        args: &Args,
        _stream: StreamHandle,
    ) -> Result<()> {
        let base = ["_w480", "_w4000", "_wp"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(name);
        *self.launches.lock().entry(base.to_owned()).or_default() += 1;
        let c = CString::new(name).expect("kernel names have no NUL");
        let mut params = args.params();
        let status = kvrs_sim_launch(
            c.as_ptr(),
            grid.as_ptr(),
            block.as_ptr(),
            shared_bytes,
            params.as_mut_ptr(),
        );
        if status != 0 {
            // SAFETY: a NUL-terminated string of this thread, valid until its next launch.
            let why = CStr::from_ptr(kvrs_sim_last_error()).to_string_lossy();
            return Err(KvError::Device(format!(
                "simulated launch of {name} failed ({}): {why}",
                launch_failure(status)
            )));
        }
        Ok(())
    }

    fn synchronize(&self, _stream: StreamHandle) -> Result<()> {
        Ok(())
    }

    fn param_words(&self) -> usize {
        LARGE_WORDS
    }

    fn new_event(&self) -> Result<EventHandle> {
        Ok(self.events.fetch_add(1, Ordering::Relaxed) + 1)
    }

    unsafe fn record_event(&self, _event: EventHandle, _stream: StreamHandle) -> Result<()> {
        // Work runs when it is queued: every event is reached when recorded.
        Ok(())
    }

    unsafe fn stream_wait_event(&self, _stream: StreamHandle, _event: EventHandle) -> Result<()> {
        // Work runs when it is queued: nothing is ever left to wait for.
        Ok(())
    }

    unsafe fn wait_event(&self, _event: EventHandle) -> Result<()> {
        Ok(())
    }

    unsafe fn free_event(&self, _event: EventHandle) {}
}

/// Launches of kernel `name` on the simulated device `ordinal` so far (each instance of
/// a kernel taking launch words counts under its base name, `kvrs_copy_blocks` for
/// `kvrs_copy_blocks_w480`): what tests count to see that an operation is one launch.
pub fn launches(ordinal: usize, name: &str) -> u64 {
    let gpu = SimGpu::get(ordinal);
    let counts = gpu.launches.lock();
    counts.get(name).copied().unwrap_or(0)
}
