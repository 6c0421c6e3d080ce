"""The benchmark's prompt sets: a small built-in suite written for this project, and prompt
files in the MT-Bench question format.

The built-in suite covers what users ask of a small chat model, one category per kind of
workload speculative decoding meets: ``code`` and ``math`` (structured output that echoes the
question), ``chat`` (open-ended prose), and two long-context kinds, ``summarize`` (an article
to condense) and ``retrieve`` (passages to answer from, where the answer copies from the
context: prompt lookup's best case). The long contexts are a few hundred tokens each, so the
suite runs in minutes on two cores.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

_ARTICLE = """\
The town of Hallbrook voted last week to replace its ageing water treatment plant, ending a
debate that had run for almost six years. The current plant was built in 1962 for a population
of eight thousand; the town now has just over twenty-one thousand residents, and in the dry
summer of last year the plant ran at full capacity for fifty-three consecutive days. Twice that
summer the council asked residents to stop watering gardens, and a local brewery cut production
for three weeks.

The new plant will be built on the site of a former rail depot, two kilometres east of the old
one, and is expected to cost 48 million, of which 30 million comes from a regional
infrastructure grant and the rest from a municipal bond. Supporters argued that the grant would
not be offered again and that repairs to the old plant would cost nearly as much within a
decade. Opponents, led by the residents' association of the Eastgate district, objected to the
site: the depot borders a primary school and a wetland that hosts migrating birds each spring.
They also questioned whether the town's growth forecasts, which assume thirty thousand residents
by 2045, were realistic.

The final design answers some of those objections. The plant's entrance will face the industrial
road rather than the school, construction traffic will be barred during school hours, and a
strip of the wetland that the depot had paved over will be restored as part of the project.
Treated water will also be monitored by an independent laboratory, with results published
monthly. The plant will use membrane filtration instead of the sand filters of the old one,
which the engineers say will cut chemical use by about a third.

Construction is due to begin in March and to take about thirty months. Until then the old plant
will keep running, and the council has budgeted 1.2 million for emergency repairs. Water bills
are expected to rise by 6 percent next year and by a further 4 percent once the plant opens,
to repay the bond over twenty-five years. The mayor called the vote "the most important decision
this council will make", while the Eastgate association said it would keep watching the
project closely and had not ruled out a legal challenge over the wetland."""

_PASSAGES = """\
[1] The Larch Street library opens at 9 a.m. on weekdays and at 10 a.m. on Saturdays; it is
closed on Sundays and public holidays. Its reading room has forty seats and twelve computers,
which can be booked for two hours at a time with a library card.
[2] Library cards are free for residents of the county. Visitors from outside the county can
buy a yearly card for 15, or a one-month card for 4. Children under twelve need a parent or
guardian to sign their application form.
[3] Books can be borrowed for three weeks and renewed twice online or by phone, unless another
reader has reserved them. DVDs and board games can be borrowed for one week and cannot be
renewed. Late returns cost 20 cents per item per day, up to a maximum of 5 per item.
[4] The library's meeting room holds up to thirty people and can be booked by local groups free
of charge for up to three hours, or for 25 per hour by businesses. Bookings must be made at
least five days in advance at the front desk.
[5] Every Tuesday at 4 p.m. the library runs a homework club for pupils aged eight to fourteen,
and on the first Saturday of each month a repair café where volunteers fix small appliances,
bicycles and clothes. Both are free and need no booking.
[6] Printing costs 10 cents per black-and-white page and 50 cents per colour page. Scanning is
free. Payment is by card or with credit added to the library card; cash is not accepted."""

SUITE: dict[str, list[str]] = {
    "code": [
        "Write a Python function `merge_intervals(intervals)` that takes a list of [start, end] "
        "pairs and returns a new list in which overlapping intervals are merged, sorted by "
        "start. Include a docstring and two example calls.",
        "Explain what this function does and fix its bug:\n```python\ndef average(values):\n"
        "    total = 0\n    for v in values:\n        total += v\n    return total / len(values)"
        "\n```\nIt crashes when `values` is empty; make it return None in that case.",
    ],
    "math": [
        "A train leaves at 9:40 and travels 168 km at an average speed of 72 km/h. At what time "
        "does it arrive? Show your reasoning step by step.",
        "Maria buys 3 notebooks at 2.40 each and 2 pens at 1.15 each, and pays with a 20 note. "
        "How much change does she get? Explain each step.",
    ],
    "chat": [
        "I have a job interview for a junior data analyst position tomorrow. What should I "
        "prepare, and what questions could I ask the interviewer?",
        "Give me three ideas for a cheap weekend trip with friends, and say what makes each "
        "one fun.",
    ],
    "summarize": [
        f"Summarize the following article in five sentences.\n\n{_ARTICLE}",
        f"{_ARTICLE}\n\nList the main arguments for and against the new plant mentioned in the "
        "article above.",
    ],
    "retrieve": [
        f"Answer the question using only the passages below, and say which passage you used.\n\n"
        f"{_PASSAGES}\n\nQuestion: How long can I borrow a DVD, and what happens if I return it "
        "late?",
        f"{_PASSAGES}\n\nUsing the passages above, explain how a visitor from outside the county "
        "can print documents at the library and what it costs.",
    ],
}


# JSONL fields tried in order: GSM8K, MT-Bench (first turn), MATH-500, MBPP, HumanEval.
PROMPT_FIELDS = ("question", "turns", "problem", "text", "prompt")


def load_prompts(path: str | Path, n: int) -> list[str]:
    """The first ``n`` prompts of a JSONL file (fields tried: :data:`PROMPT_FIELDS`; for a list
    such as MT-Bench's ``turns``, its first entry)."""
    prompts = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if len(prompts) == n:
                break
            if not line.strip():
                continue
            row = json.loads(line)
            field = next((f for f in PROMPT_FIELDS if f in row), None)
            if field is None:
                raise ValueError(f"{path}:{lineno}: no prompt field; expected one of "
                                 f"{PROMPT_FIELDS}, found {sorted(row)}")
            value = row[field]
            prompts.append(value[0] if isinstance(value, list) else value)
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def with_context(prompts: Sequence[str], count_tokens, tokens: int) -> list[str]:
    """Each prompt behind background text, so that it holds about ``tokens`` tokens: the
    context-length axis of a benchmark. The background is the suite's own long texts (the
    article, the passages, then the other prompts), paragraph by paragraph, each used once
    before any repeats, until ``count_tokens(prompt)`` reaches ``tokens`` (overshooting by at
    most one paragraph); a prompt already that long is kept as it is.

    Args:
      prompts: the prompts.
      count_tokens: ``text -> its length in tokens`` (e.g. of the chat-encoded text).
      tokens: the context length to reach.
    """
    paragraphs = [p for text in (_ARTICLE, _PASSAGES, *(q for ps in SUITE.values() for q in ps))
                  for p in text.split("\n\n") if p.strip()]
    out = []
    for prompt in prompts:
        background, i = [], 0
        text = prompt
        while count_tokens(text) < tokens:
            background.append(paragraphs[i % len(paragraphs)])
            i += 1
            text = ("Background material (it may or may not be relevant):\n\n"
                    + "\n\n".join(background) + "\n\n" + prompt)
        out.append(text)
    return out


def builtin(per_category: int | None = None) -> dict[str, list[str]]:
    """The built-in suite: {category: prompts}, the first ``per_category`` of each (all by
    default)."""
    if per_category is not None and per_category < 1:
        raise ValueError(f"per_category must be >= 1, got {per_category}")
    return {c: list(ps[:per_category]) for c, ps in SUITE.items()}


def mt_bench_file(path: str | Path, per_category: int | None = None) -> dict[str, list[str]]:
    """Prompts of a JSONL file in the MT-Bench question format, grouped by category.

    Each line is an object with ``turns`` (a list of user turns; the first is the prompt) and
    optionally ``category`` (default ``"default"``); a ``prompt`` string is taken in place of
    ``turns``.

    Raises:
      ValueError: an unreadable line, a line without ``turns``/``prompt``, or no prompts.
    """
    out: dict[str, list[str]] = {}
    path = Path(path)
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not JSON ({e.msg})") from None
        if not isinstance(row, Mapping):
            raise ValueError(f"{path}:{i}: expected a JSON object")
        turns = row.get("turns")
        text = turns[0] if isinstance(turns, list) and turns else row.get("prompt")
        if not isinstance(text, str) or not text:
            raise ValueError(f"{path}:{i}: needs a non-empty 'turns' list or 'prompt' string")
        ps = out.setdefault(str(row.get("category", "default")), [])
        if per_category is None or len(ps) < per_category:
            ps.append(text)
    if not out:
        raise ValueError(f"{path} holds no prompts")
    return out
