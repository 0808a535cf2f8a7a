//! The seed's decode loop as its users write it, through the crate-root Rust API: for
//! every layer and head, `store_key`/`store_value` at `pos = seq_len`, then `advance()`.
//! Each step must commit, and the stored vectors must read back (`keys_for`,
//! `extract_block`); a position stored only partly reads as zeros where nothing was
//! stored, even over a truncated sequence's old K/V.

use kvrs::{KvCache, KvError};

const LAYERS: usize = 2;
const HEADS: usize = 3;
const DIM: usize = 4;

fn key(layer: usize, head: usize, pos: usize) -> Vec<f32> {
    (0..DIM)
        .map(|d| (layer * 1000 + head * 100 + pos * 10 + d) as f32)
        .collect()
}

fn value(layer: usize, head: usize, pos: usize) -> Vec<f32> {
    key(layer, head, pos).iter().map(|x| -x).collect()
}

#[test]
fn the_seed_decode_loop_commits_every_step() -> Result<(), KvError> {
    let mut cache = KvCache::<f32>::new(LAYERS, HEADS, DIM, 16);
    for step in 0..5 {
        let pos = cache.seq_len();
        assert_eq!(pos, step);
        for layer in 0..LAYERS {
            for head in 0..HEADS {
                cache.store_key(layer, head, pos, &key(layer, head, pos))?;
                cache.store_value(layer, head, pos, &value(layer, head, pos))?;
            }
        }
        cache.advance()?;
    }
    assert_eq!(cache.seq_len(), 5);
    for layer in 0..LAYERS {
        assert_eq!(cache.layer_len(layer), 5);
        let (k, v) = cache.extract_block(layer, 0, 5)?;
        for head in 0..HEADS {
            let (kh, vh) = (
                cache.keys_for(layer, head, 5),
                cache.values_for(layer, head, 5),
            );
            for pos in 0..5 {
                let at = (head * 5 + pos) * DIM;
                assert_eq!(k[at..at + DIM], key(layer, head, pos)[..]);
                assert_eq!(v[at..at + DIM], value(layer, head, pos)[..]);
                assert_eq!(kh[pos * DIM..(pos + 1) * DIM], key(layer, head, pos)[..]);
                assert_eq!(vh[pos * DIM..(pos + 1) * DIM], value(layer, head, pos)[..]);
            }
        }
    }
    Ok(())
}

#[test]
fn a_partly_stored_position_reads_zeros_where_nothing_was_stored() -> Result<(), KvError> {
    let mut cache = KvCache::<f32>::new(LAYERS, HEADS, DIM, 16);
    for layer in 0..LAYERS {
        for head in 0..HEADS {
            cache.store_key(layer, head, 0, &[7.0; DIM])?;
            cache.store_value(layer, head, 0, &[7.0; DIM])?;
        }
    }
    cache.advance()?;
    cache.truncate(0)?;
    // Only head 1's key of layer 0 at position 0: the old sequence's 7s must not show.
    cache.store_key(0, 1, 0, &[1.0; DIM])?;
    assert_eq!(cache.layer_len(0), 1);
    assert!(cache.advance().is_err(), "layer 1 holds no position yet");
    let (k, v) = cache.extract_block(0, 0, 1)?;
    assert_eq!(k, [vec![0.0; DIM], vec![1.0; DIM], vec![0.0; DIM]].concat());
    assert_eq!(v, vec![0.0; HEADS * DIM]);
    Ok(())
}

#[test]
fn a_vector_of_the_wrong_length_is_refused_and_changes_nothing() {
    let mut cache = KvCache::<f32>::new(LAYERS, HEADS, DIM, 16);
    let err = cache.store_key(0, 0, 0, &[1.0; DIM + 1]).unwrap_err();
    assert!(matches!(err, KvError::Shape { name: "key", .. }), "{err}");
    assert_eq!(cache.layer_len(0), 0);
    let err = cache.store_value(0, HEADS, 0, &[1.0; DIM]).unwrap_err();
    assert!(
        matches!(err, KvError::OutOfRange { name: "head", .. }),
        "{err}"
    );
    for pos in [16, usize::MAX] {
        let err = cache.store_value(0, 0, pos, &[1.0; DIM]).unwrap_err();
        assert!(
            matches!(err, KvError::CacheFull { capacity: 16, .. }),
            "{err}"
        );
    }
    assert_eq!(cache.layer_len(0), 0);
}
