# SPDX-License-Identifier: Apache-2.0
"""How often greedy outputs disagree in bf16, with and without speculation.

Greedy ESP is token-identical to plain decoding in fp32. In bf16, rounding
depends on which rows share a forward pass, so near-tied tokens can flip:
even plain vLLM disagrees with itself when the batch composition changes.
This script measures both on the same prompts, in one run:

* plain bf16 at batch 1 against plain bf16 at batch 8 (vLLM alone);
* ngram and ESP in bf16 at batch 8 against plain bf16 at batch 8;
* plain bf16 against plain fp32 (both batch 8).

A prompt "disagrees" when the two token sequences differ anywhere; the
first differing position is reported too.

    python -m benchmarks.bf16_agreement --model gemma3-270m --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def first_difference(a: list[int], b: list[int]) -> int | None:
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(reference, other) -> dict:
    firsts = [first_difference(a, b) for a, b in zip(reference.token_ids, other.token_ids)]
    differing = [f for f in firsts if f is not None]
    return {"prompts": len(firsts), "differ": len(differing),
            "first_difference_positions": sorted(differing)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--dataset", default=None,
                        help="Spec-Bench question.jsonl (default: bundled prompts)")
    parser.add_argument("--num-prompts", type=int, default=26)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_esp_dev import data
    from vllm_esp_dev.models import MODELS, model_path
    from vllm_esp_dev.runs import run_once

    model = str(model_path(args.model)) if args.model in MODELS else args.model
    questions = data.select_questions(data.load_questions(args.dataset), 100,
                                      limit=args.num_prompts)
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [data.chat_prompt_ids(tokenizer, q) for q in questions]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    def run(label, dtype, batch, spec=None):
        print(f"running {label}", flush=True)
        return run_once(model, prompts, greedy, speculative_config=spec, dtype=dtype,
                        max_num_seqs=batch, label=label)

    runs = {
        "plain-bf16-b1": run("plain-bf16-b1", "bfloat16", 1),
        "plain-bf16-b8": run("plain-bf16-b8", "bfloat16", 8),
        "ngram-bf16-b8": run("ngram-bf16-b8", "bfloat16", 8,
                             {"method": "ngram", "num_speculative_tokens": 3,
                              "prompt_lookup_max": 3, "prompt_lookup_min": 1}),
        "esp-bf16-b8": run("esp-bf16-b8", "bfloat16", 8, {"method": "esp"}),
        "plain-fp32-b8": run("plain-fp32-b8", "float32", 8),
    }
    result = {
        "model": args.model, "prompts": len(prompts), "max_tokens": args.max_tokens,
        "comparisons": {
            "plain bf16: batch 1 vs batch 8": compare(runs["plain-bf16-b1"], runs["plain-bf16-b8"]),
            "ngram bf16 vs plain bf16 (batch 8)": compare(runs["plain-bf16-b8"], runs["ngram-bf16-b8"]),
            "ESP bf16 vs plain bf16 (batch 8)": compare(runs["plain-bf16-b8"], runs["esp-bf16-b8"]),
            "plain bf16 vs plain fp32 (batch 8)": compare(runs["plain-fp32-b8"], runs["plain-bf16-b8"]),
        },
        "drafts": {k: r.num_drafts for k, r in runs.items()},
    }
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"bf16-{args.model}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
