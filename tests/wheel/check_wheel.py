"""Installs the wheel `make wheel` built into a fresh virtual environment and runs
smoke.py there with no Rust on the PATH: what a user of `pip install kvrs` gets.

    python tests/wheel/check_wheel.py dist/kvrs-*-abi3-*.whl
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path


def main(wheel: str) -> int:
    here = Path(__file__).resolve().parent
    with tempfile.TemporaryDirectory(prefix="kvrs-wheel-") as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        py = venv / "bin" / "python"
        # Only the system directories: no cargo, rustc or the project's .venv.
        env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": os.environ.get("HOME", tmp)}
        subprocess.run(
            [str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", wheel],
            check=True,
            env=env,
        )
        # From a directory outside the source tree, so `import kvrs` finds the wheel.
        return subprocess.run([str(py), str(here / "smoke.py")], cwd=tmp, env=env).returncode


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
