# SPDX-License-Identifier: Apache-2.0
"""tau per Spec-Bench category with the reference decoder (transformers).

    ./run python -m benchmarks.reference_tau [--per-category 2] [--max-tokens 64]

Runs plain greedy decoding, ESP at several configs and prompt lookup on the
same prompts with vllm_esp_dev.reference (batch 1, fp32, SmolLM2-135M-Instruct by
default), checks that every speculative output equals plain greedy, and
prints a markdown table of tau (mean tokens emitted per verification step)
per category. This measures acceptance only: the reference decoder is a
specification, not a fast engine (see benchmarks/spec_bench.py for speed).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict

ESP_ONLY = {"candidates": ["esp"]}
CONFIGS = {
    "esp [4]": {"tree": [4], **ESP_ONLY},
    "esp [29]": {"tree": [29], **ESP_ONLY},
    "esp [15,4]": {"tree": [15, 4], **ESP_ONLY},
    "esp BC=30": {"block_complexity": 30, **ESP_ONLY},
    "hybrid BC=10": {"block_complexity": 10, "candidates": ["esp", "ngram"]},
    "hybrid BC=30": {"block_complexity": 30, "candidates": ["esp", "ngram"]},
}
LOOKUP = {"prompt lookup (n<=3, 3 drafts)": dict(max_ngram=3, num_draft_tokens=3),
          "prompt lookup (n<=3, 10 drafts)": dict(max_ngram=3, num_draft_tokens=10)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dataset", default=None)
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write raw results here")
    parser.add_argument("--configs", nargs="+", default=None,
                        help=f"only these configs (default: all of "
                        f"{list(CONFIGS) + list(LOOKUP)})")
    args = parser.parse_args(argv)

    # Before the slow imports: a missing Spec-Bench fails at once.
    from vllm_esp_dev.data import load_questions_or_exit, select_questions

    questions = select_questions(load_questions_or_exit(args.dataset or "spec-bench"),
                                 args.per_category)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_esp.config import ESPConfig
    from vllm_esp_dev.data import chat_prompt_ids
    from vllm_esp_dev.models import MODELS, model_path
    from vllm_esp_dev.reference import ReferenceDecoder

    torch.set_num_threads(args.threads)
    path = str(model_path(args.model)) if args.model in MODELS else args.model
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [chat_prompt_ids(tokenizer, q) for q in questions]
    eos = tokenizer.eos_token_id

    plain = ReferenceDecoder(model)
    baseline = [plain.greedy(p, args.max_tokens, eos_token_id=eos).tokens for p in prompts]
    runners = {name: (lambda d, p: d.esp(p, args.max_tokens, eos_token_id=eos),
                      ESPConfig.from_dict(options)) for name, options in CONFIGS.items()}
    for name, options in LOOKUP.items():
        runners[name] = (lambda d, p, o=options: d.prompt_lookup(
            p, args.max_tokens, eos_token_id=eos, **o), None)

    if args.configs:
        unknown = sorted(set(args.configs) - set(runners))
        if unknown:
            parser.error(f"unknown configs {unknown}; known: {list(runners)}")
        runners = {name: runners[name] for name in args.configs}
    results = {}
    for name, (run, config) in runners.items():
        decoder = ReferenceDecoder(model, config)
        tokens, steps = defaultdict(int), defaultdict(int)
        started = time.time()
        for question, prompt, expected in zip(questions, prompts, baseline):
            result = run(decoder, prompt)
            if result.tokens != expected:
                print(f"MISMATCH: {name} on question {question['question_id']}", flush=True)
                return 1
            tokens[question["category"]] += len(result.tokens) - 1
            steps[question["category"]] += result.num_steps
        results[name] = {"tokens": dict(tokens), "steps": dict(steps)}
        overall = sum(tokens.values()) / sum(steps.values())
        print(f"{name}: tau {overall:.3f} ({time.time() - started:.0f} s)",
              file=sys.stderr, flush=True)

    categories = list(dict.fromkeys(q["category"] for q in questions))
    print(f"\nReference decoder, {args.model}, fp32, greedy, {len(prompts)} Spec-Bench "
          f"prompts ({args.per_category} per category), up to {args.max_tokens} new "
          "tokens; all outputs identical to plain greedy.\n")
    print("| method | overall | " + " | ".join(categories) + " |")
    print("|---|---" + "|---" * len(categories) + "|")
    for name, counts in results.items():
        overall = sum(counts["tokens"].values()) / sum(counts["steps"].values())
        cells = [f"{counts['tokens'][c] / counts['steps'][c]:.2f}" for c in categories]
        print(f"| {name} | **{overall:.3f}** | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
