"""Self-distillation: the target answers training prompts itself, and its responses become a
drafter's training data (records in the format of :mod:`specjax.train.data`).

    specjax data distill --out data/smollm2 --input prompts.jsonl --input gsm8k.jsonl:question

A drafter learns to predict what the target would say, so the best data is what the target
does say, sampled as it is served (temperature 0.7, top-p 0.8, top-k 20 by default).

Prompts: JSONL files, one record a line, read through a field: ``prompt`` (a user turn),
``messages`` (a conversation ending in a user turn) or any other string field (``question``,
``text``, ...). Each prompt is formatted with the target tokenizer's chat template (with
``system`` as the system message, or the template's default) and must not overlap an
evaluation set (:class:`specjax.train.data.EvalFingerprints`); prompts longer than
``max_prompt_tokens`` are skipped and counted.

Determinism and resumption: the kept prompts are shuffled once with the seed (so every prefix
of the shards samples all inputs alike) and cut into shards of ``shard_size`` prompts; the order
is written to the manifest. The shards' prompts, each shard's sorted by length, go through one
continuous-batching pool (:mod:`specjax.batching`: ``batch_size`` rows refilled every ``chunk``
steps, so rows whose answers end early do not idle until the longest one ends, and the next
shard's prompts fill the rows a finishing shard frees), and prompt i of shard k samples with
keys derived from (seed, k, i) only. A shard is thus a function of the settings and its index:
a run that is killed and restarted with the same settings skips the shard files already written
and produces the same bytes an uninterrupted run would have. A directory whose manifest holds
different settings is refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import multiprocessing
import os
import queue as queue_lib
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from specjax.train import data

DEFAULT_FIELDS = ("messages", "prompt")  # tried in this order when an input names no field
# Each worker process runs XLA single-threaded: for a model of SmolLM2-135M's size a decode step
# spreads poorly over XLA:CPU's threads: two such processes on two cores each stepped a 64-row
# pool about as fast as one of them alone, faster than one two-threaded process (the output
# bytes do not depend on the threading).
WORKER_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """A JSONL prompt file and the field that holds each line's prompt.

    Attributes:
      path: the file.
      field: the JSON field; None tries ``messages`` then ``prompt``. A ``messages`` value is a
        conversation (``[{"role", "content"}, ...]`` ending in a user turn); any other field
        holds one user turn's text.
    """

    path: str
    field: str | None = None

    @classmethod
    def parse(cls, spec: str) -> "InputSpec":
        """From ``PATH`` or ``PATH:FIELD`` (the text after the last colon is a field when it
        is a plain identifier, so Windows-style and odd paths still work)."""
        head, sep, tail = spec.rpartition(":")
        if sep and head and tail.isidentifier():
            return cls(head, tail)
        return cls(spec)


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """Every setting that decides the data; the manifest stores them and a resumed run must
    match them.

    Attributes:
      inputs: the prompt files, in order (prompt indices count their lines in this order).
      target: a model name or path that :func:`specjax.io.models.load` accepts.
      dtype: the target's dtype.
      system: the system message, or None for the chat template's default.
      max_prompt_tokens: longer formatted prompts are skipped.
      max_new_tokens, temperature, top_k, top_p: response sampling.
      seed: shuffles the prompts and seeds every batch's sampling.
      batch_size: rows decoding at once (the continuous-batching pool; part of the data: it
        fixes which prompts share a decode step's shapes).
      chunk: decode steps between the pool's refills (part of the data, like batch_size).
      shard_size: prompts per shard file.
      max_prompts: keep only the first this many prompts of the shuffled order (None = all).
      exclude_task_ids: an inclusive ``(lo, hi)`` range; lines whose ``task_id`` lies in it are
        dropped (MBPP's test split is task ids 11-510), or None.
      drop_eval_overlap: drop prompts that overlap an evaluation set (listed in the manifest)
        instead of refusing the run. GSM8K's and MBPP's train splits hold templated
        near-copies of test items (and MBPP five verbatim ones), which this keeps out.
    """

    inputs: tuple[InputSpec, ...]
    target: str = "smollm2-135m"
    dtype: str = "float32"
    system: str | None = None
    max_prompt_tokens: int = 512
    max_new_tokens: int = 384
    temperature: float = 0.7
    top_k: int = 20
    top_p: float = 0.8
    seed: int = 0
    batch_size: int = 32
    chunk: int = 32
    shard_size: int = 256
    max_prompts: int | None = None
    exclude_task_ids: tuple[int, int] | None = None
    drop_eval_overlap: bool = False

    def __post_init__(self):
        if not self.inputs:
            raise ValueError("no inputs given")
        for name in ("max_prompt_tokens", "max_new_tokens", "batch_size", "chunk", "shard_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"need temperature >= 0, top_k >= 0, 0 < top_p <= 1; got "
                             f"{self.temperature}, {self.top_k}, {self.top_p}")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ValueError(f"max_prompts must be >= 1 or None, got {self.max_prompts}")
        if self.exclude_task_ids is not None and self.exclude_task_ids[0] > self.exclude_task_ids[1]:
            raise ValueError(f"exclude_task_ids {self.exclude_task_ids}: lo > hi")


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One input line: where it came from and its conversation."""

    index: int  # over every line of every input, in order
    path: str
    line: int  # 1-based
    messages: tuple[tuple[str, str], ...]  # (role, content)


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_prompts(spec: InputSpec, first_index: int,
                 exclude_task_ids: tuple[int, int] | None = None) -> tuple[list[Prompt], int]:
    """The prompts of one input file, and its number of lines.

    Raises:
      ValueError: a line that is not JSON, lacks the field, or holds a conversation that does
        not end in a user turn; the message names the file and line.
    """
    prompts, n_lines = [], 0
    with open(spec.path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            n_lines += 1
            where = f"{spec.path}:{line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e})") from None
            index = first_index + n_lines - 1
            if exclude_task_ids is not None and "task_id" in row:
                if exclude_task_ids[0] <= int(row["task_id"]) <= exclude_task_ids[1]:
                    continue
            field = spec.field or next((k for k in DEFAULT_FIELDS if k in row), None)
            if field is None or field not in row:
                raise ValueError(f"{where}: no field {spec.field or ' or '.join(DEFAULT_FIELDS)!r}"
                                 f" (has {sorted(row)}); name one with PATH:FIELD")
            value = row[field]
            if field == "messages":
                if (not isinstance(value, list) or not value
                        or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                   and isinstance(m.get("role"), str) for m in value)):
                    raise ValueError(f"{where}: 'messages' must be a list of "
                                     "{'role': str, 'content': str}")
                if value[-1]["role"] != "user":
                    raise ValueError(f"{where}: the conversation ends in a "
                                     f"{value[-1]['role']!r} turn, not a user turn")
                messages = tuple((m["role"], m["content"]) for m in value)
            elif isinstance(value, str):
                messages = (("user", value),)
            else:
                raise ValueError(f"{where}: field {field!r} is a {type(value).__name__}, "
                                 "not a string")
            prompts.append(Prompt(index, spec.path, line_no, messages))
    return prompts, n_lines


def eval_overlaps(prompts: Sequence[Prompt],
                  fingerprints: data.EvalFingerprints) -> list[tuple[Prompt, str]]:
    """(prompt, evaluation set) for every prompt whose text (any message of a conversation)
    overlaps an evaluation set."""
    out = []
    for p in prompts:
        hit = next(filter(None, (fingerprints.match(c) for _, c in p.messages)), None)
        if hit is not None:
            out.append((p, hit))
    return out


def shard_seed(seed: int, shard: int) -> int:
    """The sampling seed of shard ``shard``: depends on nothing else (its prompt i then draws
    with keys folded from this seed and i, :mod:`specjax.batching`)."""
    return int(np.random.SeedSequence([seed, shard]).generate_state(1)[0])


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """What a run generates.

    Attributes:
      settings: the manifest's settings (compared on resume).
      prompt_ids: prompt index -> formatted prompt token ids, for the kept prompts.
      order: the kept prompt indices in shuffled order; shard k is
        ``order[k * shard_size:(k + 1) * shard_size]``.
      n_skipped: prompts longer than ``max_prompt_tokens``.
    """

    settings: dict
    prompt_ids: dict[int, list[int]]
    order: list[int]
    n_skipped: int

    @property
    def n_shards(self) -> int:
        return -(-len(self.order) // self.settings["shard_size"])

    def shard(self, k: int) -> list[int]:
        size = self.settings["shard_size"]
        return self.order[k * size:(k + 1) * size]


def make_plan(cfg: DistillConfig, tokenizer, fingerprints: data.EvalFingerprints) -> Plan:
    """Reads, checks, formats and shuffles the prompts (no model needed)."""
    prompts, inputs, first = [], [], 0
    for spec in cfg.inputs:
        ps, n_lines = read_prompts(spec, first, cfg.exclude_task_ids)
        inputs.append(dict(path=str(Path(spec.path).resolve()), field=spec.field,
                           sha256=sha256_file(spec.path), first_index=first, lines=n_lines,
                           prompts=len(ps)))
        prompts += ps
        first += n_lines
    overlaps = eval_overlaps(prompts, fingerprints)
    if overlaps and not cfg.drop_eval_overlap:
        p, hit = overlaps[0]
        text = p.messages[-1][1]
        raise ValueError(f"{p.path}:{p.line}: prompt overlaps the evaluation set {hit} "
                         f"({text[:60]!r}...; {len(overlaps)} overlapping prompts in all); "
                         "remove them from the inputs or pass --drop-eval-overlap")
    dropped = {p.index for p, _ in overlaps}
    prompts = [p for p in prompts if p.index not in dropped]
    prefix = [] if cfg.system is None else [{"role": "system", "content": cfg.system}]
    prompt_ids, n_skipped = {}, 0
    for p in prompts:
        ids = tokenizer.encode_chat(prefix + [{"role": r, "content": c} for r, c in p.messages])
        if len(ids) > cfg.max_prompt_tokens:
            n_skipped += 1
        else:
            prompt_ids[p.index] = ids
    kept = np.array(sorted(prompt_ids), np.int64)
    order = kept[np.random.default_rng(cfg.seed).permutation(len(kept))].tolist()
    if cfg.max_prompts is not None:
        order = order[:cfg.max_prompts]
    if not order:
        raise ValueError("no prompts left to generate from")
    settings = dict(
        format_version=data.FORMAT_VERSION, target=cfg.target, dtype=cfg.dtype,
        vocab_size=tokenizer.vocab_size, system=cfg.system,
        max_prompt_tokens=cfg.max_prompt_tokens, max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, seed=cfg.seed,
        batch_size=cfg.batch_size, chunk=cfg.chunk, shard_size=cfg.shard_size,
        max_prompts=cfg.max_prompts,
        exclude_task_ids=None if cfg.exclude_task_ids is None else list(cfg.exclude_task_ids),
        drop_eval_overlap=cfg.drop_eval_overlap, inputs=inputs,
        dropped_eval_overlap=[f"{p.path}:{p.line} ({hit})" for p, hit in overlaps],
        input_prompts=len(prompts), skipped_long_prompts=n_skipped, prompts=len(order))
    return Plan(settings, {i: prompt_ids[i] for i in order}, order, n_skipped)


def _check_resume(manifest: dict, plan: Plan, path: Path) -> None:
    old = manifest.get("settings", {})
    for key in sorted(set(old) | set(plan.settings)):
        if old.get(key) != plan.settings.get(key):
            raise ValueError(f"{path} was made with different settings: {key} = "
                             f"{old.get(key)!r} there, {plan.settings.get(key)!r} now; "
                             "use another --out directory or the same settings")
    if manifest.get("order") != plan.order:
        raise ValueError(f"{path} was made with a different prompt order (order); the inputs "
                         "or the tokenizer changed")


def _manifest(plan: Plan, shards: dict[int, dict]) -> dict:
    return dict(settings=plan.settings, n_shards=plan.n_shards,
                complete=len(shards) == plan.n_shards,
                shards=[dict(shard=k, **shards[k]) for k in sorted(shards)], order=plan.order)


def _write_manifest(path: Path, manifest: dict) -> None:
    data.write_atomic(path, (json.dumps(manifest, indent=1) + "\n").encode())


def generate_shards(cfg: DistillConfig, model, plan: Plan, shards: Sequence[int],
                    on_shard: Callable[[int, dict], None], on_prompt=None) -> None:
    """Generates the shards ``shards`` (in that order) through one pool.

    The shards' prompts enter one continuous-batching pool back to back, so the next shard's
    prompts fill the rows that a finishing shard frees instead of the pool draining at every
    shard's end. Within a shard prompts enter by length (a stable sort, so the schedule is a
    function of the plan alone); prompt i of that order in shard k samples with the keys of
    row i of a batch seeded :func:`shard_seed` (k), so a shard's bytes depend on its index, not
    on which shards ran beside it.

    Args:
      cfg, plan: the run.
      model: the loaded target (:class:`specjax.io.models.LoadedModel`).
      shards: the shard indices to generate.
      on_shard: called as ``on_shard(k, arrays)`` when shard k's last answer ends, with its
        arrays (see :func:`specjax.train.data.shard_arrays`).
      on_prompt: called as ``on_prompt(n_response_tokens)`` as each prompt's answer ends.
    """
    from specjax import batching

    prompts, seeds, ids, where = [], [], [], []
    for k in shards:
        indices = plan.shard(k)
        by_length = sorted(range(len(indices)), key=lambda i: len(plan.prompt_ids[indices[i]]))
        for rank, i in enumerate(by_length):
            prompts.append(plan.prompt_ids[indices[i]])
            seeds.append(shard_seed(cfg.seed, k))
            ids.append(rank)
            where.append((k, i))
    answers = {k: [None] * len(plan.shard(k)) for k in shards}
    left = {k: len(plan.shard(k)) for k in shards}

    def on_finish(f):
        k, i = where[f.index]
        answers[k][i] = f
        left[k] -= 1
        if on_prompt is not None:
            on_prompt(len(f.tokens))
        if not left[k]:
            indices, done = plan.shard(k), answers.pop(k)
            on_shard(k, data.shard_arrays(
                [plan.prompt_ids[i] for i in indices], [a.tokens for a in done], indices,
                [a.stopped for a in done], model.tokenizer.vocab_size))

    batching.generate(
        model.cfg, model.params, prompts, max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, seed=seeds,
        request_ids=ids, stop_tokens=model.tokenizer.eos_ids, pool_size=cfg.batch_size,
        chunk=cfg.chunk, on_finish=on_finish)


def _write_shard(out: Path, k: int, arrays: dict) -> dict:
    """Writes shard ``k``'s arrays into ``out`` (atomically); returns its summary."""
    data.write_atomic(out / data.shard_name(k), data.npz_bytes(arrays))
    return data.shard_summary(arrays)


def _worker(cfg: DistillConfig, plan: Plan, out_dir: str, shards: list[int], messages,
            parent: int) -> None:
    """One worker process of :func:`distill`: generates ``shards`` into ``out_dir`` and reports
    ``("prompt", n_tokens)``, ``("shard", k, summary)`` and finally ``("done",)`` on
    ``messages``. Exits if its parent (pid ``parent``) is gone."""
    from specjax.io.models import load

    model = load(cfg.target, dtype=cfg.dtype)
    out = Path(out_dir)

    def on_shard(k, arrays):
        messages.put(("shard", k, _write_shard(out, k, arrays)))

    def on_prompt(n_tokens):
        if os.getppid() != parent:  # the parent was killed: a restart will redo our shards
            os._exit(1)
        messages.put(("prompt", n_tokens))

    generate_shards(cfg, model, plan, shards, on_shard, on_prompt)
    messages.put(("done",))


def _run_workers(cfg: DistillConfig, plan: Plan, out: Path, missing: list[int], workers: int,
                 on_written: Callable[[int, dict], None],
                 on_prompt: Callable[[int], None]) -> None:
    """Generates the ``missing`` shards in ``workers`` processes (worker w takes every
    ``workers``-th one from the w-th); each writes its shard files and reports here, where
    ``on_written(k, summary)`` and ``on_prompt(n_tokens)`` are called, so that only this
    process writes the manifest."""
    ctx = multiprocessing.get_context("spawn")
    messages = ctx.Queue()
    before = os.environ.get("XLA_FLAGS")
    os.environ["XLA_FLAGS"] = f"{before} {WORKER_XLA_FLAGS}" if before else WORKER_XLA_FLAGS
    try:  # a spawned process reads the environment as it starts
        procs = [ctx.Process(target=_worker, daemon=True,
                             args=(cfg, plan, str(out), missing[w::workers], messages,
                                   os.getpid()))
                 for w in range(workers)]
        for p in procs:
            p.start()
    finally:
        if before is None:
            del os.environ["XLA_FLAGS"]
        else:
            os.environ["XLA_FLAGS"] = before
    running = workers
    try:
        while running:
            try:
                msg = messages.get(timeout=1.0)
            except queue_lib.Empty:
                failed = [w for w, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed:
                    raise RuntimeError(
                        f"distill worker {failed[0]} exited with code "
                        f"{procs[failed[0]].exitcode} (its error is printed above); the shards "
                        "written so far are kept and a restart generates the rest") from None
                continue
            if msg[0] == "prompt":
                on_prompt(msg[1])
            elif msg[0] == "shard":
                on_written(msg[1], msg[2])
            else:
                running -= 1
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()


def distill(cfg: DistillConfig, out_dir: str | Path, *, progress: bool = True,
            fingerprints: data.EvalFingerprints | None = None, workers: int = 1) -> dict:
    """Generates (or finishes) the data directory ``out_dir``; returns its manifest.

    Args:
      cfg: the settings.
      out_dir: created if missing; if it holds a manifest, its settings must equal ``cfg``'s
        and the shards already written are kept.
      progress: show a tqdm bar over prompts with response tokens/s.
      fingerprints: the evaluation-set guard (default: the shipped fingerprints).
      workers: processes generating shards side by side, each with single-threaded XLA
        (:data:`WORKER_XLA_FLAGS`); 1 generates here. The bytes are the same either way.
    Raises:
      ValueError: bad inputs, a prompt overlapping an evaluation set, or a directory made
        with different settings.
      RuntimeError: a worker process failed.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    from tqdm import tqdm

    from specjax.io.models import load

    out = Path(out_dir)
    model = load(cfg.target, dtype=cfg.dtype)
    if model.tokenizer is None:
        raise ValueError(f"{cfg.target} has no tokenizer files; distillation needs a tokenizer")
    plan = make_plan(cfg, model.tokenizer, fingerprints or data.EvalFingerprints.load())
    manifest_path = out / data.MANIFEST
    if manifest_path.exists():
        _check_resume(json.loads(manifest_path.read_text()), plan, manifest_path)
    out.mkdir(parents=True, exist_ok=True)
    shards = {k: data.shard_summary(data.read_shard(out / data.shard_name(k)))
              for k in range(plan.n_shards) if (out / data.shard_name(k)).exists()}
    _write_manifest(manifest_path, _manifest(plan, shards))
    done = sum(len(plan.shard(k)) for k in shards)
    bar = tqdm(total=len(plan.order), initial=done, unit="prompt", disable=not progress,
               desc=f"distill {out.name}")
    if plan.n_skipped:
        bar.write(f"skipped {plan.n_skipped} prompts longer than {cfg.max_prompt_tokens} tokens")
    t0, n_tok = time.perf_counter(), 0

    def on_prompt(n_tokens):
        nonlocal n_tok
        n_tok += n_tokens
        bar.update(1)
        bar.set_postfix(resp_tok_s=f"{n_tok / (time.perf_counter() - t0):.1f}")

    def record(k, summary):
        shards[k] = summary
        _write_manifest(manifest_path, _manifest(plan, shards))

    def on_shard(k, arrays):
        record(k, _write_shard(out, k, arrays))

    missing = [k for k in range(plan.n_shards) if k not in shards]
    if workers > 1 and len(missing) > 1:
        _run_workers(cfg, plan, out, missing, min(workers, len(missing)), record, on_prompt)
    elif missing:
        generate_shards(cfg, model, plan, missing, on_shard, on_prompt)
    bar.close()
    return _manifest(plan, shards)
