//! The CUDA backend: device memory allocated once in the device's primary context (the
//! one PyTorch uses, so pointers are valid in both), written and read by the kernels of
//! `kernels/kvrs.cu` (PTX embedded in the library).
//!
//! - [`attention`]: the paged attention kernel's launch;
//! - `counter`: the device-resident position counter of captured decode loops;
//! - [`detect`]: finds the driver without touching it when it is absent;
//! - [`gpu`]: the few device operations the storage needs, and kernel arguments;
//! - [`kernels`]: the kernels' names by operation and dtypes;
//! - `paged`: the pool's scatter, gather and block copies, one launch each;
//! - `pinned`: page-locked host memory for the block swaps;
//! - `swap`: the offload tiers' block swaps, one launch and one transfer per chunk;
//! - `int8`: int8 codes quantized and dequantized on the device;
//! - [`scaling`]: fp8 per-head scales applied to device tensors;
//! - `driver`: those operations on the CUDA driver (cudarc, loaded at run time);
//! - `sim`: the same on the host, running the kernels compiled for the CPU (feature
//!   `cuda-sim`, for testing on machines without a GPU);
//! - [`storage`]: [`CudaStorage`], the [`super::Storage`] on a device;
//! - `upload`: the launch path: launch words as kernel parameters, or uploaded through
//!   page-locked buffers.

pub mod attention;
pub mod attention_plan;
mod counter;
pub mod detect;
#[cfg(all(feature = "cuda", not(feature = "cuda-sim")))]
mod driver;
pub mod gpu;
mod int8;
pub mod kernels;
mod paged;
mod pinned;
pub mod scaling;
#[cfg(feature = "cuda-sim")]
mod sim;
pub mod storage;
mod swap;
mod upload;

pub use detect::device_count;
pub use pinned::SWAP_CHUNK;
pub use scaling::DeviceScaler;
#[cfg(feature = "cuda-sim")]
pub use sim::launches as sim_launches;
pub use storage::CudaStorage;

use std::sync::Arc;

#[cfg(not(feature = "cuda-sim"))]
use crate::error::KvError;
use crate::error::Result;
use gpu::Gpu;

/// The device operations for CUDA device `ordinal`, shared by every storage on it.
pub fn gpu_for(ordinal: usize) -> Result<Arc<dyn Gpu>> {
    #[cfg(feature = "cuda-sim")]
    {
        Ok(sim::SimGpu::shared(ordinal))
    }
    #[cfg(all(feature = "cuda", not(feature = "cuda-sim")))]
    {
        let count = device_count()
            .map_err(|why| KvError::Device(format!("device=cuda:{ordinal}: {why}")))?;
        if ordinal >= count {
            return Err(KvError::Device(format!(
                "device=cuda:{ordinal} does not exist: this machine has {count} CUDA devices"
            )));
        }
        driver::DriverGpu::shared(ordinal)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let why = device_count().expect_err("no CUDA support in this build");
        Err(KvError::Device(format!("device=cuda:{ordinal}: {why}")))
    }
}
