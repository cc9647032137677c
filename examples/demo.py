"""The main job: ESP beside plain vLLM on a handful of Spec-Bench prompts.

    ./run demo                              # bundled SmolLM2-135M, 6 prompts
    ./run demo --dataset my/question.jsonl --num-prompts 10 --tree 29

Runs offline batch generation twice in this process (vLLM without
speculation, then with ``speculative_config={"method": "esp", ...}``), greedy,
fp32, prints each ESP output, tokens/s for both, ESP's tau (mean tokens per
verification step, from vLLM's own spec-decode counters) and whether the
outputs are token-identical, which greedy ESP must guarantee.

Speed on a 2-core CPU depends on the block size; the default CPU tree
``[4]`` is a 10-token block. Quote ratios from one run, not absolute times.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m",
                        help="a bundled model name (smollm2-135m, gemma3-270m) "
                             "or a Hugging Face model folder")
    parser.add_argument("--dataset", default=None,
                        help="Spec-Bench question.jsonl (default: "
                             "../shared/data/spec_bench/question.jsonl)")
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--tree", type=int, nargs="+", default=None,
                        help="ESP per-level widths, e.g. 4 or 15 4")
    parser.add_argument("--block-complexity", type=int, default=None)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_esp.data import chat_prompt_ids, load_spec_bench, select_questions
    from vllm_esp.models import MODELS, model_path
    from vllm_esp.runs import run_once

    model = str(model_path(args.model)) if args.model in MODELS else args.model
    questions = select_questions(load_spec_bench(args.dataset), per_category=1,
                                 limit=args.num_prompts)
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [chat_prompt_ids(tokenizer, q) for q in questions]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

    esp_options = {"method": "esp"}
    if args.tree:
        esp_options["tree"] = args.tree
    if args.block_complexity:
        esp_options["block_complexity"] = args.block_complexity

    print(f"model: {model}\nprompts: {len(prompts)} Spec-Bench questions, "
          f"{args.max_tokens} new tokens each, greedy, fp32", flush=True)
    plain = run_once(model, prompts, greedy, label="vLLM (no speculation)")
    esp = run_once(model, prompts, greedy, speculative_config=esp_options,
                   label=f"vLLM + ESP {esp_options}")

    for index, (question, text) in enumerate(zip(questions, esp.texts)):
        print(f"\n--- [{question['category']}] {question['turns'][0][:70]}")
        print(textwrap.indent(textwrap.shorten(text, 400), "    "))

    identical = [a == b for a, b in zip(plain.token_ids, esp.token_ids)]
    print("\n| run | output tokens | tokens/s | tau |")
    print("|---|---|---|---|")
    for run in (plain, esp):
        tau = f"{run.tau:.3f}" if run.tau else "-"
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
