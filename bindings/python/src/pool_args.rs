//! The arguments of `kvrs.BlockPool(...)` that need more than a type: layer kinds, the
//! pool's size from `num_blocks` or `memory_bytes`, and prefix caching with its seed;
//! and the namespace, extra key and token ids of its prefix queries.

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use super::input::read_token_ids;

use super::errors::ToPython;
use kvrs::unstable::{check_count, check_size, parse_size, sizes};
use kvrs::{Attention, DType, HashKind, KvError, LayerKind, PagedShape, PrefixConfig};

/// Each layer's kind from `layer_types` (default: all full attention) with the window,
/// chunk and extra memory of windowed layers, validated for `num_layers` layers.
pub fn attention(
    num_layers: usize,
    layer_types: Option<Vec<String>>,
    sliding_window: Option<i64>,
    chunk_size: Option<i64>,
    swa_memory: i64,
) -> PyResult<Attention> {
    let attention = Attention {
        kinds: match layer_types {
            None => vec![LayerKind::Full; num_layers],
            Some(names) => names
                .iter()
                .map(|n| n.parse::<LayerKind>())
                .collect::<Result<_, _>>()
                .py()?,
        },
        sliding_window: sliding_window
            .map(|w| check_size("sliding_window", w))
            .transpose()
            .py()?,
        chunk_size: chunk_size
            .map(|c| check_size("chunk_size", c))
            .transpose()
            .py()?,
        swa_memory: check_count("swa_memory", swa_memory).py()?,
    };
    attention.validate(num_layers).py()?;
    Ok(attention)
}

/// Bytes of one block id of a pool of `shape` and `dtype` with `tensors` cache tensors (a
/// block of each layer of a group, K and V); fails past the address space.
pub fn block_bytes(tensors: usize, shape: &PagedShape, dtype: DType) -> PyResult<usize> {
    sizes::kv_bytes(
        "one block",
        &[
            ("", tensors),
            ("block_size", shape.block_size),
            ("num_kv_heads", shape.num_kv_heads),
        ],
        [shape.head_dim, shape.v_head_dim],
        dtype,
    )
    .py()
}

/// The number of blocks: exactly one of `num_blocks` and `memory_bytes` (an int or a size
/// such as `"4GiB"`, divided by `per_block` bytes) must be given.
pub fn num_blocks(
    num_blocks: Option<i64>,
    memory_bytes: Option<&Bound<'_, PyAny>>,
    per_block: usize,
    reserved: usize,
) -> PyResult<usize> {
    match (num_blocks, memory_bytes) {
        (Some(n), None) => Ok(check_size("num_blocks", n).py()?),
        (None, Some(m)) => {
            let bytes = match m.extract::<i64>() {
                Ok(b) if b >= 0 => b as usize,
                Ok(b) => {
                    return Err(KvError::InvalidArgument {
                        name: "memory_bytes",
                        value: b.to_string(),
                        reason: "must be >= 0".into(),
                    }
                    .py())
                }
                Err(_) => parse_size(&m.str()?.to_string()).py()?,
            };
            if bytes < reserved.saturating_add(per_block) {
                let states = if reserved > 0 {
                    format!(" after the {reserved} bytes of the state slots")
                } else {
                    String::new()
                };
                return Err(KvError::InvalidArgument {
                    name: "memory_bytes",
                    value: bytes.to_string(),
                    reason: format!(
                        "holds no block{states}: one block id (a block of each layer of a group) takes {per_block} bytes"
                    ),
                }
                .py());
            }
            Ok((bytes - reserved) / per_block)
        }
        _ => Err(KvError::InvalidArgument {
            name: "num_blocks",
            value: num_blocks.map_or("None".into(), |n| n.to_string()),
            reason: "give exactly one of num_blocks and memory_bytes".into(),
        }
        .py()),
    }
}

/// Prefix caching's configuration when `on`: the hash kind, the chains' seed (from the
/// OS when not given) and the options.
pub fn prefix(
    on: bool,
    hash: &str,
    seed: Option<u128>,
    partial_hits: bool,
    events: bool,
) -> PyResult<Option<PrefixConfig>> {
    let hash: HashKind = hash.parse().py()?;
    if !on {
        return Ok(None);
    }
    let seed = match seed {
        Some(s) => s,
        None => {
            let mut b = [0u8; 16];
            getrandom::fill(&mut b)
                .map_err(|e| KvError::Device(format!("no OS randomness for the hash seed: {e}")))
                .py()?;
            u128::from_le_bytes(b)
        }
    };
    Ok(Some(PrefixConfig {
        hash,
        seed,
        partial_hits,
        events,
    }))
}

/// Reads `seed=`: an int in [0, 2**128) or the same as a hex string (`pool.seed`
/// printed with `f"{seed:x}"`, `0x` prefix optional).
pub fn parse_seed(obj: &Bound<'_, PyAny>) -> PyResult<u128> {
    let bad = |value: String| KvError::InvalidArgument {
        name: "seed",
        value,
        reason: "must be an int in [0, 2**128) or its hex string (up to 32 hex digits), \
                 such as another pool's `pool.seed`"
            .into(),
    };
    if let Ok(s) = obj.cast::<pyo3::types::PyString>() {
        let text = s.to_str()?.trim();
        let digits = text
            .strip_prefix("0x")
            .or_else(|| text.strip_prefix("0X"))
            .unwrap_or(text);
        let ok = !digits.is_empty()
            && digits.len() <= 32
            && digits.bytes().all(|b| b.is_ascii_hexdigit());
        return ok
            .then(|| u128::from_str_radix(digits, 16).ok())
            .flatten()
            .ok_or_else(|| bad(format!("{text:?}")).py());
    }
    let integer = !obj.is_instance_of::<pyo3::types::PyBool>()
        && obj.hasattr(pyo3::intern!(obj.py(), "__index__"))?;
    if !integer {
        return Err(PyTypeError::new_err(format!(
            "seed must be an int or a hex string, not {}",
            obj.get_type().name()?
        )));
    }
    // Any integer type (`int`, `numpy.int64`) through `__index__`.
    obj.extract::<u128>().map_err(|_| bad(obj.to_string()).py())
}

/// Reads a namespace or extra key: None, str (as UTF-8) or bytes.
pub fn key_bytes(obj: Option<&Bound<'_, PyAny>>, name: &'static str) -> PyResult<Vec<u8>> {
    match obj {
        None => Ok(Vec::new()),
        Some(o) if o.is_none() => Ok(Vec::new()),
        Some(o) => {
            if let Ok(s) = o.extract::<String>() {
                Ok(s.into_bytes())
            } else if let Ok(b) = o.extract::<Vec<u8>>() {
                Ok(b)
            } else {
                Err(PyTypeError::new_err(format!("{name} must be str or bytes")))
            }
        }
    }
}

/// The `(tokens, namespace=None, extra_key=None)` of a prefix query: the token ids and
/// the key bytes.
pub fn prefix_args(
    tokens: &Bound<'_, PyAny>,
    namespace: Option<&Bound<'_, PyAny>>,
    extra_key: Option<&Bound<'_, PyAny>>,
) -> PyResult<(Vec<u32>, Vec<u8>, Vec<u8>)> {
    Ok((
        read_token_ids(tokens, "tokens")?,
        key_bytes(namespace, "namespace")?,
        key_bytes(extra_key, "extra_key")?,
    ))
}
