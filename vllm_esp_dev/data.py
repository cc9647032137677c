# SPDX-License-Identifier: Apache-2.0
"""Prompts: the bundled set and Spec-Bench.

``bundled_prompts()`` are 26 questions written for this project, two in each
of Spec-Bench's 13 categories, in Spec-Bench's format (``prompts.jsonl``
beside this file). The demo and the default tests use them, so a fresh clone
needs nothing beside it.

Spec-Bench is read from disk, never fetched and never copied into the
repository: ``--dataset PATH``, else ``$VLLM_ESP_SPEC_BENCH``, else
``../shared/data/spec_bench/question.jsonl`` beside the repository.
Spec-Bench is Apache-2.0; its LICENSE sits beside the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BUNDLED_PROMPTS = Path(__file__).resolve().parent / "prompts.jsonl"


def bundled_prompts() -> list[dict]:
    """The project's own 26 questions (2 per Spec-Bench category)."""
    return _read_jsonl(BUNDLED_PROMPTS)


def _read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def default_spec_bench_path() -> Path:
    env = os.environ.get("VLLM_ESP_SPEC_BENCH")
    if env:
        return Path(env)
    return REPO_ROOT.parent / "shared" / "data" / "spec_bench" / "question.jsonl"


def load_spec_bench(path: str | Path | None = None) -> list[dict]:
    """All questions: dicts with ``question_id``, ``category``, ``turns``."""
    path = Path(path) if path else default_spec_bench_path()
    if not path.is_file():
        raise SpecBenchNotFound(
            f"Spec-Bench questions not found at {path}. This command needs "
            "Spec-Bench's question.jsonl (https://github.com/hemingkx/Spec-Bench, "
            "data/spec_bench/question.jsonl, Apache-2.0). Pass --dataset PATH or "
            "set VLLM_ESP_SPEC_BENCH=PATH.")
    return _read_jsonl(path)


class SpecBenchNotFound(FileNotFoundError):
    pass


def load_questions(dataset: str | None) -> list[dict]:
    """``dataset`` = "bundled" (or None) for the bundled prompts, "spec-bench"
    for Spec-Bench at its default location, else a question.jsonl path."""
    if dataset in (None, "bundled"):
        return bundled_prompts()
    if dataset == "spec-bench":
        return load_spec_bench()
    return load_spec_bench(dataset)


def load_questions_or_exit(dataset: str | None) -> list[dict]:
    """``load_questions`` for a command line: a missing Spec-Bench ends the
    command with the message that says where to put it (before any model
    loads)."""
    try:
        return load_questions(dataset)
    except SpecBenchNotFound as missing:
        raise SystemExit(f"error: {missing}") from None


def categories(questions: list[dict]) -> list[str]:
    seen: dict[str, None] = {}
    for question in questions:
        seen.setdefault(question["category"], None)
    return list(seen)


def select_questions(questions: list[dict], per_category: int,
                     limit: int | None = None, skip: int = 0) -> list[dict]:
    """The first ``per_category`` questions of every category after its
    first ``skip``, interleaved across categories so that any prefix of the
    list mixes categories and prompt lengths."""
    by_category: dict[str, list[dict]] = {}
    for question in questions:
        by_category.setdefault(question["category"], []).append(question)
    selected = []
    for rank in range(skip, skip + per_category):
        for items in by_category.values():
            if rank < len(items):
                selected.append(items[rank])
    return selected[:limit] if limit else selected


def chat_prompt_ids(tokenizer, question: dict) -> list[int]:
    """First turn of a question, with the model's chat template if it has one."""
    text = question["turns"][0]
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True,
            tokenize=True, return_dict=False))
    return list(tokenizer(text).input_ids)
