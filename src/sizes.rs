//! Checked sizes: products of caller-given sizes that must stay within the address
//! space, and bookkeeping vectors allocated fallibly, so that a huge size is an error
//! (`ValueError` or `MemoryError` in Python) and never an abort or a panic.

use crate::dtype::DType;
use crate::error::{KvError, Result};

/// The product of `sizes`, each an argument's name and value (an empty name: a factor
/// that is no argument), for `what` (such as "the cache"). Fails, naming the largest
/// argument, when the product exceeds the address space (`isize::MAX`).
pub fn product(what: &str, sizes: &[(&'static str, usize)]) -> Result<usize> {
    sizes
        .iter()
        .try_fold(1usize, |acc, &(_, x)| acc.checked_mul(x))
        .filter(|&n| n <= isize::MAX as usize)
        .ok_or_else(|| too_large(what, sizes))
}

/// Bytes of `what` holding K and V for the product of `sizes` positions (or heads,
/// blocks, ...): a key of `dims[0]` and a value of `dims[1]` elements of `dtype` each,
/// int8 with a float32 scale per [`int8_scale_unit`] elements. Fails like [`product`]
/// past the address space.
pub fn kv_bytes(
    what: &str,
    sizes: &[(&'static str, usize)],
    dims: [usize; 2],
    dtype: DType,
) -> Result<usize> {
    let fail = || {
        let mut all = sizes.to_vec();
        all.push(("head_dim", dims[0]));
        if dims[1] != dims[0] {
            all.push(("v_head_dim", dims[1]));
        }
        too_large(&format!("{what}'s K and V of {dtype}"), &all)
    };
    let per_pair = kv_pair_bytes(dims, dtype).ok_or_else(fail)?;
    sizes
        .iter()
        .try_fold(per_pair, |acc, &(_, x)| acc.checked_mul(x))
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or_else(fail)
}

/// Bytes of one key of `dims[0]` and one value of `dims[1]` elements of `dtype`, int8's
/// float32 scales included (one per [`int8_scale_unit`] elements); `None` past `usize`.
pub fn kv_pair_bytes(dims: [usize; 2], dtype: DType) -> Option<usize> {
    let elems = dims[0].checked_add(dims[1])?;
    let scales = if dtype == DType::I8 {
        elems.checked_div(int8_scale_unit(dims))?.checked_mul(4)?
    } else {
        0
    };
    elems.checked_mul(dtype.size())?.checked_add(scales)
}

/// Elements per int8 scale for keys of `dims[0]` and values of `dims[1]` elements: their
/// greatest common divisor, so that every key and every value is a whole number of
/// scaled chunks and an element offset divided by the unit addresses its scale. For one
/// head size this is one scale per head vector; for an MLA latent (512 and 64) one per
/// 64 elements. 0 only when both sizes are 0.
pub fn int8_scale_unit(dims: [usize; 2]) -> usize {
    gcd(dims[0], dims[1])
}

/// The greatest common divisor of `a` and `b` (`gcd(a, 0) = a`).
pub fn gcd(mut a: usize, mut b: usize) -> usize {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// A vector of `n` copies of `value`, allocated fallibly: [`KvError::OutOfMemory`]
/// naming `what` when the allocator refuses.
pub fn filled<T: Clone>(what: &'static str, n: usize, value: T) -> Result<Vec<T>> {
    let mut v = with_capacity(what, n)?;
    v.resize(n, value);
    Ok(v)
}

/// An empty vector with room for exactly `n` elements, allocated fallibly:
/// [`KvError::OutOfMemory`] naming `what` when the allocator refuses.
pub fn with_capacity<T>(what: &'static str, n: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| KvError::OutOfMemory {
        what,
        bytes: n.saturating_mul(size_of::<T>()),
    })?;
    Ok(v)
}

/// The error of a product of `sizes` past the address space, naming the largest
/// argument.
fn too_large(what: &str, sizes: &[(&'static str, usize)]) -> KvError {
    let &(name, value) = sizes
        .iter()
        .filter(|(n, _)| !n.is_empty())
        .max_by_key(|(_, v)| *v)
        .unwrap_or(&("size", 0));
    let terms: Vec<String> = sizes
        .iter()
        .map(|(n, v)| {
            if n.is_empty() {
                v.to_string()
            } else {
                format!("{n}={v}")
            }
        })
        .collect();
    KvError::InvalidArgument {
        name,
        value: value.to_string(),
        reason: format!(
            "{what} ({}) would exceed the address space (at most {} bytes)",
            terms.join(" x "),
            isize::MAX
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn products_past_the_address_space_name_the_largest_argument() {
        assert_eq!(product("x", &[("a", 3), ("b", 4)]).unwrap(), 12);
        let e = product(
            "the pool",
            &[("num_blocks", 1 << 40), ("", 2), ("head_dim", 1 << 30)],
        )
        .unwrap_err()
        .to_string();
        assert!(e.starts_with("num_blocks=1099511627776: the pool"), "{e}");
        assert!(e.contains("(at most 9223372036854775807 bytes)"), "{e}");
        assert!(product("x", &[("a", usize::MAX)]).is_err());
    }

    #[test]
    fn kv_bytes_count_k_v_and_int8_scales() {
        let sizes = [("num_layers", 2), ("max_seq_len", 3)];
        assert_eq!(
            kv_bytes("c", &sizes, [4, 4], DType::F16).unwrap(),
            2 * 6 * 8
        );
        assert_eq!(kv_bytes("c", &sizes, [4, 4], DType::I8).unwrap(), 2 * 6 * 8);
        // Different head sizes: 6 x (12 + 4) elements; int8 keeps a scale per 4.
        assert_eq!(kv_bytes("c", &sizes, [12, 4], DType::F16).unwrap(), 6 * 32);
        assert_eq!(
            kv_bytes("c", &sizes, [12, 4], DType::I8).unwrap(),
            6 * (16 + 4 * 4)
        );
        // An MLA latent: 512 + 64 codes and 9 scales of 64 elements.
        assert_eq!(kv_pair_bytes([512, 64], DType::I8), Some(576 + 36));
        // head_dim * 4 overflows before any product.
        let e = kv_bytes("c", &[("num_kv_heads", 1)], [1 << 62, 1 << 62], DType::F32).unwrap_err();
        assert!(
            e.to_string().starts_with("head_dim=4611686018427387904"),
            "{e}"
        );
        assert!(kv_bytes("c", &[("num_blocks", 1 << 61)], [2, 2], DType::F32).is_err());
    }

    #[test]
    fn the_int8_scale_unit_divides_both_head_sizes() {
        assert_eq!(int8_scale_unit([128, 128]), 128);
        assert_eq!(int8_scale_unit([512, 64]), 64);
        assert_eq!(int8_scale_unit([192, 128]), 64);
        assert_eq!(int8_scale_unit([12, 8]), 4);
        assert_eq!(int8_scale_unit([7, 5]), 1);
    }

    #[test]
    fn refused_allocations_are_errors() {
        assert_eq!(filled("x", 3, 7u32).unwrap(), vec![7, 7, 7]);
        assert_eq!(
            filled("the refcounts", usize::MAX / 2, 0u32).unwrap_err(),
            KvError::OutOfMemory {
                what: "the refcounts",
                bytes: usize::MAX
            }
        );
        assert!(with_capacity::<u64>("x", 1 << 60).is_err());
    }
}
