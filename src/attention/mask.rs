//! Custom attention masks in FlashInfer's packed form: a bit per (query token, key
//! position), True = may attend, combined (AND) with each row's causal and window range.

/// A custom mask over a call's query rows, bit-packed as FlashInfer packs it
/// (`flashinfer/prefill.py`, `BatchPrefillWithPagedKVCacheWrapper.plan`, which calls
/// `segment_packbits(custom_mask, mask_indptr, bitorder="little")` from
/// `flashinfer/quantization/packbits.py`): bit `i` is `(bits[i / 8] >> (i % 8)) & 1`.
///
/// Query token `t` (its index along the query tensor's first dimension) sees key
/// position `p` only when bit `row_bit[t] + p` is set. Bits past the end of `bits`, and
/// tokens past the end of `row_bit`, read as masked.
#[derive(Clone, Copy, Debug)]
pub struct CustomMask<'a> {
    /// The packed bits, little bit order within each byte.
    pub bits: &'a [u8],
    /// For each query token, the bit of its row's key position 0.
    pub row_bit: &'a [usize],
}

impl CustomMask<'_> {
    /// Whether query token `token` may attend to key position `pos`.
    #[inline(always)]
    pub fn allows(&self, token: usize, pos: usize) -> bool {
        let Some(&first) = self.row_bit.get(token) else {
            return false;
        };
        let i = first + pos;
        self.bits
            .get(i / 8)
            .is_some_and(|&b| (b >> (i % 8)) & 1 == 1)
    }
}

/// Packs a boolean mask as [`CustomMask`] reads it: each segment `flat[a..b]` (given
/// by `indptr`, FlashInfer's `mask_indptr`) is packed alone, little bit order, and padded
/// to whole bytes (`segment_packbits(flat, indptr, bitorder="little")`). Returns the
/// packed bytes and each segment's first byte (then the total).
pub fn segment_packbits(flat: &[bool], indptr: &[usize]) -> (Vec<u8>, Vec<usize>) {
    let mut bytes = Vec::new();
    let mut starts = Vec::with_capacity(indptr.len());
    starts.push(0);
    for w in indptr.windows(2) {
        let seg = &flat[w[0]..w[1]];
        for chunk in seg.chunks(8) {
            let byte = chunk
                .iter()
                .enumerate()
                .fold(0u8, |acc, (j, &b)| acc | (u8::from(b) << j));
            bytes.push(byte);
        }
        starts.push(bytes.len());
    }
    (bytes, starts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packs_each_segment_alone_little_endian() {
        // FlashInfer's docstring example, in little bit order.
        let x = [
            true, false, true, true, false, false, true, true, true, false, true,
        ];
        let (bytes, starts) = segment_packbits(&x, &[0, 4, 7, 11]);
        assert_eq!(bytes, vec![0b1101, 0b100, 0b1011]);
        assert_eq!(starts, vec![0, 1, 2, 3]);
        let m = CustomMask {
            bits: &bytes,
            row_bit: &[0, 8, 16],
        };
        assert!(m.allows(0, 0) && !m.allows(0, 1) && m.allows(0, 3));
        assert!(!m.allows(1, 0) && m.allows(1, 2));
        assert!(m.allows(2, 1) && !m.allows(2, 2) && m.allows(2, 3) && !m.allows(2, 9));
        assert!(!m.allows(3, 0));
    }
}
