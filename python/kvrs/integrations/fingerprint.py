"""What identifies a model's K/V: its configuration and its weights, as one short string.

A pool binds to the fingerprint of the model it serves (``BlockPool.bind_model``), and a
pool made from a model takes the fingerprint as its ``model_id``, which keys every block
in the tiers and in prefix-cache files. Two models of the same shape (a base model and its
fine-tune, two checkpoints of one run) therefore never read each other's cached K/V.

The digest covers every parameter's name, shape and dtype, and a fixed sample of its bytes:
a tensor of at most ``WHOLE_BYTES`` whole, a larger one as ``WINDOWS`` evenly spaced windows
of ``WINDOW_BYTES`` (its first and last bytes included). Fine-tuning changes every
parameter it trains, so any real fine-tune changes the digest; an edit of a single element
that no window covers does not (give such a model its own ``model_id``). The cost is a few
milliseconds per model, computed again only after a parameter changes (torch's version
counter of each parameter, which in-place updates such as an optimizer step bump).
"""

from __future__ import annotations

import hashlib
import json
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from kvrs.integrations._torch import resolve_device

__all__ = ["model_fingerprint"]

# Tensors up to this size are hashed whole.
WHOLE_BYTES = 1 << 16
# Larger ones: this many windows of this many bytes, evenly spaced.
WINDOWS = 64
WINDOW_BYTES = 256

# Settings of a config that change how a model is run, not what it computes.
_RUNTIME_KEYS = frozenset(
    {
        "transformers_version",
        "name_or_path",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "torchscript",
        "attn_implementation",
        "dtype",
        "torch_dtype",
        "chunk_size_feed_forward",
        "tie_encoder_decoder",
        "problem_type",
    }
)

# model -> (the parameters' versions, fingerprint): recomputed when a parameter changes.
_CACHE: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], str]] = weakref.WeakKeyDictionary()


def _config_items(config: Any) -> Any:
    """A config's settings that determine the K/V, as JSON-ready data (sub-configs too)."""
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    if isinstance(config, dict):
        return {
            str(k): _config_items(v)
            for k, v in sorted(config.items(), key=lambda kv: str(kv[0]))
            if not str(k).startswith("_") and k not in _RUNTIME_KEYS
        }
    if isinstance(config, (list, tuple)):
        return [_config_items(v) for v in config]
    if isinstance(config, (str, int, float, bool)) or config is None:
        return config
    return repr(config)


def _sample(t: torch.Tensor) -> bytes:
    """The bytes of `t` the digest covers: all of a small tensor, windows of a large one."""
    raw = t.detach().reshape(-1).view(torch.uint8)
    n = raw.numel()
    if n <= WHOLE_BYTES:
        return raw.cpu().numpy().tobytes()
    starts = [(n - WINDOW_BYTES) * i // (WINDOWS - 1) for i in range(WINDOWS)]
    if raw.device.type == "cpu":
        # Slices of the tensor's own memory (a gather through torch costs ~100x more).
        view = raw.numpy().data
        return b"".join(view[s : s + WINDOW_BYTES] for s in starts)
    index = torch.tensor(starts, device=raw.device)[:, None] + torch.arange(WINDOW_BYTES, device=raw.device)
    return raw[index.reshape(-1)].cpu().numpy().tobytes()


def _versions(params: Sequence[tuple[str, torch.Tensor]]) -> tuple[Any, ...]:
    return tuple((name, p.data_ptr(), p._version, tuple(p.shape), p.dtype) for name, p in params)


def model_fingerprint(model: Any, *, recheck: bool = True) -> str:
    """A string that identifies `model`'s K/V: ``"<architecture>-<32 hex digits>"``, a
    BLAKE2b digest of its configuration (what the model computes: architecture, sizes,
    RoPE settings; not runtime switches such as the attention implementation) and of its
    parameters (names, shapes, dtypes and a fixed sample of their bytes: see the module).

    Models of the same configuration with other weights (a fine-tune, another checkpoint)
    get other fingerprints; the same weights loaded twice, in any process, the same one.
    The digest is kept per model object and computed again when a parameter changed
    (torch's version counters); `recheck=False` skips that check when a digest is kept
    (what a forward pass uses: the check walks every parameter). Raises
    kvrs.DeviceError for a model whose weights are not loaded (the meta device)."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError(
            f"model_fingerprint takes a transformers model (a torch.nn.Module with a config), "
            f"not {type(model).__name__}"
        )
    cached = _CACHE.get(model)
    if cached is not None and not recheck:
        return cached[1]
    params = list(model.named_parameters())
    versions = _versions(params)
    if cached is not None and cached[0] == versions:
        return cached[1]
    if any(p.device.type == "meta" for _, p in params):
        resolve_device(None, torch.device("meta"))  # raises kvrs.DeviceError, saying what to do
    h = hashlib.blake2b(digest_size=16)
    config = json.dumps(_config_items(model.config), sort_keys=True, default=repr)
    h.update(config.encode())
    for name, p in params:
        h.update(f"\0{name}\0{tuple(p.shape)}\0{p.dtype}\0".encode())
        h.update(_sample(p))
    fingerprint = f"{type(model).__name__}-{h.hexdigest()}"
    _CACHE[model] = (versions, fingerprint)
    return fingerprint
