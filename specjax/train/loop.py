"""The training loop every drafter family shares: an NNX module, a loss, a data source.

    result = loop.train(model, loss_fn, source, TrainConfig(run_dir="runs/x", steps=2000))

What it does, in order of the guarantees it makes:

* **One jitted step over pure state.** The module is split once (``nnx.split``) into its
  trainable ``nnx.Param`` state and everything else; the step ``jax.jit``-compiles a pure
  function of (:class:`TrainState`, constants, batch), merges the module inside
  (``nnx.merge``) to call the loss, takes ``jax.value_and_grad``, and applies Optax AdamW with
  global-norm clipping, linear warmup and cosine decay (:func:`learning_rate`). The state is
  donated, so parameters and moments are updated in place.
* **Exact resume.** Orbax checkpoints hold the step, the parameters, the optimizer state, the
  PRNG key and the data source's position. A run restarted with the same command restores the
  latest one into the abstract state (``jax.eval_shape``) and continues with the batches and
  keys it would have seen: its final parameters equal an uninterrupted run's bit for bit.
* **Preemption.** SIGTERM or SIGINT asks for a checkpoint at the next step boundary; the loop
  saves it and returns (:attr:`TrainResult.signal`). A second signal acts as it would without
  the loop (a second Ctrl-C raises ``KeyboardInterrupt`` at once).
* **Records.** ``metrics.jsonl`` in the run directory gets one line per log step (mean loss and
  metrics over the steps since the last line, learning rate, tokens/s) and per evaluation
  (``eval_fn``'s values prefixed ``eval_``); ``metrics.png`` redraws the curves with them
  (:class:`MetricsLog`: at every evaluation and the last step, else at most every 10 s). A
  tqdm bar shows loss and tokens/s.

Only ``nnx.Param`` variables train. Any other variable of the module is a constant of the run
(a family freezes an array by holding it in another ``nnx.Variable`` type): it is neither
differentiated nor checkpointed, so the code that builds the module must rebuild it the same
way on resume (a drafter's copy of the target's embedding, say).
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tqdm.auto import tqdm

from specjax.train import data

N_TOKENS = "n_tokens"  # the batch entry counting its tokens (for tokens/s; not given to the loss)
METRICS = "metrics.jsonl"
PLOT = "metrics.png"
CHECKPOINTS = "checkpoints"


class DataSource(Protocol):
    """Where batches come from, with a position that checkpoints can hold.

    ``next()`` returns a dict of NumPy arrays of the same shapes every call (the step compiles
    once), including ``N_TOKENS``, a scalar count of the batch's tokens. ``state()`` is a small
    JSON-able dict such that ``restore(state())`` on a fresh source makes it return the same
    batches from there on.
    """

    def next(self) -> dict[str, np.ndarray]: ...

    def state(self) -> dict: ...

    def restore(self, state: dict) -> None: ...


# loss_fn(model, batch, rng) -> (scalar loss, {name: scalar}) with batch the arrays of a
# DataSource batch (N_TOKENS removed) and rng a fresh typed PRNG key every step.
LossFn = Callable[[nnx.Module, dict[str, jax.Array], jax.Array],
                  tuple[jax.Array, dict[str, jax.Array]]]
# eval_fn(model, step) -> {name: number or bool}, run on the host between steps. The module
# is valid during the call only: the next step donates its arrays.
EvalFn = Callable[[nnx.Module, int], Mapping[str, Any]]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Settings of one training run.

    Attributes:
      run_dir: where checkpoints, ``metrics.jsonl`` and ``metrics.png`` go; a run directory
        that holds checkpoints is resumed from the latest one.
      steps: optimizer steps in all (a resumed run counts the steps already done).
      lr: the peak learning rate.
      warmup_frac: the fraction of ``steps`` that warms up linearly, used when
        ``warmup_steps`` is None.
      warmup_steps: warmup steps, overriding ``warmup_frac``.
      final_lr_frac: the cosine decay ends at ``final_lr_frac * lr`` on the last step.
      weight_decay: AdamW's decoupled weight decay, applied to matrices only (arrays of two or
        more dimensions); norm scales and biases are not pulled towards 0.
      b1, b2, eps: Adam's moment decay rates and epsilon.
      clip_norm: gradients are scaled down to this global norm when larger.
      save_every: checkpoint every this many steps (the last step is always saved).
      eval_every: run ``eval_fn`` every this many steps, at step 0 of a fresh run and at the
        last step; 0 never runs it.
      log_every: one ``metrics.jsonl`` line every this many steps (and at the last step).
      seed: seeds the PRNG key handed to the loss.
      max_to_keep: checkpoints kept on disk (the oldest are deleted).
    """

    run_dir: str
    steps: int
    lr: float = 3e-4
    warmup_frac: float = 0.05
    warmup_steps: int | None = None
    final_lr_frac: float = 0.1
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0
    save_every: int = 500
    eval_every: int = 0
    log_every: int = 10
    seed: int = 0
    max_to_keep: int = 2

    def __post_init__(self):
        if not self.run_dir:
            raise ValueError("run_dir must name a directory, got an empty string")
        for name in ("steps", "save_every", "log_every", "max_to_keep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.eval_every, int) or self.eval_every < 0:
            raise ValueError(f"eval_every must be an int >= 0, got {self.eval_every!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.warmup_frac < 1:
            raise ValueError(f"warmup_frac must be in [0, 1), got {self.warmup_frac}")
        if self.warmup_steps is not None and not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"warmup_steps must be in [0, steps={self.steps}], "
                             f"got {self.warmup_steps}")
        if not 0 <= self.final_lr_frac <= 1:
            raise ValueError(f"final_lr_frac must be in [0, 1], got {self.final_lr_frac}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if not self.clip_norm > 0:
            raise ValueError(f"clip_norm must be > 0, got {self.clip_norm}")

    @property
    def n_warmup(self) -> int:
        """Warmup steps: ``warmup_steps``, or ``warmup_frac`` of ``steps`` rounded down."""
        return self.warmup_steps if self.warmup_steps is not None else int(self.warmup_frac
                                                                           * self.steps)


def learning_rate(cfg: TrainConfig) -> optax.Schedule:
    """The learning rate of the update that completes step ``count + 1`` (Optax's ``count``
    is the number of updates already applied).

    Steps 1..W (W = ``cfg.n_warmup``) ramp linearly to the peak, ``lr * s / W`` (the first
    update is not wasted at rate 0); steps W..``steps`` follow a cosine from the peak down to
    ``final_lr_frac * lr``.
    """
    peak, floor, w, total = cfg.lr, cfg.lr * cfg.final_lr_frac, cfg.n_warmup, cfg.steps

    def schedule(count):
        step = jnp.asarray(count, jnp.float32) + 1
        progress = jnp.clip((step - w) / max(total - w, 1), 0.0, 1.0)
        cosine = floor + (peak - floor) * 0.5 * (1 + jnp.cos(math.pi * progress))
        return jnp.where(step <= w, peak * step / max(w, 1), cosine)

    return schedule


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW at :func:`learning_rate` with decay on matrices."""
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(learning_rate(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                    weight_decay=cfg.weight_decay,
                    mask=lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)),
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything a step changes, as a pytree (what a checkpoint holds besides the data
    position).

    Attributes:
      step: [] int32, optimizer steps done.
      params: the module's ``nnx.Param`` state.
      opt_state: the Optax state of ``params``.
      rng: [2] uint32 raw key data; step s hands the loss a key split from it.
    """

    step: jax.Array
    params: nnx.State
    opt_state: Any
    rng: jax.Array


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """How :func:`train` ended.

    Attributes:
      step: the last step done (and checkpointed).
      signal: the signal number (SIGTERM, SIGINT) that stopped the run early, else None.
      resumed_from: the checkpoint step the run started from, None for a fresh run.
    """

    step: int
    signal: int | None
    resumed_from: int | None


def _train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
                schedule: optax.Schedule, loss_fn: LossFn, state: TrainState,
                constants: nnx.State, batch: dict[str, jax.Array]):
    """One optimizer step; pure, so it can be jitted with ``state`` donated.

    Returns ``(state, metrics)``: the loss, the loss's own metrics, the global gradient norm
    before clipping and the learning rate used, all scalars.
    """
    key, next_key = jax.random.split(jax.random.wrap_key_data(state.rng))

    def loss_of(params):
        return loss_fn(nnx.merge(graphdef, params, constants), batch, key)

    (loss, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads),
                   lr=schedule(state.step))
    return TrainState(state.step + 1, params, opt_state, jax.random.key_data(next_key)), metrics


class _StopRequest:
    """Records the first SIGTERM or SIGINT instead of dying; the loop checks ``signum`` at
    each step boundary. After the first signal the previous handlers are back, so a second
    one acts as usual. Handlers can only be installed from the main thread; elsewhere the
    loop runs without them."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.signum = signum
        self._restore()

    def _restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __exit__(self, *exc):
        self._restore()


class MetricsLog:
    """``metrics.jsonl`` plus its plot, in a run directory.

    Each line is a JSON object with a ``step``; training lines hold ``loss``, evaluation lines
    ``eval_*`` values. The plot is redrawn on a forced append and otherwise at most every
    ``plot_interval_s`` seconds: a redraw costs a few tenths of a second of host time, as much
    as many small training steps.
    """

    def __init__(self, run_dir: str | Path, plot_interval_s: float = 10.0):
        self.path = Path(run_dir) / METRICS
        self.plot_path = Path(run_dir) / PLOT
        self.plot_interval_s = plot_interval_s
        self._plotted_at = time.monotonic()

    def records(self) -> list[dict]:
        """The logged records; a last line cut short (by a kill mid-write) is left out."""
        if not self.path.exists():
            return []
        lines = self.path.read_text().split("\n")
        return [json.loads(line) for line in lines[:-1] if line]

    def drop_after(self, step: int) -> None:
        """Forgets lines past ``step``: a run killed after its last checkpoint logged steps it
        will redo on resume, and the log should read as one run."""
        kept = [r for r in self.records() if r["step"] <= step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def append(self, record: Mapping[str, Any], force_plot: bool = False) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if force_plot or time.monotonic() - self._plotted_at >= self.plot_interval_s:
            plot_metrics(self.records(), self.plot_path)
            self._plotted_at = time.monotonic()


def plot_metrics(records: list[dict], path: str | Path) -> None:
    """Draws the training loss and each numeric evaluation value (a panel each) against the
    step into a PNG at ``path``, replaced atomically so a viewer never reads half a file
    (matplotlib's Agg canvas: no display or pyplot state needed)."""
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    evals = sorted({k for r in records for k, v in r.items()
                    if k.startswith("eval_") and isinstance(v, (int, float))
                    and not isinstance(v, bool)})
    panels = [("loss", "training loss")] + [(k, k[len("eval_"):]) for k in evals]
    fig = Figure(figsize=(4.5 * len(panels), 3.5))
    FigureCanvasAgg(fig)
    for i, (key, label) in enumerate(panels):
        rows = [r for r in records if key in r]
        ax = fig.add_subplot(1, len(panels), i + 1)
        ax.plot([r["step"] for r in rows], [r[key] for r in rows],
                marker="o" if key != "loss" else None)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    data.write_atomic(path, buf.getvalue())


def checkpoint_manager(run_dir: str | Path, max_to_keep: int = 2) -> ocp.CheckpointManager:
    """The run's Orbax checkpoint manager (``run_dir/checkpoints/<step>``).

    Saves are synchronous: a checkpoint is on disk when ``save`` returns, as one asked for by a
    signal must be before the process exits, and no save overlaps the next step, which donates
    the buffers being saved. Saves are rare, so waiting for them costs little.
    Temporary directories left by a killed save are cleaned up when the manager opens.
    """
    return ocp.CheckpointManager(
        Path(run_dir).resolve() / CHECKPOINTS,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                             enable_async_checkpointing=False,
                                             cleanup_tmp_directories=True))


def _save(mngr: ocp.CheckpointManager, state: TrainState, source: DataSource) -> None:
    mngr.save(int(state.step), args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(source.state())))


def _fresh_state(params: nnx.State, tx, seed: int) -> TrainState:
    # The state owns copies: donating the module's own arrays would free them under the
    # caller (a drafter's layers may be the very arrays of the target it drafts for).
    params = jax.tree.map(jnp.copy, params)
    return TrainState(jnp.int32(0), params, tx.init(params),
                      jax.random.key_data(jax.random.key(seed)))


def _mean_metrics(window: list[dict]) -> dict[str, float]:
    """The mean of each metric over a window of steps; the learning rate is the last one."""
    host = jax.device_get(window)
    out = {k: float(np.mean([m[k] for m in host])) for k in host[0]}
    out["lr"] = float(host[-1]["lr"])
    return out


def train(model: nnx.Module, loss_fn: LossFn, source: DataSource, cfg: TrainConfig, *,
          eval_fn: EvalFn | None = None, progress: bool = True) -> TrainResult:
    """Trains ``model``'s ``nnx.Param`` variables on ``source`` by ``loss_fn``, resuming
    from the run directory's latest checkpoint when there is one (module docstring).

    Args:
      model: the module; on return its parameters are those of the last step done.
      loss_fn: ``(model, batch, rng) -> (loss, metrics)``, traced inside the jitted step.
      source: the batches (:class:`DataSource`); restored to the checkpoint's position on
        resume.
      cfg: the run's settings.
      eval_fn: ``(model, step) -> {name: value}``, run every ``cfg.eval_every`` steps.
      progress: show a tqdm bar.
    Returns:
      how the run ended; a run stopped by a signal has saved a checkpoint at ``step``.
    """
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tx, schedule = make_optimizer(cfg), learning_rate(cfg)
    graphdef, params, constants = nnx.split(model, nnx.Param, ...)
    log = MetricsLog(run_dir)
    mngr = checkpoint_manager(run_dir, cfg.max_to_keep)
    try:
        resumed_from = mngr.latest_step()
        if resumed_from is None:
            state = _fresh_state(params, tx, cfg.seed)
            log.drop_after(-1)
        else:
            # Restore straight into the abstract state: the restored tree has exactly the
            # fresh state's structure, and no fresh optimizer state is ever materialised.
            abstract = jax.eval_shape(lambda p: _fresh_state(p, tx, cfg.seed), params)
            restored = mngr.restore(resumed_from, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
            state = restored.state
            source.restore(restored.data)
            log.drop_after(resumed_from)
        del params
        state, stop_signal = _run(graphdef, constants, tx, schedule, loss_fn, source, cfg,
                                  state, mngr, log, eval_fn, progress)
    finally:
        mngr.close()
    nnx.update(model, state.params)
    return TrainResult(step=int(state.step), signal=stop_signal, resumed_from=resumed_from)


def _run(graphdef, constants, tx, schedule, loss_fn, source, cfg, state, mngr, log, eval_fn,
         progress) -> tuple[TrainState, int | None]:
    """The steps of :func:`train` from ``state`` on; returns the last state and the signal
    that stopped the run, if any."""
    start = int(state.step)
    step_fn = jax.jit(lambda s, c, b: _train_step(graphdef, tx, schedule, loss_fn, s, c, b),
                      donate_argnums=0)

    def evaluate(step):
        values = eval_fn(nnx.merge(graphdef, state.params, constants), step)
        log.append({"step": step, **{f"eval_{k}": v for k, v in values.items()}},
                   force_plot=True)

    with _StopRequest() as stop, tqdm(total=cfg.steps, initial=start, disable=not progress,
                                      dynamic_ncols=True, mininterval=1.0) as bar:
        if eval_fn is not None and cfg.eval_every and start == 0:
            evaluate(0)
        compiled, compile_s = None, 0.0
        window, window_tokens, window_t0 = [], 0, time.perf_counter()
        for step in range(start + 1, cfg.steps + 1):
            batch = dict(source.next())
            window_tokens += int(batch.pop(N_TOKENS))
            if compiled is None:
                t0 = time.perf_counter()
                compiled = step_fn.lower(state, constants, batch).compile()
                compile_s = time.perf_counter() - t0
                window_t0 = time.perf_counter()
            state, metrics = compiled(state, constants, batch)
            window.append(metrics)
            last, stopping = step == cfg.steps, stop.signum is not None
            if step % cfg.log_every == 0 or last or stopping:
                record = {"step": step, **_mean_metrics(window)}  # waits for the step
                record["tokens_per_s"] = window_tokens / (time.perf_counter() - window_t0)
                if compile_s:
                    record["compile_s"] = compile_s
                log.append(record, force_plot=last or stopping)
                bar.set_postfix(loss=f"{record['loss']:.4f}",
                                tok_s=f"{record['tokens_per_s']:.0f}")
                window, window_tokens, compile_s = [], 0, 0.0
                window_t0 = time.perf_counter()
            do_eval = (eval_fn is not None and cfg.eval_every
                       and (step % cfg.eval_every == 0 or last))
            do_save = step % cfg.save_every == 0 or last or stopping
            if do_eval or do_save:
                # Neither is training time: tokens/s leaves them out.
                jax.block_until_ready(state)
                t0 = time.perf_counter()
                if do_eval:
                    evaluate(step)
                if do_save:
                    _save(mngr, state, source)
                window_t0 += time.perf_counter() - t0
            bar.update(1)
            if stopping:
                return state, stop.signum
    return state, None


class PackedSource:
    """A :class:`DataSource` over :func:`specjax.train.data.pack`: fixed-shape packed batches
    of distilled records, with the packing position as its state.

    Batches hold ``tokens``, ``segment_ids``, ``positions``, ``loss_mask`` (all [B, T]) and
    ``N_TOKENS``, the non-padding tokens. The state also records how many records there are
    and the packing window, so resuming over a data directory that has grown since (a
    different epoch order) or with another window is refused instead of silently training on
    other batches (a state without a window is from strict packing, ``lookahead=1``).
    """

    def __init__(self, records, *, seq_len: int, batch_size: int, seed: int = 0,
                 lookahead: int = 32):
        self.records, self.seq_len, self.batch_size, self.seed = records, seq_len, batch_size, seed
        self.lookahead = lookahead
        self._start(data.PackPosition())

    def _start(self, position: data.PackPosition):
        self._position = position
        self._batches = data.pack(self.records, seq_len=self.seq_len,
                                  batch_size=self.batch_size, seed=self.seed,
                                  lookahead=self.lookahead, start=position)

    def next(self) -> dict[str, np.ndarray]:
        batch, self._position = next(self._batches)
        batch[N_TOKENS] = np.int64((batch["segment_ids"] > 0).sum())
        return batch

    def state(self) -> dict:
        return dict(self._position.to_dict(), n_records=len(self.records),
                    lookahead=self.lookahead)

    def restore(self, state: dict) -> None:
        if state["n_records"] != len(self.records):
            raise ValueError(f"the checkpoint was trained on {state['n_records']} records, the "
                             f"data now has {len(self.records)}; resuming would change the "
                             "batch order (use a new run directory)")
        if state.get("lookahead", 1) != self.lookahead:
            raise ValueError(f"the checkpoint's batches were packed from windows of "
                             f"{state.get('lookahead', 1)} records, this source packs from "
                             f"{self.lookahead}; resuming would change the batches (use a new "
                             "run directory)")
        self._start(data.PackPosition.from_dict(state))
