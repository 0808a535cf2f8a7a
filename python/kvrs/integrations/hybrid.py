"""Hybrid models (Qwen3-Next's gated delta-net, Bamba's and Granite 4's Mamba-2 layers)
over kvrs: their attention layers keep K/V in a pool's blocks, their linear layers a
fixed-size recurrent state (a convolution window and an SSM / delta-rule matrix) in the
pool's state slots, one per sequence (see ``BlockPool(state_layers=...)``).

`kvrs.integrations.layout.layer_plan` reads a config into the pool's two kinds
of layers; this module updates the states: the cache classes
([`kvrs.integrations.transformers`][kvrs.integrations.transformers]) and
[`forward_batch`][kvrs.integrations.transformers.forward_batch]
(`kvrs.integrations.paged_attention`) use it. The state is updated exactly as
transformers' own ``LinearAttentionLayer`` updates it, but in kvrs's memory: the model's
kernels read and write the slot views in place.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import kvrs
from kvrs.integrations._torch import as_torch, torch

__all__ = ["MixerRecorder", "check_state", "conv_window", "is_linear_mixer", "wrap_mixer"]


def conv_window(view: torch.Tensor, new: torch.Tensor, has_previous: bool, kernel: int) -> torch.Tensor:
    """transformers' ``LinearAttentionLayer.update_conv_state`` over kvrs memory: the
    window the causal convolution sees (the cached window, then `new`; or `new` padded to
    the kernel on a first call), whose last `kernel` columns are stored in `view`."""
    if has_previous:
        full = torch.cat([view.to(new.dtype), new], dim=-1)
    else:
        full = new
        if full.shape[-1] < kernel:
            full = torch.nn.functional.pad(full, (kernel - full.shape[-1], 0), value=0)
    view.copy_(full[..., -kernel:])
    return full


def check_state(name: str, view: torch.Tensor, got: torch.Tensor, layer: int) -> None:
    """The model's state must have the pool's shape per row (the config's): all of it for
    the recurrent state, the channels for the convolution's new inputs (any length)."""
    dims = 1 if name == "conv" else view.ndim - 1
    if tuple(got.shape[1 : 1 + dims]) != tuple(view.shape[1 : 1 + dims]) or got.ndim != view.ndim:
        raise ValueError(
            f"layer {layer}'s {name} state has shape {tuple(got.shape)}; the pool holds "
            f"{tuple(view.shape)} per batch: the pool was made for another config"
        )


class _SequenceStates:
    """A cache-like object over one sequence's state slot: what a linear layer's own
    forward calls (``get_conv_state``, ``update_conv_state``, ...) when
    [`forward_batch`][kvrs.integrations.transformers.forward_batch] runs it on that sequence's tokens."""

    def __init__(self, seq: kvrs.Sequence, state_layer: int, layer_idx: int, has_previous: bool):
        views = seq.state(state_layer)
        self.conv = as_torch(views["conv"])[None]
        self.recurrent = as_torch(views["recurrent"])[None]
        self.layer_idx = layer_idx
        self.previous = has_previous

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.conv if self.previous else None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.recurrent if self.previous else None

    def update_conv_state(
        self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        check_state("conv", self.conv, conv_states, layer_idx)
        return conv_window(self.conv, conv_states, self.previous, self.conv.shape[-1])

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        check_state("recurrent", self.recurrent, recurrent_states, layer_idx)
        self.recurrent.copy_(recurrent_states)
        return self.recurrent

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self.previous


@dataclass
class _Chunk:
    """One linear layer's call on one sequence's tokens in a recorded forward."""

    own: Any  # the mixer's own forward
    state_layer: int
    layer: int
    hidden: torch.Tensor  # [1, tokens, d]: the layer's input for those tokens
    kwargs: dict[str, Any]
    has_previous: bool


class MixerRecorder:
    """Records, while `recording`, each linear layer's input for each sequence of
    the ForwardBatches run (the hidden states its mixer saw), so that a rollback can
    advance a restored state over a prefix of those tokens (`replay`) without
    running the model again: a state layer's new state depends only on its old state
    and its inputs, which the forward already computed."""

    def __init__(self, slots: set[int] | None = None) -> None:
        self.slots = slots  # the state slots of the sequences to record (None: all)
        self.chunks: dict[int, dict[int, list[_Chunk]]] = {}  # slot -> state layer -> chunks

    @contextmanager
    def recording(self) -> Iterator[MixerRecorder]:
        token = _RECORDER.set(self)
        try:
            yield self
        finally:
            _RECORDER.reset(token)

    def add(self, seq: kvrs.Sequence, chunk: _Chunk) -> None:
        slot = seq.state_slot
        if slot is not None and (self.slots is None or slot in self.slots):
            self.chunks.setdefault(int(slot), {}).setdefault(chunk.state_layer, []).append(chunk)

    def replay(self, seq: kvrs.Sequence, m: int) -> None:
        """Runs each linear layer of `seq`'s recorded tokens over the first `m` of them,
        from the state in its slot now (the one before the recorded forwards)."""
        if m <= 0:
            return
        for chunks in self.chunks.get(int(seq.state_slot or 0), {}).values():
            first = chunks[0]
            hidden = torch.cat([c.hidden for c in chunks], dim=1)[:, :m]
            states = _SequenceStates(seq, first.state_layer, first.layer, first.has_previous)
            first.own(hidden, cache_params=states, attention_mask=None, **first.kwargs)


_RECORDER: contextvars.ContextVar[MixerRecorder | None] = contextvars.ContextVar(
    "kvrs_mixer_recorder", default=None
)


def is_linear_mixer(module: torch.nn.Module) -> bool:
    """Whether `module` is a linear-attention or Mamba mixer (a causal convolution and a
    layer index: the modules that call ``get_conv_state``)."""
    return hasattr(module, "conv1d") and hasattr(module, "layer_idx") and hasattr(module, "conv_kernel_size")


def wrap_mixer(module: torch.nn.Module, state_layer: int) -> None:
    """Makes `module` (a linear mixer) run each sequence of a kvrs ForwardBatch on its own
    tokens and state slot; any other call runs its own forward unchanged."""
    if getattr(module, "_kvrs_state_layer", None) is not None:
        module._kvrs_state_layer = state_layer  # type: ignore[assignment]
        return
    own = module.forward
    module._kvrs_state_layer = state_layer  # type: ignore[assignment]

    def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        batch = kwargs.pop("kvrs_batch", None)
        if batch is None:
            # A kvrs cache that may be cropped keeps the layer's inputs to replay.
            record = getattr(kwargs.get("cache_params"), "record_mixer", None)
            if record is not None:
                record(module, own, hidden_states, args, kwargs)
            return own(hidden_states, *args, **kwargs)
        return _batch_forward(own, module, hidden_states, batch, kwargs)

    module.forward = forward  # type: ignore[method-assign]  # an instance attribute, per module


def _batch_forward(
    own: Any, module: torch.nn.Module, hidden: torch.Tensor, batch: kvrs.ForwardBatch, kwargs: dict[str, Any]
) -> torch.Tensor:
    """`module`'s own forward over each sequence of `batch` in turn (hidden [1, tokens,
    d], the batch's tokens in order), each against its state slot: a sequence whose
    first token sits at position 0 starts from no state, any other continues its slot."""
    kwargs = {k: v for k, v in kwargs.items() if k not in ("cache_params", "attention_mask")}
    bounds = batch.qo_indptr.tolist()
    positions = batch.positions
    layer = int(module.layer_idx)  # type: ignore[arg-type]  # an int on every mixer
    state_layer = int(module._kvrs_state_layer)  # type: ignore[arg-type]  # set by wrap_mixer
    recorder = _RECORDER.get()
    outs = []
    for i, seq in enumerate(batch.sequences):
        lo, hi = bounds[i], bounds[i + 1]
        previous = int(positions[lo]) > 0
        if recorder is not None:
            chunk = _Chunk(own, state_layer, layer, hidden[:, lo:hi].detach(), kwargs, previous)
            recorder.add(seq, chunk)
        states = _SequenceStates(seq, state_layer, layer, previous)
        outs.append(own(hidden[:, lo:hi], cache_params=states, attention_mask=None, **kwargs))
    return torch.cat(outs, dim=1)
