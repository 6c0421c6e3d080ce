"""Benchmark records (:mod:`specjax.sweep`) as JSONL, a markdown table and PNG plots."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO


def append_jsonl(record: dict, f: TextIO) -> None:
    """Writes ``record`` as one JSON line to the open text file ``f`` and flushes it (a sweep
    that stops part way keeps every record written so far)."""
    f.write(json.dumps(record) + "\n")
    f.flush()


def write_jsonl(records: Sequence[dict], path: str | Path) -> None:
    """One JSON object per line."""
    with open(path, "w") as f:
        for r in records:
            append_jsonl(r, f)


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _same(same: bool | None, gap: float | None) -> str:
    """The "= plain" cell: yes, NO with the top-2 gap where outputs part, or - (sampled)."""
    if same is None:
        return "-"
    return "yes" if same else ("NO" if gap is None else f"NO (gap {gap:.3f})")


def _speedup(r: dict) -> str:
    """The cell's speedup, and the range of its repeats' where it has several."""
    runs = r.get("speedup_runs") or []
    spread = f" ({min(runs):.2f}-{max(runs):.2f})" if len(runs) > 1 else ""
    return f"{r['speedup']:.2f}x{spread}"


def _reference(records: Sequence[dict]) -> str | None:
    """The reference precision of records measured beside one (``sweep.run(reference=)``)."""
    return next((r["reference_dtype"] for r in records if r.get("reference_dtype")), None)


def markdown(records: Sequence[dict]) -> str:
    """A markdown table, one row per record, grouped by (set, temperature, batch, context) as
    run; the context column appears when some record has one, and a "vs <dtype> plain" column
    (``reference_speedup``) when the records were measured beside a reference precision. The
    speedup column adds the range over the cell's repeats (``speedup_runs``) where there are
    several."""
    ctx = any(r.get("context") for r in records)
    ref = _reference(records)
    head = ("| set | T | batch |" + (" context |" if ctx else "")
            + " method | tok/s | speedup |" + (f" vs {ref} plain |" if ref else "")
            + " τ | TTFT ms | TPOT ms p50 / p95 / p99 | drafted "
              "| nodes/cycle | draft / verify / other ms | peak MB | = plain |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in records:
        tp = r["tpot_ms"]
        split = r["split_ms"]
        same = r["same_as_plain"]
        tpot = "-" if tp is None else f"{tp['p50']:.1f} / {tp['p95']:.1f} / {tp['p99']:.1f}"
        lines.append(
            f"| {r['set']} | {r['temperature']:g} | {r['batch']} "
            + (f"| {r.get('context') or '-'} " if ctx else "") + f"| {r['method']} "
            f"| {r['tok_s']:.1f} | {_speedup(r)} "
            + (f"| {_ratio(r.get('reference_speedup'))} " if ref else "")
            + f"| {r['tau']:.2f} "
            f"| {_num(r['ttft_ms'], '.0f')} | {tpot} "
            f"| {_num(r['drafted'], '.0%')} | {_num(r['verified'], '.1f')} "
            f"| {'-' if split is None else '{draft:.1f} / {verify:.1f} / {other:.1f}'.format(**split)} "
            f"| {_num(r['peak_mb'], '.0f')} | {_same(same, r.get('divergence_gap'))} |")
    return "\n".join(lines)


def summary(records: Sequence[dict]) -> str:
    """Per method: its mean speedup over the cells and its worst cell, and its mean speedup
    over the reference precision's plain decoding over the cells that have one ("-" when none
    of the method's do)."""
    by = {}
    for r in records:
        by.setdefault(r["method"], []).append(r)
    ref = _reference(records)
    lines = ["| method | mean speedup | worst cell | mean τ |" + (f" mean vs {ref} plain |"
                                                                  if ref else ""),
             "|---|---|---|---|" + ("---|" if ref else "")]
    for name, rs in by.items():
        worst = min(rs, key=lambda r: r["speedup"])
        mean = sum(r["speedup"] for r in rs) / len(rs)
        tau = sum(r["tau"] for r in rs) / len(rs)
        where = f"{worst['set']}, T={worst['temperature']:g}, batch {worst['batch']}"
        if worst.get("context"):
            where += f", context {worst['context']}"
        line = f"| {name} | {mean:.2f}x | {worst['speedup']:.2f}x ({where}) | {tau:.2f} |"
        if ref:  # over the method's cells that had a reference (records of several sweeps)
            refs = [r["reference_speedup"] for r in rs if r.get("reference_speedup") is not None]
            line += f" {_ratio(sum(refs) / len(refs) if refs else None)} |"
        lines.append(line)
    return "\n".join(lines)


def plot(records: Sequence[dict], path: str | Path) -> None:
    """:func:`figure` saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = figure(records)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figure(records: Sequence[dict]):
    """Speedup and τ per prompt set, one bar per method, one row of panels per (temperature,
    batch, context): a matplotlib Figure."""
    import matplotlib.pyplot as plt
    import numpy as np

    groups = sorted({(r["temperature"], r["batch"], r.get("context") or 0) for r in records})
    sets = list(dict.fromkeys(r["set"] for r in records))
    names = list(dict.fromkeys(r["method"] for r in records))
    fig, axes = plt.subplots(len(groups), 2, figsize=(12, 3.6 * len(groups)), squeeze=False)
    width = 0.8 / len(names)
    for row, (t, b, c) in enumerate(groups):
        cell = {(r["method"], r["set"]): r for r in records
                if r["temperature"] == t and r["batch"] == b and (r.get("context") or 0) == c}
        for col, (field, label) in enumerate((("speedup", "speedup over plain"), ("tau", "τ"))):
            ax = axes[row, col]
            x = np.arange(len(sets))
            for i, name in enumerate(names):
                ys = [cell[name, s][field] if (name, s) in cell else np.nan for s in sets]
                ax.bar(x + (i - (len(names) - 1) / 2) * width, ys, width, label=name)
            if field == "speedup":
                ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_xticks(x, sets)
            ax.set_ylabel(label)
            ax.set_title(f"T = {t:g}, batch {b}" + (f", context {c}" if c else ""))
    axes[0, 0].legend(fontsize=7, loc="best")
    fig.tight_layout()
    return fig
