//! The seed's decode loop as its users write it, through the crate-root Rust API: for
//! every layer and head, `store_key`/`store_value` at `pos = seq_len`, then `advance()`.
//! Each step must commit, and the stored vectors must read back (`keys_for`,
//! `extract_block`); a position stored only partly reads as zeros where nothing was
//! stored, even over a truncated sequence's old K/V.
//!
//! The seed's surface: its methods panic on bad arguments, each case its documentation
//! names, with the error's message prefixed by the method; their `try_` twins return the
//! same error and leave the cache as it was (lengths and contents).

use std::panic::{catch_unwind, AssertUnwindSafe};

use kvrs::{KvCache, KvError};

const LAYERS: usize = 2;
const HEADS: usize = 3;
const DIM: usize = 4;
const MAX: usize = 16;

fn key(layer: usize, head: usize, pos: usize) -> Vec<f32> {
    (0..DIM)
        .map(|d| (layer * 1000 + head * 100 + pos * 10 + d) as f32)
        .collect()
}

fn value(layer: usize, head: usize, pos: usize) -> Vec<f32> {
    key(layer, head, pos).iter().map(|x| -x).collect()
}

#[test]
fn the_seed_decode_loop_commits_every_step() {
    let mut cache = KvCache::new(LAYERS, HEADS, DIM, MAX);
    for step in 0..5 {
        let pos = cache.seq_len();
        assert_eq!(pos, step);
        for layer in 0..LAYERS {
            for head in 0..HEADS {
                cache.store_key(layer, head, pos, &key(layer, head, pos));
                cache.store_value(layer, head, pos, &value(layer, head, pos));
            }
        }
        cache.advance();
    }
    assert_eq!(cache.seq_len(), 5);
    for layer in 0..LAYERS {
        assert_eq!(cache.layer_len(layer), 5);
        let (k, v) = cache.extract_block(layer, 0, 5);
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
}

#[test]
fn a_partly_stored_position_reads_zeros_where_nothing_was_stored() -> Result<(), KvError> {
    let mut cache = KvCache::new(LAYERS, HEADS, DIM, MAX);
    for layer in 0..LAYERS {
        for head in 0..HEADS {
            cache.store_key(layer, head, 0, &[7.0; DIM]);
            cache.store_value(layer, head, 0, &[7.0; DIM]);
        }
    }
    cache.advance();
    cache.truncate(0)?;
    // Only head 1's key of layer 0 at position 0: the old sequence's 7s must not show.
    cache.store_key(0, 1, 0, &[1.0; DIM]);
    assert_eq!(cache.layer_len(0), 1);
    assert!(
        cache.try_advance().is_err(),
        "layer 1 holds no position yet"
    );
    let (k, v) = cache.extract_block(0, 0, 1);
    assert_eq!(k, [vec![0.0; DIM], vec![1.0; DIM], vec![0.0; DIM]].concat());
    assert_eq!(v, vec![0.0; HEADS * DIM]);
    Ok(())
}

#[test]
fn new_alone_makes_an_f32_cache() {
    // No annotation and no other use: `new` names KvCache<f32> by itself (the call to
    // memory_bytes would not compile on a cache of unknown type).
    let c = KvCache::new(1, 1, 4, 8);
    assert_eq!(c.memory_bytes(), 2 * 8 * 4 * 4); // K and V, 8 positions of 4 f32
    let _: &KvCache<f32> = &c;
    let z = KvCache::<f32>::zeros(1, 1, 4, 8);
    assert_eq!(z.memory_bytes(), c.memory_bytes());
}

#[test]
fn blocks_move_between_caches_and_set_seq_len_commits_them() {
    let mut a = KvCache::new(LAYERS, HEADS, DIM, MAX);
    for pos in 0..6 {
        for layer in 0..LAYERS {
            for head in 0..HEADS {
                a.store_key(layer, head, pos, &key(layer, head, pos));
                a.store_value(layer, head, pos, &value(layer, head, pos));
            }
        }
        a.advance();
    }
    let mut b = KvCache::new(LAYERS, HEADS, DIM, MAX);
    for layer in 0..LAYERS {
        for start in [0, 4] {
            let (k, v) = a.extract_block(layer, start, 4); // positions 6, 7 read as zeros
            b.inject_block(layer, start, 4, &k, &v);
        }
    }
    assert_eq!(
        (b.seq_len(), b.layer_len(0)),
        (0, 0),
        "inject moves no length"
    );
    b.set_seq_len(6);
    assert_eq!((b.seq_len(), b.layer_len(1)), (6, 6));
    for layer in 0..LAYERS {
        for head in 0..HEADS {
            assert_eq!(b.keys_for(layer, head, 8), a.keys_for(layer, head, 8));
            assert_eq!(b.values_for(layer, head, 8), a.values_for(layer, head, 8));
        }
    }
    assert_eq!(b.utilization_ratio(), 6.0 / MAX as f64);
    b.set_seq_len(usize::MAX); // clamped, never a panic
    assert_eq!((b.seq_len(), b.layer_len(0)), (MAX, MAX));
    assert_eq!(b.try_set_seq_len(2), Ok(()));
    assert_eq!((b.seq_len(), b.layer_len(1)), (2, 2));
}

/// A cache in a state that every refusal must keep: 3 committed positions, a 4th stored
/// in layer 0 only.
fn filled() -> KvCache {
    let mut c = KvCache::new(LAYERS, HEADS, DIM, MAX);
    for pos in 0..4 {
        let layers = if pos < 3 { LAYERS } else { 1 };
        for layer in 0..layers {
            for head in 0..HEADS {
                c.store_key(layer, head, pos, &key(layer, head, pos));
                c.store_value(layer, head, pos, &value(layer, head, pos));
            }
        }
        if pos < 3 {
            c.advance();
        }
    }
    c
}

/// The lengths and every element the cache holds.
fn snapshot(c: &KvCache) -> (usize, Vec<usize>, Vec<f32>) {
    let lens = (0..LAYERS).map(|l| c.layer_len(l)).collect();
    let mut data = Vec::new();
    for layer in 0..LAYERS {
        for head in 0..HEADS {
            data.extend_from_slice(c.keys_for(layer, head, MAX));
            data.extend_from_slice(c.values_for(layer, head, MAX));
        }
    }
    (c.seq_len(), lens, data)
}

/// A call of one of the seed's panicking methods, made either way: `try_on` calls its
/// `try_` twin, `seed_on` the seed's form. Slices are given by their lengths.
#[derive(Clone, Copy, Debug)]
enum Call {
    StoreKey(usize, usize, usize, usize),
    StoreValue(usize, usize, usize, usize),
    ExtractBlock(usize, usize, usize),
    InjectBlock(usize, usize, usize, usize, usize),
    Advance,
}

impl Call {
    fn method(self) -> &'static str {
        match self {
            Call::StoreKey(..) => "store_key",
            Call::StoreValue(..) => "store_value",
            Call::ExtractBlock(..) => "extract_block",
            Call::InjectBlock(..) => "inject_block",
            Call::Advance => "advance",
        }
    }

    fn try_on(self, c: &mut KvCache) -> Result<(), KvError> {
        match self {
            Call::StoreKey(l, h, p, n) => c.try_store_key(l, h, p, &vec![1.0; n]),
            Call::StoreValue(l, h, p, n) => c.try_store_value(l, h, p, &vec![1.0; n]),
            Call::ExtractBlock(l, s, b) => c.try_extract_block(l, s, b).map(drop),
            Call::InjectBlock(l, s, b, nk, nv) => {
                c.try_inject_block(l, s, b, &vec![1.0; nk], &vec![2.0; nv])
            }
            Call::Advance => c.try_advance(),
        }
    }

    fn seed_on(self, c: &mut KvCache) {
        match self {
            Call::StoreKey(l, h, p, n) => c.store_key(l, h, p, &vec![1.0; n]),
            Call::StoreValue(l, h, p, n) => c.store_value(l, h, p, &vec![1.0; n]),
            Call::ExtractBlock(l, s, b) => {
                c.extract_block(l, s, b);
            }
            Call::InjectBlock(l, s, b, nk, nv) => {
                c.inject_block(l, s, b, &vec![1.0; nk], &vec![2.0; nv])
            }
            Call::Advance => c.advance(),
        }
    }
}

/// `[HEADS, 2, DIM]`: a block of 2 positions.
const BLOCK2: usize = HEADS * 2 * DIM;

/// The variant of an error.
fn kind(e: &KvError) -> &'static str {
    match e {
        KvError::Shape { .. } => "Shape",
        KvError::OutOfRange { .. } => "OutOfRange",
        KvError::CacheFull { .. } => "CacheFull",
        KvError::InvalidArgument { .. } => "InvalidArgument",
        _ => "another",
    }
}

/// Every refusal the seed's methods document under `# Panics`, made on [`filled`], with
/// the variant and the start of the message of the error their `try_` twins return.
fn refusals() -> Vec<(Call, &'static str, &'static str)> {
    use Call::*;
    let past_end = "pos=16 is out of range: must be in [0, 16)";
    vec![
        (StoreKey(0, 0, 4, DIM + 1), "Shape", "key has shape [5]"),
        (
            StoreKey(LAYERS, 0, 4, DIM),
            "OutOfRange",
            "layer=2 is out of range",
        ),
        (
            StoreKey(1, HEADS, 3, DIM),
            "OutOfRange",
            "head=3 is out of range",
        ),
        (StoreKey(1, 0, MAX, DIM), "OutOfRange", past_end),
        (
            StoreKey(1, 0, usize::MAX, DIM),
            "OutOfRange",
            "pos=9223372036854775807 is out of range",
        ),
        (StoreValue(0, 0, 4, DIM - 1), "Shape", "value has shape [3]"),
        (StoreValue(usize::MAX, 0, 4, DIM), "OutOfRange", "layer="),
        (
            StoreValue(0, HEADS, 5, DIM),
            "OutOfRange",
            "head=3 is out of range",
        ),
        (StoreValue(0, 0, MAX, DIM), "OutOfRange", past_end),
        (
            ExtractBlock(LAYERS, 0, 2),
            "OutOfRange",
            "layer=2 is out of range",
        ),
        (
            ExtractBlock(0, MAX, 2),
            "OutOfRange",
            "start_pos=16 is out of range",
        ),
        (
            ExtractBlock(0, 0, 0),
            "InvalidArgument",
            "block_size=0: must be in 1..=16",
        ),
        (
            ExtractBlock(0, 0, MAX + 1),
            "InvalidArgument",
            "block_size=17: must be",
        ),
        (
            ExtractBlock(0, 0, usize::MAX),
            "InvalidArgument",
            "block_size=",
        ),
        (
            InjectBlock(LAYERS, 0, 2, BLOCK2, BLOCK2),
            "OutOfRange",
            "layer=2 is out",
        ),
        (
            InjectBlock(0, MAX, 2, BLOCK2, BLOCK2),
            "OutOfRange",
            "start_pos=16 is out",
        ),
        (
            InjectBlock(0, 0, 0, 0, 0),
            "InvalidArgument",
            "block_size=0: must be",
        ),
        (
            InjectBlock(0, 0, MAX + 1, 2, 2),
            "InvalidArgument",
            "block_size=17: must be",
        ),
        (
            InjectBlock(0, 0, usize::MAX, 2, 2),
            "InvalidArgument",
            "block_size=",
        ),
        (
            InjectBlock(0, 0, 2, BLOCK2 - 1, BLOCK2),
            "Shape",
            "keys has shape [23]",
        ),
        (
            InjectBlock(0, 14, 2, BLOCK2, BLOCK2 + DIM),
            "Shape",
            "values has shape [28]",
        ),
        // Layer 1 does not hold position 3.
        (
            Advance,
            "InvalidArgument",
            "n=1: committing to seq_len 4 needs every layer",
        ),
    ]
}

#[test]
fn each_try_twin_returns_the_error_and_leaves_the_cache_as_it_was() {
    for (call, variant, message) in refusals() {
        let mut c = filled();
        let before = snapshot(&c);
        let err = call.try_on(&mut c).unwrap_err();
        assert_eq!(kind(&err), variant, "{call:?}: {err:?}");
        assert!(err.to_string().starts_with(message), "{call:?}: {err}");
        assert_eq!(snapshot(&c), before, "{call:?} changed the cache");
    }
    // A full cache cannot advance either.
    let mut c = KvCache::new(1, 1, DIM, 2);
    c.set_seq_len(2);
    let before = snapshot_one(&c);
    let err = c.try_advance().unwrap_err();
    assert!(
        matches!(err, KvError::InvalidArgument { name: "n", .. }),
        "{err}"
    );
    assert_eq!(snapshot_one(&c), before);
}

/// The lengths and contents of a one-layer, one-head cache.
fn snapshot_one(c: &KvCache) -> (usize, usize, Vec<f32>, Vec<f32>) {
    let max = c.max_seq_len();
    (
        c.seq_len(),
        c.layer_len(0),
        c.keys_for(0, 0, max).to_vec(),
        c.values_for(0, 0, max).to_vec(),
    )
}

#[test]
fn each_seed_method_panics_with_its_name_and_the_twins_error_and_changes_nothing() {
    for (call, _, _) in refusals() {
        let mut c = filled();
        let before = snapshot(&c);
        let err = call.try_on(&mut filled()).unwrap_err();
        let panic = catch_unwind(AssertUnwindSafe(|| call.seed_on(&mut c)))
            .expect_err(&format!("{call:?} did not panic"));
        let msg = panic.downcast_ref::<String>().expect("a formatted message");
        assert_eq!(*msg, format!("KvCache::{}: {err}", call.method()));
        assert_eq!(snapshot(&c), before, "{call:?} changed the cache");
    }
}

#[test]
fn calls_the_cache_accepts_do_the_same_either_way() {
    let calls = [
        Call::StoreKey(1, 2, 3, DIM),
        Call::StoreValue(0, 1, 9, DIM),
        Call::ExtractBlock(1, 14, 4),
        Call::InjectBlock(0, 14, 4, HEADS * 4 * DIM, HEADS * 4 * DIM),
        Call::Advance,
    ];
    let (mut a, mut b) = (filled(), filled());
    for call in calls {
        call.try_on(&mut a).unwrap();
        call.seed_on(&mut b);
        assert_eq!(snapshot(&a), snapshot(&b), "{call:?}");
    }
    assert_eq!(a.seq_len(), 4);
}

// The seed's panics, one test for each case its methods document under `# Panics`.

#[test]
#[should_panic(expected = "KvCache::store_key: key has shape [5]")]
fn store_key_panics_on_a_key_of_the_wrong_length() {
    filled().store_key(0, 0, 4, &[1.0; DIM + 1]);
}

#[test]
#[should_panic(expected = "KvCache::store_key: layer=2 is out of range: must be in [0, 2)")]
fn store_key_panics_on_a_layer_out_of_range() {
    filled().store_key(LAYERS, 0, 0, &[1.0; DIM]);
}

#[test]
#[should_panic(expected = "KvCache::store_key: head=3 is out of range: must be in [0, 3)")]
fn store_key_panics_on_a_head_out_of_range() {
    filled().store_key(0, HEADS, 0, &[1.0; DIM]);
}

#[test]
#[should_panic(expected = "KvCache::store_key: pos=16 is out of range: must be in [0, 16)")]
fn store_key_panics_at_max_seq_len() {
    filled().store_key(0, 0, MAX, &[1.0; DIM]);
}

#[test]
#[should_panic(expected = "KvCache::store_value: value has shape [3]")]
fn store_value_panics_on_a_value_of_the_wrong_length() {
    filled().store_value(0, 0, 4, &[1.0; DIM - 1]);
}

#[test]
#[should_panic(expected = "KvCache::store_value: layer=2 is out of range")]
fn store_value_panics_on_a_layer_out_of_range() {
    filled().store_value(LAYERS, 0, 0, &[1.0; DIM]);
}

#[test]
#[should_panic(expected = "KvCache::store_value: head=3 is out of range")]
fn store_value_panics_on_a_head_out_of_range() {
    filled().store_value(0, HEADS, 0, &[1.0; DIM]);
}

#[test]
#[should_panic(expected = "KvCache::store_value: pos=9223372036854775807 is out of range")]
fn store_value_panics_at_max_seq_len() {
    filled().store_value(0, 0, usize::MAX, &[1.0; DIM]);
}

#[test]
#[should_panic(expected = "KvCache::extract_block: layer=2 is out of range")]
fn extract_block_panics_on_a_layer_out_of_range() {
    filled().extract_block(LAYERS, 0, 2);
}

#[test]
#[should_panic(
    expected = "KvCache::extract_block: start_pos=16 is out of range: must be in [0, 16)"
)]
fn extract_block_panics_on_a_start_pos_out_of_range() {
    filled().extract_block(0, MAX, 2);
}

#[test]
#[should_panic(expected = "KvCache::extract_block: block_size=0: must be in 1..=16 (max_seq_len)")]
fn extract_block_panics_on_an_empty_block() {
    filled().extract_block(0, 0, 0);
}

#[test]
#[should_panic(expected = "KvCache::extract_block: block_size=17: must be in 1..=16 (max_seq_len)")]
fn extract_block_panics_on_a_block_past_max_seq_len() {
    filled().extract_block(0, 0, MAX + 1);
}

#[test]
#[should_panic(expected = "KvCache::inject_block: layer=2 is out of range")]
fn inject_block_panics_on_a_layer_out_of_range() {
    filled().inject_block(LAYERS, 0, 2, &[1.0; BLOCK2], &[1.0; BLOCK2]);
}

#[test]
#[should_panic(expected = "KvCache::inject_block: start_pos=16 is out of range")]
fn inject_block_panics_on_a_start_pos_out_of_range() {
    filled().inject_block(0, MAX, 2, &[1.0; BLOCK2], &[1.0; BLOCK2]);
}

#[test]
#[should_panic(expected = "KvCache::inject_block: block_size=0: must be in 1..=16")]
fn inject_block_panics_on_an_empty_block() {
    filled().inject_block(0, 0, 0, &[], &[]);
}

#[test]
#[should_panic(expected = "KvCache::inject_block: block_size=17: must be in 1..=16")]
fn inject_block_panics_on_a_block_past_max_seq_len() {
    filled().inject_block(0, 0, MAX + 1, &[1.0; BLOCK2], &[1.0; BLOCK2]);
}

#[test]
#[should_panic(expected = "KvCache::inject_block: keys has shape [23]")]
fn inject_block_panics_on_keys_of_the_wrong_length() {
    filled().inject_block(0, 0, 2, &[1.0; BLOCK2 - 1], &[1.0; BLOCK2]);
}

#[test]
#[should_panic(expected = "KvCache::inject_block: values has shape [25]")]
fn inject_block_panics_on_values_of_the_wrong_length() {
    filled().inject_block(0, 0, 2, &[1.0; BLOCK2], &[1.0; BLOCK2 + 1]);
}

#[test]
#[should_panic(
    expected = "KvCache::advance: n=1: committing to seq_len 4 needs every layer to hold 4 positions, but layer 1 holds 3"
)]
fn advance_panics_unless_every_layer_holds_the_position() {
    filled().advance();
}

#[test]
#[should_panic(expected = "KvCache::advance: n=1: committing to seq_len 3 needs every layer")]
fn advance_panics_on_a_full_cache() {
    let mut c = KvCache::new(1, 1, DIM, 2);
    c.set_seq_len(2);
    c.advance();
}

#[test]
#[should_panic(expected = "KvCache::new: num_kv_heads=0")]
fn new_panics_on_a_zero_size() {
    KvCache::new(1, 0, DIM, MAX);
}

#[test]
#[should_panic(expected = "KvCache::zeros: head_dim=0")]
fn zeros_panics_on_a_zero_size() {
    KvCache::<half::f16>::zeros(1, 1, 0, MAX);
}
