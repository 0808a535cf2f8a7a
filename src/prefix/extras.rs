//! The extra keys of cached blocks, interned: one shared copy and one digest per distinct
//! extra key, counted by the blocks that use it, so a block stores a small id and a saved
//! cache can recompute every block's hash.

use std::sync::Arc;

use rustc_hash::FxHashMap;

use super::hash::extra_digest;

/// The id of the empty extra key (no LoRA adapter, no multimodal input): never released.
pub(crate) const NO_EXTRA: u32 = 0;

#[derive(Debug)]
struct Interned {
    bytes: Arc<[u8]>,
    digest: u128,
    blocks: u32,
}

/// Distinct extra keys by id, with the blocks using each.
#[derive(Debug)]
pub(crate) struct ExtraKeys {
    ids: FxHashMap<Arc<[u8]>, u32>,
    slots: Vec<Interned>,
    free: Vec<u32>,
}

impl Default for ExtraKeys {
    fn default() -> Self {
        ExtraKeys {
            ids: FxHashMap::default(),
            slots: vec![Interned {
                bytes: Arc::from(&[][..]),
                digest: 0,
                blocks: 0,
            }],
            free: Vec::new(),
        }
    }
}

impl ExtraKeys {
    /// The id of `extra` for one more block using it (interned on first use).
    pub fn acquire(&mut self, extra: &[u8]) -> u32 {
        if extra.is_empty() {
            return NO_EXTRA;
        }
        if let Some(&id) = self.ids.get(extra) {
            self.slots[id as usize].blocks += 1;
            return id;
        }
        let entry = Interned {
            bytes: Arc::from(extra),
            digest: extra_digest(extra),
            blocks: 1,
        };
        let id = match self.free.pop() {
            Some(id) => {
                self.slots[id as usize] = entry;
                id
            }
            None => {
                self.slots.push(entry);
                (self.slots.len() - 1) as u32
            }
        };
        self.ids.insert(self.slots[id as usize].bytes.clone(), id);
        id
    }

    /// One block less uses `id`; the key is forgotten with its last block.
    pub fn release(&mut self, id: u32) {
        if id == NO_EXTRA {
            return;
        }
        let slot = &mut self.slots[id as usize];
        slot.blocks -= 1;
        if slot.blocks == 0 {
            let bytes = std::mem::replace(&mut slot.bytes, Arc::from(&[][..]));
            self.ids.remove(&bytes);
            self.free.push(id);
        }
    }

    /// The id of `extra` if some cached block uses it.
    pub fn find(&self, extra: &[u8]) -> Option<u32> {
        if extra.is_empty() {
            return Some(NO_EXTRA);
        }
        self.ids.get(extra).copied()
    }

    /// The digest of key `id` ([`extra_digest`]).
    pub fn digest(&self, id: u32) -> u128 {
        self.slots[id as usize].digest
    }

    /// The bytes of key `id`.
    pub fn bytes(&self, id: u32) -> &[u8] {
        &self.slots[id as usize].bytes
    }

    /// Checks that each key's count is `uses(id)` and that every key counted is findable.
    pub fn check(&self, uses: &FxHashMap<u32, u32>) -> Result<(), String> {
        for (id, slot) in self.slots.iter().enumerate().skip(1) {
            let want = uses.get(&(id as u32)).copied().unwrap_or(0);
            if slot.blocks != want {
                return Err(format!(
                    "extra key {id} counts {} blocks but {want} use it",
                    slot.blocks
                ));
            }
            if want > 0 && self.find(&slot.bytes) != Some(id as u32) {
                return Err(format!("extra key {id} is not found by its bytes"));
            }
        }
        if self.ids.len() + self.free.len() + 1 != self.slots.len() {
            return Err(format!(
                "{} extra keys indexed and {} free slots, of {}",
                self.ids.len(),
                self.free.len(),
                self.slots.len() - 1
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_shared_and_forgotten_with_their_last_block() {
        let mut x = ExtraKeys::default();
        assert_eq!(x.acquire(b""), NO_EXTRA);
        let a = x.acquire(b"lora-a");
        assert_eq!(x.acquire(b"lora-a"), a);
        let b = x.acquire(b"lora-b");
        assert_ne!(a, b);
        assert_eq!(x.digest(a), extra_digest(b"lora-a"));
        assert_eq!((x.bytes(b), x.digest(NO_EXTRA)), (&b"lora-b"[..], 0));
        x.release(a);
        assert_eq!(x.find(b"lora-a"), Some(a));
        x.release(a);
        assert_eq!(x.find(b"lora-a"), None);
        assert_eq!(x.acquire(b"lora-c"), a); // the slot is reused
        let uses = FxHashMap::from_iter([(a, 1), (b, 1)]);
        x.check(&uses).unwrap();
    }
}
