//! Borrowed strided tensors (up to rank 3) and the strided copy with dtype conversion
//! that every storage backend's host path uses.

use crate::dtype::{convert_contiguous, read_f32, write_f32, DType};
use crate::error::{KvError, Result};
use crate::layout::{Device, Region};
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
        // Written so that no sum can wrap: `start + len` may exceed `usize::MAX`.
        assert!(
            start <= self.shape[dim] && len <= self.shape[dim] - start,
            "slicing dimension {dim} of {:?} to {start}..{start}+{len}",
            self.shape,
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

    /// Whether two different indices may address the same element. Conservative: false
    /// only when, with the dimensions ordered by stride, each stride steps past every
    /// element the smaller ones reach (as in any C-order, Fortran-order or permuted
    /// layout, or a slice of one), which makes the layout one-to-one.
    fn may_overlap_itself(&self) -> bool {
        if self.shape.contains(&0) {
            return false;
        }
        let mut dims: [(usize, usize); MAX_RANK] =
            std::array::from_fn(|i| (self.strides[i].unsigned_abs(), self.shape[i]));
        dims.sort_unstable();
        // The highest element offset the dimensions seen so far reach from [0, 0, 0].
        let mut reach = 0usize;
        for (stride, n) in dims {
            if n == 1 {
                continue;
            }
            if stride <= reach {
                return true;
            }
            match (n - 1)
                .checked_mul(stride)
                .and_then(|r| r.checked_add(reach))
            {
                Some(r) => reach = r,
                None => return true,
            }
        }
        false
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

        /// Whether two different indices may address the same element (a broadcast or
        /// an `as_strided` view). Conservative: false only when, by growing stride, each
        /// dimension steps past every element the smaller ones reach.
        pub fn may_overlap_itself(&self) -> bool {
            self.raw.may_overlap_itself()
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

        /// Fails with a shape error naming `name` unless the tensor has region `r`'s
        /// shape (padded to rank 3): a copy between a storage's region and a caller's
        /// tensor runs over the region's shape, so any other tensor would be read or
        /// written past its end. Every storage checks this before it copies.
        pub(crate) fn expect_region(&self, name: &'static str, r: &Region) -> Result<()> {
            if self.raw.shape != r.shape {
                return Err(KvError::Shape {
                    name,
                    got: self.shape().to_vec(),
                    expected: format!("{:?} (the shape of the storage region)", r.shape),
                });
            }
            Ok(())
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
/// A `TensorMut<'a>` behaves like `&'a mut [T]`: it is built safely only from a mutable
/// borrow ([`TensorMut::from_bytes_mut`]), so no other reference to the memory exists
/// while it lives, and everything that writes through it takes `&mut self` (the calls
/// that fill it take `&mut TensorMut`). A sub-view ([`TensorMut::slice`],
/// [`TensorMut::reborrow`]) borrows it mutably, so two sub-views of one tensor never
/// coexist, and a shared `&TensorMut` only reads (its layout, or [`TensorMut::as_ref`]).
/// The raw constructors are `unsafe` and used at the FFI edge, where two outputs may be
/// one array: every call that takes two outputs checks that they are disjoint.
///
/// Two threads cannot write one tensor through a shared reference:
///
/// ```compile_fail
/// use kvrs::unstable::TensorMut;
/// let mut buf = [1f32; 16];
/// let t = TensorMut::from_f32_mut(&mut buf, &[16]).unwrap();
/// let shared = &t;
/// std::thread::scope(|s| {
///     s.spawn(move || shared.fill_zero());
///     s.spawn(move || shared.fill_zero());
/// });
/// ```
///
/// and two sub-views of one tensor cannot be alive at once:
///
/// ```compile_fail
/// use kvrs::unstable::TensorMut;
/// let mut buf = [1f32; 16];
/// let mut t = TensorMut::from_f32_mut(&mut buf, &[16]).unwrap();
/// let mut a = t.slice(2, 0, 1);
/// let mut b = t.slice(2, 0, 1);
/// a.fill_zero();
/// b.fill_zero();
/// ```
#[derive(Debug)]
pub struct TensorMut<'a> {
    raw: Layout,
    _borrow: PhantomData<&'a mut [u8]>,
}

// SAFETY: as for `&'a mut [u8]`: the tensor is the only way to its memory, valid for
// writes for 'a on any thread, so moving it to another thread is sound; a shared
// `&TensorMut` only reads it (every write takes `&mut self`), so sharing one is too.
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
    /// `'a`, and nothing else may read or write it while the tensor lives (other than
    /// through it).
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

    /// Address of element `[0, 0, 0]`, for writing (through `&mut self`: no other
    /// access to the tensor runs while the caller writes).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.raw.ptr
    }

    /// The same tensor, borrowed for a shorter time (as `&mut *r` reborrows `&mut [T]`):
    /// this one is usable again once the result is dropped.
    pub fn reborrow(&mut self) -> TensorMut<'_> {
        Self::wrap(self.raw)
    }

    /// The sub-tensor of indices `start..start + len` along dimension `dim` of the rank-3
    /// padded shape, borrowing this tensor mutably (panics when the range exceeds the
    /// dimension).
    pub fn slice(&mut self, dim: usize, start: usize, len: usize) -> TensorMut<'_> {
        Self::wrap(self.raw.slice(dim, start, len))
    }

    /// The same tensor with two dimensions of the rank-3 padded shape swapped.
    pub fn transposed(self, a: usize, b: usize) -> TensorMut<'a> {
        Self::wrap(self.raw.transposed(a, b))
    }

    /// Sets every element to zero.
    pub fn fill_zero(&mut self) {
        let r = &self.raw;
        if r.shape.contains(&0) {
            return;
        }
        let size = r.dtype.size() as isize;
        let [s0, s1, s2] = r.strides;
        let [n0, n1, n2] = r.shape;
        if s2 == 1 && (n1 == 1 || s1 == n2 as isize) && (n0 == 1 || s0 == (n1 * n2) as isize) {
            // SAFETY: as below; the tensor is one contiguous run of n0 * n1 * n2 elements.
            unsafe { std::ptr::write_bytes(r.ptr, 0, n0 * n1 * n2 * size as usize) };
            return;
        }
        for i in 0..r.shape[0] as isize {
            for j in 0..r.shape[1] as isize {
                let row = r.ptr.wrapping_offset((i * s0 + j * s1) * size);
                // SAFETY: every element lies in the tensor, valid for writes and borrowed
                // mutably (its constructors' contract); zero bytes are a zero of every
                // dtype. Contiguous rows are cleared in one call.
                unsafe {
                    if s2 == 1 {
                        std::ptr::write_bytes(row, 0, r.shape[2] * size as usize);
                    } else {
                        for k in 0..r.shape[2] as isize {
                            std::ptr::write_bytes(row.offset(k * s2 * size), 0, size as usize);
                        }
                    }
                }
            }
        }
    }

    /// The tensor as a destination that several threads fill at once (rayon's workers,
    /// each writing its own part), borrowing it mutably for as long as they run; `None`
    /// when its layout may address one element twice (a stride-0 or overlapping view
    /// from the FFI edge), which the callers then fill from one thread.
    pub(crate) fn share(&mut self) -> Option<SharedTensorMut<'_>> {
        if self.raw.may_overlap_itself() {
            return None;
        }
        Some(SharedTensorMut {
            raw: self.raw,
            _borrow: PhantomData,
        })
    }
}

/// A [`TensorMut`] shared by threads that write disjoint parts of it: the one way the
/// core splits a destination across rayon's workers (parallel gathers, attention
/// items). Crate-private, made only by [`TensorMut::share`] (which borrows the tensor
/// mutably and refuses a layout that addresses an element twice), and usable only
/// through `unsafe` calls whose callers show the parts disjoint.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SharedTensorMut<'a> {
    raw: Layout,
    _borrow: PhantomData<&'a mut [u8]>,
}

// SAFETY: the memory is valid for writes for 'a on any thread (it comes from a
// TensorMut borrowed mutably for 'a); each write through the handle is an `unsafe` call
// whose caller guarantees that no other thread touches the same elements.
unsafe impl Send for SharedTensorMut<'_> {}
unsafe impl Sync for SharedTensorMut<'_> {}

impl<'a> SharedTensorMut<'a> {
    /// The element type.
    pub(crate) fn dtype(&self) -> DType {
        self.raw.dtype
    }

    /// Address of element `[0, 0, 0]` (writing through it is the caller's `unsafe`
    /// business: see [`SharedTensorMut::slice`] for the rule).
    pub(crate) fn as_mut_ptr(&self) -> *mut u8 {
        self.raw.ptr
    }

    /// The sub-tensor of indices `start..start + len` along dimension `dim`, for one
    /// thread to write (panics when the range exceeds the dimension).
    ///
    /// # Safety
    /// Sub-tensors (and elements written through [`SharedTensorMut::as_mut_ptr`]) alive
    /// at the same time must be disjoint: along one `dim`, their ranges must not
    /// overlap. (The layout addresses each element once, so disjoint ranges are disjoint
    /// memory.)
    pub(crate) unsafe fn slice(&self, dim: usize, start: usize, len: usize) -> TensorMut<'a> {
        TensorMut::wrap(self.raw.slice(dim, start, len))
    }
}

/// Fails unless the outputs `a` and `b` (named for the message) touch no common byte:
/// the core may fill them from different threads, and two tensors from the raw
/// constructors (the FFI edge) may be views of one array.
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
pub fn expect_block_pair(
    keys: &[usize],
    values: &[usize],
    shapes: [[usize; MAX_RANK]; 2],
) -> Result<()> {
    expect_shape("keys", keys, &shapes[0])?;
    expect_shape("values", values, &shapes[1])
}

/// Copies every element of a rank-3 shape from `src` to `dst`, converting the dtype.
///
/// Dimensions of size 1 are dropped, the rest are ordered by source stride (reads run
/// sequentially, which matters more than sequential writes), and
/// dimensions that are contiguous in both tensors are merged, so a copy between
/// compatible layouts runs as a few long rows (a plain `memcpy` per row when the dtypes
/// match). Returns how many elements saturated an fp8 `dst_dtype` (rounded past its
/// largest finite value and clamped to it; [`crate::quant::Fp8::saturates`]), 0 for
/// other dtypes.
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
) -> usize {
    if shape.contains(&0) {
        return 0;
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
    let mut saturated = 0;
    if inner_dst == 1 && inner_src == 1 {
        if dst_dtype == src_dtype {
            let bytes = row_len * dst_dtype.size();
            rows(&mut |d, s| std::ptr::copy_nonoverlapping(s, d, bytes));
        } else {
            rows(&mut |d, s| saturated += convert_contiguous(d, dst_dtype, s, src_dtype, row_len));
        }
    } else {
        let fp8 = if src_dtype == dst_dtype {
            None // codes copied as they are: nothing is encoded
        } else {
            dst_dtype.fp8()
        };
        rows(&mut |d, s| {
            for i in 0..row_len as isize {
                let v = read_f32(s.offset(i * inner_src * ss), src_dtype);
                saturated += fp8.is_some_and(|f| f.saturates(v)) as usize;
                write_f32(d.offset(i * inner_dst * ds), dst_dtype, v);
            }
        });
    }
    saturated
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
    #[should_panic(expected = "slicing dimension 2")]
    fn a_slice_range_cannot_wrap_around() {
        let mut x = [0f32; 4];
        let mut t = TensorMut::from_f32_mut(&mut x, &[4]).unwrap();
        // 1 + usize::MAX wraps to 0 <= 4: must not pass as a range inside the tensor.
        let _ = t.slice(2, 1, usize::MAX);
    }

    #[test]
    fn sub_views_borrow_their_tensor_in_turn() {
        let mut x = [1f32; 8];
        let mut t = TensorMut::from_f32_mut(&mut x, &[2, 4]).unwrap();
        t.slice(1, 0, 1).fill_zero();
        let mut row = t.slice(1, 1, 1);
        row.reborrow().slice(2, 2, 2).fill_zero();
        assert_eq!(row.as_ref().shape(), &[1, 4]);
        assert_eq!(x, [0., 0., 0., 0., 1., 1., 0., 0.]);
    }

    #[test]
    fn only_layouts_addressing_each_element_once_are_shared() {
        let mut x = [0f32; 24];
        let p = x.as_mut_ptr() as *mut u8;
        let make = |shape: &[usize], strides: &[isize]| unsafe {
            TensorMut::new(p, DType::F32, shape, strides).unwrap()
        };
        // C order, a transpose, a slice of one, a padded row: each element once.
        assert!(make(&[2, 3, 4], &[12, 4, 1]).share().is_some());
        assert!(make(&[2, 3, 4], &[12, 4, 1])
            .transposed(0, 1)
            .share()
            .is_some());
        assert!(make(&[2, 2, 2], &[12, 4, 1]).share().is_some());
        assert!(make(&[3, 4], &[8, 1]).share().is_some());
        assert!(make(&[0, 4], &[0, 0]).share().is_some());
        // A broadcast (stride 0) and overlapping rows address elements twice.
        assert!(make(&[3, 4], &[0, 1]).share().is_none());
        assert!(make(&[3, 4], &[2, 1]).share().is_none());
        assert!(make(&[2, 3, 4], &[4, 12, 2]).share().is_none());
        assert!(make(&[2, 2], &[isize::MIN / 2, isize::MIN / 2])
            .share()
            .is_none());
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
