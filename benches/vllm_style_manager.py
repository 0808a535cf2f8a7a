"""A minimal pure-Python block manager written the way vLLM v1 writes its own
(vllm/v1/core/kv_cache_utils.py and block_pool.py): blocks with reference counts, a doubly
linked free-block queue with fake head and tail, per-request block lists, and
`allocate_slots` that grows a request's list by whole blocks. It is the peer kvrs's
scheduling step is measured against in benches/bench_paged.py; written here from the
published design, not copied.
"""

from __future__ import annotations

import numpy as np


class KVCacheBlock:
    """One block: id, reference count and links in the free queue."""

    __slots__ = ("block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) popleft, append and remove."""

    def __init__(self, blocks: list[KVCacheBlock]):
        self.num_free = len(blocks)
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        prev = self.head
        for b in blocks:
            prev.next_free, b.prev_free = b, prev
            prev = b
        prev.next_free, self.tail.prev_free = self.tail, prev

    def popleft(self) -> KVCacheBlock:
        b = self.head.next_free
        if b is self.tail or b is None:
            raise ValueError("no free blocks")
        self.head.next_free, b.next_free.prev_free = b.next_free, self.head
        b.prev_free = b.next_free = None
        self.num_free -= 1
        return b

    def append(self, b: KVCacheBlock) -> None:
        last = self.tail.prev_free
        last.next_free, b.prev_free = b, last
        b.next_free, self.tail.prev_free = self.tail, b
        self.num_free += 1


class BlockManager:
    """Per-request block lists over one pool of blocks."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.req_to_blocks: dict[int, list[KVCacheBlock]] = {}
        self.num_tokens: dict[int, int] = {}

    def add_request(self, req_id: int) -> None:
        self.req_to_blocks[req_id] = []
        self.num_tokens[req_id] = 0

    def allocate_slots(self, req_id: int, num_new_tokens: int) -> bool:
        """Grows the request's block list to hold num_new_tokens more; False if the pool is full."""
        blocks = self.req_to_blocks[req_id]
        total = self.num_tokens[req_id] + num_new_tokens
        needed = -(-total // self.block_size) - len(blocks)
        if needed > self.free_queue.num_free:
            return False
        for _ in range(needed):
            b = self.free_queue.popleft()
            b.ref_cnt += 1
            blocks.append(b)
        self.num_tokens[req_id] = total
        return True

    def free(self, req_id: int) -> None:
        for b in reversed(self.req_to_blocks.pop(req_id)):
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue.append(b)
        del self.num_tokens[req_id]

    def schedule_decode(self, req_ids: list[int]):
        """One decode step: a slot for one new token per request, then the slot mapping and
        FlashInfer's page table as NumPy int arrays."""
        bs = self.block_size
        slots = []
        indices: list[int] = []
        indptr = [0]
        last = []
        for r in req_ids:
            if not self.allocate_slots(r, 1):
                raise MemoryError("pool full")
            blocks = self.req_to_blocks[r]
            pos = self.num_tokens[r] - 1
            slots.append(blocks[pos // bs].block_id * bs + pos % bs)
            indices.extend(b.block_id for b in blocks)
            indptr.append(len(indices))
            last.append((self.num_tokens[r] - 1) % bs + 1)
        return (
            np.array(slots, np.int64),
            np.array(indptr, np.int32),
            np.array(indices, np.int32),
            np.array(last, np.int32),
        )
