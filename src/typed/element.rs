//! The element types of the typed API and the one place slices become core tensors.

use half::{bf16, f16};

use crate::dtype::DType;
use crate::error::{KvError, Result};
use crate::tensor::{TensorMut, TensorRef};

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// An element type a typed cache stores and reads: `f32`, [`half::f16`] or [`half::bf16`].
///
/// Sealed: the core converts between exactly these (and computes attention in `f32`).
pub trait Element: bytemuck::Pod + Default + Send + Sync + 'static + sealed::Sealed {
    /// The core's name for this type.
    const DTYPE: DType;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
}

/// Fails unless `data` holds exactly `shape`'s elements.
fn check_len(name: &'static str, len: usize, shape: &[usize]) -> Result<()> {
    let want: usize = shape.iter().product();
    if len != want {
        return Err(KvError::Shape {
            name,
            got: vec![len],
            expected: format!("{want} elements (a C-order {shape:?} slice)"),
        });
    }
    Ok(())
}

/// `data` as a C-order tensor of `shape`, read by the core.
pub(crate) fn tensor<'a, T: Element>(
    name: &'static str,
    data: &'a [T],
    shape: &[usize],
) -> Result<TensorRef<'a>> {
    check_len(name, data.len(), shape)?;
    TensorRef::from_bytes(bytemuck::cast_slice(data), T::DTYPE, shape)
}

/// `data` as a C-order tensor of `shape`, written by the core.
pub(crate) fn tensor_mut<'a, T: Element>(
    name: &'static str,
    data: &'a mut [T],
    shape: &[usize],
) -> Result<TensorMut<'a>> {
    check_len(name, data.len(), shape)?;
    TensorMut::from_bytes_mut(bytemuck::cast_slice_mut(data), T::DTYPE, shape)
}

/// Tokens in a `[n, heads, head_dim]` slice of `len` elements.
pub(crate) fn token_count(
    name: &'static str,
    len: usize,
    heads: usize,
    head_dim: usize,
) -> Result<usize> {
    let per_token = heads * head_dim;
    if per_token == 0 || !len.is_multiple_of(per_token) {
        return Err(KvError::Shape {
            name,
            got: vec![len],
            expected: format!("a multiple of {heads} x {head_dim} = {per_token} elements ([n, {heads}, {head_dim}])"),
        });
    }
    Ok(len / per_token.max(1))
}

/// `q` (`[n, num_q_heads, dims[0]]`, `n` read from `q`'s length) and `out` (`[n,
/// num_q_heads, dims[1]]`) as the core's query and output tensors.
pub(crate) fn query_tensors<'a, Q: Element>(
    q: &'a [Q],
    out: &'a mut [Q],
    num_q_heads: usize,
    dims: [usize; 2],
) -> Result<(TensorRef<'a>, TensorMut<'a>)> {
    let n = token_count("q", q.len(), num_q_heads.max(1), dims[0])?;
    Ok((
        tensor("q", q, &[n, num_q_heads, dims[0]])?,
        tensor_mut("out", out, &[n, num_q_heads, dims[1]])?,
    ))
}

/// A `usize` index as the core's signed index (an index past `i64::MAX` is out of range
/// whatever the limit, and stays so).
pub(crate) fn index(i: usize) -> i64 {
    i64::try_from(i).unwrap_or(i64::MAX)
}
