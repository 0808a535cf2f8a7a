"""BLAKE3 in pure Python (hash, keyed hash, derive_key), after the specification's
reference implementation: enough for tests to sign and forge prefix-cache files without a
package. Slow (tens of microseconds per 64-byte block); meant for small files.
"""

from __future__ import annotations

import struct

_M = 0xFFFFFFFF
_IV = (0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A, 0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19)
_PERMUTATION = (2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8)
_CHUNK_START, _CHUNK_END, _PARENT, _ROOT = 1, 2, 4, 8
_KEYED_HASH, _DERIVE_KEY_CONTEXT, _DERIVE_KEY_MATERIAL = 16, 32, 64
_CHUNK, _BLOCK = 1024, 64


def _g(s: list[int], a: int, b: int, c: int, d: int, x: int, y: int) -> None:
    s[a] = (s[a] + s[b] + x) & _M
    t = s[d] ^ s[a]
    s[d] = ((t >> 16) | (t << 16)) & _M
    s[c] = (s[c] + s[d]) & _M
    t = s[b] ^ s[c]
    s[b] = ((t >> 12) | (t << 20)) & _M
    s[a] = (s[a] + s[b] + y) & _M
    t = s[d] ^ s[a]
    s[d] = ((t >> 8) | (t << 24)) & _M
    s[c] = (s[c] + s[d]) & _M
    t = s[b] ^ s[c]
    s[b] = ((t >> 7) | (t << 25)) & _M


def _compress(cv: tuple[int, ...], block: bytes, counter: int, block_len: int, flags: int) -> list[int]:
    m = list(struct.unpack("<16I", block.ljust(_BLOCK, b"\0")))
    s = [*cv[:8], *_IV[:4], counter & _M, (counter >> 32) & _M, block_len, flags]
    for r in range(7):
        _g(s, 0, 4, 8, 12, m[0], m[1])
        _g(s, 1, 5, 9, 13, m[2], m[3])
        _g(s, 2, 6, 10, 14, m[4], m[5])
        _g(s, 3, 7, 11, 15, m[6], m[7])
        _g(s, 0, 5, 10, 15, m[8], m[9])
        _g(s, 1, 6, 11, 12, m[10], m[11])
        _g(s, 2, 7, 8, 13, m[12], m[13])
        _g(s, 3, 4, 9, 14, m[14], m[15])
        if r < 6:
            m = [m[i] for i in _PERMUTATION]
    for i in range(8):
        s[i] ^= s[i + 8]
        s[i + 8] ^= cv[i]
    return s


# An output not yet compressed: (chaining value, block, counter, block length, flags).
_Output = tuple[tuple[int, ...], bytes, int, int, int]


def _chunk(key: tuple[int, ...], chunk: bytes, counter: int, flags: int) -> _Output:
    blocks = [chunk[i : i + _BLOCK] for i in range(0, len(chunk), _BLOCK)] or [b""]
    cv = key
    for j, block in enumerate(blocks[:-1]):
        start = _CHUNK_START if j == 0 else 0
        cv = tuple(_compress(cv, block, counter, _BLOCK, flags | start)[:8])
    start = _CHUNK_START if len(blocks) == 1 else 0
    return cv, blocks[-1], counter, len(blocks[-1]), flags | start | _CHUNK_END


def _cv(o: _Output) -> bytes:
    return struct.pack("<8I", *_compress(*o)[:8])


def _tree(key: tuple[int, ...], chunks: list[bytes], first: int, flags: int) -> _Output:
    if len(chunks) == 1:
        return _chunk(key, chunks[0], first, flags)
    left = 1 << ((len(chunks) - 1).bit_length() - 1)  # the largest power of two below
    lo = _tree(key, chunks[:left], first, flags)
    hi = _tree(key, chunks[left:], first + left, flags)
    return key, _cv(lo) + _cv(hi), 0, _BLOCK, flags | _PARENT


def _hash(data: bytes, key: tuple[int, ...], flags: int) -> bytes:
    chunks = [data[i : i + _CHUNK] for i in range(0, len(data), _CHUNK)] or [b""]
    cv, block, counter, block_len, fl = _tree(key, chunks, 0, flags)
    return struct.pack("<16I", *_compress(cv, block, counter, block_len, fl | _ROOT))[:32]


def blake3(data: bytes, key: bytes | None = None) -> bytes:
    """The 32-byte BLAKE3 hash of `data`, keyed with the 32-byte `key` if given."""
    if key is None:
        return _hash(data, _IV, 0)
    return _hash(data, struct.unpack("<8I", key), _KEYED_HASH)


def derive_key(context: str, material: bytes) -> bytes:
    """BLAKE3's key derivation: a 32-byte key for `context` from `material`."""
    context_key = _hash(context.encode(), _IV, _DERIVE_KEY_CONTEXT)
    return _hash(material, struct.unpack("<8I", context_key), _DERIVE_KEY_MATERIAL)
