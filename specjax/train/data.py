"""Distilled drafter training data: shards on disk, reading them back, packing into batches,
and the evaluation-set guard.

A record is one prompt (formatted with the target's chat template) followed by the target's
own response. Records hold token ids only, never target hidden states: the taps a drafter
learns from are recomputed at training time by the target's teacher-forced pass over the
packed batch, which costs one forward pass and keeps the data a few bytes per token.

On-disk format (:data:`FORMAT_VERSION`): a directory with ``manifest.json`` (written by
:mod:`specjax.train.distill`) and shards ``shard-00000.npz``, ``shard-00001.npz``, ...; each
shard holds R records as

* ``tokens``: [N] uint16 (int32 when the vocabulary exceeds 65536), the records' prompt +
  response ids concatenated;
* ``offsets``: [R + 1] int64, record r is ``tokens[offsets[r]:offsets[r + 1]]``;
* ``loss_mask``: [N] uint8, 1 exactly on response tokens (a final stop token included);
* ``prompt_index``: [R] int64, the record's index in the input prompt list;
* ``stopped``: [R] bool, whether the response ended on a stop token (else it hit the
  ``max_new_tokens`` cap).

Shards are written atomically (a temporary file, then ``os.replace``) and deterministically
(fixed zip timestamps, no compression), so the same records always give the same bytes.

The evaluation-set guard (:class:`EvalFingerprints`) refuses training prompts that overlap
public evaluation sets. It ships as a compact fingerprint file (``eval_fingerprints.npz``,
package data), never as the benchmark text itself; :meth:`EvalFingerprints.build` makes it from
the benchmark files (``specjax data fingerprints --bench-dir DIR``).
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import os
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)  # the earliest zip timestamp; fixed so bytes are reproducible


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.npz"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (SmolLM2's 49152, Llama-3's 128256 does not), else int32."""
    return np.dtype(np.uint16 if vocab_size <= 65536 else np.int32)


# ------------------------------------------------------------------------------ writing


def write_atomic(path: str | Path, data: bytes) -> None:
    """Writes ``data`` to ``path`` through a temporary file and ``os.replace``, so a reader
    (or a restarted writer) sees either the old file or the whole new one, never a part."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def npz_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    """An ``.npz`` (readable by ``np.load``) that depends only on ``arrays``.

    ``np.savez`` stamps each member with the current time, so two saves of the same arrays
    differ; here every member gets the same fixed timestamp and is stored uncompressed.
    """
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        for name, a in arrays.items():
            info = zipfile.ZipInfo(f"{name}.npy", date_time=_ZIP_EPOCH)
            with zf.open(info, "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.asarray(a), allow_pickle=False)
    return buf.getvalue()


def shard_arrays(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                 prompt_index: Sequence[int], stopped: Sequence[bool],
                 vocab_size: int) -> dict[str, np.ndarray]:
    """The arrays of one shard (see the module docstring) from R prompts and their responses.

    Args:
      prompts: R prompt token-id lists.
      responses: R generated token-id lists (a final stop token included).
      prompt_index: [R] each record's index in the input prompt list.
      stopped: [R] whether each response ended on a stop token.
      vocab_size: the tokenizer's vocabulary size; picks the token dtype.
    """
    if not len(prompts) == len(responses) == len(prompt_index) == len(stopped):
        raise ValueError(f"got {len(prompts)} prompts, {len(responses)} responses, "
                         f"{len(prompt_index)} prompt indices and {len(stopped)} stop flags")
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    offsets = np.zeros(len(prompts) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    dtype = token_dtype(vocab_size)
    tokens = np.zeros(int(offsets[-1]), dtype)
    loss_mask = np.zeros(int(offsets[-1]), np.uint8)
    for r, (p, resp) in enumerate(zip(prompts, responses)):
        start, mid = int(offsets[r]), int(offsets[r]) + len(p)
        tokens[start:mid] = p
        tokens[mid:int(offsets[r + 1])] = resp
        loss_mask[mid:int(offsets[r + 1])] = 1
    return dict(tokens=tokens, offsets=offsets, loss_mask=loss_mask,
                prompt_index=np.asarray(prompt_index, np.int64),
                stopped=np.asarray(stopped, np.bool_))


def read_shard(path: str | Path) -> dict[str, np.ndarray]:
    """The arrays of one shard file, checked for consistency."""
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in ("tokens", "offsets", "loss_mask", "prompt_index", "stopped")}
    n, r = len(arrays["tokens"]), len(arrays["prompt_index"])
    if (len(arrays["offsets"]) != r + 1 or int(arrays["offsets"][-1]) != n
            or len(arrays["loss_mask"]) != n or len(arrays["stopped"]) != r):
        raise ValueError(f"{path}: inconsistent shard ({r} records, {n} tokens, "
                         f"{len(arrays['offsets'])} offsets, {len(arrays['loss_mask'])} mask "
                         f"entries, {len(arrays['stopped'])} stop flags)")
    return arrays


def shard_summary(arrays: Mapping[str, np.ndarray]) -> dict[str, int]:
    """Counts the manifest lists per finished shard."""
    return dict(records=len(arrays["prompt_index"]), tokens=len(arrays["tokens"]),
                response_tokens=int(arrays["loss_mask"].sum()),
                stopped=int(arrays["stopped"].sum()))


# ------------------------------------------------------------------------------ reading


class Records:
    """Every record of a distilled data directory, in shard order, held in memory.

    Reads the shard files present, so a directory that is still being generated can be read
    (each shard file is complete, being written atomically). Token ids stay in their stored
    dtype; a record comes out as int32.

    Example::

        recs = Records("data/smollm2")
        tokens, loss_mask = recs[0]  # [L] int32, [L] bool
        recs.n_tokens, recs.n_response_tokens
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        manifest = self.directory / MANIFEST
        if not manifest.exists():
            raise FileNotFoundError(f"no {MANIFEST} in {self.directory}")
        self.manifest = json.loads(manifest.read_text())
        version = self.manifest.get("settings", {}).get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(f"{manifest}: format_version {version!r}, this reader reads "
                             f"{FORMAT_VERSION}")
        shards = []
        for k in range(self.manifest["n_shards"]):
            path = self.directory / shard_name(k)
            if path.exists():
                shards.append(read_shard(path))
        if shards:
            self._tokens = np.concatenate([s["tokens"] for s in shards])
            self._loss_mask = np.concatenate([s["loss_mask"] for s in shards]).astype(bool)
            starts = np.cumsum([0] + [len(s["tokens"]) for s in shards[:-1]])
            self._offsets = np.concatenate(
                [s["offsets"][:-1] + base for s, base in zip(shards, starts)]
                + [np.array([len(self._tokens)], np.int64)])
            self.prompt_index = np.concatenate([s["prompt_index"] for s in shards])
            self.stopped = np.concatenate([s["stopped"] for s in shards])
        else:
            self._tokens = np.zeros(0, np.int32)
            self._loss_mask = np.zeros(0, bool)
            self._offsets = np.zeros(1, np.int64)
            self.prompt_index = np.zeros(0, np.int64)
            self.stopped = np.zeros(0, bool)
        self.n_shards_read = len(shards)

    def __len__(self) -> int:
        return len(self.prompt_index)

    def __getitem__(self, r: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [L] int32, loss_mask [L] bool) of record ``r``."""
        if not -len(self) <= r < len(self):
            raise IndexError(f"record {r} out of range for {len(self)} records")
        r = r % len(self)
        a, b = int(self._offsets[r]), int(self._offsets[r + 1])
        return self._tokens[a:b].astype(np.int32), self._loss_mask[a:b]

    @property
    def lengths(self) -> np.ndarray:
        """[R] int64 tokens per record (prompt + response)."""
        return np.diff(self._offsets)

    @property
    def n_tokens(self) -> int:
        return len(self._tokens)

    @property
    def n_response_tokens(self) -> int:
        return int(self._loss_mask.sum())


def token_counts(records, vocab_size: int) -> np.ndarray:
    """[V] how often each id occurs as a response token (``loss_mask``) in ``records``."""
    counts = np.zeros(vocab_size, np.int64)
    for r in range(len(records)):
        tokens, mask = records[r]
        counts += np.bincount(np.asarray(tokens)[np.asarray(mask, bool)], minlength=vocab_size)
    return counts


# ------------------------------------------------------------------------------ packing


@dataclasses.dataclass(frozen=True)
class PackPosition:
    """Where packing stands in epoch ``epoch``'s order: the records at order positions
    ``pending`` were read ahead and wait for a row, then come those from position ``index`` on.

    Serializable (``to_dict`` / ``from_dict``) so a trainer can save it with its checkpoint and
    resume with exactly the batches it would have seen next.
    """

    epoch: int = 0
    index: int = 0
    pending: tuple[int, ...] = ()

    def __post_init__(self):
        if self.epoch < 0 or self.index < 0:
            raise ValueError(f"epoch and index must be >= 0, got {self.epoch}, {self.index}")
        pending = tuple(int(p) for p in self.pending)
        object.__setattr__(self, "pending", pending)
        if any(not 0 <= p < self.index for p in pending):
            raise ValueError(f"pending order positions must lie before index {self.index}, "
                             f"got {pending}")
        if pending != tuple(sorted(set(pending))):
            raise ValueError(f"pending order positions must be distinct and ascending, got "
                             f"{pending}")

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "pending": list(self.pending)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PackPosition":
        return cls(epoch=int(d["epoch"]), index=int(d["index"]), pending=d.get("pending", ()))


def epoch_order(n_records: int, seed: int, epoch: int) -> np.ndarray:
    """[R] the record order of one epoch: a permutation depending only on (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(n_records)


def pack(records, *, seq_len: int, batch_size: int, seed: int = 0, lookahead: int = 32,
         start: PackPosition = PackPosition()) -> Iterator[tuple[dict[str, np.ndarray],
                                                                 PackPosition]]:
    """Packs records into fixed-shape training batches, forever (epoch after epoch).

    Each epoch visits the records in :func:`epoch_order`. A row fills from a window of the
    next ``lookahead`` unpacked records of that order: it takes the first of them that fits
    in the space left, the window refills from the order, and the row is done when none of
    the window fits. A record is never split across rows or batches. A record longer than
    ``seq_len`` is truncated to its first ``seq_len`` tokens (its prompt and the start of its
    response): the tail cut off would need the whole prefix in the same row to be trained on,
    so splitting it would only add rows without context. ``lookahead=1`` packs strictly in
    order; the default fills about 92% of the tokens of 512-token rows of the shipped
    SmolLM2 distillation set (records of 281 tokens on average once cut to 512) where strict
    order fills 75%. The last batch of an epoch may have empty rows; a batch never mixes
    epochs.

    Args:
      records: a :class:`Records` (anything with ``len`` and ``[r] -> (tokens, loss_mask)``).
      seq_len: T, tokens per row.
      batch_size: B, rows per batch.
      seed: the shuffling seed.
      lookahead: W, the records a row chooses among.
      start: where to begin (a position yielded earlier, to resume).
    Yields:
      ``(batch, position)``: ``batch`` holds ``tokens`` [B, T] int32 (0 on padding),
      ``segment_ids`` [B, T] int32 (0 = padding, 1, 2, ... = the records of the row in order),
      ``positions`` [B, T] int32 (0, 1, ... within each record, 0 on padding) and
      ``loss_mask`` [B, T] bool (the response tokens a drafter learns to predict);
      ``position`` is where the next batch starts.
    """
    if seq_len < 1 or batch_size < 1 or lookahead < 1:
        raise ValueError(f"seq_len, batch_size and lookahead must be >= 1, got {seq_len}, "
                         f"{batch_size}, {lookahead}")
    n = len(records)
    if n == 0:
        raise ValueError("no records to pack")
    if start.index > n:
        raise ValueError(f"start index {start.index} beyond the {n} records of an epoch")
    epoch, index = start.epoch, start.index
    order = epoch_order(n, seed, epoch)
    # Tokens the record at order position p takes (of the current epoch's order: pending is
    # always empty when the epoch, and with it the order, changes).
    length = lambda p: min(len(records[int(order[p])][0]), seq_len)  # noqa: E731
    pending = [(p, length(p)) for p in start.pending]  # (order position, tokens it takes)
    while True:
        if index == n and not pending:
            epoch, index = epoch + 1, 0
            order = epoch_order(n, seed, epoch)
        batch = {k: np.zeros((batch_size, seq_len), np.int32)
                 for k in ("tokens", "segment_ids", "positions")}
        batch["loss_mask"] = np.zeros((batch_size, seq_len), bool)
        for row in range(batch_size):
            col, segment = 0, 0
            while True:
                while len(pending) < lookahead and index < n:
                    pending.append((index, length(index)))
                    index += 1
                fits = next((e for e in pending if e[1] <= seq_len - col), None)
                if fits is None:
                    break
                pending.remove(fits)
                tokens, mask = records[int(order[fits[0]])]
                size = fits[1]
                segment += 1
                span = slice(col, col + size)
                batch["tokens"][row, span] = tokens[:size]
                batch["segment_ids"][row, span] = segment
                batch["positions"][row, span] = np.arange(size)
                batch["loss_mask"][row, span] = mask[:size]
                col += size
        yield batch, PackPosition(epoch, index, tuple(p for p, _ in pending))


# ---------------------------------------------------------------------- evaluation guard

# (set name, path under the benchmark directory, text field, task ids kept or None = all).
EVAL_SOURCES = (
    ("MT-Bench", "mt_bench/question.jsonl", "turns", None),
    ("GSM8K test", "gsm8k/test.jsonl", "question", None),
    ("HumanEval", "humaneval/HumanEval.jsonl.gz", "prompt", None),
    ("MBPP test", "mbpp/mbpp.jsonl", "text", (11, 510)),
    ("MBPP test", "mbpp/sanitized-mbpp.json", "prompt", (11, 510)),
    ("MATH-500", "math500/test.jsonl", "problem", None),
)
SHINGLE_WORDS = 10
FINGERPRINT_FILE = Path(__file__).with_name("eval_fingerprints.npz")


def normalize(text: str) -> str:
    """Casefolded, whitespace runs collapsed to one space, stripped."""
    return " ".join(text.casefold().split())


def _hash64(strings: Sequence[str]) -> np.ndarray:
    """[len(strings)] uint64: the first 8 bytes of each string's BLAKE2b digest."""
    return np.array([int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(),
                                    "little") for s in strings], np.uint64)


def shingles(text: str, n: int) -> list[str]:
    """The normalized text's runs of ``n`` consecutive words (none when it has fewer)."""
    words = normalize(text).split(" ")
    return [" ".join(words[i:i + n]) for i in range(len(words) - n + 1)]


def _eval_texts(bench_dir: Path) -> list[tuple[str, str]]:
    """(set name, text) for every evaluation text under ``bench_dir`` (see EVAL_SOURCES)."""
    out = []
    for name, rel, field, task_ids in EVAL_SOURCES:
        path = bench_dir / rel
        if path.suffix == ".json":
            rows = json.loads(path.read_text())
        else:
            opener = gzip.open if path.suffix == ".gz" else open
            with opener(path, "rt", encoding="utf-8") as f:
                rows = [json.loads(line) for line in f if line.strip()]
        for row in rows:
            if task_ids is not None and not task_ids[0] <= row["task_id"] <= task_ids[1]:
                continue
            value = row[field]
            out += [(name, v) for v in (value if isinstance(value, list) else [value])]
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class EvalFingerprints:
    """Hashes that tell whether a text overlaps an evaluation set, without the set's text.

    A text matches when its whole normalized text (:func:`normalize`) equals an evaluation
    text's, or when it shares a run of ``shingle_words`` consecutive normalized words with
    one. Hashes are 64-bit (BLAKE2b), so a chance collision among ~10^5 fingerprints and a
    prompt's ~10^2 shingles has probability ~10^-12.

    Attributes:
      names: the evaluation sets' names.
      shingle_words: words per shingle.
      full: [F] uint64 sorted hashes of whole normalized texts; ``full_set`` [F] uint8 their
        set (an index into ``names``).
      shingles: [S] uint64 sorted unique shingle hashes; ``shingle_set`` [S] uint8 their set.
    """

    names: tuple[str, ...]
    shingle_words: int
    full: np.ndarray
    full_set: np.ndarray
    shingles: np.ndarray
    shingle_set: np.ndarray

    @classmethod
    def build(cls, bench_dir: str | Path,
              shingle_words: int = SHINGLE_WORDS) -> "EvalFingerprints":
        """Fingerprints of the evaluation sets in :data:`EVAL_SOURCES` under ``bench_dir``
        (MT-Bench both turns, GSM8K test, HumanEval, MBPP test = task ids 11-510 of both MBPP
        files, MATH-500)."""
        texts = _eval_texts(Path(bench_dir))
        names = tuple(dict.fromkeys(name for name, _ in texts))
        set_of = {name: i for i, name in enumerate(names)}
        full = _hash64([normalize(t) for _, t in texts])
        full_set = np.array([set_of[name] for name, _ in texts], np.uint8)
        sh, sh_set = [], []
        for name, t in texts:
            s = shingles(t, shingle_words)
            sh.append(_hash64(s))
            sh_set.append(np.full(len(s), set_of[name], np.uint8))
        sh, sh_set = np.concatenate(sh), np.concatenate(sh_set)
        full, i = np.unique(full, return_index=True)
        sh, j = np.unique(sh, return_index=True)
        return cls(names, shingle_words, full, full_set[i], sh, sh_set[j])

    def save(self, path: str | Path) -> None:
        write_atomic(path, npz_bytes(dict(
            names=np.array(self.names), shingle_words=np.int64(self.shingle_words),
            full=self.full, full_set=self.full_set, shingles=self.shingles,
            shingle_set=self.shingle_set)))

    @classmethod
    def load(cls, path: str | Path | None = None) -> "EvalFingerprints":
        """From ``path``, or from the fingerprint file shipped with the package."""
        with np.load(FINGERPRINT_FILE if path is None else path, allow_pickle=False) as z:
            return cls(tuple(str(s) for s in z["names"]), int(z["shingle_words"]), z["full"],
                       z["full_set"], z["shingles"], z["shingle_set"])

    def _find(self, table: np.ndarray, sets: np.ndarray, hashes: np.ndarray) -> str | None:
        if not len(hashes) or not len(table):
            return None
        i = np.minimum(np.searchsorted(table, hashes), len(table) - 1)
        hit = table[i] == hashes
        return self.names[int(sets[i[hit.argmax()]])] if hit.any() else None

    def match(self, text: str) -> str | None:
        """The name of an evaluation set ``text`` overlaps, or None."""
        return (self._find(self.full, self.full_set, _hash64([normalize(text)]))
                or self._find(self.shingles, self.shingle_set,
                              _hash64(shingles(text, self.shingle_words))))
