//! The static scales of an fp8 cache and their application to the tensors written into
//! and read out of it.
//!
//! An fp8 cache stores `x / scale` for each key (and value) element, where `scale` is a
//! float32 given per layer, for K and for V, and optionally per KV head, as a model's
//! checkpoint provides them (vLLM's `k_scale` / `v_scale`); 1.0 when none is given. A
//! write divides by the scale before encoding, a float read multiplies after decoding,
//! and attention folds the scale into the rows it loads. The codes in the storage are
//! plain fp8 values: views of them, block copies and persistence move bytes only.

use std::cell::RefCell;

use crate::attention;
use crate::dtype::{read_f32, write_f32, DType};
use crate::error::{KvError, Result};
use crate::layout::{Device, Kv};
use crate::sizes;
use crate::storage::cuda::DeviceScaler;
use crate::storage::Storage;
use crate::tensor::{copy_strided, TensorMut, TensorRef};

thread_local! {
    /// The f32 copies of scaled inputs, reused across calls.
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// One float32 scale per (layer, K or V, KV head).
#[derive(Clone, Debug, PartialEq)]
pub struct KvScales {
    num_kv_heads: usize,
    /// `[layer][head]` scales of the keys, then of the values.
    k: Vec<f32>,
    v: Vec<f32>,
}

impl KvScales {
    /// Every scale 1.0. Fails when `num_layers * num_kv_heads` scales exceed the
    /// address space or the host's memory.
    pub fn unit(num_layers: usize, num_kv_heads: usize) -> Result<Self> {
        let n = count(num_layers, num_kv_heads)?;
        Ok(KvScales {
            num_kv_heads,
            k: sizes::filled("the K scales", n, 1.0)?,
            v: sizes::filled("the V scales", n, 1.0)?,
        })
    }

    /// Scales from `k` and `v`, each one value (every layer and head), `num_layers`
    /// values (one per layer) or `num_layers * num_kv_heads` values (layer-major);
    /// every value finite and positive.
    pub fn new(num_layers: usize, num_kv_heads: usize, k: &[f32], v: &[f32]) -> Result<Self> {
        let n = count(num_layers, num_kv_heads)?;
        let expand = |name: &'static str, x: &[f32]| -> Result<Vec<f32>> {
            if let Some(bad) = x.iter().find(|s| !(s.is_finite() && **s > 0.0)) {
                return Err(KvError::InvalidArgument {
                    name,
                    value: bad.to_string(),
                    reason: "scales must be finite and > 0".into(),
                });
            }
            match x.len() {
                1 => sizes::filled(name, n, x[0]),
                l if l == n => Ok(x.to_vec()),
                l if l == num_layers => {
                    let mut all = sizes::with_capacity(name, n)?;
                    all.extend(x.iter().flat_map(|&s| std::iter::repeat_n(s, num_kv_heads)));
                    Ok(all)
                }
                l => Err(KvError::Shape {
                    name,
                    got: vec![l],
                    expected: format!(
                        "one scale, one per layer ({num_layers}) or one per layer and KV \
                         head ({num_layers} x {num_kv_heads})"
                    ),
                }),
            }
        };
        Ok(KvScales {
            num_kv_heads,
            k: expand("k_scale", k)?,
            v: expand("v_scale", v)?,
        })
    }

    /// KV heads per layer.
    pub fn num_kv_heads(&self) -> usize {
        self.num_kv_heads
    }

    /// Whether every scale is 1.0.
    pub fn is_unit(&self) -> bool {
        self.k.iter().chain(&self.v).all(|&s| s == 1.0)
    }

    /// The scales of `layer`'s K or V, one per KV head.
    pub fn heads(&self, layer: usize, kv: Kv) -> &[f32] {
        let all = match kv {
            Kv::Key => &self.k,
            Kv::Value => &self.v,
        };
        &all[layer * self.num_kv_heads..(layer + 1) * self.num_kv_heads]
    }

    /// Every key scale, `[layer][head]`.
    pub fn keys(&self) -> &[f32] {
        &self.k
    }

    /// Every value scale, `[layer][head]`.
    pub fn values(&self) -> &[f32] {
        &self.v
    }
}

/// The number of scales of K (or of V): one per layer and KV head.
fn count(num_layers: usize, num_kv_heads: usize) -> Result<usize> {
    sizes::product(
        "the scales",
        &[("num_layers", num_layers), ("num_kv_heads", num_kv_heads)],
    )
}

/// What multiplies the elements of `layer` that attention reads from `storage`: its
/// per-vector scales (int8), `scales`' per-head ones (fp8), or nothing.
pub fn attention_scales<'a>(
    storage: &dyn Storage,
    scales: &'a KvScales,
    layer: usize,
) -> attention::Scales<'a> {
    if let Some(r) = storage.row_scales() {
        return attention::Scales::PerRow {
            ptr: r.ptr,
            row_len: r.row_len,
        };
    }
    if storage.dtype().fp8().is_some() {
        return attention::Scales::PerHead {
            k: scales.heads(layer, Kv::Key),
            v: scales.heads(layer, Kv::Value),
        };
    }
    attention::Scales::None
}

/// Fails unless `scales` are all 1 or `dtype` is an fp8 dtype.
pub fn check_dtype(scales: &KvScales, dtype: DType) -> Result<()> {
    if scales.is_unit() || dtype.fp8().is_some() {
        return Ok(());
    }
    Err(KvError::InvalidArgument {
        name: "k_scale",
        value: format!("scales for a {dtype} cache"),
        reason: "k_scale and v_scale apply to fp8 caches ('fp8_e4m3', 'fp8_e5m2'); int8 \
                 computes a scale per token and head"
            .into(),
    })
}

/// Whether scaling by `scales` changes anything.
fn is_unit(scales: &[f32]) -> bool {
    scales.iter().all(|&s| s == 1.0)
}

/// The index of each element's head: `scales` has one entry per index of `t` along
/// `head_axis` (of its rank-3 shape), or a single entry for every element.
fn head_scale(scales: &[f32], head_axis: usize, index: [usize; 3]) -> f32 {
    if scales.len() == 1 {
        scales[0]
    } else {
        scales[index[head_axis]]
    }
}

/// Calls `f` with each of `inputs` divided by its scales along `head_axis` (float32
/// copies: on the host, or through `device` for inputs on a CUDA cache's device), or with
/// the inputs themselves when every scale is 1.
pub fn with_divided<const N: usize, R>(
    device: Option<DeviceScaler>,
    inputs: [(&TensorRef, &[f32]); N],
    head_axis: usize,
    f: impl FnOnce([&TensorRef; N]) -> Result<R>,
) -> Result<R> {
    if inputs.iter().all(|(_, s)| is_unit(s)) {
        return f(inputs.map(|(t, _)| t));
    }
    if let Some((t, _)) = inputs.iter().find(|(t, _)| t.device() != Device::Cpu) {
        let Some(scaler) = device.filter(|_| inputs.iter().all(|(t, _)| t.device() != Device::Cpu))
        else {
            return Err(KvError::Device(format!(
                "the input lives on {}; pass every input on the cache's device",
                t.device()
            )));
        };
        let copies = scaler.divided(inputs, head_axis)?;
        return f(std::array::from_fn(|i| &copies[i]));
    }
    SCRATCH.with(|scratch| {
        let mut scratch = scratch.borrow_mut();
        let total: usize = inputs
            .iter()
            .map(|(t, _)| t.shape3().iter().product::<usize>())
            .sum();
        if scratch.len() < total {
            scratch.resize(total, 0.0);
        }
        let mut copies = [None; N];
        let mut rest = &mut scratch[..total];
        for (slot, (t, scales)) in copies.iter_mut().zip(&inputs) {
            let [a, b, c] = t.shape3();
            let (mine, tail) = rest.split_at_mut(a * b * c);
            rest = tail;
            let strides = [(b * c) as isize, c as isize, 1];
            // SAFETY: `mine` holds the tensor's elements; t's validity is its contract.
            unsafe {
                copy_strided(
                    mine.as_mut_ptr() as *mut u8,
                    DType::F32,
                    strides,
                    t.as_ptr(),
                    t.dtype(),
                    t.strides3(),
                    [a, b, c],
                )
            };
            // Row by row ([i][j] of c elements): the scale changes per element only when
            // the heads lie along the last axis.
            for (r, row) in mine.chunks_exact_mut(c.max(1)).enumerate() {
                let (i, j) = (r / b.max(1), r % b.max(1));
                if head_axis == 2 && scales.len() > 1 {
                    for (x, s) in row.iter_mut().zip(scales.iter()) {
                        *x /= s;
                    }
                } else {
                    let s = head_scale(scales, head_axis, [i, j, 0]);
                    row.iter_mut().for_each(|x| *x /= s);
                }
            }
            // SAFETY: the copy outlives every use of the TensorRef (inside `f`).
            *slot = Some(unsafe {
                TensorRef::new(mine.as_ptr() as *const u8, DType::F32, t.shape(), {
                    let nd = t.shape().len();
                    &strides[3 - nd..]
                })?
            });
        }
        let copies = copies.map(|c| c.expect("every input was copied"));
        f(std::array::from_fn(|i| &copies[i]))
    })
}

/// Multiplies every element of `t` (a float dtype; host memory, or through `device` on
/// a CUDA cache's device) by its head's scale along `head_axis`; nothing happens when
/// every scale is 1 or `t` holds raw codes.
pub fn multiply_heads(
    device: Option<DeviceScaler>,
    t: &mut TensorMut,
    head_axis: usize,
    scales: &[f32],
) -> Result<()> {
    if is_unit(scales) || t.dtype().is_quantized() {
        return Ok(());
    }
    if t.device() != Device::Cpu {
        return match device {
            Some(scaler) => scaler.multiply(t, head_axis, scales),
            None => Err(KvError::Device(format!(
                "the output lives on {}; this cache lives on the host",
                t.device()
            ))),
        };
    }
    let [a, b, c] = t.shape3();
    let (st, dtype) = (t.strides3(), t.dtype());
    let size = dtype.size() as isize;
    let base = t.as_mut_ptr();
    for i in 0..a {
        for j in 0..b {
            for k in 0..c {
                let at = (i as isize * st[0] + j as isize * st[1] + k as isize * st[2]) * size;
                // SAFETY: the element lies in the tensor, valid for writes and borrowed
                // mutably by contract.
                unsafe {
                    let p = base.offset(at);
                    let x = read_f32(p, dtype) * head_scale(scales, head_axis, [i, j, k]);
                    write_f32(p, dtype, x);
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scales_expand_from_one_per_layer_or_per_head() {
        let s = KvScales::new(2, 3, &[0.5, 2.0], &[4.0]).unwrap();
        assert_eq!(s.heads(1, Kv::Key), &[2.0; 3]);
        assert_eq!(s.heads(0, Kv::Value), &[4.0; 3]);
        let per_head: Vec<f32> = (1..=6).map(|i| i as f32).collect();
        let s = KvScales::new(2, 3, &per_head, &per_head).unwrap();
        assert_eq!(s.heads(1, Kv::Value), &[4.0, 5.0, 6.0]);
        assert!(!s.is_unit());
        assert!(KvScales::unit(2, 3).unwrap().is_unit());
        assert!(KvScales::new(2, 3, &[1.0; 4], &[1.0]).is_err());
        assert!(KvScales::new(2, 3, &[0.0], &[1.0]).is_err());
        assert!(KvScales::new(2, 3, &[1.0], &[f32::NAN]).is_err());
    }

    #[test]
    fn huge_scale_counts_are_errors() {
        // Past the address space (a ValueError), or past the host's memory (MemoryError).
        let e = KvScales::unit(2, usize::MAX).unwrap_err();
        assert!(e.to_string().starts_with("num_kv_heads="), "{e}");
        assert!(matches!(
            KvScales::unit(1, 1 << 62),
            Err(KvError::OutOfMemory { .. })
        ));
        assert!(KvScales::new(1, 1 << 62, &[0.5], &[1.0]).is_err());
        assert!(KvScales::new(1 << 62, 1, &[0.5], &[1.0]).is_err());
    }

    #[test]
    fn division_and_multiplication_follow_the_head_axis() {
        // [2 tokens, 2 heads, 2 dims], heads scaled by 2 and 4.
        let x: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let t = unsafe { TensorRef::contiguous(x.as_ptr() as *const u8, DType::F32, &[2, 2, 2]) }
            .unwrap();
        let scales = [2.0, 4.0];
        let got = with_divided(None, [(&t, &scales[..])], 1, |[d]| {
            let mut out = vec![0f32; 8];
            unsafe {
                copy_strided(
                    out.as_mut_ptr() as *mut u8,
                    DType::F32,
                    [4, 2, 1],
                    d.as_ptr(),
                    d.dtype(),
                    d.strides3(),
                    [2, 2, 2],
                )
            };
            Ok(out)
        })
        .unwrap();
        assert_eq!(got, vec![0.0, 0.5, 0.5, 0.75, 2.0, 2.5, 1.5, 1.75]);
        let mut back = got.clone();
        let mut t = TensorMut::from_f32_mut(&mut back, &[2, 2, 2]).unwrap();
        multiply_heads(None, &mut t, 1, &scales).unwrap();
        assert_eq!(back, x);
    }
}
