//! The block swaps of the offload tiers (`Storage::read_blocks` / `write_blocks`) on the
//! host and on the simulated CUDA device, against the simplest reference: whole-block
//! region reads. Buffers at every alignment; on the device, swaps longer than one chunk
//! of the page-locked buffer, which stays bounded.
#![cfg(feature = "cuda-sim")]

use kvrs::unstable::cuda::SWAP_CHUNK;
use kvrs::unstable::{allocate, BlockId, Storage, TensorMut};
use kvrs::{DType, Device, KvLayout, PagedShape};
use proptest::prelude::*;

/// Raw bytes of `blocks`' cache tensors `0..tensors`, read region by region.
fn reference(s: &dyn Storage, shape: &PagedShape, tensors: usize, blocks: &[BlockId]) -> Vec<u8> {
    let bb = shape.block_elems() * s.dtype().size();
    let mut out = vec![0u64; (blocks.len() * tensors * bb).div_ceil(8)];
    let base = out.as_mut_ptr() as *mut u8;
    for (i, &b) in blocks.iter().enumerate() {
        for t in 0..tensors {
            // SAFETY: `out` holds every block, 8-byte aligned.
            let mut dst = unsafe {
                TensorMut::contiguous(
                    base.add((i * tensors + t) * bb),
                    s.dtype(),
                    &[1, 1, shape.block_elems()],
                )
            }
            .unwrap();
            s.read(shape.whole_block(t, b), &mut dst).unwrap();
        }
    }
    // SAFETY: `out` holds at least that many bytes.
    unsafe { std::slice::from_raw_parts(base, blocks.len() * tensors * bb) }.to_vec()
}

fn bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Writes `blocks` from slices at byte offset `skew`, reads them back whole and through
/// `read_blocks` into a buffer at offset `skew`: both equal what was written.
fn round_trip(
    s: &mut dyn Storage,
    shape: &PagedShape,
    tensors: usize,
    blocks: &[BlockId],
    skew: usize,
    seed: u64,
) {
    let per_block = tensors * shape.block_elems() * s.dtype().size();
    let all = bytes(seed, skew + blocks.len() * per_block);
    let data = &all[skew..];
    let slices: Vec<&[u8]> = data.chunks(per_block).collect();
    s.write_blocks(*shape, tensors, blocks, &slices).unwrap();
    assert!(reference(s, shape, tensors, blocks) == data, "region reads");
    let mut out = vec![0u8; skew + data.len()];
    s.read_blocks(*shape, tensors, blocks, &mut out[skew..])
        .unwrap();
    assert!(&out[skew..] == data, "read_blocks");
}

fn storage(device: Device, dtype: DType, shape: &PagedShape) -> Box<dyn Storage> {
    allocate(
        device,
        dtype,
        shape.num_layers * shape.layer_elems(),
        shape.head_dim,
    )
    .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn block_swaps_equal_region_reads_at_any_alignment(
        dtype in prop::sample::select(vec![DType::F32, DType::F16, DType::BF16, DType::F8E4M3, DType::F8E5M2]),
        block_size in 1usize..5,
        head_dim in prop::sample::select(vec![1usize, 2, 3, 8]),
        picks in prop::collection::vec(0u32..12, 1..8),
        skew in 0usize..8,
        seed in any::<u64>(),
        cuda in any::<bool>(),
    ) {
        let shape = PagedShape {
            num_layers: 3,
            num_kv_heads: 2,
            head_dim,
            v_head_dim: head_dim,
            block_size,
            num_blocks: 12,
            layout: KvLayout::Nhd,
        };
        let mut blocks = picks.clone();
        blocks.sort_unstable();
        blocks.dedup();
        let device = if cuda { Device::Cuda(0) } else { Device::Cpu };
        let mut s = storage(device, dtype, &shape);
        for tensors in [1, 3] {
            round_trip(s.as_mut(), &shape, tensors, &blocks, skew, seed ^ tensors as u64);
        }
    }
}

#[test]
fn long_device_swaps_go_in_chunks_through_a_bounded_pinned_buffer() {
    // 512 KiB blocks of 2 tensors: 40 of them are 40 MiB, two chunks.
    let shape = PagedShape {
        num_layers: 2,
        num_kv_heads: 8,
        head_dim: 128,
        v_head_dim: 128,
        block_size: 128,
        num_blocks: 48,
        layout: KvLayout::Hnd,
    };
    let mut s = storage(Device::Cuda(0), DType::F16, &shape);
    assert_eq!(s.as_cuda().unwrap().pinned_bytes(), 0, "made on first use");
    let blocks: Vec<BlockId> = (0..40).map(|i| (i * 7) % 48).collect();
    round_trip(s.as_mut(), &shape, 2, &blocks, 3, 11);
    let pinned = s.as_cuda().unwrap().pinned_bytes();
    assert!(pinned > 0 && pinned <= SWAP_CHUNK, "{pinned} bytes pinned");
    // A block larger than a chunk goes alone; the buffer grows to hold it.
    let big = PagedShape {
        num_layers: 1,
        num_kv_heads: 8,
        head_dim: 128,
        v_head_dim: 128,
        block_size: SWAP_CHUNK / (2 * 8 * 128 * 2) + 1,
        num_blocks: 2,
        layout: KvLayout::Nhd,
    };
    let mut s = storage(Device::Cuda(0), DType::F16, &big);
    round_trip(s.as_mut(), &big, 1, &[1, 0], 5, 12);
    assert_eq!(s.as_cuda().unwrap().pinned_bytes(), SWAP_CHUNK + 4096);
}
