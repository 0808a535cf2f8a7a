//! Borrowed strided tensors (up to rank 3) and the strided copy with dtype conversion
//! that every storage backend's host path uses.

use crate::dtype::{convert_contiguous, read_f32, write_f32, DType};
use crate::error::{KvError, Result};
use crate::layout::Device;

pub use crate::layout::MAX_RANK;

/// A borrowed, strided view of host or device memory: what a caller hands the core to
/// read from (`TensorRef`) or to write into (through [`TensorRef::as_mut_ptr`]).
///
/// Strides are in elements and may be negative (a reversed NumPy view). The core never
/// keeps a `TensorRef` past the call that received it. Tensors are on the host unless
/// built with [`TensorRef::on`]; only a storage of the same device reads device tensors.
#[derive(Clone, Copy, Debug)]
pub struct TensorRef {
    ptr: *const u8,
    dtype: DType,
    device: Device,
    ndim: usize,
    shape: [usize; MAX_RANK],
    strides: [isize; MAX_RANK],
}

// SAFETY: a TensorRef is a pointer plus a layout; whoever builds it guarantees the memory
// stays valid (and is not freed) for as long as the TensorRef is used, on any thread.
unsafe impl Send for TensorRef {}
unsafe impl Sync for TensorRef {}

impl TensorRef {
    /// Describes `shape`/`strides` (elements) of `dtype` elements starting at `ptr`.
    ///
    /// # Safety
    /// Every element addressed by the layout must be valid for reads (and for writes if the
    /// tensor is used as a destination) for as long as the returned value is used.
    pub unsafe fn new(
        ptr: *const u8,
        dtype: DType,
        shape: &[usize],
        strides: &[isize],
    ) -> Result<Self> {
        if shape.len() > MAX_RANK || shape.len() != strides.len() {
            return Err(KvError::Shape {
                name: "tensor",
                got: shape.to_vec(),
                expected: format!("at most {MAX_RANK} dimensions"),
            });
        }
        let mut s = [1usize; MAX_RANK];
        let mut st = [0isize; MAX_RANK];
        let pad = MAX_RANK - shape.len();
        s[pad..].copy_from_slice(shape);
        st[pad..].copy_from_slice(strides);
        Ok(TensorRef {
            ptr,
            dtype,
            device: Device::Cpu,
            ndim: shape.len(),
            shape: s,
            strides: st,
        })
    }

    /// A contiguous (C-order) tensor over `ptr`.
    ///
    /// # Safety
    /// As for [`TensorRef::new`].
    pub unsafe fn contiguous(ptr: *const u8, dtype: DType, shape: &[usize]) -> Result<Self> {
        if shape.len() > MAX_RANK {
            return Self::new(ptr, dtype, shape, &[]);
        }
        let mut strides = [0isize; MAX_RANK];
        let mut acc = 1isize;
        for i in (0..shape.len()).rev() {
            strides[i] = acc;
            acc *= shape[i] as isize;
        }
        Self::new(ptr, dtype, shape, &strides[..shape.len()])
    }

    /// The same tensor, said to live on `device` (its pointer is then a device address).
    pub fn on(mut self, device: Device) -> Self {
        self.device = device;
        self
    }

    /// Where the memory lives.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The shape as given (without padding).
    pub fn shape(&self) -> &[usize] {
        &self.shape[MAX_RANK - self.ndim..]
    }

    /// The shape padded to rank 3 with leading 1s.
    pub fn shape3(&self) -> [usize; MAX_RANK] {
        self.shape
    }

    /// The strides (elements) padded to rank 3.
    pub fn strides3(&self) -> [isize; MAX_RANK] {
        self.strides
    }

    /// Address of element `[0, 0, 0]`.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    /// Address of element `[0, 0, 0]`, for tensors used as a destination.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr as *mut u8
    }

    /// Fails with a shape error naming `name` unless the shape equals `expected` exactly.
    pub fn expect_shape(&self, name: &'static str, expected: &[usize]) -> Result<()> {
        if self.shape() != expected {
            return Err(KvError::Shape {
                name,
                got: self.shape().to_vec(),
                expected: format!("{expected:?}"),
            });
        }
        Ok(())
    }

    /// The sub-tensor of indices `start..start + len` along dimension `dim` of the rank-3
    /// padded shape.
    pub fn slice(&self, dim: usize, start: usize, len: usize) -> TensorRef {
        assert!(
            start + len <= self.shape[dim],
            "slicing dimension {dim} of {:?} to {start}..{}",
            self.shape,
            start + len
        );
        let mut t = *self;
        t.shape[dim] = len;
        // SAFETY (of later use): the sliced elements lie inside the original tensor.
        t.ptr = self
            .ptr
            .wrapping_offset(start as isize * self.strides[dim] * self.dtype.size() as isize);
        t
    }

    /// The same tensor with two dimensions of the rank-3 padded shape swapped.
    pub fn transposed(&self, a: usize, b: usize) -> TensorRef {
        let mut t = *self;
        t.shape.swap(a, b);
        t.strides.swap(a, b);
        t
    }

    /// Sets every element to zero.
    ///
    /// # Safety
    /// The tensor must be valid for writes (see [`TensorRef::new`]).
    pub unsafe fn fill_zero(&self) {
        let zero = [0u8; 4];
        copy_strided(
            self.as_mut_ptr(),
            self.dtype,
            self.strides,
            zero.as_ptr(),
            self.dtype,
            [0; MAX_RANK],
            self.shape,
        );
    }

    /// Number of bytes a contiguous copy of this tensor would take.
    pub fn nbytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }
}

/// Checks a block pair: `keys` and `values`, each exactly `shape` (`[heads, n, head_dim]`).
pub fn expect_block_pair(
    keys: &TensorRef,
    values: &TensorRef,
    shape: [usize; MAX_RANK],
) -> Result<()> {
    keys.expect_shape("keys", &shape)?;
    values.expect_shape("values", &shape)
}

/// Copies every element of a rank-3 shape from `src` to `dst`, converting the dtype.
///
/// Dimensions of size 1 are dropped, the rest are ordered by source stride (reads run
/// sequentially, which matters more than sequential writes), and
/// dimensions that are contiguous in both tensors are merged, so a copy between
/// compatible layouts runs as a few long rows (a plain `memcpy` per row when the dtypes
/// match).
///
/// # Safety
/// `src` must be readable and `dst` writable at every element addressed by `shape` with
/// their strides; the two must not overlap.
pub unsafe fn copy_strided(
    dst: *mut u8,
    dst_dtype: DType,
    dst_strides: [isize; MAX_RANK],
    src: *const u8,
    src_dtype: DType,
    src_strides: [isize; MAX_RANK],
    shape: [usize; MAX_RANK],
) {
    if shape.contains(&0) {
        return;
    }
    // (size, dst stride, src stride) of the dimensions that matter, outermost first.
    let mut order: [(usize, isize, isize); MAX_RANK] = [(1, 0, 0); MAX_RANK];
    let mut n = 0;
    for i in 0..MAX_RANK {
        if shape[i] != 1 {
            order[n] = (shape[i], dst_strides[i], src_strides[i]);
            n += 1;
        }
    }
    order[..n].sort_by_key(|d| std::cmp::Reverse(d.2.unsigned_abs()));
    let mut dims: [(usize, isize, isize); MAX_RANK] = [(1, 0, 0); MAX_RANK];
    let mut m = 0;
    for &d in &order[..n] {
        if m > 0 {
            let (os, od, oss) = dims[m - 1];
            if od == d.1 * d.0 as isize && oss == d.2 * d.0 as isize {
                dims[m - 1] = (os * d.0, d.1, d.2);
                continue;
            }
        }
        dims[m] = d;
        m += 1;
    }
    if m == 0 {
        dims[0] = (1, 1, 1);
        m = 1;
    }
    let (row_len, inner_dst, inner_src) = dims[m - 1];
    let (ds, ss) = (dst_dtype.size() as isize, src_dtype.size() as isize);
    let outer: [(usize, isize, isize); 2] = match m {
        1 => [(1, 0, 0), (1, 0, 0)],
        2 => [(1, 0, 0), dims[0]],
        _ => [dims[0], dims[1]],
    };
    let rows = |row: &mut dyn FnMut(*mut u8, *const u8)| {
        for a in 0..outer[0].0 as isize {
            for b in 0..outer[1].0 as isize {
                let d = dst.offset((a * outer[0].1 + b * outer[1].1) * ds);
                let s = src.offset((a * outer[0].2 + b * outer[1].2) * ss);
                row(d, s);
            }
        }
    };
    if inner_dst == 1 && inner_src == 1 {
        if dst_dtype == src_dtype {
            let bytes = row_len * dst_dtype.size();
            rows(&mut |d, s| std::ptr::copy_nonoverlapping(s, d, bytes));
        } else {
            rows(&mut |d, s| convert_contiguous(d, dst_dtype, s, src_dtype, row_len));
        }
    } else {
        rows(&mut |d, s| {
            for i in 0..row_len as isize {
                let v = read_f32(s.offset(i * inner_src * ss), src_dtype);
                write_f32(d.offset(i * inner_dst * ds), dst_dtype, v);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transposing_copy_matches_index_arithmetic() {
        // src [n=3, h=2, d=4] contiguous -> dst [h=2, max=5, d=4] at positions 1..4.
        let src: Vec<f32> = (0..24).map(|x| x as f32).collect();
        let mut dst = vec![0f32; 2 * 5 * 4];
        unsafe {
            copy_strided(
                dst.as_mut_ptr().add(4) as *mut u8,
                DType::F32,
                [4, 20, 1],
                src.as_ptr() as *const u8,
                DType::F32,
                [8, 4, 1],
                [3, 2, 4],
            );
        }
        for t in 0..3 {
            for h in 0..2 {
                for d in 0..4 {
                    assert_eq!(dst[h * 20 + (t + 1) * 4 + d], src[t * 8 + h * 4 + d]);
                }
            }
        }
        assert!(dst[..4].iter().all(|&x| x == 0.0));
    }

    #[test]
    fn negative_and_non_unit_inner_strides() {
        let src: Vec<f32> = (0..6).map(|x| x as f32).collect();
        let mut dst = vec![0u16; 6];
        unsafe {
            // Read src reversed along the last axis, as a [2, 3] tensor.
            copy_strided(
                dst.as_mut_ptr() as *mut u8,
                DType::F16,
                [0, 3, 1],
                src.as_ptr().add(2) as *const u8,
                DType::F32,
                [0, 3, -1],
                [1, 2, 3],
            );
        }
        let got: Vec<f32> = dst
            .iter()
            .map(|&b| half::f16::from_bits(b).to_f32())
            .collect();
        assert_eq!(got, vec![2.0, 1.0, 0.0, 5.0, 4.0, 3.0]);
    }

    #[test]
    fn rank_and_shape_checks() {
        let x = [0f32; 8];
        let t =
            unsafe { TensorRef::contiguous(x.as_ptr() as *const u8, DType::F32, &[2, 4]).unwrap() };
        assert_eq!(t.shape(), &[2, 4]);
        assert_eq!(t.shape3(), [1, 2, 4]);
        assert_eq!(t.strides3(), [0, 4, 1]);
        assert!(t.expect_shape("k", &[2, 4]).is_ok());
        let e = t.expect_shape("k", &[1, 2, 4]).unwrap_err();
        assert_eq!(e.to_string(), "k has shape [2, 4], expected [1, 2, 4]");
        assert!(unsafe {
            TensorRef::contiguous(x.as_ptr() as *const u8, DType::F32, &[1, 1, 2, 4])
        }
        .is_err());
    }
}
