//! State checkpoints travel with their blocks: a hybrid pool (one attention layer, one
//! recurrent layer of a toy model) writes its cached blocks and the checkpoints at their
//! ends to a `HostTier` and a `DiskTier`, and a fresh pool (a new pool object on the same
//! directory, for disk) hits the prefix with the state restored bit for bit. A corrupted
//! or forged checkpoint payload is a miss, never a wrong state; a pool of another state
//! layout shares nothing. Prefix-cache files carry every cached checkpoint
//! (token-granular) and refuse tampering and other state layouts.

use std::path::PathBuf;
use std::sync::Arc;

use kvrs::tier::{DiskTier, HostTier, Tier};
use kvrs::unstable::checkpoint_payload::{checkpoint_key, state_range};
use kvrs::unstable::payload::{seal, TierKey};
use kvrs::unstable::{BlockHash, PoolCore, StateConfig, StateSpec, TensorMut, TensorRef};
use kvrs::{DType, HashKind, KvError, KvLayout, PagedShape, PrefixConfig, SeqId, TierOptions};

const D: usize = 2;
const BS: usize = 4;
const SECRET: &[u8] = b"a-secret-of-the-pools-sharing-tiers";

fn emb(token: u32) -> [f32; D] {
    [
        (token % 7) as f32 / 8.0 - 0.375,
        (token % 5) as f32 / 16.0 + 0.0625,
    ]
}

/// The state after `tokens` and the K (= state) of every position.
fn run_model(tokens: &[u32]) -> ([f32; D], Vec<f32>) {
    let mut h = [0f32; D];
    let mut k = Vec::new();
    for &t in tokens {
        let e = emb(t);
        for i in 0..D {
            h[i] = h[i] * 0.5 + e[i];
        }
        k.extend_from_slice(&h);
    }
    (h, k)
}

/// A pool of 16 blocks with one state layer of `dims`, and `tiers`.
fn pool(dims: &[usize], tiers: Vec<Arc<dyn Tier>>) -> PoolCore {
    let p = no_states_pool()
        .with_states(StateConfig {
            layers: 1,
            slots: 2,
            checkpoints: 4,
            specs: vec![StateSpec {
                name: "h".into(),
                dims: dims.to_vec(),
                dtype: DType::F32,
            }],
        })
        .unwrap();
    if tiers.is_empty() {
        return p;
    }
    let options = TierOptions {
        secret: Some(SECRET.to_vec()),
        ..TierOptions::default()
    };
    p.with_tiers(tiers, "toy", &options).unwrap()
}

fn state(p: &PoolCore, id: SeqId) -> [f32; D] {
    let mut h = [0f32; D];
    let dst = &mut TensorMut::from_f32_mut(&mut h, &[D, 1, 1]).unwrap();
    p.read_state(id, 0, "h", dst).unwrap();
    h
}

/// Computes positions `seq_len..seq_len + n` of `tokens` as the model does (the state in
/// place, the K/V appended), committed with their token ids.
fn compute(p: &mut PoolCore, id: SeqId, tokens: &[u32], n: usize) {
    let start = p.seq(id).unwrap().seq_len;
    let (h, k) = run_model(&tokens[..start + n]);
    let k = &k[start * D..];
    let v: Vec<f32> = k.iter().map(|x| -x).collect();
    let kt = TensorRef::from_f32(k, &[n, 1, D]).unwrap();
    p.append(id, 0, &kt, &TensorRef::from_f32(&v, &[n, 1, D]).unwrap())
        .unwrap();
    let h = TensorRef::from_f32(&h, &[D, 1, 1]).unwrap();
    p.write_state(id, 0, "h", &h).unwrap();
    p.advance(id, n as i64, Some(&tokens[start..start + n]))
        .unwrap();
}

/// The prompt every writer runs: 10 tokens, prefilled in chunks of 4, 4 and 2 (so
/// checkpoints at 4, 8 and 10), then 2 decoded tokens (block 2 fills up).
fn prompt() -> Vec<u32> {
    (1..=12).map(|i| i * 3 + 1).collect()
}

/// Runs the prompt on `p` in `namespace`; returns the sequence and its blocks' hashes.
fn run_prompt(p: &mut PoolCore, namespace: &[u8]) -> (SeqId, Vec<BlockHash>) {
    let t = prompt();
    let id = p.new_sequence_with(&t[..10], namespace, b"");
    for n in [4, 4, 2, 1, 1] {
        compute(p, id, &t, n);
    }
    let s = p.seq(id).unwrap();
    assert_eq!(s.seq_len, 12);
    (id, s.hashes.clone())
}

/// A reader's prompt: the first 8 tokens of the writer's, then others.
fn reader_prompt() -> Vec<u32> {
    let mut t = prompt()[..8].to_vec();
    t.extend([90, 91, 92]);
    t
}

/// Starts the reader's prompt on `p`; returns its hit length and whether its state and
/// K/V are those of running its first tokens from scratch.
fn read_back(p: &mut PoolCore) -> usize {
    let t = reader_prompt();
    let id = p.new_sequence_with(&t, b"", b"");
    let n = p.seq(id).unwrap().seq_len;
    let (h, k) = run_model(&t[..n]);
    assert_eq!(state(p, id), h, "the state restored at {n}");
    if n > 0 {
        let (mut gk, mut gv) = (vec![f32::NAN; n * D], vec![f32::NAN; n * D]);
        p.gather(
            id,
            0,
            &mut TensorMut::from_f32_mut(&mut gk, &[1, n, D]).unwrap(),
            &mut TensorMut::from_f32_mut(&mut gv, &[1, n, D]).unwrap(),
        )
        .unwrap();
        assert_eq!(gk, k);
    }
    p.check_invariants().unwrap();
    p.free_sequence(id).unwrap();
    n
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvrs-ckpt-tiers-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn a_fresh_pool_hits_a_hybrid_prefix_from_a_host_or_disk_tier_with_its_state() {
    // Host: evicted (blocks with the checkpoints anchored at them, then the rest).
    let host: Arc<dyn Tier> = Arc::new(HostTier::new(1 << 20));
    let mut a = pool(&[D], vec![host.clone()]);
    let (id, _) = run_prompt(&mut a, b"");
    a.free_sequence(id).unwrap();
    a.evict_all();
    a.flush_tiers();
    let mut b = pool(&[D], vec![host.clone()]);
    assert_eq!(
        read_back(&mut b),
        8,
        "two blocks and the checkpoint at their end"
    );
    let c = host.counters().snapshot();
    assert_eq!(c[1], ("hits", 3), "two blocks and one checkpoint: {c:?}");

    // Disk: stored with the sequence's blocks; a new tier object on the directory.
    let dir = temp_dir("disk");
    let disk = || -> Vec<Arc<dyn Tier>> { vec![Arc::new(DiskTier::open(&dir, 1 << 20).unwrap())] };
    let mut a = pool(&[D], disk());
    let (id, _) = run_prompt(&mut a, b"");
    assert_eq!(a.store_to_tiers(id).unwrap(), 3);
    a.flush_tiers();
    drop(a);
    let mut b = pool(&[D], disk());
    assert_eq!(read_back(&mut b), 8);
    // The hit is in the pool now: a second reader needs no tier.
    assert_eq!(read_back(&mut b), 8);
    b.check_invariants().unwrap();

    // A pool of another state layout shares neither blocks nor checkpoints.
    let mut other = pool(&[D + 1], disk());
    let t = reader_prompt();
    let id = other.new_sequence_with(&t, b"", b"");
    assert_eq!(other.seq(id).unwrap().seq_len, 0);
    assert_eq!(other.stats().cached_blocks, 0);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The payload of the checkpoint at position 8 of the writer's prompt in `tier`, its
/// key, and the keys of those at 4 and of the same position in namespace "other".
struct Written {
    tier: Arc<HostTier>,
    key: String,
    payload: Vec<u8>,
    at_4: Vec<u8>,
    other_ns: Vec<u8>,
}

fn written() -> Written {
    let tier = Arc::new(HostTier::new(1 << 20));
    let mut a = pool(&[D], vec![tier.clone() as Arc<dyn Tier>]);
    let (fp, p) = (a.tiers().unwrap().fingerprint, a.prefix().unwrap());
    let (root, other_root) = (p.root(b""), p.root(b"other"));
    let (id, hashes) = run_prompt(&mut a, b"");
    let (other, other_hashes) = run_prompt(&mut a, b"other");
    for s in [id, other] {
        a.store_to_tiers(s).unwrap();
    }
    a.flush_tiers();
    let key = checkpoint_key(&fp, root, hashes[1], 0, &[]);
    let keys = [
        key.clone(),
        checkpoint_key(&fp, root, hashes[0], 0, &[]),
        checkpoint_key(&fp, other_root, other_hashes[1], 0, &[]),
    ];
    let got: Vec<Vec<u8>> = tier
        .get_many(&keys, 0..=usize::MAX)
        .into_iter()
        .map(Option::unwrap)
        .collect();
    let [payload, at_4, other_ns] = <[Vec<u8>; 3]>::try_from(got).unwrap();
    Written {
        tier,
        key,
        payload,
        at_4,
        other_ns,
    }
}

#[test]
fn a_corrupted_or_forged_checkpoint_is_a_miss_never_a_wrong_state() {
    let w = written();
    let states = state_range(0, D * 4);
    let (public_mac, other_ns_mac) = {
        let a = pool(&[D], vec![w.tier.clone() as Arc<dyn Tier>]);
        let fp = a.tiers().unwrap().fingerprint;
        let p = a.prefix().unwrap();
        (
            TierKey::new(None).config(&fp).namespace(p.root(b"")),
            TierKey::new(Some(SECRET))
                .config(&fp)
                .namespace(p.root(b"other")),
        )
    };
    let flipped = |at: usize| {
        let mut p = w.payload.clone();
        p[at] ^= 1;
        p
    };
    let mut forged = w.payload.clone();
    forged[states.clone()].copy_from_slice(&[0x3f; D * 4]);
    seal(&mut forged, &public_mac);
    let mut resigned = w.payload.clone();
    seal(&mut resigned, &other_ns_mac);
    let mut grown = w.payload.clone();
    grown.push(0);
    let cases = [
        ("a state byte flipped", flipped(states.start + 1)),
        ("a header byte flipped", flipped(60)),
        ("the MAC flipped", flipped(w.payload.len() - 1)),
        ("re-signed without the secret", forged),
        ("the checkpoint at 4 filed under 8's key", w.at_4.clone()),
        ("another namespace's checkpoint", w.other_ns.clone()),
        ("signed with another namespace's key", resigned),
        ("a byte longer", grown),
    ];
    for (what, bad) in cases {
        w.tier.put_many(&[(w.key.clone(), Arc::new(bad))]);
        let mut b = pool(&[D], vec![w.tier.clone() as Arc<dyn Tier>]);
        let rejected = w.tier.counters().snapshot()[3].1;
        // Blocks load, the checkpoint at 8 does not: the hit is the one at 4.
        assert_eq!(read_back(&mut b), 4, "{what}");
        assert!(
            w.tier.counters().snapshot()[3].1 > rejected,
            "{what}: counted as refused"
        );
        assert_eq!(
            w.tier
                .get_many(std::slice::from_ref(&w.key), 0..=usize::MAX)[0],
            None,
            "{what}: forgotten by the tier"
        );
    }
    // The genuine payload hits again.
    w.tier
        .put_many(&[(w.key.clone(), Arc::new(w.payload.clone()))]);
    let mut b = pool(&[D], vec![w.tier.clone() as Arc<dyn Tier>]);
    assert_eq!(read_back(&mut b), 8);
}

#[test]
fn files_carry_token_granular_checkpoints_and_refuse_tampering_and_other_layouts() {
    let dir = temp_dir("files");
    let path = dir.join("cache.kvc");
    let mut a = pool(&[D], Vec::new());
    let (id, _) = run_prompt(&mut a, b"");
    a.free_sequence(id).unwrap();
    a.save_prefix_cache(&path).unwrap();

    // A fresh pool hits 10 tokens (inside block 2) with the state at 10.
    let mut b = pool(&[D], Vec::new());
    let report = b.load_prefix_cache(&path).unwrap();
    assert_eq!((report.loaded, report.checkpoints), (3, 3));
    let mut t = prompt()[..10].to_vec();
    t.extend([77, 78]);
    let id = b.new_sequence_with(&t, b"", b"");
    assert_eq!(b.seq(id).unwrap().seq_len, 10);
    assert_eq!(state(&b, id), run_model(&t[..10]).0);
    b.check_invariants().unwrap();
    // Loading again changes nothing.
    b.free_sequence(id).unwrap();
    assert_eq!(b.load_prefix_cache(&path).unwrap().checkpoints, 0);

    // Another state layout, or none: refused, with the reason.
    for (dims, want) in [
        (&[D + 1][..], "state_layout is"),
        (&[][..], "this pool has none"),
    ] {
        let mut other = if dims.is_empty() {
            no_states_pool()
        } else {
            pool(dims, Vec::new())
        };
        match other.load_prefix_cache(&path) {
            Err(KvError::BadFile { reason, .. }) => assert!(reason.contains(want), "{reason}"),
            r => panic!("{r:?}"),
        }
        assert_eq!(other.stats().cached_blocks, 0);
    }
    // A file of a pool without state layers loads its blocks into one with them.
    let plain = dir.join("plain.kvc");
    let mut np = no_states_pool();
    let t = prompt();
    let id = np.new_sequence_with(&t, b"", b"");
    let (_, k) = run_model(&t);
    let kt = TensorRef::from_f32(&k, &[12, 1, D]).unwrap();
    np.append(id, 0, &kt, &kt).unwrap();
    np.advance(id, 12, None).unwrap();
    np.free_sequence(id).unwrap();
    np.save_prefix_cache(&plain).unwrap();
    let report = pool(&[D], Vec::new()).load_prefix_cache(&plain).unwrap();
    assert_eq!((report.loaded, report.checkpoints), (3, 0));

    // A flipped byte of a checkpoint's state: the MAC refuses the file.
    let mut bytes = std::fs::read(&path).unwrap();
    let (n, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let at = 8 + n + header.info("ckpt_states").unwrap().data_offsets.0;
    bytes[at + 2] ^= 4;
    std::fs::write(&path, &bytes).unwrap();
    let mut c = pool(&[D], Vec::new());
    match c.load_prefix_cache(&path) {
        Err(KvError::BadFile { reason, .. }) => assert!(reason.contains("MAC"), "{reason}"),
        r => panic!("{r:?}"),
    }
    assert_eq!(c.stats().cached_blocks, 0);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The attention pool of [`pool`] without state layers: 16 blocks, prefix caching.
fn no_states_pool() -> PoolCore {
    let shape = PagedShape {
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: D,
        v_head_dim: D,
        block_size: BS,
        num_blocks: 16,
        layout: KvLayout::Nhd,
    };
    let prefix = PrefixConfig {
        hash: HashKind::Blake3,
        seed: 5,
        partial_hits: true,
        events: false,
    };
    PoolCore::new(shape, DType::F32, kvrs::Device::Cpu, Some(prefix))
        .unwrap()
        .with_model_id("toy")
}
