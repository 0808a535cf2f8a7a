//! Layer kinds (full, sliding-window, chunked attention) and how a pool groups layers so
//! that each group has its own block table.
//!
//! Layers of one kind are split into groups of equal size `per_block` (the greatest common
//! divisor of the kinds' layer counts, as vLLM's hybrid allocator does). A block id then
//! holds one block for each of `per_block` storage tensors, and a group's layer `j` lives
//! in tensor `j`: sliding layers release their old blocks while full layers keep theirs.

use std::fmt;
use std::str::FromStr;

use crate::error::{KvError, Result};

/// What a layer attends to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayerKind {
    /// Every earlier position of the sequence (causal attention).
    Full,
    /// The `W` most recent positions, the token itself included.
    Sliding,
    /// The earlier positions of the token's own chunk of `chunk_size` positions.
    Chunked,
}

impl LayerKind {
    /// The name used in the Python API and the README.
    pub fn name(self) -> &'static str {
        match self {
            LayerKind::Full => "full",
            LayerKind::Sliding => "sliding",
            LayerKind::Chunked => "chunked",
        }
    }
}

impl FromStr for LayerKind {
    type Err = KvError;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "full" | "full_attention" => Ok(LayerKind::Full),
            "sliding" | "sliding_attention" => Ok(LayerKind::Sliding),
            "chunked" | "chunked_attention" => Ok(LayerKind::Chunked),
            _ => Err(KvError::InvalidArgument {
                name: "layer_types",
                value: format!("{s:?}"),
                reason: "each layer is 'full', 'sliding' or 'chunked'".into(),
            }),
        }
    }
}

impl fmt::Display for LayerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The attention pattern of every layer of a pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attention {
    /// Kind of each layer.
    pub kinds: Vec<LayerKind>,
    /// Window of sliding layers, in positions (the token included).
    pub sliding_window: Option<usize>,
    /// Chunk size of chunked layers, in positions.
    pub chunk_size: Option<usize>,
    /// Extra positions sliding layers keep behind their window.
    pub swa_memory: usize,
}

impl Attention {
    /// Every one of `num_layers` layers full.
    pub fn full(num_layers: usize) -> Self {
        Attention {
            kinds: vec![LayerKind::Full; num_layers],
            sliding_window: None,
            chunk_size: None,
            swa_memory: 0,
        }
    }

    /// Checks that each kind used has its size and each size given has a layer.
    pub fn validate(&self, num_layers: usize) -> Result<()> {
        if self.kinds.len() != num_layers {
            return Err(KvError::InvalidArgument {
                name: "layer_types",
                value: format!("{} entries", self.kinds.len()),
                reason: format!("needs one entry per layer ({num_layers})"),
            });
        }
        for (kind, size, name) in [
            (LayerKind::Sliding, self.sliding_window, "sliding_window"),
            (LayerKind::Chunked, self.chunk_size, "chunk_size"),
        ] {
            let used = self.kinds.contains(&kind);
            match size {
                None if used => {
                    return Err(KvError::InvalidArgument {
                        name,
                        value: "None".into(),
                        reason: format!("layer_types has {kind} layers, which need it"),
                    })
                }
                Some(0) => {
                    return Err(KvError::InvalidArgument {
                        name,
                        value: "0".into(),
                        reason: "must be >= 1".into(),
                    })
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// The first position a token at `pos` of a layer of `kind` attends to.
    pub fn first_visible(&self, kind: LayerKind, pos: usize) -> usize {
        match kind {
            LayerKind::Full => 0,
            LayerKind::Sliding => (pos + 1).saturating_sub(self.window()),
            LayerKind::Chunked => pos / self.chunk() * self.chunk(),
        }
    }

    /// The first position a layer of `kind` keeps once `seq_len` positions are committed:
    /// what the next token sees, and for sliding layers `swa_memory` more.
    pub fn keep_from(&self, kind: LayerKind, seq_len: usize) -> usize {
        let first = self.first_visible(kind, seq_len);
        match kind {
            LayerKind::Sliding => first.saturating_sub(self.swa_memory),
            _ => first,
        }
    }

    fn window(&self) -> usize {
        self.sliding_window.expect("validated")
    }

    fn chunk(&self) -> usize {
        self.chunk_size.expect("validated")
    }
}

/// Layers of one kind that share a block table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Group {
    /// Their kind.
    pub kind: LayerKind,
    /// The layers, in order; layer `layers[j]` lives in storage tensor `j`.
    pub layers: Vec<usize>,
}

/// The pool's layer groups and where each layer lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerGroups {
    /// The attention pattern they were made from.
    pub attention: Attention,
    /// Groups, full ones first, then sliding, then chunked.
    pub groups: Vec<Group>,
    /// Group of each layer.
    pub group_of: Vec<usize>,
    /// Storage tensor of each layer.
    pub tensor_of: Vec<usize>,
    /// Layers per group: storage tensors, each holding one block per block id.
    pub per_block: usize,
}

impl LayerGroups {
    /// Groups the layers of `attention` (already validated).
    pub fn new(attention: Attention) -> Self {
        let kinds = [LayerKind::Full, LayerKind::Sliding, LayerKind::Chunked];
        let of_kind = |k: LayerKind| -> Vec<usize> {
            (0..attention.kinds.len())
                .filter(|&l| attention.kinds[l] == k)
                .collect()
        };
        let per_block = kinds
            .iter()
            .map(|&k| of_kind(k).len())
            .filter(|&n| n > 0)
            .fold(0, crate::sizes::gcd);
        let mut groups = Vec::new();
        let mut group_of = vec![0; attention.kinds.len()];
        let mut tensor_of = vec![0; attention.kinds.len()];
        for kind in kinds {
            for layers in of_kind(kind).chunks(per_block) {
                for (j, &l) in layers.iter().enumerate() {
                    group_of[l] = groups.len();
                    tensor_of[l] = j;
                }
                groups.push(Group {
                    kind,
                    layers: layers.to_vec(),
                });
            }
        }
        LayerGroups {
            attention,
            groups,
            group_of,
            tensor_of,
            per_block,
        }
    }

    /// Kind of `layer`.
    pub fn kind(&self, layer: usize) -> LayerKind {
        self.attention.kinds[layer]
    }

    /// Whether every layer is full (one group, the plain paged layout).
    pub fn all_full(&self) -> bool {
        self.groups.len() == 1 && self.groups[0].kind == LayerKind::Full
    }

    /// The most blocks one sequence holds while it grows to `seq_len` positions in
    /// forward passes of at most `max_chunk` new tokens each (`block_size` positions per
    /// block). A pass of `q` tokens at committed length `c` holds, in each table, the
    /// blocks from what the table keeps at `c` through position `c + q - 1`: every block
    /// for a full table; for a windowed one its window (a sliding table's `swa_memory`
    /// too) plus the pass, a whole prompt while it is prefilled. The answer is the
    /// largest sum over the tables at one `c`, with the longest pass from there: a
    /// sequence reaches it, and a pool of `n` times this many blocks runs `n` such
    /// sequences at once.
    pub fn blocks_per_sequence(
        &self,
        seq_len: usize,
        max_chunk: usize,
        block_size: usize,
    ) -> usize {
        let bs = block_size.max(1);
        let chunk = max_chunk.max(1);
        let kinds = [LayerKind::Full, LayerKind::Sliding, LayerKind::Chunked];
        let tables = kinds.map(|k| self.groups.iter().filter(|g| g.kind == k).count());
        (0..seq_len)
            .map(|c| {
                let end = (c + chunk).min(seq_len).div_ceil(bs);
                kinds
                    .iter()
                    .zip(tables)
                    .filter(|&(_, n)| n > 0)
                    .map(|(&k, n)| n * (end - self.attention.keep_from(k, c) / bs))
                    .sum()
            })
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn groups(kinds: &str) -> LayerGroups {
        let kinds = kinds
            .chars()
            .map(|c| match c {
                'f' => LayerKind::Full,
                's' => LayerKind::Sliding,
                _ => LayerKind::Chunked,
            })
            .collect();
        LayerGroups::new(Attention {
            kinds,
            sliding_window: Some(4),
            chunk_size: Some(8),
            swa_memory: 0,
        })
    }

    #[test]
    fn layers_split_into_equal_groups_by_kind() {
        let g = groups("sssssf");
        assert_eq!(g.per_block, 1);
        assert_eq!(g.groups.len(), 6);
        assert_eq!(g.group_of[5], 0);
        let g = groups("sfsfsfsf");
        assert_eq!(g.per_block, 4);
        assert_eq!(g.groups[1].layers, vec![0, 2, 4, 6]);
        assert_eq!((g.group_of[4], g.tensor_of[4]), (1, 2));
        let g = groups("ffff");
        assert!(g.all_full());
        assert_eq!(g.per_block, 4);
        assert_eq!(groups("ssffss").per_block, 2);
    }

    #[test]
    fn windows_and_chunks_follow_hugging_face() {
        let a = groups("fsc").attention;
        // Window 4: position 10 sees 7, 8, 9, 10.
        assert_eq!(a.first_visible(LayerKind::Sliding, 10), 7);
        assert_eq!(a.first_visible(LayerKind::Sliding, 2), 0);
        // Chunks of 8: position 10 sees 8, 9, 10.
        assert_eq!(a.first_visible(LayerKind::Chunked, 10), 8);
        assert_eq!(a.first_visible(LayerKind::Full, 10), 0);
        let mut a = a;
        a.swa_memory = 5;
        assert_eq!(a.keep_from(LayerKind::Sliding, 10), 2);
    }

    #[test]
    fn a_sequence_needs_each_table_s_blocks() {
        // Window 4, blocks of 4: decode holds the window's block plus a block; a pass of
        // 12 tokens spans the 3 positions it sees before it and itself (5 blocks at most).
        let g = groups("sf");
        assert_eq!(g.blocks_per_sequence(64, 1, 4), 16 + 2);
        assert_eq!(g.blocks_per_sequence(64, 12, 4), 16 + 5);
        assert_eq!(g.blocks_per_sequence(64, 64, 4), 16 + 16);
        // 5 sliding : 1 full is 6 tables; chunks of 8 hold their chunk and the pass.
        assert_eq!(groups("sssssf").blocks_per_sequence(30, 30, 16), 6 * 2);
        assert_eq!(groups("sssssf").blocks_per_sequence(128, 1, 16), 8 + 5 * 2);
        assert_eq!(groups("c").blocks_per_sequence(64, 1, 4), 2);
        assert_eq!(groups("ffff").blocks_per_sequence(0, 1, 4), 0);
    }
}
