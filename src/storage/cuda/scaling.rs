//! [`DeviceScaler`]: an fp8 cache's per-head scales applied to tensors on the device,
//! the device half of [`crate::scales`]. Inputs are divided into float32 copies in a
//! device scratch buffer (the caller's tensors never change); outputs are multiplied in
//! place. The scratch grows when a call needs more, never per call, and is reused in
//! stream order: a later call's writes queue behind the launches that read the last one's.

use std::sync::Arc;

use parking_lot::Mutex;

use super::gpu::{blocks_for, Args, DevicePtr, Gpu, StreamHandle, THREADS};
use super::kernels::{kernel, Kernel};
use crate::dtype::DType;
use crate::error::{KvError, Result};
use crate::layout::Device;
use crate::tensor::{TensorMut, TensorRef, MAX_RANK};

/// Device memory for scaled copies, shared by a storage and its scalers.
#[derive(Debug, Default)]
pub struct Scratch {
    ptr: DevicePtr,
    bytes: usize,
}

/// Applies per-head scales to tensors on one device, on one stream.
#[derive(Debug, Clone)]
pub struct DeviceScaler {
    gpu: Arc<dyn Gpu>,
    scratch: Arc<Mutex<Scratch>>,
    stream: StreamHandle,
}

/// Bytes rounded up to the 256 the kernels' arrays are aligned to.
fn aligned(bytes: usize) -> usize {
    bytes.next_multiple_of(256)
}

impl DeviceScaler {
    /// A scaler on `gpu`'s `stream` using `scratch` (allocated on first use).
    pub fn new(gpu: Arc<dyn Gpu>, scratch: Arc<Mutex<Scratch>>, stream: StreamHandle) -> Self {
        DeviceScaler {
            gpu,
            scratch,
            stream,
        }
    }

    /// Frees the scratch buffer of a storage being dropped.
    pub(super) fn free(gpu: &dyn Gpu, scratch: &Mutex<Scratch>) {
        let s = scratch.lock();
        if s.bytes > 0 {
            // SAFETY: allocated by `reserve` on this gpu, freed once (the storage's drop).
            unsafe { gpu.free(s.ptr) };
        }
    }

    /// Makes the scratch at least `bytes` long and returns its address.
    fn reserve(&self, s: &mut Scratch, bytes: usize) -> Result<DevicePtr> {
        if bytes > s.bytes {
            let size = bytes.max(2 * s.bytes).max(64 << 10);
            let fresh = self.gpu.alloc_zeroed(size)?;
            if s.bytes > 0 {
                // SAFETY: the old buffer came from alloc_zeroed; free waits for queued work.
                unsafe { self.gpu.free(s.ptr) };
            }
            *s = Scratch {
                ptr: fresh,
                bytes: size,
            };
        }
        Ok(s.ptr)
    }

    /// Launches `dst = src / scales` (`divide`) or `src * scales` along `axis`.
    #[allow(clippy::too_many_arguments)]
    fn launch(
        &self,
        dst: DevicePtr,
        dst_dtype: DType,
        dst_strides: [isize; MAX_RANK],
        src: &TensorRef,
        scales: DevicePtr,
        n_scales: usize,
        axis: usize,
        divide: bool,
    ) -> Result<()> {
        let shape = src.shape3();
        if src.device() != Device::Cuda(self.gpu.ordinal()) {
            return Err(KvError::Device(format!(
                "the tensor lives on {}; this scaler works on cuda:{}",
                src.device(),
                self.gpu.ordinal()
            )));
        }
        if n_scales != 1 && (axis >= MAX_RANK || shape[axis] != n_scales) {
            return Err(KvError::Shape {
                name: "the tensor",
                got: src.shape().to_vec(),
                expected: format!("{n_scales} indices along dimension {axis} (one per scale)"),
            });
        }
        let n: usize = shape.iter().product();
        if n == 0 {
            return Ok(());
        }
        let args = Args::new()
            .u64(dst)
            .strides(dst_strides)
            .u64(src.as_ptr() as DevicePtr)
            .strides(src.strides3())
            .dims(shape)
            .u64(scales)
            .i64(n_scales as i64)
            .i32(axis as i32)
            .i32(i32::from(divide));
        let name = kernel(Kernel::Scale3, src.dtype(), dst_dtype)?;
        // SAFETY: src is a device tensor (its contract), dst holds its shape, and the
        // scales hold n_scales floats, one per index along `axis` (or one for all).
        unsafe {
            self.gpu.launch(
                name,
                [blocks_for(n), 1, 1],
                [THREADS, 1, 1],
                &args,
                self.stream,
            )
        }
    }

    /// Float32 copies of `inputs` (device tensors), each divided by its scales along
    /// `axis`: valid until the next call on this scaler's storage, in stream order.
    pub fn divided<const N: usize>(
        &self,
        inputs: [(&TensorRef, &[f32]); N],
        axis: usize,
    ) -> Result<[TensorRef<'_>; N]> {
        let mut s = self.scratch.lock();
        let scale_bytes: usize = inputs.iter().map(|(_, sc)| aligned(4 * sc.len())).sum();
        let data_bytes: usize = inputs
            .iter()
            .map(|(t, _)| aligned(4 * t.shape3().iter().product::<usize>()))
            .sum();
        let base = self.reserve(&mut s, scale_bytes + data_bytes)?;
        let (mut scale_at, mut data_at) = (base, base + scale_bytes as u64);
        let mut out = [None; N];
        for (slot, (t, scales)) in out.iter_mut().zip(inputs) {
            let [a, b, c] = t.shape3();
            // SAFETY: the scratch holds the scales at scale_at (reserved above).
            unsafe {
                self.gpu.htod(
                    scale_at,
                    scales.as_ptr() as *const u8,
                    4 * scales.len(),
                    self.stream,
                )?
            };
            let strides = [(b * c) as isize, c as isize, 1];
            self.launch(
                data_at,
                DType::F32,
                strides,
                t,
                scale_at,
                scales.len(),
                axis,
                true,
            )?;
            let nd = t.shape().len();
            // SAFETY: the copy lies in the scratch, device memory of this gpu.
            let copy = unsafe {
                TensorRef::new(
                    data_at as *const u8,
                    DType::F32,
                    t.shape(),
                    &strides[3 - nd..],
                )?
            };
            *slot = Some(copy.on(Device::Cuda(self.gpu.ordinal())));
            scale_at += aligned(4 * scales.len()) as u64;
            data_at += aligned(4 * a * b * c) as u64;
        }
        Ok(out.map(|c| c.expect("one copy per input")))
    }

    /// Multiplies `t` (a float device tensor) in place by its scales along `axis`.
    pub fn multiply(&self, t: &mut TensorMut, axis: usize, scales: &[f32]) -> Result<()> {
        let mut s = self.scratch.lock();
        let at = self.reserve(&mut s, aligned(4 * scales.len()))?;
        // SAFETY: the scratch holds the scales (reserved above).
        unsafe {
            self.gpu.htod(
                at,
                scales.as_ptr() as *const u8,
                4 * scales.len(),
                self.stream,
            )?
        };
        self.launch(
            t.as_mut_ptr() as DevicePtr,
            t.dtype(),
            t.strides3(),
            &t.as_ref(),
            at,
            scales.len(),
            axis,
            false,
        )
    }
}
