"""Every ```python block of the README and of every page of the manual (docs/*.md) runs as written.

The ```rust blocks run as rustdoc doctests (src/lib.rs includes each page under
`#[cfg(doctest)]`); blocks that are not meant to run use other fences (```bash, ```text).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)


def page_name(page: Path) -> str:
    return str(page.relative_to(ROOT))


BLOCKS = [
    pytest.param(page, code, id=f"{page_name(page)}-block{i}")
    for page in PAGES
    for i, code in enumerate(FENCE.findall(page.read_text()))
]


def test_pages_have_examples():
    pages_with_code = {page_name(param.values[0]) for param in BLOCKS}
    assert {"README.md", "docs/caches.md", "docs/pools.md", "docs/transformers.md"} <= pages_with_code


def test_every_page_is_a_doctest():
    """src/lib.rs includes every page, so rustdoc compiles and runs its ```rust blocks."""
    lib = (ROOT / "src" / "lib.rs").read_text()
    for page in PAGES:
        assert f'include_str!("../{page_name(page)}")' in lib, page_name(page)


@pytest.mark.parametrize(("page", "code"), BLOCKS)
def test_example_runs(page, code):
    if "kvrs.real_model" in code:
        from kvrs.real_model import missing

        why = missing()
        if why is not None:
            pytest.skip(why)
    exec(compile(code, str(page), "exec"), {"__name__": "__main__"})
