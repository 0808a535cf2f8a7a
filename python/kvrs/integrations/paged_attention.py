"""Continuous batching of a transformers model over a [`BlockPool`][kvrs.BlockPool].

``use_paged_attention(model)`` switches a model's attention to ``"kvrs_paged"``: when a
forward pass carries a [`ForwardBatch`][kvrs.ForwardBatch] (``forward_batch`` passes it), every
attention layer writes its new K/V into the pool with ``batch.put`` and computes
attention with ``batch.attention``, which reads each sequence's blocks in place, so one
forward pass serves a ragged batch of many sequences (prefill chunks beside decode
tokens, each at its own position) with no gathered history and no dense mask. A kvrs
cache passed as ``past_key_values`` attends in place the same way. Anything else runs
plain SDPA, so the same model still runs ``generate()`` with any cache.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import kvrs
from kvrs.integrations import hybrid, mla
from kvrs.integrations._torch import as_torch, torch
from kvrs.integrations.layout import bind_pool, check_pool, layer_plan

from transformers import AttentionInterface  # isort: skip
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # isort: skip
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # isort: skip

__all__ = [
    "ATTN_IMPLEMENTATION",
    "forward_batch",
    "paged_attention",
    "restore_attention",
    "use_paged_attention",
]

ATTN_IMPLEMENTATION = "kvrs_paged"
"""The attention implementation name kvrs registers with transformers."""


def _options(module: torch.nn.Module, scaling: float | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The model-specific attention options kvrs computes: scale, Gemma 2's soft-capping,
    gpt-oss's sinks."""
    sinks = getattr(module, "sinks", None)
    return {
        "scale": scaling,
        "softcap": kwargs.get("softcap"),
        "sinks": None if sinks is None else sinks.detach().float().cpu().numpy(),
    }


def _fallback(module: torch.nn.Module) -> Any:
    """The attention to run without kvrs: SDPA, or the model's own eager attention for
    what SDPA lacks (soft-capping, sinks)."""
    config = getattr(module, "config", None)
    if getattr(module, "sinks", None) is None and getattr(config, "attn_logit_softcapping", None) is None:
        return sdpa_attention_forward
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise kvrs.NotSupportedError(
            f"{type(module).__name__} needs soft-capping or sinks, which SDPA lacks, and its module has "
            "no eager_attention_forward to fall back on; pass a ForwardBatch or a kvrs cache instead"
        )
    return eager


def _additive_mask(mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The mask eager attention adds, from the boolean (or skipped: None, meaning causal)
    mask the registered SDPA mask function makes."""
    if mask is None:
        q, k = query.shape[-2], key.shape[-2]
        mask = torch.ones(q, k, dtype=torch.bool, device=query.device).tril(k - q)[None, None]
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
        ~mask, torch.finfo(query.dtype).min
    )


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention computed by kvrs over its cache, read in place: through
    ``kwargs["kvrs_batch"]`` (a ForwardBatch) when given, through a kvrs cache that
    attends in place when `key` comes from one (see
    [`use_paged_attention`][kvrs.integrations.transformers.use_paged_attention]), else
    plain SDPA."""
    batch: kvrs.ForwardBatch | None = kwargs.pop("kvrs_batch", None)
    custom_mask = kwargs.pop("kvrs_custom_mask", None)
    layer = int(module.layer_idx)  # type: ignore[arg-type]  # an int on every attention module
    source = getattr(key, "_kvrs_source", None)
    if batch is None and source is None:
        attend = _fallback(module)
        if attend is not sdpa_attention_forward:
            attention_mask = _additive_mask(attention_mask, query, key)
        return attend(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    options = _options(module, scaling, kwargs)
    if source is not None:
        # query [batch, heads, n, d]; the cache attends each row over what it holds.
        return source.attend(layer, query.detach(), options, getattr(module, "sliding_window", None)), None
    # The pool's K/V layer (a hybrid model's pool numbers its attention layers apart).
    layer = getattr(module, "_kvrs_layer", layer)
    # query [1, heads, n, d]; key, value [1, kv_heads, n, d]; the pool takes [n, heads, d].
    batch.put(layer, key[0].transpose(0, 1), value[0].transpose(0, 1))  # type: ignore[union-attr]
    if custom_mask is not None:
        options["custom_mask"] = custom_mask
    out = batch.attention(layer, query[0].detach().transpose(0, 1), **options)  # type: ignore[union-attr]
    return as_torch(out)[None], None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def _attend_in_place(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """Forward pre-hook: a kvrs cache passed to the model attends in place for this
    forward (unless the batch is padded: padding needs the model's mask, or the model's
    attention is no longer kvrs's)."""
    cache = kwargs.get("past_key_values")
    pool = getattr(cache, "pool", None)
    if isinstance(pool, kvrs.BlockPool):
        # A KvrsPagedCache's pool serves one model.
        bind_pool(pool, module, recheck=False)
    if cache is not None and hasattr(cache, "attend_in_place"):
        mask = kwargs.get("attention_mask")
        padded = mask is not None and mask.ndim == 2 and not bool(mask.all())
        # Only while the model's attention is kvrs's (set_attn_implementation may have
        # switched it back since use_paged_attention).
        ours = getattr(module.config, "_attn_implementation", None) == ATTN_IMPLEMENTATION
        cache.attend_in_place = ours and not padded


_MISSING = object()
# The attributes use_paged_attention sets on a model's modules (instance attributes).
_MODULE_ATTRIBUTES = ("forward", "generate", "_kvrs_mla", "_kvrs_state_layer", "_kvrs_layer")


def _configs(model: Any) -> list[Any]:
    """Every config object of `model` (its own, its submodels' and their sub-configs):
    where transformers records attention implementations."""
    found: dict[int, Any] = {}
    todo = [m.config for m in model.modules() if hasattr(m, "config")]
    while todo:
        config = todo.pop()
        if id(config) in found or not hasattr(config, "_attn_implementation_internal"):
            continue
        found[id(config)] = config
        todo += [getattr(config, key, None) for key in getattr(config, "sub_configs", {})]
    return list(found.values())


def _implementations(model: Any) -> list[tuple[Any, Any]]:
    """Each config of `model` with the attention implementation it records now."""
    return [(c, c._attn_implementation_internal) for c in _configs(model)]


def _set_implementations(saved: list[tuple[Any, Any]]) -> None:
    for config, implementation in saved:
        config._attn_implementation_internal = implementation


class _Switch:
    """What [`use_paged_attention`][kvrs.integrations.transformers.use_paged_attention] changed on a model,
    kept on the model so that
    [`restore_attention`][kvrs.integrations.transformers.restore_attention] puts it back: each config's
    attention implementation (the
    configs are shared with any model built from them), the module attributes it set
    (wrapped forwards of MLA layers and linear mixers, layer numbers), its hook."""

    def __init__(self, model: Any):
        self.implementations = _implementations(model)
        self.modules: list[tuple[torch.nn.Module, dict[str, Any]]] = []
        self.saved: set[int] = set()
        self.hook: Any = None  # the pre-hook's torch.utils.hooks.RemovableHandle

    def save(self, module: torch.nn.Module) -> None:
        """Records `module`'s attributes before the switch first changes them."""
        if id(module) not in self.saved:
            self.saved.add(id(module))
            self.modules.append((module, {a: module.__dict__.get(a, _MISSING) for a in _MODULE_ATTRIBUTES}))

    def undo(self) -> None:
        _set_implementations(self.implementations)
        for module, before in self.modules:
            for name, value in before.items():
                if value is not _MISSING:
                    module.__dict__[name] = value
                else:
                    module.__dict__.pop(name, None)
        if self.hook is not None:
            self.hook.remove()


def use_paged_attention(model: Any) -> Any:
    """Switches `model`'s attention to kvrs (until
    [`restore_attention`][kvrs.integrations.transformers.restore_attention]): a
    ForwardBatch ([`forward_batch`][kvrs.integrations.transformers.forward_batch]) or a kvrs cache
    (``KvrsCache``,
    ``KvrsPagedCache``) passed as ``past_key_values`` makes each layer attend over kvrs's
    memory in place, with no gathered history and no dense mask; anything else runs SDPA.
    DeepSeek-style MLA layers attend over the cached latent in absorbed form
    (`kvrs.integrations.mla`); a hybrid model's linear layers run each sequence of a
    ForwardBatch against its state slot (`kvrs.integrations.hybrid`).

    The switch is transformers' ``set_attn_implementation("kvrs_paged")``, which writes the
    model's config: a model built from the same config object afterwards starts switched
    too, and transformers' own ``generate_batch`` refuses a switched model.
    [`restore_attention`][kvrs.integrations.transformers.restore_attention] undoes all of it.
    [`generate_batch`][kvrs.integrations.transformers.generate_batch] switches a model
    only while it runs. Returns `model`."""
    switch: _Switch | None = model.__dict__.get("_kvrs_switch")
    if switch is None:
        switch = _Switch(model)
        model.__dict__["_kvrs_switch"] = switch
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    plan = layer_plan(model.config, with_shapes=False)
    for module in model.modules():
        index = getattr(module, "layer_idx", None)
        if mla.is_mla(module):
            switch.save(module)
            mla.wrap_forward(module)
        if not isinstance(index, int):
            continue
        if hybrid.is_linear_mixer(module) and index in plan.state_of:
            switch.save(module)
            hybrid.wrap_mixer(module, plan.state_of[index])
        elif index in plan.kv_of:
            switch.save(module)
            module._kvrs_layer = plan.kv_of[index]
    if switch.hook is None:
        switch.hook = model.register_forward_pre_hook(_attend_in_place, with_kwargs=True)
    if getattr(model, "_is_stateful", False) and "generate" not in model.__dict__:
        switch.save(model)
        model.generate = _assisted_generate(model, model.generate)
    return model


def _assisted_generate(model: Any, generate: Any) -> Any:
    """`model.generate` (a hybrid model's: transformers marks it stateful and refuses
    assisted generation) that lets ``assistant_model`` through when ``past_key_values``
    is a kvrs cache that rolls the recurrent states back on crop (``KvrsPagedCache``);
    any other call is transformers' own, refusal included."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        cache = kwargs.get("past_key_values")
        if kwargs.get("assistant_model") is None or not hasattr(cache, "rolls_back_states"):
            return generate(*args, **kwargs)
        model.__dict__["_is_stateful"] = False  # the cache rolls the states back itself
        try:
            return generate(*args, **kwargs)
        finally:
            del model.__dict__["_is_stateful"]

    return wrapped


def restore_attention(model: Any) -> Any:
    """Undoes [`use_paged_attention`][kvrs.integrations.transformers.use_paged_attention]: the attention
    implementation every config of
    `model` had before (so new models from the same config, and transformers' own
    ``generate_batch``, see the original), the modules' own forwards, no kvrs hook.
    A model that is not switched is left as it is. Returns `model`."""
    switch: _Switch | None = model.__dict__.pop("_kvrs_switch", None)
    if switch is not None:
        switch.undo()
    return model


@contextmanager
def _switched(model: Any) -> Iterator[None]:
    """Runs the body with `model`'s attention switched to kvrs and puts back what it
    was on the way out, also on an exception (a model already switched stays so)."""
    # (A model built from a switched model's config reads as switched but has none of
    # its modules wrapped: it is switched here too.)
    if model.config._attn_implementation == ATTN_IMPLEMENTATION and "_kvrs_switch" in model.__dict__:
        yield
        return
    before = _implementations(model) if "_kvrs_switch" in model.__dict__ else None
    use_paged_attention(model)
    try:
        yield
    finally:
        if before is None:
            restore_attention(model)
        else:  # switched earlier, then set back by the caller: set back again
            _set_implementations(before)


def forward_batch(
    model: Any,
    batch: kvrs.ForwardBatch,
    token_ids: Any = None,
    *,
    logits_to_keep: Any = None,
    position_ids: Any = None,
    custom_mask: Any = None,
) -> torch.Tensor:
    """Runs one ForwardBatch through `model` (switched by
    [`use_paged_attention`][kvrs.integrations.transformers.use_paged_attention]) and
    returns the logits of its tokens [num_tokens, vocab], or of the rows `logits_to_keep`
    names: ``"last"`` (each sequence's last token, ``batch.last_token_indices``: the rows a
    sampler reads, in ``batch.sequences`` order) or a list of batch indices. Keeping only
    those rows skips the language-model head for the others, as transformers'
    ``logits_to_keep`` does.

    The tokens are the ids the pool records for them (``batch.token_ids``: those given to
    ``start_forward(tokens=...)``, else the sequences' prompts), so the K/V the batch
    writes are always those of the ids its blocks are cached under. `token_ids` is needed
    only where the pool knows no id; where it knows one, a different id raises ValueError.
    Does not commit: call ``batch.finish()`` (or leave the ``with`` block) afterwards.

    A token tree (speculative verification) gives `position_ids` (each token's rotary
    position, a node's depth after the committed prefix, where ``batch.positions`` are
    the slots) and `custom_mask` (FlashInfer's flattened bool ``[q_len x kv_len]`` per
    sequence, True = may attend, as ``ForwardBatch.attention`` takes it)."""
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise ValueError(
            f"model uses attn_implementation={model.config._attn_implementation!r}; "
            "call kvrs.integrations.transformers.use_paged_attention(model) first"
        )
    if batch.sequences:
        check_pool(batch.sequences[0].pool, model, recheck=False)
    known = torch.from_numpy(batch.token_ids)
    if token_ids is None:
        unknown = (known < 0).nonzero().flatten().tolist()
        if unknown:
            raise ValueError(
                f"token_ids: the pool knows no id for batch tokens {unknown[:8]}; pass "
                "start_forward(..., tokens=...) or forward_batch(..., token_ids=...)"
            )
        ids = known
    else:
        ids = torch.as_tensor(token_ids, dtype=torch.long)
    if ids.ndim != 1 or ids.shape[0] != batch.num_tokens:
        raise ValueError(
            f"token_ids has shape {tuple(ids.shape)}; the batch needs [{batch.num_tokens}] (1-D)"
        )
    vocab = model.config.get_text_config().vocab_size
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"token_ids must lie in [0, {vocab}) (the model's vocab_size)")
    differ = ((known >= 0) & (ids.cpu() != known)).nonzero().flatten().tolist()
    if differ:
        i = differ[0]
        raise ValueError(
            f"token_ids[{i}]={int(ids[i])}, but the batch records token id {int(known[i])} there "
            "(start_forward(tokens=...) or the sequence's prompt): the K/V would be cached under "
            "ids they were not computed from"
        )
    keep = _rows_to_keep(batch, logits_to_keep)
    device = model.device  # the pool's device too: batch.put takes the model's K/V as they are
    ids = ids.reshape(1, -1).to(device)
    if position_ids is None:
        positions = torch.from_numpy(batch.positions).reshape(1, -1).to(device)
    else:
        positions = torch.as_tensor(position_ids, dtype=torch.long).reshape(1, -1).to(device)
        if positions.shape[1] != batch.num_tokens:
            raise ValueError(
                f"position_ids has {positions.shape[1]} entries; the batch has {batch.num_tokens} tokens"
            )
    extra: dict[str, Any] = {} if keep is None else {"logits_to_keep": keep.to(device)}
    if custom_mask is not None:
        extra["kvrs_custom_mask"] = custom_mask
    out = model(input_ids=ids, position_ids=positions, kvrs_batch=batch, use_cache=False, **extra)
    return out.logits[0]


def _rows_to_keep(batch: kvrs.ForwardBatch, logits_to_keep: Any) -> torch.Tensor | None:
    """The batch rows whose logits `forward_batch` computes (None: all of them)."""
    if logits_to_keep is None:
        return None
    if isinstance(logits_to_keep, str):
        if logits_to_keep.lower() != "last":
            raise ValueError(
                f"logits_to_keep={logits_to_keep!r}: give 'last', a list of batch indices or None"
            )
        return torch.from_numpy(batch.last_token_indices)
    rows = torch.as_tensor(logits_to_keep, dtype=torch.long).flatten()
    n = batch.num_tokens
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= n):
        raise IndexError(f"logits_to_keep: batch indices must lie in [0, {n}) (the batch's tokens)")
    return rows
