//! The binary payload of one recurrent-state checkpoint in an offload tier (a hybrid
//! model's state at a token position, [`crate::paged::checkpoints`]), and the key tiers
//! file it under. It travels beside the block payloads ([`super::payload`]): the same
//! configuration fingerprint, the same keyed BLAKE3 MAC under the namespace's key, the
//! same refusals.
//!
//! Layout (little-endian), then a keyed BLAKE3 MAC of everything before it:
//!
//! | bytes | field |
//! |---|---|
//! | 8 | magic `KVRSCKP` and format version 1 |
//! | 16 | the pool-configuration fingerprint (its state layout included) |
//! | 16, 16, 16 | anchor (chain hash before the position, or the root), extra-key digest, chain root |
//! | 8 | the token position |
//! | 4 + 4 | the run's length `r` (token ids after the last block boundary); 4 zero bytes |
//! | 8 | bytes of state `S` |
//! | 4 x r, zero-padded to 16 | the run's token ids |
//! | S | every state of every state layer ([`crate::paged::StateArena::read_checkpoint`]) |
//! | 32 | keyed BLAKE3 of all the above, under the namespace's [`MacKey`] |
//!
//! A checkpoint's key is a digest of its anchor, extra-key digest and run, 64 hex digits
//! (block keys have 32), in its namespace's key prefix, so dropping a namespace drops its
//! checkpoints too.

use super::payload::{hex, namespace_prefix, Fingerprint, MacKey, Refusal};
use crate::prefix::BlockHash;

/// The payload's magic bytes and version.
const MAGIC: &[u8; 8] = b"KVRSCKP\x01";

/// Bytes before the run's token ids.
const HEADER: usize = 8 + 16 + 3 * 16 + 8 + 4 + 4 + 8;

/// Bytes of the trailing MAC.
const MAC: usize = 32;

/// What names a checkpoint and where it sits: its key fields, its root and position.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointMeta {
    /// The chain hash of the whole blocks before the position (the root before the
    /// first block).
    pub anchor: BlockHash,
    /// The digest of the sequence's extra key (0 for none).
    pub extra: u128,
    /// The chain root (namespace) whose MAC key signs it.
    pub root: BlockHash,
    /// The token position whose state it holds.
    pub position: usize,
    /// The token ids from the last block boundary to the position.
    pub run: Vec<u32>,
}

/// The tier key of the checkpoint `(anchor, extra, run)` of namespace `root`:
/// `kvrs:{fingerprint}:{root}:{digest}`, the digest 64 hex digits.
pub fn checkpoint_key(
    fp: &Fingerprint,
    root: BlockHash,
    anchor: BlockHash,
    extra: u128,
    run: &[u32],
) -> String {
    let mut h = blake3::Hasher::new_derive_key("kvrs 2026-12 tier checkpoint key");
    h.update(&anchor.to_le_bytes());
    h.update(&extra.to_le_bytes());
    h.update(&(run.len() as u64).to_le_bytes());
    for t in run {
        h.update(&t.to_le_bytes());
    }
    format!(
        "{}{}",
        namespace_prefix(fp, root),
        hex(h.finalize().as_bytes())
    )
}

/// Bytes of the run's token ids, padded so the state starts 16-byte aligned.
fn run_bytes(run: usize) -> usize {
    (4 * run).next_multiple_of(16)
}

/// Bytes of a payload with a run of `run` tokens and `state_bytes` of state.
pub fn payload_len(run: usize, state_bytes: usize) -> usize {
    HEADER + run_bytes(run) + state_bytes + MAC
}

/// Where the state lies in a payload with a run of `run` tokens.
pub fn state_range(run: usize, state_bytes: usize) -> std::ops::Range<usize> {
    let at = HEADER + run_bytes(run);
    at..at + state_bytes
}

/// Writes the header and run of a checkpoint payload into a zeroed buffer of
/// [`payload_len`] bytes, whose state the caller fills at [`state_range`] before
/// [`super::payload::seal`].
pub fn begin(fp: &Fingerprint, meta: &CheckpointMeta, state_bytes: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload_len(meta.run.len(), state_bytes));
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(fp);
    for h in [meta.anchor, meta.extra, meta.root] {
        out.extend_from_slice(&h.to_le_bytes());
    }
    out.extend_from_slice(&(meta.position as u64).to_le_bytes());
    out.extend_from_slice(&(meta.run.len() as u32).to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&(state_bytes as u64).to_le_bytes());
    for t in &meta.run {
        out.extend_from_slice(&t.to_le_bytes());
    }
    out.resize(payload_len(meta.run.len(), state_bytes), 0);
    out
}

fn u128_at(b: &[u8], at: usize) -> u128 {
    u128::from_le_bytes(b[at..at + 16].try_into().expect("16 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Checks `payload` as the checkpoint `(anchor, extra, run)` of a pool with fingerprint
/// `fp` and `state_bytes` of state per checkpoint, in the namespace whose MAC key is
/// `mac`: format, configuration, length, key, then MAC (compared in constant time).
/// Returns its fields; the caller checks its root and position where it knows them.
pub fn decode(
    payload: &[u8],
    fp: &Fingerprint,
    state_bytes: usize,
    (anchor, extra, run): (BlockHash, u128, &[u32]),
    mac: &MacKey,
) -> Result<CheckpointMeta, Refusal> {
    if payload.len() < HEADER || &payload[..8] != MAGIC {
        return Err(Refusal::Format);
    }
    if &payload[8..24] != fp || u64_at(payload, 88) != state_bytes as u64 {
        return Err(Refusal::Config);
    }
    let r = u32::from_le_bytes(payload[80..84].try_into().expect("4 bytes")) as usize;
    if r != run.len() || payload.len() != payload_len(r, state_bytes) {
        return Err(if r == run.len() {
            Refusal::Checksum
        } else {
            Refusal::Key
        });
    }
    let got: Vec<u32> = payload[HEADER..HEADER + 4 * r]
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect();
    if u128_at(payload, 24) != anchor || u128_at(payload, 40) != extra || got != run {
        return Err(Refusal::Key);
    }
    let n = payload.len() - MAC;
    let trailer: [u8; 32] = payload[n..].try_into().expect("32 bytes");
    if blake3::keyed_hash(mac, &payload[..n]) != blake3::Hash::from(trailer) {
        return Err(Refusal::Checksum);
    }
    Ok(CheckpointMeta {
        anchor,
        extra,
        root: u128_at(payload, 56),
        position: usize::try_from(u64_at(payload, 72)).map_err(|_| Refusal::Format)?,
        run: got,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tier::payload::{fingerprint, seal, TierKey};

    const SECRET: &[u8] = b"sixteen-byte-key-of-the-pools";

    fn sample(run: Vec<u32>) -> (Fingerprint, CheckpointMeta, MacKey, Vec<u8>) {
        let fp = fingerprint([("model", "m"), ("states", "h[2]:float32")]);
        let meta = CheckpointMeta {
            anchor: 7,
            extra: 9,
            root: 1,
            position: 8 + run.len(),
            run,
        };
        let mac = TierKey::new(Some(SECRET)).config(&fp).namespace(1);
        let mut p = begin(&fp, &meta, 24);
        let r = state_range(meta.run.len(), 24);
        p[r].iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
        seal(&mut p, &mac);
        (fp, meta, mac, p)
    }

    #[test]
    fn a_checkpoint_round_trips_and_every_fault_is_refused() {
        for run in [vec![], vec![3, 4, 5]] {
            let (fp, meta, mac, p) = sample(run.clone());
            assert_eq!(p.len(), payload_len(run.len(), 24));
            assert_eq!(state_range(run.len(), 24).start % 16, 0);
            let key = (7, 9, run.as_slice());
            assert_eq!(decode(&p, &fp, 24, key, &mac).unwrap(), meta);
            assert_eq!(p[state_range(run.len(), 24)][5], 5);
            assert_eq!(decode(&p, &fp, 24, (8, 9, &run), &mac), Err(Refusal::Key));
            assert_eq!(decode(&p, &fp, 24, (7, 0, &run), &mac), Err(Refusal::Key));
            assert_eq!(
                decode(&p, &fp, 24, (7, 9, &[3, 4]), &mac),
                Err(Refusal::Key)
            );
            assert_eq!(decode(&p, &fp, 32, key, &mac), Err(Refusal::Config));
            let other = fingerprint([("model", "m"), ("states", "h[3]:float32")]);
            assert_eq!(decode(&p, &other, 24, key, &mac), Err(Refusal::Config));
            assert_eq!(
                decode(&p[..p.len() - 1], &fp, 24, key, &mac),
                Err(Refusal::Checksum)
            );
            assert_eq!(decode(&p[..40], &fp, 24, key, &mac), Err(Refusal::Format));
            for bit in [0, 8 * 60, 8 * 75, 8 * (p.len() - 40), 8 * (p.len() - 1)] {
                let mut q = p.clone();
                q[bit / 8] ^= 1 << (bit % 8);
                assert!(decode(&q, &fp, 24, key, &mac).is_err(), "bit {bit}");
            }
            // Another namespace's key, no secret, a forger re-signing without it.
            let public = TierKey::new(None).config(&fp).namespace(1);
            let other_ns = TierKey::new(Some(SECRET)).config(&fp).namespace(2);
            for wrong in [public, other_ns] {
                assert_eq!(decode(&p, &fp, 24, key, &wrong), Err(Refusal::Checksum));
            }
            let mut forged = p.clone();
            forged[state_range(run.len(), 24)].fill(0xAB);
            seal(&mut forged, &public);
            assert_eq!(decode(&forged, &fp, 24, key, &mac), Err(Refusal::Checksum));
        }
    }

    #[test]
    fn checkpoint_keys_are_distinct_per_key_and_in_their_namespace() {
        let fp = fingerprint([("a", "1")]);
        let k = checkpoint_key(&fp, 5, 9, 0, &[]);
        assert!(k.starts_with(&namespace_prefix(&fp, 5)));
        assert_eq!(k.len(), namespace_prefix(&fp, 5).len() + 64);
        let block = crate::tier::payload::block_key(&fp, 5, 9);
        assert_ne!(k.len(), block.len());
        for other in [
            checkpoint_key(&fp, 5, 9, 1, &[]),
            checkpoint_key(&fp, 5, 8, 0, &[]),
            checkpoint_key(&fp, 5, 9, 0, &[1]),
        ] {
            assert_ne!(k[k.len() - 64..], other[other.len() - 64..]);
        }
    }
}
