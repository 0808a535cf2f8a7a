//! The device-resident position counter of a contiguous CUDA cache and the append that
//! reads it: the steps of a decode loop captured in a CUDA graph, whose kernel arguments
//! are plain values and whose host bookkeeping waits until the loop ends.

use super::gpu::{Args, DevicePtr};
use super::kernels::{kernel, Kernel};
use super::storage::CudaStorage;
use crate::error::{KvError, Result};
use crate::storage::Storage;
use crate::tensor::TensorRef;

impl CudaStorage {
    /// The address of the device-resident position counter (an int64), made on first use.
    pub fn counter(&self) -> Result<DevicePtr> {
        let mut c = self.counter.lock();
        if let Some(p) = *c {
            return Ok(p);
        }
        let p = self.gpu.alloc_zeroed(8)?;
        *c = Some(p);
        Ok(p)
    }

    /// Sets the counter to `value` (ordered on the current stream).
    pub fn write_counter(&self, value: i64) -> Result<()> {
        let p = self.counter()?;
        // SAFETY: 8 bytes of counter, from a host value.
        unsafe {
            self.gpu
                .htod(p, &value as *const i64 as *const u8, 8, self.stream())
        }
    }

    /// Waits for the current stream and reads the counter.
    pub fn read_counter(&self) -> Result<i64> {
        let p = self.counter()?;
        let mut value = 0i64;
        // SAFETY: 8 bytes of counter into a host value.
        unsafe {
            self.gpu
                .dtoh(&mut value as *mut i64 as *mut u8, p, 8, self.stream())?
        };
        Ok(value)
    }

    /// Launches `counter += n`: the end of a captured decode step.
    pub fn advance_counter(&self, n: i64) -> Result<()> {
        let args = Args::new().u64(self.counter()?).i64(n);
        // SAFETY: the counter is 8 bytes of this storage's device.
        unsafe {
            self.gpu.launch(
                "kvrs_advance_counter",
                [1, 1, 1],
                [1, 1, 1],
                &args,
                self.stream(),
            )
        }
    }

    /// Launches the contiguous cache's append of `k`, `v` (`[n, H, D]` on this device,
    /// `head_dim` contiguous) at the position the counter holds, into the layer whose K
    /// starts at element `layer_offset` (`max_seq_len` positions per head). Arguments are
    /// plain values, so the launch can be captured in a CUDA graph and replayed.
    pub fn append_at_counter(
        &self,
        layer_offset: usize,
        max_seq_len: usize,
        k: &TensorRef,
        v: &TensorRef,
    ) -> Result<()> {
        for (name, t) in [("k", k), ("v", v)] {
            if !self.is_local(name, t.device())? {
                return Err(KvError::Device(format!(
                    "{name} lives on the host; a captured append reads tensors on {}",
                    self.device()
                )));
            }
            if t.strides3()[2] != 1 {
                return Err(KvError::InvalidArgument {
                    name: if name == "k" { "k" } else { "v" },
                    value: format!("strides {:?}", t.strides3()),
                    reason: "the last dimension must be contiguous".into(),
                });
            }
        }
        if k.dtype() != v.dtype() {
            return Err(KvError::InvalidArgument {
                name: "v",
                value: v.dtype().to_string(),
                reason: format!("must have k's dtype {}", k.dtype()),
            });
        }
        let [n, heads, head_dim] = k.shape3();
        if n == 0 {
            return Ok(());
        }
        let (ks, vs) = (k.strides3(), v.strides3());
        let args = Args::new()
            .u64(k.as_ptr() as DevicePtr)
            .u64(v.as_ptr() as DevicePtr)
            .i64(ks[0] as i64)
            .i64(ks[1] as i64)
            .i64(vs[0] as i64)
            .i64(vs[1] as i64)
            .i64(0)
            .i64(0)
            .u64(self.device_addr(layer_offset));
        // int8: the layer's scales follow its codes (the q8 kernel's extra argument).
        let args = match &self.scales {
            Some(sc) => args.u64(sc.device_addr(layer_offset / self.head_dim)),
            None => args,
        };
        let args = args
            .u64(self.counter()?)
            .i64(max_seq_len as i64)
            .i32(heads as i32)
            .i32(head_dim as i32);
        let name = kernel(Kernel::AppendContiguous, k.dtype(), self.dtype())?;
        // SAFETY: the layer lies in this storage (checked by the cache); the kernel drops
        // positions past max_seq_len; the inputs are device tensors of [n, H, D].
        unsafe {
            self.gpu.launch(
                name,
                [n as u32, 1, 1],
                [Self::row_threads(heads * head_dim), 1, 1],
                &args,
                self.stream(),
            )
        }
    }
}
