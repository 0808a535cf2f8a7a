//! Loading a checked file into the pool: the most recently used blocks the pool lacks,
//! as many as its free room holds, those whose chain from a root is complete; then its
//! state checkpoints anchored at cached blocks, as many as the free checkpoint slots hold.

use super::check::CheckedFile;
use super::{bad_config, LoadReport};
use crate::error::Result;
use crate::paged::PoolCore;
use crate::prefix::{BlockHash, CachedBlock};
use crate::sizes;
use crate::tensor::TensorRef;

/// What loading's bookkeeping names when the host refuses it.
const WHAT: &str = "loading a prefix-cache file";

impl PoolCore {
    /// Caches the blocks of `file` (checked by [`super::FileConfig::check`] against this
    /// pool's [`Self::prefix_file_config`]) as evictable, in the file's order (least
    /// recently used first). With less free room than the file's new blocks, the most
    /// recently used that fit are taken, and of those only blocks whose chain reaches a
    /// root (through the file's taken blocks or the pool's cache) are loaded.
    pub fn commit_file(&mut self, file: CheckedFile) -> Result<LoadReport> {
        let config = self.prefix_file_config()?;
        if config.entries != file.entries
            || (file.checkpoints.is_some() && config.state_layout != file.state_layout)
        {
            return Err(bad_config());
        }
        let n = file.blocks.len();
        let Some(index) = self.prefix() else {
            return Err(bad_config());
        };
        let room = self.free_block_count();
        // Bookkeeping allocated fallibly, before any block is loaded.
        let mut fresh: Vec<usize> = sizes::with_capacity(WHAT, n)?;
        fresh.extend((0..n).filter(|&i| index.lookup(file.blocks[i].hash).is_none()));
        let mut taken = sizes::filled(WHAT, n, false)?;
        for &i in &fresh[fresh.len().saturating_sub(room)..] {
            taken[i] = true;
        }
        drop(fresh);
        // Each taken block's root, `None` when its chain is broken: a block's root is its
        // own (a first block), its taken parent's, or its cached parent's. The file's
        // parent links have no loops (checked), so each walk ends.
        let mut roots: Vec<Option<Option<BlockHash>>> = sizes::filled(WHAT, n, None)?;
        let mut walk = sizes::with_capacity(WHAT, n)?;
        for start in (0..n).filter(|&i| taken[i]) {
            walk.clear();
            let mut i = start;
            let root = loop {
                if let Some(r) = roots[i] {
                    break r;
                }
                let b = &file.blocks[i];
                if b.root.is_some() {
                    break b.root;
                }
                walk.push(i);
                match b.file_parent.filter(|&j| taken[j]) {
                    Some(j) => i = j,
                    None => {
                        break index
                            .lookup(b.parent)
                            .and_then(|c| index.meta(c))
                            .map(|m| m.root)
                    }
                }
            };
            roots[start] = Some(root);
            for &j in &walk {
                roots[j] = Some(root);
            }
        }
        let mut loaded = 0;
        for (i, root) in roots.into_iter().enumerate() {
            let Some(Some(root)) = root else { continue };
            if self.load_block(&file, i, root)? {
                loaded += 1;
            }
        }
        let checkpoints = match &file.checkpoints {
            Some(c) => self.commit_checkpoints(c, &file.bytes)?,
            None => 0,
        };
        Ok(LoadReport {
            loaded,
            skipped: n - loaded,
            checkpoints,
        })
    }

    /// Copies block `i` of `file` into a free block and caches it; false when no block
    /// is free or its hash got cached meanwhile.
    fn load_block(&mut self, file: &CheckedFile, i: usize, root: BlockHash) -> Result<bool> {
        let sh = self.shape();
        let (dtype, elems) = (self.dtype(), sh.block_elems());
        let Some(b) = self.blocks.take_for_loading() else {
            return Ok(false);
        };
        let per_block = self.groups().per_block;
        let block_bytes = elems * dtype.size();
        let vectors = elems / sh.scale_unit();
        let written = (|| -> Result<()> {
            for (layer, range) in file.data.iter().enumerate() {
                let data = &file.bytes[range.clone()];
                if layer < per_block {
                    let data = &data[i * block_bytes..(i + 1) * block_bytes];
                    let src = TensorRef::from_bytes(data, dtype, &[1, 1, elems])?;
                    self.storage_mut().write(sh.whole_block(layer, b), &src)?;
                } else {
                    let scales: Vec<f32> = data[i * vectors * 4..(i + 1) * vectors * 4]
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect();
                    self.storage_mut()
                        .write_row_scales(sh.whole_block(layer - per_block, b), &scales)?;
                }
            }
            Ok(())
        })();
        let block = &file.blocks[i];
        let meta = CachedBlock {
            hash: block.hash,
            parent: block.parent,
            first: block.root.is_some(),
            root,
        };
        let tokens = &file.tokens[i * sh.block_size..(i + 1) * sh.block_size];
        let extra = &file.extras[block.extra];
        if let Err(e) = written {
            self.blocks.discard(b);
            return Err(e);
        }
        // A hash cached meanwhile returns the block to the free list.
        Ok(self.blocks.adopt_loaded(b, meta, tokens, extra))
    }
}
