"""The built wheel ships the kernels as ``specjax.kernels`` and no top-level ``kernels``.

transformers probes for a PyPI distribution named ``kernels`` at import time and imports any
module of that name it finds; a wheel that installed one would break or hijack it.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out), str(ROOT)], check=True)
    (path,) = out.glob("specjax-*.whl")
    return path


def test_wheel_maps_kernels_under_specjax(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "specjax/kernels/__init__.py" in names
    assert "specjax/kernels/attention.py" in names
    assert "specjax/kernels/cpu_gemm.cc" in names  # compiled on first use
    assert not [n for n in names if n.startswith("kernels/")]


def test_installed_wheel_imports_kernels_and_leaves_the_name_free(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(site), str(wheel)], check=True)
    probe = (
        "import importlib.util, specjax.kernels.attention as a, specjax;"
        "assert specjax.__file__.startswith(%r), specjax.__file__;"
        "assert callable(a.reference_attention);"
        "k = importlib.util.find_spec('kernels');"
        "assert k is None or not (k.origin or '').startswith(%r), k.origin"
    ) % (str(site), str(site))
    # -I: isolated mode, so neither the repository nor its editable install is on the path;
    # the installed wheel and the interpreter's site-packages (for jax) are.
    env_path = [str(site)] + [p for p in sys.path if p.endswith("site-packages")]
    subprocess.run([sys.executable, "-I", "-c",
                    f"import sys; sys.path[:0] = {env_path!r}; {probe}"],
                   check=True, cwd=tmp_path)
    assert not (site / "kernels").exists()
