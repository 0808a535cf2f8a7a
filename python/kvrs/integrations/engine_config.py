"""What the engine adapters (`kvrs.integrations.sglang`, `.vllm`, `.lmcache`) read from an
engine's configuration, in one place: the kvrs tiers a config lists, the tier key named by
an environment variable, the tenant namespace and the deployment's extra fingerprint facts.

Needs no engine: each adapter passes its own config values in."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import kvrs

__all__ = ["DEFAULT_TIER_KEY_ENV", "extra_facts", "make_tiers", "namespace_arg", "tier_secret"]

#: The environment variable the adapters read the tier key from unless told otherwise.
DEFAULT_TIER_KEY_ENV = "KVRS_TIER_KEY"


def make_tiers(specs: Sequence[Mapping[str, Any]]) -> list[kvrs.Tier]:
    """The kvrs tiers of a config's ``"tiers"`` list, fastest first: each a dict with
    ``"type"`` ``"host"`` (``max_bytes``), ``"disk"`` (``path``, ``max_bytes``) or
    ``"redis"`` (``url`` and [`kvrs.RedisTier`][kvrs.RedisTier]'s keyword arguments)."""
    if isinstance(specs, (str, bytes)) or not isinstance(specs, Sequence) or not specs:
        raise ValueError(f"tiers must be a non-empty list of tier dicts, not {specs!r}")
    tiers: list[kvrs.Tier] = []
    for i, spec in enumerate(specs):
        if not isinstance(spec, Mapping):
            raise TypeError(f"tiers[{i}] must be a dict, not {type(spec).__name__}")
        kw = dict(spec)
        kind = kw.pop("type", None)
        try:
            if kind == "host":
                tiers.append(kvrs.HostTier(**kw))
            elif kind == "disk":
                tiers.append(kvrs.DiskTier(**kw))
            elif kind == "redis":
                tiers.append(kvrs.RedisTier(**kw))
            else:
                raise ValueError(f"type={kind!r}: must be 'host', 'disk' or 'redis'")
        except TypeError as e:
            raise TypeError(f"tiers[{i}]: {e}") from e
        except ValueError as e:
            raise ValueError(f"tiers[{i}]: {e}") from e
    return tiers


def tier_secret(env: Any, logger: logging.Logger) -> bytes | None:
    """The tier key held by environment variable `env` (at least 16 bytes), or None (with a
    warning on `logger`: pages are then checksummed, not authenticated)."""
    if not isinstance(env, str) or not env:
        raise TypeError(f"tier_key_env must be the name of an environment variable, not {env!r}")
    secret = os.environ.get(env)
    if secret is None:
        logger.warning(
            "kvrs: $%s is not set: pages are checksummed, not authenticated (anyone who can "
            "write to the tiers is trusted)",
            env,
        )
        return None
    if len(secret.encode()) < 16:
        raise ValueError(
            f"${env} holds {len(secret.encode())} bytes: the tier key must be at least 16 "
            "(e.g. python -c 'import secrets; print(secrets.token_hex(32))')"
        )
    return secret.encode()


def namespace_arg(namespace: Any) -> str:
    """The config's tenant namespace (``""``: none)."""
    if namespace is None:
        return ""
    if not isinstance(namespace, str):
        raise TypeError(f"namespace must be a str, not {type(namespace).__name__}")
    return namespace


def extra_facts(facts: Any) -> dict[str, str]:
    """The deployment's extra fingerprint facts (``"fingerprint": {"revision": ...}``), each
    filed as ``"extra.<name>"``."""
    if facts is None:
        return {}
    if not isinstance(facts, Mapping):
        raise TypeError(f"fingerprint must be a dict of extra facts, not {type(facts).__name__}")
    out: dict[str, str] = {}
    for k, v in facts.items():
        if not isinstance(v, (str, int, float, bool)):
            raise TypeError(f"fingerprint[{k!r}] must be a str, int, float or bool, not {type(v).__name__}")
        out[f"extra.{k}"] = str(v)
    return out
