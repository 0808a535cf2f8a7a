//! The encoder cache: position-independent keys and values of one encoder input
//! (cross-attention), written once per layer and read by every decode step.

use crate::attention::{AttnOptions, QueryRow};
use crate::dtype::DType;
use crate::error::{KvError, Result};
use crate::kv_cache::{CacheCore, CacheShape};
use crate::scales::KvScales;
use crate::storage::Device;
use crate::tensor::{TensorMut, TensorRef};

/// Cross-attention K/V for one encoder input: every layer holds the same number of
/// encoder positions, written once, until [`EncoderCache::clear`].
#[derive(Debug)]
pub struct EncoderCache {
    cache: CacheCore,
    length: Option<usize>,
}

impl EncoderCache {
    /// Preallocates room for `shape.max_seq_len` encoder positions in every layer.
    pub fn new(shape: CacheShape, dtype: DType, device: Device) -> Result<Self> {
        Ok(EncoderCache {
            cache: CacheCore::new(shape, dtype, device)?,
            length: None,
        })
    }

    /// Sets the fp8 scales (an fp8 dtype; unit scales for any other).
    pub fn with_scales(self, scales: KvScales) -> Result<Self> {
        Ok(EncoderCache {
            cache: self.cache.with_scales(scales)?,
            length: self.length,
        })
    }

    /// The underlying storage (same layout as a [`CacheCore`]).
    pub fn cache(&self) -> &CacheCore {
        &self.cache
    }

    /// Encoder positions, once the first layer was set.
    pub fn length(&self) -> Option<usize> {
        self.length
    }

    /// Whether `layer` holds its K/V (a validated layer index).
    pub fn is_set(&self, layer: usize) -> bool {
        self.cache.layer_len(layer) > 0
    }

    /// Writes `layer`'s K and V (`[n, heads, head_dim]`); every layer must get the same
    /// `n`, and a layer is written once until [`EncoderCache::clear`].
    pub fn set(&mut self, layer: i64, k: &TensorRef, v: &TensorRef) -> Result<()> {
        let l = self.cache.check_layer(layer)?;
        let n = k.shape().first().copied().unwrap_or(0);
        if let Some(len) = self.length {
            if n != len {
                return Err(KvError::Shape {
                    name: "k",
                    got: k.shape().to_vec(),
                    expected: format!(
                        "[{len}, ...]: every layer holds the same {len} encoder positions"
                    ),
                });
            }
        }
        if self.cache.layer_len(l) > 0 {
            return Err(KvError::InvalidArgument {
                name: "layer",
                value: l.to_string(),
                reason: "is already set; clear() the encoder cache before the next input".into(),
            });
        }
        if n == 0 {
            return Err(KvError::Shape {
                name: "k",
                got: k.shape().to_vec(),
                expected: "at least one encoder position".into(),
            });
        }
        self.cache.append(layer, k, v)?;
        self.length = Some(n);
        Ok(())
    }

    /// Cross-attention of `q` (`[n, num_q_heads, head_dim]`, any number of decoder
    /// tokens) over every encoder position of `layer` (no causal mask); writes `out`.
    pub fn attention(
        &self,
        layer: i64,
        q: &TensorRef,
        out: &mut TensorMut,
        opts: &AttnOptions<'_>,
    ) -> Result<()> {
        let l = self.cache.check_layer(layer)?;
        if !self.is_set(l) {
            return Err(KvError::InvalidArgument {
                name: "layer",
                value: l.to_string(),
                reason: "holds no encoder K/V yet; set() it first".into(),
            });
        }
        let len = self.cache.layer_len(l);
        let n = q.shape().first().copied().unwrap_or(0);
        let rows: Vec<QueryRow> = (0..n)
            .map(|token| QueryRow {
                token,
                pos: len,
                lo: 0,
                hi: len,
            })
            .collect();
        self.cache.attend_rows(l, q, out, &rows, opts)
    }

    /// Forgets the input; the memory stays allocated for the next one.
    pub fn clear(&mut self) {
        self.cache.clear();
        self.length = None;
    }
}
