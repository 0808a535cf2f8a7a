"""The integration modules' public names: each module lists them in ``__all__``; what it
defines for itself alone starts with an underscore; what it imports (NumPy, torch,
typing, transformers' classes, helpers) is not part of it. The user-facing module,
kvrs.integrations.transformers, shows only its API to ``dir()`` and tab completion."""

from __future__ import annotations

import ast
import importlib
import inspect

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

MODULES = [
    "kvrs.integrations._torch",
    "kvrs.integrations.calibration",
    "kvrs.integrations.generation",
    "kvrs.integrations.hybrid",
    "kvrs.integrations.layout",
    "kvrs.integrations.mla",
    "kvrs.integrations.paged_attention",
    "kvrs.integrations.results",
    "kvrs.integrations.sampling",
    "kvrs.integrations.suffix_drafts",
    "kvrs.integrations.token_tree",
    "kvrs.integrations.transformers",
]


def defined_names(module) -> set[str]:
    """Names the module's own top-level statements define (functions, classes, constants)."""
    tree = ast.parse(inspect.getsource(module))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names - {"__all__"}


@pytest.mark.parametrize("name", MODULES)
def test_each_module_lists_its_public_names_and_keeps_helpers_private(name):
    module = importlib.import_module(name)
    public = set(module.__all__)
    assert len(public) == len(module.__all__) and all(hasattr(module, n) for n in public)
    helpers = {n for n in defined_names(module) - public if not n.startswith("_") and n != "__dir__"}
    assert not helpers, f"{name} defines public names outside __all__: {sorted(helpers)}"
    namespace: dict[str, object] = {}
    exec(f"from {name} import *", namespace)
    assert set(namespace) - {"__builtins__"} == public


def test_the_transformers_module_shows_only_its_api():
    module = importlib.import_module("kvrs.integrations.transformers")
    assert dir(module) == sorted(module.__all__)
    for imported in ("np", "torch", "Any", "Cache", "hybrid", "as_torch", "model_parts", "layer_plan"):
        assert imported not in module.__all__ and imported not in dir(module)
    assert {
        "KvrsCache",
        "KvrsPagedCache",
        "generate_batch",
        "use_paged_attention",
        "restore_attention",
    } <= set(dir(module))
