"""Token trees for speculative [`generate_batch`][kvrs.integrations.transformers.generate_batch]:
several candidate continuations of a request (the n-gram or suffix matches it has) merged
into one tree of draft tokens and verified in one forward.

A tree's nodes are placed after the request's last committed token in node order
(parents before children), each in a slot of its own; a node's rotary position is its
depth, and the attention mask lets it see the committed prefix, its ancestors and
itself, not its siblings (`ForwardBatch.attention(custom_mask=...)`). Verification walks
down from the root: the target's token at a node (its argmax, or a draw from its
probabilities with the request's generator) moves to the child holding that token, and
the first token no child holds ends the step. That is exactly the token plain decoding
gives at each step (one draw per output token, in order, as without drafts), so greedy
outputs are identical and seeded sampling reproduces itself. The accepted path is then
moved to the front of the drafts' slots (`Sequence.accept`) and committed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvrs.integrations._torch import torch

__all__ = ["DraftTree", "causal_mask", "tree_accept", "tree_mask"]


@dataclass
class DraftTree:
    """Draft tokens as a tree under the last committed token (the root, not a node).

    Invariant: ``parents[j] < j`` (parents before children; -1 is the root), and no two
    children of one parent hold the same token."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    children: dict[tuple[int, int], int] = field(default_factory=dict)
    first: int = 0
    """Nodes ``0..first-1`` are the first candidate (the chain draft); the rest branch off."""

    @classmethod
    def merge(cls, candidates: Sequence[Sequence[int]], max_nodes: int) -> DraftTree:
        """The trie of `candidates` (shared prefixes shared), nodes in the order the
        candidates first reach them, at most `max_nodes` of them: the first candidate
        is nodes ``0..len-1``, a chain, so one candidate is the chain draft itself."""
        tree = cls()
        for cand in candidates:
            at = -1
            for t in cand:
                node = tree.children.get((at, int(t)))
                if node is None:
                    if len(tree.tokens) >= max_nodes:
                        break
                    node = len(tree.tokens)
                    tree.tokens.append(int(t))
                    tree.parents.append(at)
                    tree.children[(at, int(t))] = node
                at = node
            if not tree.first:
                tree.first = len(tree.tokens)
        return tree

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        """Whether every node is its predecessor's only child (a plain draft list)."""
        return all(p == j - 1 for j, p in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Each node's depth (a child of the root has depth 1)."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def path(self, j: int) -> list[int]:
        """Node `j` and its ancestors, root side first."""
        out = []
        while j >= 0:
            out.append(j)
            j = self.parents[j]
        return out[::-1]

    def follow(self, tokens: Sequence[int]) -> list[int]:
        """The nodes `tokens` lead through from the root (stopping where none holds one)."""
        at, nodes = -1, []
        for t in tokens:
            child = self.children.get((at, int(t)))
            if child is None:
                break
            nodes.append(child)
            at = child
        return nodes

    def path_tokens(self, j: int) -> list[int]:
        """The tokens from the root down to node `j` (inclusive); [] for the root (-1)."""
        return [self.tokens[i] for i in self.path(j)] if j >= 0 else []


def tree_accept(
    rows: torch.Tensor, tree: DraftTree, sampling: bool, generator: torch.Generator | None = None
) -> tuple[list[int], list[int]]:
    """Verification of `tree`: `rows` [1 + len(tree), vocab] are the target's logits
    (greedy) or sampling probabilities (`sampling`) at the root and after each node. From
    the root, the target's token (argmax, or one draw with `generator`) moves to the
    child holding it; the first token no child holds is the target's own and ends the
    step. Returns (the new tokens: accepted nodes' then the target's, the accepted nodes)."""
    best = None if sampling else rows.argmax(-1).tolist()
    at = -1
    nodes: list[int] = []
    out: list[int] = []
    while True:
        row = at + 1
        if best is not None:
            token = int(best[row])
        else:
            token = int(torch.multinomial(rows[row], 1, generator=generator))
        out.append(token)
        child = tree.children.get((at, token))
        if child is None:
            return out, nodes
        nodes.append(child)
        at = child


def tree_mask(prefix: int, todo: int, tree: DraftTree) -> np.ndarray:
    """One sequence's ``[q_len, kv_len]`` attention mask (True = may attend) for a batch
    that places `todo` tokens then `tree`'s nodes after `prefix` committed positions:
    the todo tokens causally, each node the prefix, every todo token, its ancestors and
    itself."""
    n = len(tree)
    q, kv = todo + n, prefix + todo + n
    m = np.zeros((q, kv), dtype=bool)
    m[:, :prefix] = True
    m[:todo, prefix : prefix + todo] = np.tril(np.ones((todo, todo), dtype=bool))
    m[todo:, prefix : prefix + todo] = True
    for j in range(n):
        for a in tree.path(j):
            m[todo + j, prefix + todo + a] = True
    return m


def causal_mask(prefix: int, q: int) -> np.ndarray:
    """The ``[q, prefix + q]`` causal mask of `q` tokens after `prefix` positions."""
    m = np.ones((q, prefix + q), dtype=bool)
    m[:, prefix:] = np.tril(np.ones((q, q), dtype=bool))
    return m
