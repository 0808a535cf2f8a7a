//! The device operations on the CUDA driver (cudarc's raw API, libcuda loaded at run
//! time): the device's primary context (PyTorch's, so addresses are valid in both), the
//! kernels' module loaded from the embedded PTX (or compiled with NVRTC when the driver
//! refuses that PTX), and kvrs's own stream. Launches find their function handle by
//! binary search over the PTX's kernels (each looked up once), and make the context
//! current only when it is not.

use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use parking_lot::Mutex;

use super::gpu::{Args, DevicePtr, EventHandle, Gpu, StreamHandle, LARGE_WORDS, SMALL_WORDS};
use crate::error::{KvError, Result};

/// The kernels, compiled to PTX for compute_80 by `make ptx`.
const PTX: &str = include_str!("../../../kernels/kvrs.ptx");
/// Their source, for NVRTC when the driver cannot load the PTX.
const SOURCE: &str = include_str!("../../../kernels/kvrs.cu");
/// The headers it includes, by the names it includes them as.
const HEADERS: [(&str, &str); 3] = [
    (
        "tensor_core.cuh",
        include_str!("../../../kernels/tensor_core.cuh"),
    ),
    (
        "attention_mma.cuh",
        include_str!("../../../kernels/attention_mma.cuh"),
    ),
    (
        "attention_mla.cuh",
        include_str!("../../../kernels/attention_mla.cuh"),
    ),
];

/// Dynamic shared memory a kernel may take without opting in (48 KB on every device).
const DEFAULT_SHARED: u32 = 48 * 1024;

/// One CUDA device, driven through its primary context.
#[derive(Debug)]
pub struct DriverGpu {
    ordinal: usize,
    ctx: sys::CUcontext,
    module: sys::CUmodule,
    /// The handle of each kernel of [`entries`], looked up on its first launch.
    functions: Box<[OnceLock<usize>]>,
    /// The dynamic shared memory each kernel of [`entries`] was allowed beyond the
    /// default [`DEFAULT_SHARED`] (0: none asked yet).
    shared_allowed: Box<[AtomicU32]>,
    stream: sys::CUstream,
    /// Streaming multiprocessors (the attention plan sizes its splits by them).
    sm_count: usize,
    /// Launch words a kernel parameter may hold (see [`Gpu::param_words`]).
    param_words: usize,
}

/// The kernels of the embedded PTX, sorted by name: a launch finds its function's slot
/// by binary search (no lock, no allocation).
fn entries() -> &'static [&'static str] {
    static ENTRIES: OnceLock<Vec<&'static str>> = OnceLock::new();
    ENTRIES.get_or_init(|| {
        let mut names: Vec<&'static str> = PTX
            .split(".visible .entry ")
            .skip(1)
            .filter_map(|rest| rest.split('(').next())
            .collect();
        names.sort_unstable();
        names
    })
}

// SAFETY: the context, module, functions and stream are driver handles, usable from any
// thread once the context is current there (every method makes it current first).
unsafe impl Send for DriverGpu {}
unsafe impl Sync for DriverGpu {}

fn driver_error(what: &str, e: cu::DriverError) -> KvError {
    KvError::Device(format!("{what}: {e:?}"))
}

impl DriverGpu {
    /// The device `ordinal` (which must exist), set up once per process.
    pub fn shared(ordinal: usize) -> Result<Arc<dyn Gpu>> {
        static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<DriverGpu>>>> = OnceLock::new();
        let mut devices = DEVICES.get_or_init(Default::default).lock();
        if let Some(g) = devices.get(&ordinal) {
            return Ok(g.clone());
        }
        let g = Arc::new(Self::open(ordinal)?);
        devices.insert(ordinal, g.clone());
        Ok(g)
    }

    fn open(ordinal: usize) -> Result<Self> {
        let what = |s: &str| format!("cuda:{ordinal}: {s}");
        let dev = cu::device::get(ordinal as i32)
            .map_err(|e| driver_error(&what("no such device"), e))?;
        // SAFETY: `dev` came from device::get.
        let ctx = unsafe { cu::primary_ctx::retain(dev) }
            .map_err(|e| driver_error(&what("cannot retain the primary context"), e))?;
        // SAFETY: a context just retained.
        unsafe { cu::ctx::set_current(ctx) }.map_err(|e| driver_error(&what("set_current"), e))?;
        let module = load_module().map_err(|why| KvError::Device(what(&why)))?;
        let sm = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT;
        // SAFETY: `dev` came from device::get.
        let sm_count = unsafe { cu::device::get_attribute(dev, sm) }
            .map_err(|e| driver_error(&what("cannot read the SM count"), e))?;
        let stream = cu::stream::create(cu::stream::StreamKind::Default)
            .map_err(|e| driver_error(&what("cannot create a stream"), e))?;
        // CUDA 12.1 raised the kernel parameter limit from 4 KB to 32 KB (Volta and
        // later; kvrs needs sm_80).
        let mut version = 0;
        // SAFETY: writes one int.
        let large = unsafe { sys::cuDriverGetVersion(&mut version) }
            .result()
            .is_ok()
            && version >= 12010;
        Ok(DriverGpu {
            ordinal,
            ctx,
            module,
            functions: (0..entries().len()).map(|_| OnceLock::new()).collect(),
            shared_allowed: (0..entries().len()).map(|_| AtomicU32::new(0)).collect(),
            stream,
            sm_count: sm_count.max(1) as usize,
            param_words: if large { LARGE_WORDS } else { SMALL_WORDS },
        })
    }

    /// Makes the device's primary context current on this thread, unless it is.
    fn current(&self) -> Result<()> {
        if cu::ctx::get_current().ok().flatten() == Some(self.ctx) {
            return Ok(());
        }
        // SAFETY: the primary context is retained for the process's life.
        unsafe { cu::ctx::set_current(self.ctx) }.map_err(|e| driver_error("set_current", e))
    }

    /// Kernel `name`'s index in [`entries`] and its function handle.
    fn function(&self, name: &str) -> Result<(usize, sys::CUfunction)> {
        let missing = || KvError::Device(format!("no kernel named {name} in kvrs's PTX"));
        let i = entries().binary_search(&name).map_err(|_| missing())?;
        if let Some(&f) = self.functions[i].get() {
            return Ok((i, f as sys::CUfunction));
        }
        let c = CString::new(name).expect("kernel names have no NUL");
        // SAFETY: the module stays loaded for the process's life.
        let f = unsafe { cu::module::get_function(self.module, c) }
            .map_err(|e| driver_error(&format!("kernel {name}"), e))?;
        Ok((
            i,
            *self.functions[i].get_or_init(|| f as usize) as sys::CUfunction,
        ))
    }

    /// Lets kernel `i` (function `f`) take `bytes` of dynamic shared memory, beyond
    /// [`DEFAULT_SHARED`] (asked of the driver once per kernel and size; no stream
    /// operation, so a launch being captured in a graph may ask).
    fn allow_shared(&self, i: usize, f: sys::CUfunction, bytes: u32, name: &str) -> Result<()> {
        if bytes <= DEFAULT_SHARED || self.shared_allowed[i].load(Ordering::Relaxed) >= bytes {
            return Ok(());
        }
        let attr = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        // SAFETY: a function of the loaded module.
        unsafe { cu::function::set_function_attribute(f, attr, bytes as i32) }
            .map_err(|e| driver_error(&format!("{name}: {bytes} bytes of shared memory"), e))?;
        self.shared_allowed[i].fetch_max(bytes, Ordering::Relaxed);
        Ok(())
    }
}

/// Loads the embedded PTX; when the driver refuses it (a driver older than the PTX),
/// compiles the embedded source with NVRTC.
fn load_module() -> std::result::Result<sys::CUmodule, String> {
    let ptx = CString::new(PTX).expect("PTX has no NUL");
    // SAFETY: a NUL-terminated PTX image.
    match unsafe { cu::module::load_data(ptx.as_ptr() as *const c_void) } {
        Ok(m) => Ok(m),
        Err(refused) => {
            let compiled = compile_with_nvrtc().map_err(|why| {
                format!(
                    "the driver refused kvrs's PTX ({refused:?}) and NVRTC could not compile the kernels: {why}. \
                     Update the NVIDIA driver, or install NVRTC (pip install nvidia-cuda-nvrtc, which PyTorch brings)"
                )
            })?;
            // SAFETY: NUL-terminated PTX from NVRTC.
            unsafe { cu::module::load_data(compiled.as_ptr() as *const c_void) }
                .map_err(|e| format!("the driver refused the PTX NVRTC made: {e:?}"))
        }
    }
}

/// The kernels compiled by NVRTC for compute_80, as NUL-terminated PTX.
fn compile_with_nvrtc() -> std::result::Result<Vec<std::ffi::c_char>, String> {
    use cudarc::nvrtc::result as rtc;
    // SAFETY: only tries to open the library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err("libnvrtc was not found".into());
    }
    let src = CString::new(SOURCE).expect("source has no NUL");
    let c = |s: &str| CString::new(s).expect("sources have no NUL");
    let (names, bodies): (Vec<CString>, Vec<CString>) =
        HEADERS.iter().map(|(n, b)| (c(n), c(b))).unzip();
    let names: Vec<*const std::ffi::c_char> = names.iter().map(|n| n.as_ptr()).collect();
    let bodies: Vec<*const std::ffi::c_char> = bodies.iter().map(|b| b.as_ptr()).collect();
    let mut prog = std::mem::MaybeUninit::uninit();
    // SAFETY: NUL-terminated source and headers, alive for the call (NVRTC copies them).
    let prog = unsafe {
        cudarc::nvrtc::sys::nvrtcCreateProgram(
            prog.as_mut_ptr(),
            src.as_ptr(),
            std::ptr::null(),
            HEADERS.len() as i32,
            bodies.as_ptr(),
            names.as_ptr(),
        )
        .result()
        .map_err(|e| format!("{e:?}"))?;
        prog.assume_init()
    };
    let mut options = vec![
        "--gpu-architecture=compute_80".to_string(),
        "-std=c++17".into(),
    ];
    for dir in include_dirs() {
        options.push(format!("--include-path={dir}"));
    }
    // SAFETY: `prog` was created above and is destroyed once, below.
    unsafe {
        let compiled = rtc::compile_program(prog, &options);
        let out = match compiled {
            Ok(()) => rtc::get_ptx(prog).map_err(|e| format!("{e:?}")),
            Err(e) => {
                let log = rtc::get_program_log(prog).unwrap_or_default();
                let log: Vec<u8> = log
                    .iter()
                    .map(|&c| c as u8)
                    .take_while(|&c| c != 0)
                    .collect();
                Err(format!("{e:?}: {}", String::from_utf8_lossy(&log)))
            }
        };
        let _ = rtc::destroy_program(prog);
        out
    }
}

/// Where cuda_fp16.h and cuda_bf16.h may be: `$CUDA_HOME/include`, `$CUDA_PATH/include`
/// and `/usr/local/cuda/include` (NVRTC also has them built in from CUDA 12.8).
fn include_dirs() -> Vec<String> {
    let mut dirs: Vec<String> = ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(|v| std::env::var(v).ok())
        .map(|root| format!("{root}/include"))
        .collect();
    dirs.push("/usr/local/cuda/include".into());
    dirs.retain(|d| std::path::Path::new(d).join("cuda_fp16.h").exists());
    dirs
}

impl Gpu for DriverGpu {
    fn ordinal(&self) -> usize {
        self.ordinal
    }

    fn sm_count(&self) -> usize {
        self.sm_count
    }

    fn default_stream(&self) -> StreamHandle {
        self.stream as StreamHandle
    }

    fn alloc_zeroed(&self, bytes: usize) -> Result<DevicePtr> {
        self.current()?;
        // SAFETY: plain device allocation (never managed memory), zeroed before use.
        unsafe {
            let p = cu::malloc_sync(bytes.max(1)).map_err(|e| {
                driver_error(
                    &format!("cannot allocate {bytes} bytes on cuda:{}", self.ordinal),
                    e,
                )
            })?;
            if let Err(e) = cu::memset_d8_sync(p, 0, bytes.max(1)) {
                let _ = cu::free_sync(p);
                return Err(driver_error("memset", e));
            }
            Ok(p)
        }
    }

    unsafe fn free(&self, ptr: DevicePtr) {
        if self.current().is_ok() {
            // Work still queued may use the memory: wait for it (freeing is rare).
            let _ = cu::ctx::synchronize();
            let _ = cu::free_sync(ptr);
        }
    }

    fn alloc_pinned(&self, bytes: usize) -> Result<*mut u8> {
        self.current()?;
        // SAFETY: a plain page-locked allocation; callers write before they read.
        unsafe { cu::malloc_host(bytes.max(1), 0) }
            .map(|p| p as *mut u8)
            .map_err(|e| driver_error(&format!("cannot page-lock {bytes} bytes of host memory"), e))
    }

    unsafe fn free_pinned(&self, ptr: *mut u8) {
        if self.current().is_ok() {
            let _ = cu::free_host(ptr as *mut c_void);
        }
    }

    unsafe fn htod(
        &self,
        dst: DevicePtr,
        src: *const u8,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        self.current()?;
        // From pageable memory the copy returns once `src` has been staged; from pinned
        // memory at once.
        let src = std::slice::from_raw_parts(src, bytes);
        cu::memcpy_htod_async(dst, src, stream as sys::CUstream)
            .map_err(|e| driver_error("htod", e))
    }

    unsafe fn dtoh(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        self.current()?;
        let dst = std::slice::from_raw_parts_mut(dst, bytes);
        cu::memcpy_dtoh_async(dst, src, stream as sys::CUstream)
            .map_err(|e| driver_error("dtoh", e))?;
        self.synchronize(stream)
    }

    unsafe fn launch_shared(
        &self,
        name: &str,
        grid: [u32; 3],
        block: [u32; 3],
        shared_bytes: u32,
        args: &Args,
        stream: StreamHandle,
    ) -> Result<()> {
        self.current()?;
        let (i, f) = self.function(name)?;
        self.allow_shared(i, f, shared_bytes, name)?;
        let mut params = args.params();
        cu::launch_kernel(
            f,
            (grid[0], grid[1], grid[2]),
            (block[0], block[1], block[2]),
            shared_bytes,
            stream as sys::CUstream,
            &mut params,
        )
        .map_err(|e| driver_error(&format!("launching {name}"), e))
    }

    fn synchronize(&self, stream: StreamHandle) -> Result<()> {
        self.current()?;
        // SAFETY: a stream handle of this context (or 0, the legacy default stream).
        unsafe { cu::stream::synchronize(stream as sys::CUstream) }
            .map_err(|e| driver_error("stream synchronize", e))
    }

    fn param_words(&self) -> usize {
        self.param_words
    }

    fn new_event(&self) -> Result<EventHandle> {
        self.current()?;
        cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map(|e| e as EventHandle)
            .map_err(|e| driver_error("event create", e))
    }

    unsafe fn record_event(&self, event: EventHandle, stream: StreamHandle) -> Result<()> {
        self.current()?;
        cu::event::record(event as sys::CUevent, stream as sys::CUstream)
            .map_err(|e| driver_error("event record", e))
    }

    unsafe fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> Result<()> {
        self.current()?;
        let flags = sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT;
        cu::stream::wait_event(stream as sys::CUstream, event as sys::CUevent, flags)
            .map_err(|e| driver_error("stream wait event", e))
    }

    unsafe fn wait_event(&self, event: EventHandle) -> Result<()> {
        self.current()?;
        cu::event::synchronize(event as sys::CUevent).map_err(|e| driver_error("event wait", e))
    }

    unsafe fn free_event(&self, event: EventHandle) {
        if self.current().is_ok() {
            let _ = cu::event::destroy(event as sys::CUevent);
        }
    }
}
