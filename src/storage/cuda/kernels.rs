//! The names of the kernels in `kernels/kvrs.cu`, by operation and dtypes: a table made
//! once, so a launch looks its kernel up without allocating.

use std::sync::OnceLock;

use crate::dtype::DType;
use crate::error::{KvError, Result};

/// Kernels with one variant per pair of dtypes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// `kvrs_scatter_*`: tokens by slot mapping (input, storage).
    Scatter,
    /// `kvrs_append_contiguous_*`: the contiguous cache's append at the device counter
    /// (input, storage).
    AppendContiguous,
    /// `kvrs_copy3_*`: strided rank-3 copy with conversion (source, destination).
    Copy3,
    /// `kvrs_scale3_*`: copy dividing or multiplying by per-head scales (source,
    /// destination; floats only).
    Scale3,
    /// `kvrs_quantize3_*`: a region of int8 codes written from floats (source, int8).
    Quantize3,
    /// `kvrs_dequantize3_*`: a region of int8 codes read into floats (int8, destination).
    Dequantize3,
}

const KERNELS: [Kernel; 6] = [
    Kernel::Scatter,
    Kernel::AppendContiguous,
    Kernel::Copy3,
    Kernel::Scale3,
    Kernel::Quantize3,
    Kernel::Dequantize3,
];

/// Every dtype, in the table's order.
const DTYPES: [DType; 6] = DType::ALL;

/// A dtype's part of kernel names.
fn part(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::F8E4M3 => "e4m3",
        DType::F8E5M2 => "e5m2",
        DType::I8 => "i8",
    }
}

/// The name of `kernel` for dtypes `(a, b)` as `kernels/kvrs.cu` defines it, or `None`
/// where it defines none.
fn defined(kernel: Kernel, a: DType, b: DType) -> Option<String> {
    let float = |d: DType| !d.is_quantized();
    let (pa, pb) = (part(a), part(b));
    match kernel {
        Kernel::Scatter | Kernel::AppendContiguous if float(a) => {
            let op = if kernel == Kernel::Scatter {
                "scatter"
            } else {
                "append_contiguous"
            };
            Some(format!("kvrs_{op}_{pa}_{pb}"))
        }
        Kernel::Copy3 if a == b && a.size() == 1 => Some("kvrs_copy3_b8_b8".into()),
        Kernel::Copy3 if b != DType::I8 && a != DType::I8 && (float(a) || float(b)) => {
            Some(format!("kvrs_copy3_{pa}_{pb}"))
        }
        Kernel::Scale3 if float(a) && float(b) => Some(format!("kvrs_scale3_{pa}_{pb}")),
        Kernel::Quantize3 if float(a) && b == DType::I8 => Some(format!("kvrs_quantize3_{pa}")),
        Kernel::Dequantize3 if a == DType::I8 && float(b) => Some(format!("kvrs_dequantize3_{pb}")),
        _ => None,
    }
}

/// The instances of a kernel that takes launch words: the words in a parameter of
/// [`super::gpu::SMALL_WORDS`] or [`super::gpu::LARGE_WORDS`], or behind a pointer
/// (`kernels/kvrs.cu`, "Copies at copy speed").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WordsKernel {
    /// `NAME_w480`.
    pub small: &'static str,
    /// `NAME_w4000`.
    pub large: &'static str,
    /// `NAME_wp`.
    pub pointer: &'static str,
}

impl WordsKernel {
    /// The instances of kernel `base` (names made once per process).
    fn leak(base: &str) -> Self {
        let name = |suffix: &str| &*format!("{base}_{suffix}").leak();
        WordsKernel {
            small: name("w480"),
            large: name("w4000"),
            pointer: name("wp"),
        }
    }

    /// The instances of a kernel named by literals.
    const fn of(small: &'static str, large: &'static str, pointer: &'static str) -> Self {
        WordsKernel {
            small,
            large,
            pointer,
        }
    }
}

/// The names of every kernel of [`KERNELS`] for every pair of [`DTYPES`].
struct Table {
    names: Vec<Option<&'static str>>,
    words: Vec<Option<WordsKernel>>,
}

fn table() -> &'static Table {
    static TABLE: OnceLock<Table> = OnceLock::new();
    TABLE.get_or_init(|| {
        let n = KERNELS.len() * DTYPES.len() * DTYPES.len();
        let mut t = Table {
            names: vec![None; n],
            words: vec![None; n],
        };
        for (k, &kern) in KERNELS.iter().enumerate() {
            for (i, &x) in DTYPES.iter().enumerate() {
                for (j, &y) in DTYPES.iter().enumerate() {
                    // A fixed set of names, made once for the process.
                    let name = defined(kern, x, y);
                    t.words[index(k, i, j)] = name
                        .as_deref()
                        .filter(|_| kern == Kernel::Scatter)
                        .map(WordsKernel::leak);
                    t.names[index(k, i, j)] = name.map(|n| &*n.leak());
                }
            }
        }
        t
    })
}

fn index(k: usize, a: usize, b: usize) -> usize {
    (k * DTYPES.len() + a) * DTYPES.len() + b
}

/// The table index of `kernel` for `(a, b)`.
fn slot(kernel: Kernel, a: DType, b: DType) -> usize {
    let at = |d: DType| DTYPES.iter().position(|&x| x == d).expect("every dtype");
    let k = KERNELS
        .iter()
        .position(|&x| x == kernel)
        .expect("every kernel");
    index(k, at(a), at(b))
}

/// The instances of the scatter from `input` into `storage` (int8 quantizes), or
/// `NotSupported` when the backend has none.
pub fn scatter_kernel(input: DType, storage: DType) -> Result<WordsKernel> {
    kernel(Kernel::Scatter, input, storage)?;
    Ok(table().words[slot(Kernel::Scatter, input, storage)].expect("scatters take words"))
}

/// The name of `kernel` for dtypes `(a, b)` (their order as [`Kernel`] says), or
/// `NotSupported` when the backend has no such kernel. (The scatter's base name: see
/// [`scatter_kernel`].)
pub fn kernel(kernel: Kernel, a: DType, b: DType) -> Result<&'static str> {
    table().names[slot(kernel, a, b)].ok_or_else(|| {
        KvError::NotSupported(format!(
            "{kernel:?} from {a} to {b} on a CUDA device (8-bit tensors are written and \
             read as float32, float16 or bfloat16)"
        ))
    })
}

/// The head sizes with their own attention kernel (q and the accumulator in registers,
/// 16-byte rows); any other head_dim up to [`MAX_HEAD_DIM`] takes the `dn` kernel.
pub const ATTENTION_HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// Largest head_dim the attention kernels take.
pub const MAX_HEAD_DIM: usize = 256;

/// The attention kernel for queries of `q` over storage of `c` with keys of `dims[0]` and
/// values of `dims[1]` elements (each at most [`MAX_HEAD_DIM`]):
/// `kvrs_paged_attention_{q}[_{c}]_d{64,128,256,n}`, the generic `dn` for two head sizes.
/// Float storage takes queries of its own dtype, 8-bit storage any float queries.
pub fn attention_kernel(q: DType, c: DType, dims: [usize; 2]) -> Result<&'static str> {
    let [head_dim, v_head_dim] = dims;
    const VARIANTS: usize = ATTENTION_HEAD_DIMS.len() + 1;
    static TABLE: OnceLock<Vec<Option<&'static str>>> = OnceLock::new();
    let index = |a: usize, b: usize, v: usize| (a * DTYPES.len() + b) * VARIANTS + v;
    let table = TABLE.get_or_init(|| {
        let mut t = vec![None; DTYPES.len() * DTYPES.len() * VARIANTS];
        for (i, &a) in DTYPES.iter().enumerate() {
            for (j, &b) in DTYPES.iter().enumerate() {
                let base = match (a.is_quantized(), b.is_quantized()) {
                    (false, false) if a == b => format!("kvrs_paged_attention_{}", part(a)),
                    (false, true) => format!("kvrs_paged_attention_{}_{}", part(a), part(b)),
                    _ => continue,
                };
                let suffixes = ATTENTION_HEAD_DIMS.iter().map(|d| format!("d{d}"));
                for (v, suffix) in suffixes.chain(["dn".to_string()]).enumerate() {
                    // A fixed set of names, made once for the process.
                    t[index(i, j, v)] = Some(&*format!("{base}_{suffix}").leak());
                }
            }
        }
        t
    });
    let at = |d: DType| DTYPES.iter().position(|&x| x == d).expect("every dtype");
    let variant = ATTENTION_HEAD_DIMS
        .iter()
        .position(|&d| d == head_dim && d == v_head_dim)
        .unwrap_or(ATTENTION_HEAD_DIMS.len());
    match table[index(at(q), at(c), variant)] {
        Some(name) if head_dim.max(v_head_dim) <= MAX_HEAD_DIM => Ok(name),
        Some(_) if v_head_dim > MAX_HEAD_DIM => Err(KvError::NotSupported(format!(
            "attention on a CUDA pool with v_head_dim={v_head_dim} (at most {MAX_HEAD_DIM})"
        ))),
        Some(_) => Err(KvError::NotSupported(format!(
            "attention on a CUDA pool with head_dim={head_dim} (at most {MAX_HEAD_DIM})"
        ))),
        None => Err(KvError::NotSupported(format!(
            "attention with {q} queries over {c} storage on a CUDA device (float storage takes \
             queries of its dtype, 8-bit storage float32, float16 or bfloat16 queries)"
        ))),
    }
}

/// The tensor-core attention kernel (`kvrs_paged_attention_mma_{f16,bf16}_d{64,128,256}`,
/// `kernels/attention_mma.cuh`) for queries of `q` over storage of `c` with keys and values
/// of `dims` elements, with the dynamic shared memory a block takes; `None` where there is
/// none (other dtypes or head sizes: the CUDA-core kernel serves them).
pub fn attention_mma_kernel(q: DType, c: DType, dims: [usize; 2]) -> Option<(&'static str, u32)> {
    let [head_dim, v_head_dim] = dims;
    if q != c || head_dim != v_head_dim {
        return None;
    }
    let names = match q {
        DType::F16 => [
            "kvrs_paged_attention_mma_f16_d64",
            "kvrs_paged_attention_mma_f16_d128",
            "kvrs_paged_attention_mma_f16_d256",
        ],
        DType::BF16 => [
            "kvrs_paged_attention_mma_bf16_d64",
            "kvrs_paged_attention_mma_bf16_d128",
            "kvrs_paged_attention_mma_bf16_d256",
        ],
        _ => return None,
    };
    let v = ATTENTION_HEAD_DIMS.iter().position(|&d| d == head_dim)?;
    Some((names[v], mma_shared_bytes(head_dim)))
}

/// Rows of packed query rows (token, head) one tensor-core attention block takes
/// (`MmaShape::BM`: four warps of 16).
pub const MMA_BLOCK_ROWS: usize = 64;

/// Threads per block of the tensor-core attention kernel.
pub const MMA_THREADS: u32 = 128;

/// `MmaShape<head_dim>::SHARED_BYTES` of `kernels/attention_mma.cuh`: two stages of K and
/// V tiles (64 positions, 32 for head_dim 256) and the block's Q rows, 2 bytes an element.
fn mma_shared_bytes(head_dim: usize) -> u32 {
    let tile = if head_dim <= 128 { 64 } else { 32 };
    (2 * 2 * tile * head_dim * 2 + MMA_BLOCK_ROWS * head_dim * 2) as u32
}

/// The latent (MLA) attention kernel (`kvrs_paged_attention_mla_{f16,bf16}`,
/// `kernels/attention_mla.cuh`) for queries of `q` over a latent pool of `c` whose keys
/// are latents of `dims[0]` and values rotary parts of `dims[1]` elements, with the
/// dynamic shared memory a block takes and the merge of its splits; `None` where there is
/// none (it takes float16 or bfloat16, a 512-element latent and a 64-element rotary part:
/// DeepSeek-V2/V3's and Kimi K2's).
pub fn attention_mla_kernel(
    q: DType,
    c: DType,
    dims: [usize; 2],
) -> Option<(&'static str, u32, &'static str)> {
    if q != c || dims != [MLA_LATENT, MLA_ROPE] {
        return None;
    }
    // Two stages of 32 [latent | rotary] rows, 64 query rows, P: 64 x 40 elements.
    let row = 2 * (MLA_LATENT + MLA_ROPE);
    let shared = (2 * 32 * row + MMA_BLOCK_ROWS * row + MMA_BLOCK_ROWS * 40 * 2) as u32;
    match q {
        DType::F16 => Some((
            "kvrs_paged_attention_mla_f16",
            shared,
            "kvrs_attention_merge_f16_d512",
        )),
        DType::BF16 => Some((
            "kvrs_paged_attention_mla_bf16",
            shared,
            "kvrs_attention_merge_bf16_d512",
        )),
        _ => None,
    }
}

/// The latent size of the MLA kernel (`MlaShape::DC`).
pub const MLA_LATENT: usize = 512;

/// The rotary part's size of the MLA kernel (`MlaShape::DR`).
pub const MLA_ROPE: usize = 64;

/// Threads per block of the MLA kernel.
pub const MLA_THREADS: u32 = 256;

/// The kernel that merges the attention kernel's splits, for queries of `dtype`.
pub fn attention_merge_kernel(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "kvrs_attention_merge_f32",
        DType::F16 => "kvrs_attention_merge_f16",
        _ => "kvrs_attention_merge_bf16",
    }
}

/// The gather kernel (raw copies, no conversion) for storage of `dtype`.
pub fn gather_kernel(dtype: DType) -> WordsKernel {
    match dtype {
        DType::F32 => WordsKernel::of(
            "kvrs_gather_f32_w480",
            "kvrs_gather_f32_w4000",
            "kvrs_gather_f32_wp",
        ),
        DType::F16 => WordsKernel::of(
            "kvrs_gather_f16_w480",
            "kvrs_gather_f16_w4000",
            "kvrs_gather_f16_wp",
        ),
        DType::BF16 => WordsKernel::of(
            "kvrs_gather_bf16_w480",
            "kvrs_gather_bf16_w4000",
            "kvrs_gather_bf16_wp",
        ),
        _ => WordsKernel::of(
            "kvrs_gather_b8_w480",
            "kvrs_gather_b8_w4000",
            "kvrs_gather_b8_wp",
        ),
    }
}

/// Whole-block copies within the cache tensors (copy-on-write).
pub const COPY_BLOCKS: WordsKernel = WordsKernel::of(
    "kvrs_copy_blocks_w480",
    "kvrs_copy_blocks_w4000",
    "kvrs_copy_blocks_wp",
);

/// Whole blocks from a packed buffer into the cache tensors (swap-in).
pub const LOAD_BLOCKS: WordsKernel = WordsKernel::of(
    "kvrs_load_blocks_w480",
    "kvrs_load_blocks_w4000",
    "kvrs_load_blocks_wp",
);

/// Whole blocks from the cache tensors into a packed buffer (swap-out).
pub const SAVE_BLOCKS: WordsKernel = WordsKernel::of(
    "kvrs_save_blocks_w480",
    "kvrs_save_blocks_w4000",
    "kvrs_save_blocks_wp",
);

/// The zeroing kernel for elements of `dtype`.
pub fn zero_kernel(dtype: DType) -> &'static str {
    match dtype.size() {
        1 => "kvrs_zero3_b8",
        2 => "kvrs_zero3_b16",
        _ => "kvrs_zero3_b32",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_named_kernel_is_in_the_ptx() {
        let ptx = include_str!("../../../kernels/kvrs.ptx");
        let mut named = 0;
        let check = |name: &str| {
            let entry = format!(".visible .entry {name}(");
            assert!(ptx.contains(&entry), "{name} is not in kernels/kvrs.ptx");
        };
        let check_words = |w: WordsKernel| [w.small, w.large, w.pointer].map(check);
        for k in KERNELS {
            for a in DTYPES {
                for b in DTYPES {
                    if k == Kernel::Scatter {
                        if let Ok(w) = scatter_kernel(a, b) {
                            named += 1;
                            check_words(w);
                        }
                    } else if let Ok(name) = kernel(k, a, b) {
                        named += 1;
                        check(name);
                    }
                }
            }
        }
        for d in DTYPES {
            check_words(gather_kernel(d));
        }
        for w in [COPY_BLOCKS, LOAD_BLOCKS, SAVE_BLOCKS] {
            check_words(w);
        }
        for q in DTYPES {
            for c in DTYPES {
                for d in [64, 128, 256, 4, 80] {
                    if let Ok(name) = attention_kernel(q, c, [d, d]) {
                        named += 1;
                        check(name);
                    }
                    if let Some((name, shared)) = attention_mma_kernel(q, c, [d, d]) {
                        named += 1;
                        check(name);
                        // Within sm_80's opt-in limit (163 KB), two blocks per H100 SM.
                        assert!(shared <= 114 * 1024, "{name}: {shared}");
                    }
                }
            }
        }
        assert!(named >= 141, "{named}");
        assert_eq!(
            attention_mma_kernel(DType::BF16, DType::BF16, [128, 128]),
            Some(("kvrs_paged_attention_mma_bf16_d128", 80 * 1024))
        );
        assert_eq!(
            attention_mma_kernel(DType::F16, DType::F16, [128, 64]),
            None
        );
        for q in [DType::F16, DType::BF16] {
            let (name, shared, merge) = attention_mla_kernel(q, q, [512, 64]).unwrap();
            check(name);
            check(merge);
            // Within sm_80's opt-in limit.
            assert!(shared <= 163 * 1024, "{shared}");
        }
        assert_eq!(
            attention_mla_kernel(DType::F16, DType::F16, [256, 64]),
            None
        );
        assert_eq!(
            attention_mla_kernel(DType::F32, DType::F32, [512, 64]),
            None
        );
        assert_eq!(
            attention_mma_kernel(DType::F32, DType::F32, [128, 128]),
            None
        );
        assert_eq!(
            attention_mma_kernel(DType::F16, DType::F8E4M3, [128, 128]),
            None
        );
        assert!(kernel(Kernel::Copy3, DType::I8, DType::F32).is_err());
        assert!(attention_kernel(DType::I8, DType::F16, [128, 128]).is_err());
        assert!(attention_kernel(DType::F16, DType::F32, [128, 128]).is_err());
        assert!(attention_kernel(DType::F16, DType::F16, [512, 512]).is_err());
        assert_eq!(
            attention_kernel(DType::BF16, DType::F8E4M3, [96, 96]).unwrap(),
            "kvrs_paged_attention_bf16_e4m3_dn"
        );
        // Two head sizes, even two with kernels of their own, take the generic kernel.
        assert_eq!(
            attention_kernel(DType::F16, DType::F16, [128, 64]).unwrap(),
            "kvrs_paged_attention_f16_dn"
        );
        let e = attention_kernel(DType::F16, DType::F16, [128, 512]).unwrap_err();
        assert!(e.to_string().contains("v_head_dim=512"), "{e}");
    }
}
