"""The real peers' cache managers, imported from their released wheels without their engines.

`make bench-peers` downloads vLLM's and SGLang's wheels (`pip download --no-deps`, the versions
below) and unpacks their Python files into benches/.peers/ (ignored by git). This module imports
from there only the modules that hold the cache managers, unchanged:

- vLLM v1: `vllm.v1.core.kv_cache_manager.KVCacheManager` with its coordinator, single-type
  managers, `BlockPool`, `kv_cache_utils` (block hashing, the free-block queue),
  `kv_cache_interface` (specs and configs) and `vllm.v1.request.Request`;
- SGLang: `sglang.srt.mem_cache.radix_cache.RadixCache` with `base_prefix_cache`,
  `cache_init_params`, `events`, `evict_policy` and `mem_cache.utils`.

Everything else those modules import (the engine, configs, distributed code, CUDA kernels,
metrics, multimodal code) is not executed. Packages are entered without running their
`__init__.py`, and each other module is a stub:

- a few definitions the managers call at run time are taken verbatim from the wheel's own
  source (`_SOURCE`: parsed with `ast`, only the named top-level definitions compiled);
- a few are written here (`_written_stubs`), each for a feature the benchmarks leave off
  (structured output, logging, multimodal windows, environment flags);
- every other imported name is a placeholder class, good for annotations, base classes and
  decorators at import time. After loading, any use of a placeholder is recorded, and
  `check_untouched()` fails a benchmark whose measured code reached one: the measured paths
  run the peers' real code only.
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import types
from pathlib import Path
from typing import Any

VLLM_VERSION = "0.33.0"
SGLANG_VERSION = "0.5.23"
PEERS_DIR = Path(__file__).resolve().parent / ".peers"

# Modules executed from the wheels, unchanged.
_REAL = {
    "vllm": {
        "vllm.utils.math_utils",
        "vllm.utils.hashing",
        "vllm.v1.core.block_pool",
        "vllm.v1.core.kv_cache_coordinator",
        "vllm.v1.core.kv_cache_manager",
        "vllm.v1.core.kv_cache_metrics",
        "vllm.v1.core.kv_cache_utils",
        "vllm.v1.core.single_type_kv_cache_manager",
        "vllm.v1.kv_cache_interface",
        "vllm.v1.kv_cache_layout",
        "vllm.v1.kv_cache_spec_registry",
        "vllm.v1.request",
    },
    "sglang": {
        "sglang.srt.mem_cache.base_prefix_cache",
        "sglang.srt.mem_cache.cache_init_params",
        "sglang.srt.mem_cache.events",
        "sglang.srt.mem_cache.evict_policy",
        "sglang.srt.mem_cache.radix_cache",
        "sglang.srt.mem_cache.utils",
    },
}

# Definitions taken verbatim from a heavy module's source: module -> (file, names).
_SOURCE = {
    "vllm.utils": ("vllm/utils/__init__.py", ["length_from_prompt_token_ids_or_embeds"]),
    "vllm.utils.torch_utils": ("vllm/utils/torch_utils.py", ["get_dtype_size"]),
    "vllm.v1.utils": ("vllm/v1/utils.py", ["T", "ConstantList", "tensor_data"]),
    "vllm.v1.metrics.stats": (
        "vllm/v1/metrics/stats.py",
        ["BaseCacheStats", "PrefixCacheStats", "PrefillStats"],
    ),
    "sglang.srt.utils.common": ("sglang/srt/utils/common.py", ["ceil_align"]),
}

# Uses of placeholders after loading: (placeholder, what was done).
touched: list[tuple[str, str]] = []
_armed = False


class _Placeholder(type):
    """A stand-in for a name the peers import but the benchmarks never use."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        _touch(cls, f".{name}")
        return _placeholder(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        _touch(cls, "()")
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # a decorator
        return super().__call__()

    def __getitem__(cls, item: Any) -> Any:
        return cls

    def __or__(cls, other: Any) -> Any:
        return cls

    def __ror__(cls, other: Any) -> Any:
        return cls


def _placeholder(name: str) -> type:
    return _Placeholder(name, (), {"__qualname__": name})


def _touch(cls: type, what: str) -> None:
    if _armed:
        touched.append((cls.__qualname__, what))


def check_untouched() -> None:
    """Raises if measured code reached a placeholder (it would not be the peer's real code)."""
    if touched:
        raise RuntimeError(f"the peers' code used stubbed names: {sorted(set(touched))}")


class _StubModule(types.ModuleType):
    """A module whose names not defined here are placeholders."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


def _written_stubs(name: str, module: types.ModuleType) -> None:
    """The stubs written here, for features the benchmarks leave off."""
    if name in ("vllm.logger", "sglang.srt.utils.common"):
        module.init_logger = logging.getLogger
    if name == "vllm.envs":
        # Block hashes stay bytes in KV events (which the benchmarks do not enable).
        module.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES = False
    if name == "vllm.config":
        # No engine, so no current engine configuration.
        module.get_current_vllm_config_or_none = lambda: None
    if name == "vllm.platforms":
        # A platform without plugins: no custom KV cache specs to register.
        module.current_platform = types.SimpleNamespace(register_custom_kv_cache_specs=lambda config: None)
    if name == "vllm.v1.structured_output.request":
        # No structured output: a request without a grammar.
        module.StructuredOutputRequest = type(
            "StructuredOutputRequest", (), {"from_sampling_params": staticmethod(lambda params: None)}
        )


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports the real modules from the unpacked wheels, packages without their __init__, and
    stubs for everything else under the peers' top-level packages."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.real = set().union(*_REAL.values())

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.split(".")[0]
        if top not in _REAL:
            return None
        rel = Path(*fullname.split("."))
        if fullname in self.real:
            return importlib.util.spec_from_file_location(fullname, self.root / rel.with_suffix(".py"))
        is_pkg = (self.root / rel).is_dir()
        spec = importlib.machinery.ModuleSpec(fullname, self, is_package=is_pkg)
        if is_pkg:
            spec.submodule_search_locations = [str(self.root / rel)]
        return spec

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        name = module.__name__
        if name in _SOURCE:
            file, names = _SOURCE[name]
            _exec_definitions(self.root / file, names, module)
        _written_stubs(name, module)


def _exec_definitions(path: Path, names: list[str], module: types.ModuleType) -> None:
    """Compiles into `module` only the top-level definitions `names` of the source at `path`,
    with the file's imports of the standard library, torch and the peers' own packages
    (which resolve to real modules or stubs); other imports (third-party packages of the
    engine: zmq, psutil, uvloop, ...) are left out."""
    tree = ast.parse(path.read_text(), str(path))
    light = set(sys.stdlib_module_names) | {"torch", "numpy", "typing_extensions"} | set(_REAL)

    def kept_import(node: ast.stmt) -> bool:
        if isinstance(node, ast.Import):
            return all(a.name.split(".")[0] in light for a in node.names)
        if isinstance(node, ast.ImportFrom):
            return node.level == 0 and (node.module or "").split(".")[0] in light | {"__future__"}
        return False

    def defined(node: ast.stmt) -> set[str]:
        if isinstance(node, ast.Assign):
            return {t.id for t in node.targets if isinstance(t, ast.Name)}
        return {getattr(node, "name", "")}

    keep = [n for n in tree.body if kept_import(n) or defined(n) & set(names)]
    missing = set(names) - set().union(*map(defined, keep))
    if missing:
        raise ImportError(f"{path} defines no {sorted(missing)}")
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(path), "exec"), module.__dict__)


def available() -> bool:
    """Whether `make bench-peers` has unpacked the peers' wheels."""
    return all((PEERS_DIR / top / ".version").is_file() for top in _REAL)


def fetch() -> None:
    """Downloads the peers' wheels (`pip download --no-deps`, the wheel for the interpreter
    running this) and unpacks their Python files into PEERS_DIR; the wheels are then deleted.
    Does nothing for a peer already unpacked at its version."""
    import subprocess
    import zipfile

    for top, version in (("vllm", VLLM_VERSION), ("sglang", SGLANG_VERSION)):
        stamp = PEERS_DIR / top / ".version"
        if stamp.is_file() and stamp.read_text() == version:
            continue
        wheels = PEERS_DIR / "wheels"
        wheels.mkdir(parents=True, exist_ok=True)
        print(f"downloading {top}=={version} (its wheel, no dependencies)", flush=True)
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        subprocess.run([*pip, "-d", str(wheels), f"{top}=={version}"], check=True)
        (wheel,) = wheels.glob(f"{top}-{version}-*.whl")
        with zipfile.ZipFile(wheel) as z:
            sources = [n for n in z.namelist() if n.startswith(f"{top}/") and n.endswith(".py")]
            z.extractall(PEERS_DIR, sources)
        wheel.unlink()
        stamp.write_text(version)


_loaded = False


def load() -> None:
    """Puts the unpacked wheels' managers on the import path (once); raises with the command
    to run when they are not there."""
    global _loaded, _armed
    if _loaded:
        return
    if not available():
        raise RuntimeError(
            f"vLLM {VLLM_VERSION} and SGLang {SGLANG_VERSION} are not unpacked in {PEERS_DIR}: "
            "run `make bench-peers` (it downloads their wheels, then runs the benchmarks against them)"
        )
    sys.meta_path.insert(0, _Finder(PEERS_DIR))
    importlib.import_module("sglang.srt.mem_cache.radix_cache")
    importlib.import_module("vllm.v1.core.kv_cache_manager")
    importlib.import_module("vllm.v1.request")

    _loaded = True
    _armed = True


# What the benchmarks build from the peers' real classes.


def vllm_manager(num_blocks: int, block_size: int, caching: bool, max_model_len: int = 1 << 16):
    """vLLM v1's `KVCacheManager` over one full-attention KV cache group (what a model with
    only full-attention layers gets), as its scheduler builds it."""
    load()
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float16)
    config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)]
    )
    return KVCacheManager(
        config,
        max_model_len=max_model_len,
        scheduler_block_size=block_size,
        hash_block_size=block_size,
        enable_caching=caching,
    )


def vllm_block_hasher(block_size: int):
    """vLLM's per-request block hasher with its default hash (sha256 of the pickled block)."""
    load()
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return get_request_block_hasher(block_size, sha256)


def vllm_request(request_id: str, tokens: list[int], block_hasher=None, max_tokens: int = 1 << 20):
    """vLLM's `Request` for a prompt of `tokens` (with `block_hasher`, its block hashes are
    computed here, as vLLM computes them when a request enters the engine). Its sampling
    parameters are a record of the three fields `Request` reads (vLLM's `SamplingParams` is a
    msgspec/pydantic struct of the engine's configuration)."""
    load()
    from vllm.v1.request import Request

    params = types.SimpleNamespace(max_tokens=max_tokens, extra_args=None, skip_reading_prefix_cache=None)
    return Request(request_id, tokens, params, None, block_hasher=block_hasher)


def sglang_cache(page_size: int):
    """SGLang's `RadixCache` without memory pools (`create_simulated`, as its own tests build
    it): the tree, its matching and its eviction strategy, with token ids as values."""
    load()
    from sglang.srt.mem_cache.radix_cache import RadixCache

    return RadixCache.create_simulated(page_size=page_size)


if __name__ == "__main__":
    fetch()
