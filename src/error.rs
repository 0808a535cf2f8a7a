//! The one error type of the core. Every message names the argument, its value and the limit.

use thiserror::Error;

/// Everything that can go wrong in the core. Python maps each kind to the exception
/// a Python user expects (see the bindings crate's
/// `bindings/python/src/errors.rs`).
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum KvError {
    /// Writing would go past the cache's capacity (Python: `kvrs.CacheFullError`).
    #[error(
        "cache full: {what} needs {needed} more {unit} but {free} of {capacity} {unit} are free"
    )]
    CacheFull {
        /// What was being written.
        what: String,
        /// Units the write needs beyond what is held.
        needed: usize,
        /// Units free now.
        free: usize,
        /// Units the cache (or pool) holds in all.
        capacity: usize,
        /// What is counted: a cache's positions or a pool's blocks.
        unit: Unit,
    },
    /// An index (layer, head, position) outside its range (Python: `IndexError`).
    #[error("{name}={value} is out of range: must be in [0, {limit})")]
    OutOfRange {
        /// The argument's name.
        name: &'static str,
        /// The value given.
        value: i64,
        /// The exclusive upper bound.
        limit: usize,
    },
    /// A tensor of the wrong rank or shape (Python: `ValueError`).
    #[error("{name} has shape {got:?}, expected {expected}")]
    Shape {
        /// The argument's name.
        name: &'static str,
        /// The shape given.
        got: Vec<usize>,
        /// The expected shape, in words.
        expected: String,
    },
    /// A tensor whose element type kvrs does not store (Python: `TypeError`).
    #[error("{name} has dtype {got}, expected one of float32, float16, bfloat16")]
    UnsupportedDType {
        /// The argument's name.
        name: &'static str,
        /// The dtype given.
        got: String,
    },
    /// A dtype name kvrs does not know (Python: `ValueError`).
    #[error("dtype='{0}' is not supported: use 'float32', 'float16', 'bfloat16', or for storage 'fp8_e4m3', 'fp8_e5m2', 'int8'")]
    UnknownDType(String),
    /// Any other invalid argument value (Python: `ValueError`).
    #[error("{name}={value}: {reason}")]
    InvalidArgument {
        /// The argument's name.
        name: &'static str,
        /// The value given, as text.
        value: String,
        /// Why it is invalid, with the limit.
        reason: String,
    },
    /// The operation is valid but not available (yet) in this configuration
    /// (Python: `kvrs.NotSupportedError`).
    #[error("not supported: {0}")]
    NotSupported(String),
    /// A file that cannot be read or written (Python: `OSError`).
    #[error("{path}: {reason}")]
    Io {
        /// The file.
        path: String,
        /// What went wrong.
        reason: String,
    },
    /// A saved cache that is truncated, corrupted or made for another pool (Python: `ValueError`).
    #[error("{path}: {reason}; nothing was loaded")]
    BadFile {
        /// The file.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The host refused an allocation (Python: `MemoryError`).
    #[error("cannot allocate {bytes} bytes for {what}")]
    OutOfMemory {
        /// What was being allocated.
        what: &'static str,
        /// Bytes asked for.
        bytes: usize,
    },
    /// A device that is unknown or unavailable (Python: `kvrs.DeviceError`).
    #[error("device error: {0}")]
    Device(String),
}

/// Result alias of the core.
pub type Result<T, E = KvError> = std::result::Result<T, E>;

/// Checks `0 <= value < limit` and returns the value as an index.
pub fn check_index(name: &'static str, value: i64, limit: usize) -> Result<usize> {
    if value < 0 || value as u64 >= limit as u64 {
        return Err(KvError::OutOfRange { name, value, limit });
    }
    Ok(value as usize)
}

/// What a [`KvError::CacheFull`] counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    /// Positions of a contiguous cache.
    Positions,
    /// Blocks of a pool.
    Blocks,
    /// Recurrent-state slots of a pool (one per sequence of a hybrid model).
    StateSlots,
}

impl std::fmt::Display for Unit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Unit::Positions => "positions",
            Unit::Blocks => "blocks",
            Unit::StateSlots => "state slots",
        })
    }
}

/// Checks that a tensor of token vectors has `shape` `[n_tokens, heads, head_dim]` and
/// returns `n_tokens`. The error names the expected axes, and for a head-major `[heads,
/// n_tokens, head_dim]` shape says which transpose to use. A shape with `n_tokens ==
/// heads` is read as documented (token-major): it cannot be told apart.
pub fn check_tokens(
    name: &'static str,
    shape: &[usize],
    heads: usize,
    head_dim: usize,
) -> Result<usize> {
    if let [n, h, d] = *shape {
        if h == heads && d == head_dim {
            return Ok(n);
        }
    }
    let head_major = matches!(*shape, [h, n, d] if h == heads && d == head_dim && n != heads);
    // A middle axis that is a multiple of the KV heads may also be the query heads (keys
    // repeated for GQA): then transposing would be wrong, so the hint says both.
    let repeated = matches!(*shape, [_, n, _] if n > heads && n % heads == 0);
    let hint = match (head_major, repeated) {
        (true, false) => format!(
            "; {name} looks head-major [num_kv_heads, n_tokens, head_dim]: pass \
             {name}.transpose(0, 1) (NumPy: {name}.swapaxes(0, 1))"
        ),
        (true, true) => format!(
            "; if {name} is head-major [num_kv_heads, n_tokens, head_dim], pass \
             {name}.transpose(0, 1) (NumPy: {name}.swapaxes(0, 1)); if it holds one vector per \
             query head (keys repeated for GQA), pass the {heads} KV heads before repeating"
        ),
        _ => String::new(),
    };
    Err(KvError::Shape {
        name,
        got: shape.to_vec(),
        expected: format!(
            "[n_tokens, num_kv_heads={heads}, {}={head_dim}]{hint}",
            if name.starts_with('v') {
                "v_head_dim"
            } else {
                "head_dim"
            }
        ),
    })
}

/// Checks `value >= 0` and returns it as a count.
pub fn check_count(name: &'static str, value: i64) -> Result<usize> {
    usize::try_from(value).map_err(|_| KvError::InvalidArgument {
        name,
        value: value.to_string(),
        reason: "must be >= 0".into(),
    })
}

/// Checks `value >= 1` and returns it as a size.
pub fn check_size(name: &'static str, value: i64) -> Result<usize> {
    match usize::try_from(value) {
        Ok(v) if v >= 1 => Ok(v),
        _ => Err(KvError::InvalidArgument {
            name,
            value: value.to_string(),
            reason: "must be >= 1".into(),
        }),
    }
}

/// Checks that every named size is at least 1.
pub fn check_positive(sizes: &[(&'static str, usize)]) -> Result<()> {
    match sizes.iter().find(|(_, v)| *v == 0) {
        Some(&(name, _)) => Err(KvError::InvalidArgument {
            name,
            value: "0".into(),
            reason: "must be >= 1".into(),
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_argument_value_and_limit() {
        let e = check_index("layer", 7, 4).unwrap_err();
        assert_eq!(e.to_string(), "layer=7 is out of range: must be in [0, 4)");
        assert!(check_index("head", -1, 4).is_err());
        assert_eq!(check_index("pos", 3, 4).unwrap(), 3);
        assert_eq!(
            check_count("n", -2).unwrap_err().to_string(),
            "n=-2: must be >= 0"
        );
    }
}
