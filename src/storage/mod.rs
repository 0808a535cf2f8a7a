//! The storage interface: one region of device or host memory, allocated once, that
//! caches address through strided [`Region`]s. The host backend lives in [`host`]; the
//! CUDA backend implements the same trait, so the caches never look at the device.

pub mod cuda;
mod host;

pub use host::HostStorage;

use std::fmt;
use std::str::FromStr;

use crate::dtype::DType;
use crate::error::{KvError, Result};
use crate::tensor::{TensorRef, MAX_RANK};

/// Where a storage lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    /// Host memory.
    Cpu,
    /// CUDA device memory on the given ordinal.
    Cuda(usize),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

impl FromStr for Device {
    type Err = KvError;

    /// Parses `"cpu"`, `"cuda"` (ordinal 0) and `"cuda:N"`.
    fn from_str(s: &str) -> Result<Self> {
        let t = s.trim().to_ascii_lowercase();
        if t == "cpu" {
            return Ok(Device::Cpu);
        }
        if t == "cuda" {
            return Ok(Device::Cuda(0));
        }
        if let Some(n) = t.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
            return Ok(Device::Cuda(n));
        }
        Err(KvError::InvalidArgument {
            name: "device",
            value: format!("{s:?}"),
            reason: "use 'cpu', 'cuda' or 'cuda:N'".into(),
        })
    }
}

/// A strided rank-3 window into a storage, in elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// Element offset of `[0, 0, 0]` from the start of the storage.
    pub offset: usize,
    /// Extent of each dimension.
    pub shape: [usize; MAX_RANK],
    /// Element strides (non-negative: regions never run backwards).
    pub strides: [usize; MAX_RANK],
}

impl Region {
    /// One past the highest element offset the region touches (its offset when empty).
    pub fn end(&self) -> usize {
        if self.shape.contains(&0) {
            return self.offset;
        }
        self.offset
            + (0..MAX_RANK)
                .map(|i| (self.shape[i] - 1) * self.strides[i])
                .sum::<usize>()
            + 1
    }

    /// Number of elements in the region.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Strides as signed values, as the copy routine takes them.
    pub fn signed_strides(&self) -> [isize; MAX_RANK] {
        self.strides.map(|s| s as isize)
    }
}

/// One allocation of keys and values, made once and addressed by regions.
///
/// Implementations allocate in their constructor and never reallocate, so the pointer
/// behind [`Storage::data_ptr`] is stable for the storage's whole life and zero-copy
/// views of it never dangle while the storage lives.
pub trait Storage: Send + Sync + fmt::Debug {
    /// Where the memory lives.
    fn device(&self) -> Device;
    /// The element type stored.
    fn dtype(&self) -> DType;
    /// Size in elements.
    fn numel(&self) -> usize;
    /// Address of element 0 (a host pointer, or a device address for device storages).
    fn data_ptr(&self) -> *mut u8;
    /// Writes `src` (host memory, any supported dtype) into `dst`, converting to the
    /// storage dtype. `src` must have `dst`'s shape.
    fn write(&mut self, dst: Region, src: &TensorRef) -> Result<()>;
    /// Reads `src` into `dst` (host memory of the storage dtype, `src`'s shape).
    fn read(&self, src: Region, dst: &TensorRef) -> Result<()>;
    /// Copies region `src` onto region `dst` of the same storage (same shape; the two
    /// must not overlap): copy-on-write and forks.
    fn copy_within(&mut self, src: Region, dst: Region) -> Result<()>;
    /// Sets every element of `dst` to zero.
    fn fill_zero(&mut self, dst: Region) -> Result<()>;

    /// Size in bytes.
    fn nbytes(&self) -> usize {
        self.numel() * self.dtype().size()
    }
}

/// Allocates zero-filled storage of `numel` elements of `dtype` on `device`.
pub fn allocate(device: Device, dtype: DType, numel: usize) -> Result<Box<dyn Storage>> {
    match device {
        Device::Cpu => Ok(Box::new(HostStorage::zeroed(dtype, numel)?)),
        Device::Cuda(ordinal) => {
            let count = cuda::device_count()
                .map_err(|why| KvError::Device(format!("device={device}: {why}")))?;
            if ordinal >= count {
                return Err(KvError::Device(format!(
                    "device={device} does not exist: this machine has {count} CUDA devices"
                )));
            }
            Err(KvError::Device(format!(
                "device={device}: CUDA storage is not implemented in this version of kvrs yet; use device='cpu'"
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_devices() {
        assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
        assert_eq!("cuda".parse::<Device>().unwrap(), Device::Cuda(0));
        assert_eq!("CUDA:3".parse::<Device>().unwrap(), Device::Cuda(3));
        assert!("tpu".parse::<Device>().is_err());
        assert!("cuda:x".parse::<Device>().is_err());
        assert_eq!(Device::Cuda(1).to_string(), "cuda:1");
    }

    #[test]
    fn region_end_and_numel() {
        let r = Region {
            offset: 10,
            shape: [2, 3, 4],
            strides: [100, 4, 1],
        };
        assert_eq!(r.end(), 10 + 100 + 8 + 3 + 1);
        assert_eq!(r.numel(), 24);
        let empty = Region {
            offset: 5,
            shape: [0, 3, 4],
            strides: [1, 1, 1],
        };
        assert_eq!(empty.end(), 5);
    }

    #[test]
    fn cuda_is_a_device_error_without_the_backend() {
        assert!(matches!(
            allocate(Device::Cuda(0), DType::F16, 4),
            Err(KvError::Device(_))
        ));
    }
}
