//! The vocabulary every layer shares, below all of them: where a storage lives
//! ([`Device`]), keys or values ([`Kv`]), strided windows into a storage ([`Region`]),
//! and where each block, position and head of a paged pool lives ([`BlockId`],
//! [`KvLayout`], [`PagedShape`]). It imports nothing of kvrs but the error type, so
//! `tensor`, `storage`, `kv_cache` and `paged` all build on it and none on another's
//! types.

use std::fmt;
use std::str::FromStr;

use crate::error::{KvError, Result};

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

/// Keys or values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kv {
    /// The keys.
    Key = 0,
    /// The values.
    Value = 1,
}

/// Highest rank kvrs reads or writes; lower ranks are padded with leading 1s.
pub const MAX_RANK: usize = 3;

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
    /// One past the highest element offset the region touches (its offset when empty),
    /// or `usize::MAX` when that does not fit a `usize` (no storage holds such a region:
    /// the storages' bounds checks compare this, so it must not wrap).
    pub fn end(&self) -> usize {
        if self.shape.contains(&0) {
            return self.offset;
        }
        (0..MAX_RANK)
            .try_fold(self.offset, |acc, i| {
                (self.shape[i] - 1)
                    .checked_mul(self.strides[i])
                    .and_then(|reach| acc.checked_add(reach))
            })
            .and_then(|last| last.checked_add(1))
            .unwrap_or(usize::MAX)
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

/// Index of a block in the pool.
pub type BlockId = u32;

/// Order of a block's positions and heads: FlashInfer's two paged layouts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvLayout {
    /// `[num_blocks, 2, block_size, num_kv_heads, head_dim]` per layer.
    Nhd,
    /// `[num_blocks, 2, num_kv_heads, block_size, head_dim]` per layer.
    Hnd,
}

impl FromStr for KvLayout {
    type Err = KvError;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_uppercase().as_str() {
            "NHD" => Ok(KvLayout::Nhd),
            "HND" => Ok(KvLayout::Hnd),
            _ => Err(KvError::InvalidArgument {
                name: "layout",
                value: format!("{s:?}"),
                reason: "use 'NHD' or 'HND'".into(),
            }),
        }
    }
}

impl fmt::Display for KvLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KvLayout::Nhd => "NHD",
            KvLayout::Hnd => "HND",
        })
    }
}

/// The sizes of a paged pool; storage is `[tensors][num_blocks][K|V][...]`, each tensor
/// one contiguous FlashInfer cache tensor (a layer's, or shared by one layer of each
/// layer group: see `paged::groups`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagedShape {
    /// Transformer layers.
    pub num_layers: usize,
    /// Key/value heads per layer.
    pub num_kv_heads: usize,
    /// Elements per key head vector.
    pub head_dim: usize,
    /// Elements per value head vector (`head_dim` for most models; MLA latent pools
    /// keep `qk_rope_head_dim` rotary values beside `kv_lora_rank` latent keys).
    pub v_head_dim: usize,
    /// Positions per block.
    pub block_size: usize,
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Order within a block.
    pub layout: KvLayout,
}

impl PagedShape {
    /// Elements of one block in one layer, K and V.
    pub fn block_elems(&self) -> usize {
        self.block_size * self.num_kv_heads * (self.head_dim + self.v_head_dim)
    }

    /// Elements per head vector of `kv`.
    pub fn dim(&self, kv: Kv) -> usize {
        match kv {
            Kv::Key => self.head_dim,
            Kv::Value => self.v_head_dim,
        }
    }

    /// Elements per int8 scale: `gcd(head_dim, v_head_dim)`
    /// (`sizes::int8_scale_unit`), one scale per head vector when K and V have
    /// one head size.
    pub fn scale_unit(&self) -> usize {
        crate::sizes::int8_scale_unit([self.head_dim, self.v_head_dim])
    }

    /// Head vectors (K and V) in one block of one layer.
    pub fn block_vectors(&self) -> usize {
        2 * self.block_size * self.num_kv_heads
    }

    /// Elements of one cache tensor.
    pub fn layer_elems(&self) -> usize {
        self.num_blocks * self.block_elems()
    }

    /// Element offset of `block` in cache tensor `tensor`.
    pub fn block_offset(&self, tensor: usize, block: BlockId) -> usize {
        tensor * self.layer_elems() + block as usize * self.block_elems()
    }

    /// Positions `offset..offset + n` of `block`'s K or V in cache tensor `tensor`, as
    /// `[n, heads, head_dim]`.
    pub fn positions(
        &self,
        tensor: usize,
        kv: Kv,
        block: BlockId,
        offset: usize,
        n: usize,
    ) -> Region {
        let (h, d, bs) = (self.num_kv_heads, self.dim(kv), self.block_size);
        let base = self.block_offset(tensor, block) + kv as usize * bs * h * self.head_dim;
        let (pos_stride, head_stride) = match self.layout {
            KvLayout::Nhd => (h * d, d),
            KvLayout::Hnd => (d, bs * d),
        };
        Region {
            offset: base + offset * pos_stride,
            shape: [n, h, d],
            strides: [pos_stride, head_stride, 1],
        }
    }

    /// All of `block` in cache tensor `tensor` (K and V) as one contiguous run.
    pub fn whole_block(&self, tensor: usize, block: BlockId) -> Region {
        Region {
            offset: self.block_offset(tensor, block),
            shape: [1, 1, self.block_elems()],
            strides: [0, 0, 1],
        }
    }

    /// Shape of one cache tensor, as FlashInfer expects it (K and V of one head size;
    /// see [`PagedShape::part_tensor_shape`] otherwise).
    pub fn layer_tensor_shape(&self) -> [usize; 5] {
        let (n, bs, h, d) = (
            self.num_blocks,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
        );
        match self.layout {
            KvLayout::Nhd => [n, 2, bs, h, d],
            KvLayout::Hnd => [n, 2, h, bs, d],
        }
    }
}

impl PagedShape {
    /// Shape and element strides of the K or V part of one cache tensor, as a
    /// `[num_blocks, block_size, heads, dim]` (NHD) or `[num_blocks, heads, block_size,
    /// dim]` (HND) view whose offset is `kv`'s part of block 0: FlashInfer's separate K
    /// and V caches (its MLA `ckv`/`kpe` pages when `num_kv_heads` is 1).
    pub fn part_tensor_shape(&self, kv: Kv) -> ([usize; 4], [usize; 4]) {
        let (n, bs, h, d) = (
            self.num_blocks,
            self.block_size,
            self.num_kv_heads,
            self.dim(kv),
        );
        let r = self.positions(0, kv, 0, 0, 1);
        match self.layout {
            KvLayout::Nhd => (
                [n, bs, h, d],
                [self.block_elems(), r.strides[0], r.strides[1], 1],
            ),
            KvLayout::Hnd => (
                [n, h, bs, d],
                [self.block_elems(), r.strides[1], r.strides[0], 1],
            ),
        }
    }

    /// Element offset of `kv`'s part within a block.
    pub fn part_offset(&self, kv: Kv) -> usize {
        kv as usize * self.block_size * self.num_kv_heads * self.head_dim
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_region_end_that_overflows_saturates() {
        // (3 - 1) * 2^63 wraps to 0: the region must not look like it ends at 1.
        let r = Region {
            offset: 0,
            shape: [3, 1, 1],
            strides: [1 << 63, 0, 1],
        };
        assert_eq!(r.end(), usize::MAX);
        let r = Region {
            offset: usize::MAX,
            shape: [1, 1, 1],
            strides: [0, 0, 1],
        };
        assert_eq!(r.end(), usize::MAX);
    }

    #[test]
    fn regions_follow_flashinfer_layouts() {
        let mut s = PagedShape {
            num_layers: 2,
            num_kv_heads: 3,
            head_dim: 4,
            v_head_dim: 4,
            block_size: 5,
            num_blocks: 6,
            layout: KvLayout::Nhd,
        };
        // NHD: [6, 2, 5, 3, 4]; layer 1, block 2, V, position 3, head 1.
        let r = s.positions(1, Kv::Value, 2, 3, 1);
        let flat = |idx: [usize; 5], dims: [usize; 5]| {
            idx.iter().zip(dims).fold(0, |acc, (&i, d)| acc * d + i)
        };
        assert_eq!(
            r.offset + r.strides[1],
            s.layer_elems() + flat([2, 1, 3, 1, 0], s.layer_tensor_shape())
        );
        s.layout = KvLayout::Hnd;
        let r = s.positions(1, Kv::Value, 2, 3, 1);
        assert_eq!(
            r.offset + r.strides[1],
            s.layer_elems() + flat([2, 1, 1, 3, 0], s.layer_tensor_shape())
        );
        assert_eq!(s.whole_block(1, 2).end(), s.block_offset(1, 3));
    }
}
