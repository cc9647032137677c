# SPDX-License-Identifier: Apache-2.0
"""The main job: vLLM with ESP beside vLLM without speculation.

    ./run demo                                   # bundled model and prompts
    ./run demo --num-prompts 26 --max-tokens 128
    ./run demo --dataset path/to/spec_bench/question.jsonl --verbose

Runs offline batch generation twice in this process (plain vLLM, then
``speculative_config={"method": "esp"}``), greedy, fp32, on the project's
bundled prompts (or Spec-Bench with ``--dataset``). Prints the answers, a
table with tokens/s and tau (mean tokens per verification step, from vLLM's
own spec-decode counters) and whether the outputs are token-identical, which
greedy ESP must guarantee. Quote speed as the ratio from one run.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--model", default="smollm2-135m",
                        help="a bundled model name (smollm2-135m, gemma3-270m) "
                             "or a Hugging Face model folder")
    parser.add_argument("--dataset", default=None,
                        help="a Spec-Bench question.jsonl (default: the 26 "
                             "prompts bundled with vllm-esp)")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=1,
                        help="max_num_seqs for both engines")
    parser.add_argument("--esp-config", default=None,
                        help='extra ESP keys as JSON, e.g. \'{"block_complexity": 30}\'')
    parser.add_argument("--verbose", action="store_true",
                        help="keep vLLM's INFO logging")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import json

    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_esp_dev import data
    from vllm_esp_dev.models import MODELS, model_path
    from vllm_esp_dev.runs import run_once

    try:
        questions = data.load_questions(args.dataset)
    except data.SpecBenchNotFound as missing:
        print(f"error: {missing}", file=sys.stderr)
        return 2
    questions = data.select_questions(questions, per_category=len(questions),
                                      limit=args.num_prompts)
    esp_options = {"method": "esp", **json.loads(args.esp_config or "{}")}

    model = str(model_path(args.model)) if args.model in MODELS else args.model
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [data.chat_prompt_ids(tokenizer, q) for q in questions]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    source = args.dataset or "bundled prompts"
    print(f"model: {model}\nprompts: {len(prompts)} from {source}, "
          f"{args.max_tokens} new tokens each, greedy, fp32, batch {args.batch_size}",
          flush=True)
    # Both engines decode a short warm-up prompt first, untimed.
    warmup_ids = data.chat_prompt_ids(tokenizer, {"turns": ["Say hello."]})
    common = dict(max_num_seqs=args.batch_size, progress=True, warmup_ids=warmup_ids)
    print("\n[1/2] vLLM, no speculation", flush=True)
    plain = run_once(model, prompts, greedy, label="vLLM (no speculation)", **common)
    print(f"\n[2/2] vLLM + ESP {esp_options}", flush=True)
    esp = run_once(model, prompts, greedy, speculative_config=esp_options,
                   label="vLLM + ESP", **common)

    for question, text in zip(questions, esp.texts):
        print(f"\n--- [{question['category']}] {textwrap.shorten(question['turns'][0], 90)}")
        print(textwrap.indent(textwrap.shorten(text, 400), "    "))

    identical = [a == b for a, b in zip(plain.token_ids, esp.token_ids)]
    print("\n| run | output tokens | tokens/s | tau (tokens per step) |")
    print("|---|---|---|---|")
    for run in (plain, esp):
        tau = f"{run.tau:.2f}" if run.tau else "-"
        print(f"| {run.label} | {run.num_output_tokens} | "
              f"{run.tokens_per_second:.1f} | {tau} |")
    print(f"\nESP speed vs no speculation: "
          f"{esp.tokens_per_second / plain.tokens_per_second:.2f}x "
          f"(this machine, this run)")
    print(f"outputs identical: {sum(identical)}/{len(identical)}"
          + ("" if all(identical) else "  <-- MISMATCH: this is a bug"))
    return 0 if all(identical) else 1


if __name__ == "__main__":
    sys.exit(main())
