//! Borrowed strided tensors (up to rank 3) and the strided copy with dtype conversion
//! that every storage backend's host path uses.

use crate::dtype::{convert_contiguous, read_f32, write_f32, DType};
use crate::error::{KvError, Result};
use crate::layout::Device;
use std::marker::PhantomData;

pub use crate::layout::MAX_RANK;

/// The layout of a borrowed tensor: where its element `[0, 0, 0]` lies, its dtype and
/// device, and its shape and strides padded to rank 3. Plain data; the two tensor types
/// below add the borrow.
#[derive(Clone, Copy, Debug)]
struct Layout {
    ptr: *mut u8,
    dtype: DType,
    device: Device,
    ndim: usize,
    shape: [usize; MAX_RANK],
    strides: [isize; MAX_RANK],
}

impl Layout {
    fn new(ptr: *mut u8, dtype: DType, shape: &[usize], strides: &[isize]) -> Result<Self> {
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
        Ok(Layout {
            ptr,
            dtype,
            device: Device::Cpu,
            ndim: shape.len(),
            shape: s,
            strides: st,
        })
    }

    fn contiguous(ptr: *mut u8, dtype: DType, shape: &[usize]) -> Result<Self> {
        if shape.len() > MAX_RANK {
            return Self::new(ptr, dtype, shape, &[]);
        }
        let mut strides = [0isize; MAX_RANK];
        let mut acc = 1isize;
        for i in (0..shape.len()).rev() {
            strides[i] = acc;
            acc = acc.wrapping_mul(shape[i] as isize);
        }
        Self::new(ptr, dtype, shape, &strides[..shape.len()])
    }

    /// A contiguous layout over `bytes` bytes at `ptr`, which must hold exactly `shape`.
    fn over_bytes(ptr: *mut u8, bytes: usize, dtype: DType, shape: &[usize]) -> Result<Self> {
        let elems = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        if elems.and_then(|n| n.checked_mul(dtype.size())) != Some(bytes) {
            return Err(KvError::Shape {
                name: "tensor",
                got: shape.to_vec(),
                expected: format!("{bytes} bytes of {dtype}"),
            });
        }
        Self::contiguous(ptr, dtype, shape)
    }

    fn shape(&self) -> &[usize] {
        &self.shape[MAX_RANK - self.ndim..]
    }

    fn slice(&self, dim: usize, start: usize, len: usize) -> Layout {
        assert!(
            start + len <= self.shape[dim],
            "slicing dimension {dim} of {:?} to {start}..{}",
            self.shape,
            start + len
        );
        let mut t = *self;
        t.shape[dim] = len;
        // The sliced elements lie inside the original tensor.
        t.ptr = self
            .ptr
            .wrapping_offset(start as isize * self.strides[dim] * self.dtype.size() as isize);
        t
    }

    fn transposed(&self, a: usize, b: usize) -> Layout {
        let mut t = *self;
        t.shape.swap(a, b);
        t.strides.swap(a, b);
        t
    }

    fn span(&self) -> Span {
        Span::of(
            self.ptr as usize,
            self.dtype.size(),
            self.shape,
            self.strides,
        )
    }
}

/// The bytes a tensor touches, `[start, end)` as addresses (empty for a tensor with no
/// element); what overlap checks compare.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// Lowest address touched.
    pub start: usize,
    /// One past the highest byte touched.
    pub end: usize,
}

impl Span {
    /// The bytes of elements of `elem` bytes at `base` with `shape` and element `strides`.
    pub fn of(
        base: usize,
        elem: usize,
        shape: [usize; MAX_RANK],
        strides: [isize; MAX_RANK],
    ) -> Span {
        if shape.contains(&0) {
            return Span {
                start: base,
                end: base,
            };
        }
        let (mut lo, mut hi) = (0isize, 0isize);
        for (&n, &s) in shape.iter().zip(&strides) {
            let reach = (n as isize - 1).wrapping_mul(s).wrapping_mul(elem as isize);
            if reach < 0 {
                lo = lo.wrapping_add(reach);
            } else {
                hi = hi.wrapping_add(reach);
            }
        }
        Span {
            start: base.wrapping_add_signed(lo),
            end: base.wrapping_add_signed(hi).wrapping_add(elem),
        }
    }

    /// Whether the two spans share a byte.
    pub fn overlaps(&self, other: &Span) -> bool {
        self.start < other.end && other.start < self.end
    }
}

/// The accessors both tensor types share: device, dtype, shape and strides, the bytes
/// touched, shape checks and size.
macro_rules! layout_accessors {
    () => {
        /// The same tensor, said to live on `device` (its pointer is then a device
        /// address).
        pub fn on(mut self, device: Device) -> Self {
            self.raw.device = device;
            self
        }

        /// Where the memory lives.
        pub fn device(&self) -> Device {
            self.raw.device
        }

        /// The element type.
        pub fn dtype(&self) -> DType {
            self.raw.dtype
        }

        /// The shape as given (without padding).
        pub fn shape(&self) -> &[usize] {
            self.raw.shape()
        }

        /// The shape padded to rank 3 with leading 1s.
        pub fn shape3(&self) -> [usize; MAX_RANK] {
            self.raw.shape
        }

        /// The strides (elements) padded to rank 3.
        pub fn strides3(&self) -> [isize; MAX_RANK] {
            self.raw.strides
        }

        /// The bytes the tensor touches.
        pub fn span(&self) -> Span {
            self.raw.span()
        }

        /// Fails with a shape error naming `name` unless the shape equals `expected`
        /// exactly.
        pub fn expect_shape(&self, name: &'static str, expected: &[usize]) -> Result<()> {
            expect_shape(name, self.shape(), expected)
        }

        /// Number of bytes a contiguous copy of this tensor would take.
        pub fn nbytes(&self) -> usize {
            self.raw.shape.iter().product::<usize>() * self.raw.dtype.size()
        }
    };
}

/// A borrowed, strided, read-only view of host or device memory that the core reads
/// from: the source of every write into a cache.
///
/// Strides are in elements and may be negative (a reversed NumPy view). The lifetime
/// `'a` is the borrow of the memory: a `TensorRef` built safely from a slice
/// ([`TensorRef::from_bytes`]) cannot outlive it, and one over a cache's own storage
/// (e.g. [`crate::kv_cache::CacheCore::host_tensor`]) borrows the cache, so no write
/// into the cache can run while it lives. The raw constructors are `unsafe` and used
/// at the FFI edge, where the caller holds the owning object. Tensors are on the host
/// unless built with [`TensorRef::on`]; only a storage of the same device reads device
/// tensors.
#[derive(Clone, Copy, Debug)]
pub struct TensorRef<'a> {
    raw: Layout,
    _borrow: PhantomData<&'a [u8]>,
}

// SAFETY: a TensorRef is a shared borrow of plain memory (a pointer plus a layout); the
// memory is valid for 'a on any thread, as for `&'a [u8]`.
unsafe impl Send for TensorRef<'_> {}
unsafe impl Sync for TensorRef<'_> {}

impl<'a> TensorRef<'a> {
    fn wrap(raw: Layout) -> Self {
        TensorRef {
            raw,
            _borrow: PhantomData,
        }
    }

    /// Describes `shape`/`strides` (elements) of `dtype` elements starting at `ptr`.
    ///
    /// # Safety
    /// Every element addressed by the layout must be valid for reads for `'a`, and
    /// nothing may write it during a call that reads the tensor.
    pub unsafe fn new(
        ptr: *const u8,
        dtype: DType,
        shape: &[usize],
        strides: &[isize],
    ) -> Result<Self> {
        Layout::new(ptr as *mut u8, dtype, shape, strides).map(Self::wrap)
    }

    /// A contiguous (C-order) tensor over `ptr`.
    ///
    /// # Safety
    /// As for [`TensorRef::new`].
    pub unsafe fn contiguous(ptr: *const u8, dtype: DType, shape: &[usize]) -> Result<Self> {
        Layout::contiguous(ptr as *mut u8, dtype, shape).map(Self::wrap)
    }

    /// A contiguous tensor of `shape` over `bytes`, which must hold exactly that many
    /// `dtype` elements (any alignment).
    pub fn from_bytes(bytes: &'a [u8], dtype: DType, shape: &[usize]) -> Result<Self> {
        Layout::over_bytes(bytes.as_ptr() as *mut u8, bytes.len(), dtype, shape).map(Self::wrap)
    }

    /// `data` as a contiguous float32 tensor of `shape` (which must hold exactly its
    /// elements).
    pub fn from_f32(data: &'a [f32], shape: &[usize]) -> Result<Self> {
        Self::from_bytes(bytemuck::cast_slice(data), DType::F32, shape)
    }

    layout_accessors!();

    /// Address of element `[0, 0, 0]`.
    pub fn as_ptr(&self) -> *const u8 {
        self.raw.ptr
    }

    /// The sub-tensor of indices `start..start + len` along dimension `dim` of the rank-3
    /// padded shape.
    pub fn slice(&self, dim: usize, start: usize, len: usize) -> TensorRef<'a> {
        Self::wrap(self.raw.slice(dim, start, len))
    }

    /// The same tensor with two dimensions of the rank-3 padded shape swapped.
    pub fn transposed(&self, a: usize, b: usize) -> TensorRef<'a> {
        Self::wrap(self.raw.transposed(a, b))
    }
}

/// A borrowed, strided view of host or device memory that the core writes into: the
/// destination of every read out of a cache (gathers, block extracts, attention
/// outputs).
///
/// Built safely only from a mutable borrow ([`TensorMut::from_bytes_mut`]), so no
/// other reference to the memory exists while it lives; the raw constructors are
/// `unsafe` and used at the FFI edge. The core writes through it only inside a call
/// that received it; sub-views ([`TensorMut::slice`]) may alias each other, so every
/// call that takes two outputs checks that they are disjoint.
#[derive(Debug)]
pub struct TensorMut<'a> {
    raw: Layout,
    _borrow: PhantomData<&'a mut [u8]>,
}

// SAFETY: as for `&'a mut [u8]`: the memory is valid for writes for 'a, on any thread.
// Shared access (`&TensorMut`) lets several threads write disjoint sub-views, which the
// core splits without overlap.
unsafe impl Send for TensorMut<'_> {}
unsafe impl Sync for TensorMut<'_> {}

impl<'a> TensorMut<'a> {
    fn wrap(raw: Layout) -> Self {
        TensorMut {
            raw,
            _borrow: PhantomData,
        }
    }

    /// Describes `shape`/`strides` (elements) of `dtype` elements starting at `ptr`.
    ///
    /// # Safety
    /// Every element addressed by the layout must be valid for reads and writes for
    /// `'a`, and nothing else may read or write it during a call that writes the tensor.
    pub unsafe fn new(
        ptr: *mut u8,
        dtype: DType,
        shape: &[usize],
        strides: &[isize],
    ) -> Result<Self> {
        Layout::new(ptr, dtype, shape, strides).map(Self::wrap)
    }

    /// A contiguous (C-order) tensor over `ptr`.
    ///
    /// # Safety
    /// As for [`TensorMut::new`].
    pub unsafe fn contiguous(ptr: *mut u8, dtype: DType, shape: &[usize]) -> Result<Self> {
        Layout::contiguous(ptr, dtype, shape).map(Self::wrap)
    }

    /// A contiguous tensor of `shape` over `bytes`, which must hold exactly that many
    /// `dtype` elements (any alignment).
    pub fn from_bytes_mut(bytes: &'a mut [u8], dtype: DType, shape: &[usize]) -> Result<Self> {
        Layout::over_bytes(bytes.as_mut_ptr(), bytes.len(), dtype, shape).map(Self::wrap)
    }

    /// `data` as a contiguous float32 tensor of `shape` (which must hold exactly its
    /// elements).
    pub fn from_f32_mut(data: &'a mut [f32], shape: &[usize]) -> Result<Self> {
        Self::from_bytes_mut(bytemuck::cast_slice_mut(data), DType::F32, shape)
    }

    /// The tensor as a source (a read-only view of the same memory, borrowing this one).
    pub fn as_ref(&self) -> TensorRef<'_> {
        TensorRef::wrap(self.raw)
    }

    layout_accessors!();

    /// Address of element `[0, 0, 0]`, for writing.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.raw.ptr
    }

    /// The sub-tensor of indices `start..start + len` along dimension `dim` of the rank-3
    /// padded shape (it may alias other sub-views of this tensor).
    pub fn slice(&self, dim: usize, start: usize, len: usize) -> TensorMut<'_> {
        Self::wrap(self.raw.slice(dim, start, len))
    }

    /// The same tensor with two dimensions of the rank-3 padded shape swapped.
    pub fn transposed(&self, a: usize, b: usize) -> TensorMut<'_> {
        Self::wrap(self.raw.transposed(a, b))
    }

    /// Sets every element to zero.
    pub fn fill_zero(&self) {
        let zero = [0u8; 4];
        // SAFETY: the tensor is valid for writes (its constructors' contract), and a
        // zero of any dtype is read from `zero` with stride 0.
        unsafe {
            copy_strided(
                self.raw.ptr,
                self.raw.dtype,
                self.raw.strides,
                zero.as_ptr(),
                self.raw.dtype,
                [0; MAX_RANK],
                self.raw.shape,
            );
        }
    }
}

/// Fails unless the outputs `a` and `b` (named for the message) touch no common byte:
/// the core may fill them from different threads.
pub fn check_disjoint(
    a: (&'static str, &TensorMut<'_>),
    b: (&'static str, &TensorMut<'_>),
) -> Result<()> {
    if a.1.device() == b.1.device() && a.1.span().overlaps(&b.1.span()) {
        return Err(KvError::InvalidArgument {
            name: b.0,
            value: "an array sharing memory with ".to_string() + a.0,
            reason: format!("{} and {} must not overlap", a.0, b.0),
        });
    }
    Ok(())
}

fn expect_shape(name: &'static str, got: &[usize], expected: &[usize]) -> Result<()> {
    if got != expected {
        return Err(KvError::Shape {
            name,
            got: got.to_vec(),
            expected: format!("{expected:?}"),
        });
    }
    Ok(())
}

/// Checks the shapes of a block pair: `keys` and `values`, each exactly `shape`
/// (`[heads, n, head_dim]`).
pub fn expect_block_pair(keys: &[usize], values: &[usize], shape: [usize; MAX_RANK]) -> Result<()> {
    expect_shape("keys", keys, &shape)?;
    expect_shape("values", values, &shape)
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
