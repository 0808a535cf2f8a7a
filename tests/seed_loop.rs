//! The seed's decode loop as its users write it: for every layer and head,
//! `store_key`/`store_value` at `pos = seq_len`, then `advance()`. Each step must commit,
//! and the stored vectors must read back; a position stored only partly reads as zeros
//! where nothing was stored, even over a truncated sequence's old K/V.

use kvrs::{CacheShape, DType, Device, KVCache, Kv, TensorRef};

const LAYERS: usize = 2;
const HEADS: usize = 3;
const DIM: usize = 4;

fn vector(layer: usize, head: usize, pos: usize, kv: Kv) -> Vec<f32> {
    (0..DIM)
        .map(|d| {
            (layer * 1000 + head * 100 + pos * 10 + d) as f32
                * if kv == Kv::Key { 1.0 } else { -1.0 }
        })
        .collect()
}

fn store(cache: &mut KVCache, kv: Kv, layer: usize, head: usize, pos: usize, x: &[f32]) {
    let t = unsafe { TensorRef::contiguous(x.as_ptr() as *const u8, DType::F32, &[DIM]).unwrap() };
    cache
        .store(kv, layer as i64, head as i64, pos as i64, &t)
        .unwrap();
}

/// `[HEADS, n, DIM]` keys and values of `layer` from position 0, as float32.
fn read(cache: &KVCache, layer: usize, n: usize) -> (Vec<f32>, Vec<f32>) {
    let (mut k, mut v) = (vec![0f32; HEADS * n * DIM], vec![0f32; HEADS * n * DIM]);
    let kt = unsafe {
        TensorRef::contiguous(k.as_mut_ptr() as *const u8, DType::F32, &[HEADS, n, DIM]).unwrap()
    };
    let vt = unsafe {
        TensorRef::contiguous(v.as_mut_ptr() as *const u8, DType::F32, &[HEADS, n, DIM]).unwrap()
    };
    cache
        .extract_block(layer as i64, 0, n as i64, &kt, &vt)
        .unwrap();
    (k, v)
}

fn new_cache() -> KVCache {
    let shape = CacheShape {
        num_layers: LAYERS,
        num_kv_heads: HEADS,
        head_dim: DIM,
        max_seq_len: 16,
    };
    KVCache::new(shape, DType::F32, Device::Cpu).unwrap()
}

#[test]
fn the_seed_decode_loop_commits_every_step() {
    let mut cache = new_cache();
    for step in 0..5 {
        let pos = cache.seq_len();
        assert_eq!(pos, step);
        for layer in 0..LAYERS {
            for head in 0..HEADS {
                store(
                    &mut cache,
                    Kv::Key,
                    layer,
                    head,
                    pos,
                    &vector(layer, head, pos, Kv::Key),
                );
                store(
                    &mut cache,
                    Kv::Value,
                    layer,
                    head,
                    pos,
                    &vector(layer, head, pos, Kv::Value),
                );
            }
        }
        cache.advance(1).unwrap();
    }
    assert_eq!(cache.seq_len(), 5);
    for layer in 0..LAYERS {
        assert_eq!(cache.layer_len(layer), 5);
        let (k, v) = read(&cache, layer, 5);
        for head in 0..HEADS {
            for pos in 0..5 {
                let at = (head * 5 + pos) * DIM;
                assert_eq!(k[at..at + DIM], vector(layer, head, pos, Kv::Key)[..]);
                assert_eq!(v[at..at + DIM], vector(layer, head, pos, Kv::Value)[..]);
            }
        }
    }
}

#[test]
fn a_partly_stored_position_reads_zeros_where_nothing_was_stored() {
    let mut cache = new_cache();
    for layer in 0..LAYERS {
        for head in 0..HEADS {
            for kv in [Kv::Key, Kv::Value] {
                store(&mut cache, kv, layer, head, 0, &[7.0; DIM]);
            }
        }
    }
    cache.advance(1).unwrap();
    cache.truncate(0).unwrap();
    // Only head 1's key of layer 0 at position 0: the old sequence's 7s must not show.
    store(&mut cache, Kv::Key, 0, 1, 0, &[1.0; DIM]);
    assert_eq!(cache.layer_len(0), 1);
    assert!(cache.advance(1).is_err(), "layer 1 holds no position yet");
    let (k, v) = read(&cache, 0, 1);
    assert_eq!(k, [vec![0.0; DIM], vec![1.0; DIM], vec![0.0; DIM]].concat());
    assert_eq!(v, vec![0.0; HEADS * DIM]);
}
