//! [`CudaStorage`]: keys and values in device memory, read and written by the kernels of
//! `kernels/kvrs.cu`. Tensors on the same device are read and written in place; host
//! tensors (kvrs's own transfers: persistence, rotations, extraction to NumPy) go through
//! a device staging buffer. The paged pool's bulk operations are one launch each.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::gpu::{blocks_for, Args, DevicePtr, Gpu, StreamHandle, THREADS};
use super::kernels::{kernel, zero_kernel, Kernel};
use super::paged::ScatterLayer;
use super::pinned::PinnedBuffer;
use super::scaling::{DeviceScaler, Scratch};
use super::upload::{Staging, MIN_STAGING};
use crate::dtype::DType;
use crate::error::{KvError, Result};
use crate::layout::{BlockId, PagedShape};
use crate::storage::int8::{check_scales_len, scale_region};
use crate::storage::{paged_ops, Device, LayerRows, PagedTensor, Region, RowScales, Storage};
use crate::tensor::{copy_strided, TensorMut, TensorRef, MAX_RANK};

/// Keys and values in the memory of one CUDA device.
#[derive(Debug)]
pub struct CudaStorage {
    pub(super) gpu: Arc<dyn Gpu>,
    ptr: DevicePtr,
    dtype: DType,
    numel: usize,
    /// The stream launches go to (see [`CudaStorage::set_stream`]).
    stream: AtomicU64,
    pub(super) staging: Mutex<Staging>,
    /// The device-resident position counter of a contiguous cache, made on first use.
    pub(super) counter: Mutex<Option<DevicePtr>>,
    /// int8: the float32 scale of every chunk of `head_dim` elements (`numel / head_dim`,
    /// addressed by the codes' regions divided by `head_dim`, as on the host).
    pub(super) scales: Option<Box<CudaStorage>>,
    /// Elements per scale (int8); 1 otherwise.
    pub(super) head_dim: usize,
    /// Device memory for fp8 scaling of device tensors ([`DeviceScaler`]).
    scratch: Arc<Mutex<Scratch>>,
    /// Float32 zeros the size of one token's K (every head) and their number, made on
    /// first use (and grown for a larger token): what [`Storage::zero_slots`] scatters.
    zero_row: Mutex<Option<(DevicePtr, usize)>>,
    /// Page-locked host memory the block swaps pass through, made on first use.
    pub(super) pinned: Mutex<PinnedBuffer>,
}

impl CudaStorage {
    /// `numel` zeroed elements of `dtype` on CUDA device `ordinal`; int8 keeps a scale per
    /// `head_dim` elements (the scale unit, `gcd(head_dim, v_head_dim)` of the cache:
    /// one per head vector for one head size); other dtypes ignore it.
    pub fn zeroed(ordinal: usize, dtype: DType, numel: usize, head_dim: usize) -> Result<Self> {
        Self::on(super::gpu_for(ordinal)?, dtype, numel, head_dim)
    }

    /// `numel` zeroed elements of `dtype` on `gpu`; int8 keeps a scale per `head_dim`
    /// elements (the scale unit, as in [`CudaStorage::zeroed`]); other dtypes ignore it.
    pub fn on(gpu: Arc<dyn Gpu>, dtype: DType, numel: usize, head_dim: usize) -> Result<Self> {
        let scales = if dtype == DType::I8 {
            if head_dim == 0 || !numel.is_multiple_of(head_dim) {
                return Err(KvError::InvalidArgument {
                    name: "head_dim",
                    value: head_dim.to_string(),
                    reason: format!("must divide the storage's {numel} elements"),
                });
            }
            Some(Box::new(Self::on(
                gpu.clone(),
                DType::F32,
                numel / head_dim,
                1,
            )?))
        } else {
            None
        };
        let bytes = numel
            .checked_mul(dtype.size())
            .ok_or_else(|| KvError::InvalidArgument {
                name: "size",
                value: format!("{numel} {dtype} elements"),
                reason: "exceeds the address space".into(),
            })?;
        let ptr = gpu.alloc_zeroed(bytes)?;
        let stream = gpu.default_stream();
        let staging = match gpu.alloc_zeroed(MIN_STAGING) {
            Ok(p) => p,
            Err(e) => {
                // SAFETY: allocated just above, freed once.
                unsafe { gpu.free(ptr) };
                return Err(e);
            }
        };
        Ok(CudaStorage {
            gpu,
            ptr,
            dtype,
            numel,
            stream: AtomicU64::new(stream),
            staging: Mutex::new(Staging::new(staging)),
            counter: Mutex::new(None),
            scales,
            head_dim: if dtype == DType::I8 { head_dim } else { 1 },
            scratch: Arc::new(Mutex::new(Scratch::default())),
            pinned: Mutex::new(PinnedBuffer::default()),
            zero_row: Mutex::new(None),
        })
    }

    /// The device address of at least `n` float32 zeros, made on first use (and again
    /// when a call needs more).
    fn zero_row(&self, n: usize) -> Result<DevicePtr> {
        let mut z = self.zero_row.lock();
        match *z {
            Some((p, len)) if len >= n => return Ok(p),
            Some((p, _)) => {
                // SAFETY: allocated below by an earlier call, freed once (after the
                // queued work that reads it).
                unsafe { self.gpu.free(p) };
                *z = None;
            }
            None => {}
        }
        let p = self.gpu.alloc_zeroed(4 * n.max(1))?;
        *z = Some((p, n));
        Ok(p)
    }

    /// Sends later launches to `stream` (`None`: kvrs's own stream of the device), after
    /// the work queued on the previous stream: the new stream waits for it on the device
    /// (an event), so the host never waits and the call may come while `stream` is being
    /// captured in a CUDA graph.
    pub fn set_stream(&self, stream: Option<StreamHandle>) -> Result<()> {
        let s = stream.unwrap_or_else(|| self.gpu.default_stream());
        let old = self.stream.swap(s, Ordering::Relaxed);
        if old != s {
            self.order_streams(old, s)?;
        }
        if let Some(scales) = &self.scales {
            scales.set_stream(stream)?;
        }
        Ok(())
    }

    /// The stream launches go to now.
    pub fn stream(&self) -> StreamHandle {
        self.stream.load(Ordering::Relaxed)
    }

    /// The device operations behind this storage.
    pub fn gpu(&self) -> &Arc<dyn Gpu> {
        &self.gpu
    }

    pub(super) fn device_addr(&self, offset: usize) -> DevicePtr {
        self.ptr + (offset * self.dtype.size()) as u64
    }

    fn check(&self, r: &Region) {
        // As in the host storage: a region past the allocation is a bug in kvrs.
        assert!(
            r.end() <= self.numel,
            "region {r:?} exceeds storage of {} elements",
            self.numel
        );
    }

    /// Panics unless cache tensors `0..tensors` of `shape` lie in this storage (with
    /// their sizes in the kernels' 32-bit arguments, and int8's scales of its unit,
    /// `shape.scale_unit()`) and each of `blocks` is one of their blocks. The paged kernels
    /// address blocks themselves where the host path checks each region; as in
    /// [`CudaStorage::check`], a block past the allocation is a bug in kvrs, and stopping
    /// beats corrupting device memory.
    pub(super) fn check_blocks(
        &self,
        shape: &PagedShape,
        tensors: usize,
        blocks: impl IntoIterator<Item = u64>,
    ) {
        let small = |x: usize| x <= i32::MAX as usize;
        let fits = shape.block_size > 0
            && small(shape.block_size)
            && shape
                .num_kv_heads
                .checked_mul(shape.head_dim.max(shape.v_head_dim))
                .is_some_and(small)
            && (self.scales.is_none() || shape.scale_unit() == self.head_dim)
            && shape
                .block_size
                .checked_mul(shape.num_kv_heads * (shape.head_dim + shape.v_head_dim))
                .and_then(|b| b.checked_mul(shape.num_blocks))
                .and_then(|l| l.checked_mul(tensors))
                .is_some_and(|end| end <= self.numel);
        assert!(
            fits,
            "{tensors} cache tensors of {shape:?} exceed storage of {} elements",
            self.numel
        );
        for b in blocks {
            assert!(
                b < shape.num_blocks as u64,
                "block {b} is not one of the {} blocks of {shape:?}",
                shape.num_blocks
            );
        }
    }

    /// Panics unless cache tensor `t` lies in this storage and block table `blocks`
    /// holds positions `start..start + n`, each in one of its blocks (see
    /// [`CudaStorage::check_blocks`]): what the gather and scatter by position read.
    fn check_positions(&self, t: &PagedTensor, blocks: &[BlockId], start: usize, n: usize) {
        let tensors = t.index.checked_add(1).expect("a cache tensor index");
        self.check_blocks(&t.shape, tensors, []);
        if n > 0 {
            let bs = t.shape.block_size;
            let last = start.checked_add(n - 1).expect("positions in range") / bs;
            assert!(
                last < blocks.len(),
                "positions {start}..{start}+{n} exceed a block table of {} blocks of {bs}",
                blocks.len()
            );
            self.check_blocks(
                &t.shape,
                tensors,
                blocks[start / bs..=last].iter().map(|&b| b as u64),
            );
        }
    }

    /// Panics unless cache tensor `t` lies in this storage and each of `slots` is -1 or
    /// a slot of one of its blocks (see [`CudaStorage::check_blocks`]): what the
    /// scatter by slot writes.
    fn check_slots(&self, t: &PagedTensor, slots: &[i64]) {
        let tensors = t.index.checked_add(1).expect("a cache tensor index");
        let bs = t.shape.block_size.max(1) as u64;
        self.check_blocks(
            &t.shape,
            tensors,
            slots.iter().filter(|&&s| s >= 0).map(|&s| s as u64 / bs),
        );
    }

    /// Whether `t` lives on this storage's device; an error naming `name` when it lives on
    /// another device.
    pub(super) fn is_local(&self, name: &str, device: Device) -> Result<bool> {
        match device {
            Device::Cpu => Ok(false),
            d if d == self.device() => Ok(true),
            d => Err(KvError::Device(format!(
                "{name} lives on {d}; this cache lives on {}: copy it there first",
                self.device()
            ))),
        }
    }

    /// Launches the strided copy with conversion: `dst[i, j, k] = src[i, j, k]`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn copy3(
        &self,
        dst: DevicePtr,
        dst_dtype: DType,
        dst_strides: [isize; MAX_RANK],
        src: DevicePtr,
        src_dtype: DType,
        src_strides: [isize; MAX_RANK],
        shape: [usize; MAX_RANK],
    ) -> Result<()> {
        let n: usize = shape.iter().product();
        if n == 0 {
            return Ok(());
        }
        let args = Args::new()
            .u64(dst)
            .strides(dst_strides)
            .u64(src)
            .strides(src_strides)
            .dims(shape);
        let name = kernel(Kernel::Copy3, src_dtype, dst_dtype)?;
        // SAFETY: both ranges were checked by the callers (regions against the storage,
        // tensors by their TensorRef contract).
        unsafe {
            self.gpu.launch(
                name,
                [blocks_for(n), 1, 1],
                [THREADS, 1, 1],
                &args,
                self.stream(),
            )
        }
    }

    /// Launches the zeroing of a strided rank-3 range of `dtype` elements.
    fn zero3(
        &self,
        dst: DevicePtr,
        dtype: DType,
        strides: [isize; MAX_RANK],
        shape: [usize; MAX_RANK],
    ) -> Result<()> {
        let n: usize = shape.iter().product();
        if n == 0 {
            return Ok(());
        }
        let args = Args::new().u64(dst).strides(strides).dims(shape);
        let name = zero_kernel(dtype);
        // SAFETY: the range was checked by the caller.
        unsafe {
            self.gpu.launch(
                name,
                [blocks_for(n), 1, 1],
                [THREADS, 1, 1],
                &args,
                self.stream(),
            )
        }
    }

    /// Whether one scatter launch can write every layer of `layers` (all rows on this
    /// device, of one dtype and strides, head_dim contiguous, each layer's K and V a fixed
    /// stride after the previous one's, one pool shape): the per-layer element strides of
    /// K and V when it can. Checks every layer's rows first.
    fn one_scatter(&self, layers: &[LayerRows<'_>]) -> Result<Option<[isize; 2]>> {
        for l in layers {
            paged_ops::check_rows(&l.tensor, Some(l.slots.len()), &l.k, &l.v)?;
        }
        let Some(first) = layers.first() else {
            return Ok(None);
        };
        if !self.scatters(&first.tensor.shape, &first.k, &first.v)? {
            return Ok(None);
        }
        let size = first.k.dtype().size() as isize;
        let step = |x: for<'r> fn(&'r LayerRows<'r>) -> &'r TensorRef<'r>| -> Option<isize> {
            let base = x(first).as_ptr() as isize;
            let delta = layers.get(1).map_or(0, |l| x(l).as_ptr() as isize - base);
            let uniform = delta % size == 0
                && layers.iter().enumerate().all(|(i, l)| {
                    let t = x(l);
                    t.as_ptr() as isize == base + i as isize * delta
                        && t.dtype() == x(first).dtype()
                        && t.strides3() == x(first).strides3()
                        && t.device() == x(first).device()
                });
            uniform.then_some(delta / size)
        };
        let same_shape = layers.iter().all(|l| l.tensor.shape == first.tensor.shape);
        Ok(match (step(|l| &l.k), step(|l| &l.v)) {
            (Some(k), Some(v)) if same_shape => Some([k, v]),
            _ => None,
        })
    }

    /// Threads per block for kernels striding over `heads * head_dim` elements.
    pub(super) fn row_threads(elems: usize) -> u32 {
        (elems.div_ceil(32) * 32).clamp(32, THREADS as usize) as u32
    }
}

/// Whether the paged kernels (scatter, gather) can address `shape`'s blocks: they take
/// one head size for K and V. Pools of two head sizes (an MLA latent) go through the
/// region copies, one run of positions at a time.
pub(super) fn one_head_size(shape: &PagedShape) -> bool {
    shape.head_dim == shape.v_head_dim
}

/// C-order element strides of `shape`.
pub(super) fn contiguous(shape: [usize; MAX_RANK]) -> [isize; MAX_RANK] {
    [(shape[1] * shape[2]) as isize, shape[2] as isize, 1]
}

/// A host tensor's elements packed into 8-byte `words` (C order, its own dtype).
pub(super) fn pack(t: &TensorRef, words: &mut Vec<u64>) {
    let shape = t.shape3();
    words.resize(t.nbytes().div_ceil(8), 0);
    // SAFETY: `words` holds the packed bytes; `t` is readable (its contract).
    unsafe {
        copy_strided(
            words.as_mut_ptr() as *mut u8,
            t.dtype(),
            contiguous(shape),
            t.as_ptr(),
            t.dtype(),
            t.strides3(),
            shape,
        )
    };
}

impl Drop for CudaStorage {
    fn drop(&mut self) {
        // SAFETY: these allocations came from this gpu's alloc_zeroed and are freed once.
        unsafe {
            if let Some(c) = *self.counter.get_mut() {
                self.gpu.free(c);
            }
            if let Some((z, _)) = *self.zero_row.get_mut() {
                self.gpu.free(z);
            }
            self.gpu.free(self.ptr);
        }
        self.staging.get_mut().release(self.gpu.as_ref());
        DeviceScaler::free(self.gpu.as_ref(), &self.scratch);
        self.pinned.get_mut().release(self.gpu.as_ref());
    }
}

impl Storage for CudaStorage {
    fn device(&self) -> Device {
        Device::Cuda(self.gpu.ordinal())
    }

    fn dtype(&self) -> DType {
        self.dtype
    }

    fn numel(&self) -> usize {
        self.numel
    }

    fn data_ptr(&self) -> *mut u8 {
        self.ptr as *mut u8
    }

    fn as_cuda(&self) -> Option<&CudaStorage> {
        Some(self)
    }

    fn write(&mut self, dst: Region, src: &TensorRef) -> Result<()> {
        self.check(&dst);
        src.expect_region("the source", &dst)?;
        if self.scales.is_some() && src.dtype() != DType::I8 {
            return self.write_quantized(dst, src);
        }
        let to = (
            self.device_addr(dst.offset),
            self.dtype,
            dst.signed_strides(),
        );
        if self.is_local("the source", src.device())? {
            return self.copy3(
                to.0,
                to.1,
                to.2,
                src.as_ptr() as DevicePtr,
                src.dtype(),
                src.strides3(),
                dst.shape,
            );
        }
        self.with_upload(
            |words| pack(src, words),
            |staged| {
                self.copy3(
                    to.0,
                    to.1,
                    to.2,
                    staged,
                    src.dtype(),
                    contiguous(dst.shape),
                    dst.shape,
                )
            },
        )
    }

    fn read(&self, src: Region, dst: &mut TensorMut) -> Result<()> {
        self.check(&src);
        dst.expect_region("the destination", &src)?;
        if self.scales.is_some() && dst.dtype() != DType::I8 {
            return self.read_dequantized(src, dst);
        }
        let from = self.device_addr(src.offset);
        if self.is_local("the destination", dst.device())? {
            return self.copy3(
                dst.as_mut_ptr() as DevicePtr,
                dst.dtype(),
                dst.strides3(),
                from,
                self.dtype,
                src.signed_strides(),
                src.shape,
            );
        }
        let bytes = src.numel() * self.dtype.size();
        let mut host = vec![0u64; bytes.div_ceil(8)];
        let stream = self.stream();
        let mut st = self.staging.lock();
        self.reserve_staging(&mut st, bytes)?;
        self.copy3(
            st.ptr,
            self.dtype,
            contiguous(src.shape),
            from,
            self.dtype,
            src.signed_strides(),
            src.shape,
        )?;
        // SAFETY: `host` holds `bytes`; the staging buffer holds the packed region.
        unsafe {
            self.gpu
                .dtoh(host.as_mut_ptr() as *mut u8, st.ptr, bytes, stream)?;
            copy_strided(
                dst.as_mut_ptr(),
                dst.dtype(),
                dst.strides3(),
                host.as_ptr() as *const u8,
                self.dtype,
                contiguous(src.shape),
                src.shape,
            );
        }
        Ok(())
    }

    fn copy_within(&mut self, src: Region, dst: Region) -> Result<()> {
        self.check(&src);
        self.check(&dst);
        assert!(
            src.end() <= dst.offset || dst.end() <= src.offset,
            "overlapping copy {src:?} -> {dst:?}"
        );
        assert_eq!(
            src.shape, dst.shape,
            "copy between regions of different shapes"
        );
        self.copy3(
            self.device_addr(dst.offset),
            self.dtype,
            dst.signed_strides(),
            self.device_addr(src.offset),
            self.dtype,
            src.signed_strides(),
            src.shape,
        )?;
        match &mut self.scales {
            Some(sc) => sc.copy_within(
                scale_region(&src, self.head_dim),
                scale_region(&dst, self.head_dim),
            ),
            None => Ok(()),
        }
    }

    fn fill_zero(&mut self, dst: Region) -> Result<()> {
        self.check(&dst);
        self.zero3(
            self.device_addr(dst.offset),
            self.dtype,
            dst.signed_strides(),
            dst.shape,
        )?;
        match &mut self.scales {
            Some(sc) => sc.fill_zero(scale_region(&dst, self.head_dim)),
            None => Ok(()),
        }
    }

    fn zero(&self, t: &mut TensorMut) -> Result<()> {
        if self.is_local("the output", t.device())? {
            return self.zero3(
                t.as_mut_ptr() as DevicePtr,
                t.dtype(),
                t.strides3(),
                t.shape3(),
            );
        }
        t.fill_zero();
        Ok(())
    }

    fn write_slots(
        &mut self,
        t: PagedTensor,
        slots: &[i64],
        k: &TensorRef,
        v: &TensorRef,
    ) -> Result<()> {
        paged_ops::check_rows(&t, Some(slots.len()), k, v)?;
        if !self.scatters(&t.shape, k, v)? {
            return paged_ops::write_slots(self, t, slots, k, v);
        }
        self.check_slots(&t, slots);
        let layer = ScatterLayer {
            tensor: t.index,
            slots,
        };
        self.scatter(t.shape, &[layer], k, v, [0, 0])
    }

    fn write_layers(&mut self, layers: &[LayerRows<'_>]) -> Result<()> {
        let Some(strides) = self.one_scatter(layers)? else {
            return layers
                .iter()
                .try_for_each(|l| self.write_slots(l.tensor, l.slots, &l.k, &l.v));
        };
        for l in layers {
            self.check_slots(&l.tensor, l.slots);
        }
        let each: Vec<ScatterLayer> = layers
            .iter()
            .map(|l| ScatterLayer {
                tensor: l.tensor.index,
                slots: l.slots,
            })
            .collect();
        self.scatter(
            layers[0].tensor.shape,
            &each,
            &layers[0].k,
            &layers[0].v,
            strides,
        )
    }

    fn zero_slots(&mut self, t: PagedTensor, slots: &[i64]) -> Result<()> {
        let (n, sh) = (slots.len(), t.shape);
        if n == 0 {
            return Ok(());
        }
        if !one_head_size(&sh) {
            // The scatter kernel takes one head size; the region copies zero each run.
            return paged_ops::zero_slots(self, t, slots);
        }
        self.check_slots(&t, slots);
        let row = self.zero_row(sh.num_kv_heads * sh.head_dim)?;
        // SAFETY: `row` holds num_kv_heads * head_dim float32 zeros on this device for
        // this storage's life; every token reads the same row (stride 0).
        let zeros = unsafe {
            TensorRef::new(
                row as *const u8,
                DType::F32,
                &[n, sh.num_kv_heads, sh.head_dim],
                &[0, sh.head_dim as isize, 1],
            )?
        }
        .on(self.device());
        // One launch for every slot (the scatter skips -1).
        let layer = ScatterLayer {
            tensor: t.index,
            slots,
        };
        self.scatter(sh, &[layer], &zeros, &zeros, [0, 0])
    }

    fn write_positions(
        &mut self,
        t: PagedTensor,
        blocks: &[BlockId],
        start: usize,
        k: &TensorRef,
        v: &TensorRef,
    ) -> Result<()> {
        let n = paged_ops::check_rows(&t, None, k, v)?;
        if !self.scatters(&t.shape, k, v)? {
            return paged_ops::write_positions(self, t, blocks, start, k, v);
        }
        self.check_positions(&t, blocks, start, n);
        let bs = t.shape.block_size;
        let slots: Vec<i64> = (start..start + n)
            .map(|p| (blocks[p / bs] as usize * bs + p % bs) as i64)
            .collect();
        let layer = ScatterLayer {
            tensor: t.index,
            slots: &slots,
        };
        self.scatter(t.shape, &[layer], k, v, [0, 0])
    }

    fn read_positions(
        &self,
        t: PagedTensor,
        blocks: &[BlockId],
        start: usize,
        n: usize,
        k_out: &mut TensorMut,
        v_out: &mut TensorMut,
    ) -> Result<()> {
        paged_ops::check_outputs(&t, n, k_out, v_out)?;
        let local =
            self.is_local("k_out", k_out.device())? && self.is_local("v_out", v_out.device())?;
        let same_dtype = k_out.dtype() == self.dtype && v_out.dtype() == self.dtype;
        if !local
            || !same_dtype
            || k_out.strides3()[2] != 1
            || v_out.strides3()[2] != 1
            || !one_head_size(&t.shape)
        {
            return paged_ops::read_positions(self, t, blocks, start, n, k_out, v_out);
        }
        self.check_positions(&t, blocks, start, n);
        self.gather(t, blocks, start, n, k_out, v_out)
    }

    fn copy_blocks(
        &mut self,
        shape: crate::layout::PagedShape,
        tensors: usize,
        pairs: &[(BlockId, BlockId)],
    ) -> Result<()> {
        if pairs.is_empty() || tensors == 0 {
            return Ok(());
        }
        let block_bytes = shape.block_elems() * self.dtype.size();
        if !block_bytes.is_multiple_of(4) {
            // The kernel moves 32-bit words; odd 8-bit blocks go region by region.
            return paged_ops::copy_blocks(self, shape, tensors, pairs);
        }
        self.check_blocks(
            &shape,
            tensors,
            pairs.iter().flat_map(|&(s, d)| [s as u64, d as u64]),
        );
        let codes: Vec<DevicePtr> = (0..tensors)
            .map(|t| self.device_addr(shape.block_offset(t, 0)))
            .collect();
        self.launch_copy_blocks(&codes, pairs, block_bytes)?;
        if let Some(sc) = &self.scales {
            let d = self.head_dim;
            let scales: Vec<DevicePtr> = (0..tensors)
                .map(|t| sc.device_addr(shape.block_offset(t, 0) / d))
                .collect();
            self.launch_copy_blocks(&scales, pairs, 4 * shape.block_elems() / d)?;
        }
        Ok(())
    }

    fn read_blocks(
        &self,
        shape: PagedShape,
        tensors: usize,
        blocks: &[BlockId],
        out: &mut [u8],
    ) -> Result<()> {
        paged_ops::check_packed(self, "out", out.len(), &shape, tensors, blocks.len())?;
        match self.save_blocks(shape, tensors, blocks, out) {
            Some(r) => r,
            None => paged_ops::read_blocks(self, shape, tensors, blocks, out),
        }
    }

    fn write_blocks(
        &mut self,
        shape: PagedShape,
        tensors: usize,
        blocks: &[BlockId],
        data: &[&[u8]],
    ) -> Result<()> {
        paged_ops::check_data(self, &shape, tensors, blocks, data)?;
        match self.load_blocks(shape, tensors, blocks, data) {
            Some(r) => r,
            None => paged_ops::write_blocks(self, shape, tensors, blocks, data),
        }
    }

    fn read_row_scales(&self, src: Region, dst: &mut [f32]) -> Result<()> {
        let Some(sc) = &self.scales else {
            return Err(KvError::NotSupported(format!(
                "{} storage keeps no per-vector scales",
                self.dtype
            )));
        };
        let r = scale_region(&src, self.head_dim);
        check_scales_len(dst.len(), &r)?;
        sc.read(r, &mut TensorMut::from_f32_mut(dst, &r.shape)?)
    }

    fn write_row_scales(&mut self, dst: Region, src: &[f32]) -> Result<()> {
        let d = self.head_dim;
        let Some(sc) = &mut self.scales else {
            return Err(KvError::NotSupported(format!(
                "{} storage keeps no per-vector scales",
                self.dtype
            )));
        };
        let r = scale_region(&dst, d);
        check_scales_len(src.len(), &r)?;
        sc.write(r, &TensorRef::from_f32(src, &r.shape)?)
    }

    fn row_scales(&self) -> Option<RowScales> {
        self.scales.as_ref().map(|sc| RowScales {
            ptr: sc.ptr as *mut f32,
            row_len: self.head_dim,
            len: sc.numel,
        })
    }

    fn scaler(&self) -> Option<DeviceScaler> {
        Some(DeviceScaler::new(
            self.gpu.clone(),
            self.scratch.clone(),
            self.stream(),
        ))
    }

    fn nbytes(&self) -> usize {
        self.numel * self.dtype.size() + self.scales.as_ref().map_or(0, |sc| sc.nbytes())
    }
}
