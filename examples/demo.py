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

By default it prints nothing else: vLLM logs errors only, Python's warnings
are ignored, and whatever vLLM's engine processes write goes to a temporary
log (``quiet_output``), which is printed if the run fails. ``--verbose``
shows it all as it comes.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import tempfile
import textwrap
import warnings

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
                        help="show vLLM's logging, warnings and engine output")
    return parser.parse_args(argv)


@contextlib.contextmanager
def quiet_output():
    """This process's own Python output (``print``, progress bars,
    tracebacks) still reaches the terminal; whatever is written to file
    descriptors 1 and 2 directly, by C++ libraries here and by everything in
    the processes it starts (vLLM's engine core and worker: their logging,
    warnings and progress bars), goes to a temporary log instead. If the
    body raises, the log is printed to stderr before the traceback; after a
    success it is deleted. Python's warnings in this process are ignored.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    log = tempfile.NamedTemporaryFile(prefix="vllm-esp-demo-", suffix=".log", delete=False)
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    streams = sys.stdout, sys.stderr
    sys.stdout = open(saved[1], "w", buffering=1, closefd=False, encoding="utf-8")
    sys.stderr = open(saved[2], "w", buffering=1, closefd=False, encoding="utf-8")
    for fd in (1, 2):
        os.dup2(log.fileno(), fd)
    failed = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield log.name
        failed = False
    except Exception:
        sys.stderr.flush()
        log.flush()
        with open(log.name, encoding="utf-8", errors="replace") as captured:
            text = captured.read()
        if text:
            print(f"\nThe run failed. What vLLM and its engine processes wrote "
                  f"({log.name}):\n{text.rstrip()}\n", file=sys.stderr)
        raise
    finally:
        # The terminal's streams stay open: vLLM's log handler here keeps
        # the one it found at import.
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = streams
        for fd in (1, 2):
            os.dup2(saved[fd], fd)
        log.close()
        if not failed:
            os.unlink(log.name)


def progress_bar(*args, **kwargs):
    """vLLM's progress bars in ``LLM.generate`` but one: the generation's
    (vLLM also draws one for rendering the prompts)."""
    from tqdm import tqdm

    if kwargs.get("desc") == "Rendering prompts":
        kwargs["disable"] = True
    return tqdm(*args, **kwargs)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.verbose:
        return run(args, progress=True)
    quiet_vllm_logging()
    with quiet_output():
        return run(args, progress=progress_bar)


def quiet_vllm_logging() -> None:
    """vLLM's logging at ERROR, in this process and (through the engine's
    logging config) in its engine processes: errors still show."""
    os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
    # Also before vLLM configures its logger: some of its modules warn on
    # import ("Triton is installed, but doesn't include CPU backend").
    logging.getLogger("vllm").setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def run(args, progress) -> int:
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
    common = dict(max_num_seqs=args.batch_size, progress=progress, warmup_ids=warmup_ids)
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
