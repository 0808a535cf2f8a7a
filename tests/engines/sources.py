"""The engines' own test code, fetched from their source packages on PyPI when a test first
needs it (never committed): the pinned sdist is downloaded into ``.engines/`` at the
repository root, its SHA-256 checked, and its ``tests/`` (and vLLM's
``examples/disaggregated``, which its connector tests read) unpacked beside it, away from
the engine's own sources so that the installed engine is the one imported.

    python tests/engines/sources.py vllm      # prints the directory holding vLLM's tests/

It also writes the one model config vLLM's test utilities read (``HF_HOME``, offline).
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import tarfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".engines"
#: The Hugging Face home the engine tests run with (offline): only generated configs.
HF_HOME = CACHE / "hf"
#: The Hub id vLLM's test utilities build their ModelConfig from.
OPT_MODEL = "facebook/opt-125m"

#: name -> (version, sdist URL on PyPI, SHA-256, members to unpack). The versions are
#: those of tests/engines/requirements.txt.
SDISTS = {
    "vllm": (
        "0.33.0",
        "https://files.pythonhosted.org/packages/f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/vllm-0.33.0.tar.gz",
        "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
        ("tests/", "examples/disaggregated/"),
    ),
    "lmcache": (
        "0.5.6",
        "https://files.pythonhosted.org/packages/84/25/3ccd46844c94e08897aa8d72716a538c07e4583410d84dbc6cd12cb60dc1/lmcache-0.5.6.tar.gz",
        "d6951e60ce8818a76aa42d0866a4ba85f1c95cd919355fff30ff24dcc3243f1e",
        ("tests/",),
    ),
}


def engine_tests(name: str) -> Path:
    """The directory holding engine `name`'s ``tests/`` package (fetched the first time)."""
    version, url, sha256, members = SDISTS[name]
    out = CACHE / f"{name}-{version}"
    done = out / ".complete"
    if done.exists():
        return out
    CACHE.mkdir(exist_ok=True)
    archive = CACHE / url.rsplit("/", 1)[1]
    if not archive.exists() or hashlib.sha256(archive.read_bytes()).hexdigest() != sha256:
        part = archive.with_suffix(".part")
        with urllib.request.urlopen(url, timeout=120) as r, open(part, "wb") as f:
            shutil.copyfileobj(r, f)
        got = hashlib.sha256(part.read_bytes()).hexdigest()
        if got != sha256:
            part.unlink()
            raise RuntimeError(f"{url}: SHA-256 {got}, expected {sha256}")
        part.rename(archive)
    shutil.rmtree(out, ignore_errors=True)
    prefix = f"{name}-{version}/"
    with tarfile.open(archive) as tar:
        picked = []
        for m in tar.getmembers():
            rel = m.name[len(prefix) :] if m.name.startswith(prefix) else ""
            if any(rel.startswith(p) for p in members) and (m.isfile() or m.isdir()):
                m.name = rel
                picked.append(m)
        tar.extractall(out, members=picked, filter="data")
    done.touch()
    return out


def write_opt_config() -> None:
    """facebook/opt-125m's config.json in a Hub cache layout under `HF_HOME` (no weights:
    none are read), generated with transformers rather than downloaded."""
    snap = "0" * 40
    repo = HF_HOME / "hub" / ("models--" + OPT_MODEL.replace("/", "--"))
    target = repo / "snapshots" / snap / "config.json"
    if target.exists():
        return
    from transformers import OPTConfig

    target.parent.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(snap)
    OPTConfig(
        vocab_size=50272,
        hidden_size=768,
        num_hidden_layers=12,
        ffn_dim=3072,
        num_attention_heads=12,
        max_position_embeddings=2048,
        word_embed_proj_dim=768,
        dtype="float16",
    ).to_json_file(str(target))


if __name__ == "__main__":
    print(engine_tests(sys.argv[1]))
    if sys.argv[1] == "vllm":
        write_opt_config()
