# SPDX-License-Identifier: Apache-2.0
"""Where a decode step's wall time goes, phase by phase, for any method.

Timers wrap the model runner's phases (vLLM's and ESP's own) in one
in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) while it generates
Spec-Bench answers one level at a time. Only steps that verify drafts are
counted, or with ``--steps undrafted`` only decode steps without drafts
(every request one token, no prefill; every decode step of ``none``, so
that a step without drafts can be compared with plain vLLM's phase by
phase); the table gives milliseconds per such step, each round in its own
column, rounds alternating the methods' order.

Nested phases overlap: ``execute_model`` holds ``forward``,
``prepare_inputs`` and ``attention metadata``; ``sample_tokens`` holds
``sample`` (verification) and ``propose``; ``engine step`` holds all of
them and the engine's own work around the runner (scheduling, output
processing). Unlike ``step_profile.py``'s
torch profiler, plain timers add almost nothing to a step, so the Python
around the forward is measured as it runs in a benchmark: after each
forward, with the caches cold (the same numpy code costs several times
its cost in a warm loop).

    ./run python -m benchmarks.step_phases --dataset PATH --methods esp suffix \\
        --batch-size 1 --rounds 2 --skip-per-category 4
    ./run python -m benchmarks.step_phases --dataset bundled --methods esp esp-chain \\
        --temperature 0 0.7 --dtype bfloat16
    ./run python -m benchmarks.step_phases --dataset PATH --methods none esp \\
        --batch-size 26 --steps undrafted

``--temperature`` runs every temperature in turn (all rounds of the
first, then the next); a sampled one (T > 0) generates exactly
``--max-tokens`` tokens per request (ignore_eos) with a seed per request,
and its columns are named ``method T0.7``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from pathlib import Path
from typing import Any

from benchmarks.metrics import add_sampling_arguments, temperature_label
from vllm_esp.core.goodput import SOURCE_CORPUS, SOURCE_ESP, SOURCE_LOOKUP

# vLLM's runner phases, then ESP's (absent for other methods).
RUNNER_PHASES = {
    "execute_model": "execute_model",
    "_update_states": "update states",
    "_prepare_inputs": "prepare_inputs",
    "_build_attention_metadata": "attention metadata",
    "_preprocess": "preprocess (input embeddings)",
    "_model_forward": "forward",
    "_sample": "sample (verification)",
    "_bookkeeping_sync": "bookkeeping",
    "propose_draft_token_ids": "propose",
    "_esp_begin_step": "esp: blocks and layouts",
    "_esp_select_chains": "esp: chain selection",
    "_esp_after_verification": "esp: after verification",
}
DRAFTER_PHASES = {
    "observe_step": "esp: cost model",
    "observe_verification": "esp: calibration",
    "_update_mask_embeddings": "esp: mask embeddings",
}

# ESP's candidate sources, by their index in vllm_esp.core.goodput.
SOURCE_NAMES = tuple(name for _, name in sorted(
    [(SOURCE_ESP, "esp"), (SOURCE_LOOKUP, "lookup"), (SOURCE_CORPUS, "cached answers")]))
# Per-step counts, not times: rows in the forward, rows given logits, and
# for ESP its mask rows and its drafted and accepted nodes by source.
COUNTS = ("forward rows", "logits rows", "esp: mask rows",
          *(f"esp: drafted from {name}" for name in SOURCE_NAMES),
          *(f"esp: accepted from {name}" for name in SOURCE_NAMES))


# Which steps the timers keep (``--steps``), and their name in the table:
# those that verify drafts, or decode steps without drafts (every request
# one token).
STEPS_COUNTED = {"drafted": "steps with drafts", "undrafted": "decode steps without drafts"}
STEP_KINDS = tuple(STEPS_COUNTED)


class PhaseTimers:
    """Accumulates the wall time of wrapped methods per engine step and
    keeps the steps of one kind (``keep_step``, set per step from what
    the scheduler scheduled)."""

    def __init__(self, steps: str = "drafted") -> None:
        if steps not in STEP_KINDS:
            raise ValueError(f"steps: one of {STEP_KINDS}, not {steps!r}")
        self.steps = steps
        self.current: dict[str, float] = collections.defaultdict(float)
        self.totals: dict[str, float] = collections.defaultdict(float)
        self.num_steps = 0
        self.keep_step = False
        self.counting = False
        # The phase whose end ends a step: the runner's last call, or the
        # engine's whole step once instrument_engine has wrapped it
        # (scheduling and output processing included).
        self.step_phase = "sample_tokens"

    def wrap(self, owner: Any, attribute: str, phase: str) -> None:
        original = getattr(owner, attribute)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.current[phase] += time.perf_counter() - started
                if phase == self.step_phase:
                    self.end_step()

        setattr(owner, attribute, timed)

    def end_step(self) -> None:
        if self.counting and self.keep_step:
            self.num_steps += 1
            for phase, seconds in self.current.items():
                self.totals[phase] += seconds
        self.current.clear()
        self.keep_step = False

    def per_step_ms(self) -> dict[str, float]:
        steps = max(self.num_steps, 1)
        return {phase: total / steps * (1 if phase in COUNTS else 1e3)
                for phase, total in self.totals.items()}

    def mark(self, scheduler_output) -> None:
        """Whether the step about to run is of the kind kept. vLLM builds
        spec-decode metadata for every step once speculation is on,
        prefills included; a step with drafts has scheduled them."""
        drafted = any(scheduler_output.scheduled_spec_decode_tokens.values())
        if self.steps == "drafted":
            self.keep_step = drafted
        else:
            self.keep_step = not drafted and all(
                count == 1 for count in scheduler_output.num_scheduled_tokens.values())


def instrument(runner, steps: str = "drafted") -> PhaseTimers:
    timers = PhaseTimers(steps)
    for attribute, phase in RUNNER_PHASES.items():
        if hasattr(runner, attribute):
            timers.wrap(runner, attribute, phase)
    for attribute, phase in DRAFTER_PHASES.items():
        if hasattr(getattr(runner, "drafter", None), attribute):
            timers.wrap(runner.drafter, attribute, phase)
    # The LM head, timed on its own: with a large vocabulary it is much of
    # a step (Gemma-3: 262,144 columns).
    timers.wrap(runner.model, "compute_logits", "compute_logits")
    compute_logits = runner.model.compute_logits

    def count_logits_rows(hidden_states, *args, **kwargs):
        timers.current["logits rows"] += hidden_states.shape[0]
        return compute_logits(hidden_states, *args, **kwargs)

    runner.model.compute_logits = count_logits_rows
    prepare_inputs = runner._prepare_inputs

    def prepare_and_mark(*args, **kwargs):
        result = prepare_inputs(*args, **kwargs)
        scheduler_output = args[0]
        timers.mark(scheduler_output)
        timers.current["forward rows"] += scheduler_output.total_num_scheduled_tokens
        return result

    runner._prepare_inputs = prepare_and_mark
    stats = getattr(getattr(runner, "drafter", None), "stats", None)
    if hasattr(stats, "blocks"):
        # ESP's periodic log line counts each step's verified blocks; what
        # one call adds to its counters is this step's share.
        log_blocks = stats.blocks

        def count_blocks(*args, **kwargs):
            before = (stats.mask_rows, stats.drafted_by_source.copy(),
                      stats.accepted_by_source.copy())
            log_blocks(*args, **kwargs)
            count_block_rows(timers.current, stats, before)

        stats.blocks = count_blocks
    timers.wrap(runner, "sample_tokens", "sample_tokens")
    return timers


def count_block_rows(counts: dict[str, float], stats, before) -> None:
    """Add to ``counts`` what one ``AutoStats.blocks`` call added to
    ``stats`` since ``before`` (its mask rows and drafted and accepted
    nodes by source): mask rows, and drafted and accepted tree nodes by
    candidate source."""
    mask_rows, drafted, accepted = before
    counts["esp: mask rows"] += float(stats.mask_rows - mask_rows)
    for kind, now, then in (("drafted", stats.drafted_by_source, drafted),
                            ("accepted", stats.accepted_by_source, accepted)):
        for name, count in zip(SOURCE_NAMES, now - then):
            counts[f"esp: {kind} from {name}"] += float(count)


def instrument_engine(timers: PhaseTimers, llm_engine) -> None:
    """Times what surrounds the runner in one engine step: the scheduler,
    the engine core's whole step, handing the drafts back to the scheduler,
    and in ``engine step`` all of it with the front end's output
    processing; ``engine step`` ends the step."""
    core = llm_engine.engine_core.engine_core
    timers.wrap(core.scheduler, "schedule", "engine: schedule")
    timers.wrap(core.scheduler, "update_from_output", "engine: update_from_output")
    timers.wrap(core, "post_step", "engine: post_step (drafts to scheduler)")
    # The rest of ``engine step`` is the front end: output processing
    # (detokenization). Its process_outputs is not wrapped here: the run's
    # step counter wraps and then deletes it.
    timers.wrap(core, "step_fn", "engine: core step")
    timers.wrap(llm_engine, "step", "engine step")
    timers.step_phase = "engine step"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_phases",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default=None,
                        help="Spec-Bench question.jsonl, or 'bundled'")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--methods", nargs="+", default=["esp", "suffix"])
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--skip-per-category", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    add_sampling_arguments(parser, "sampling temperature(s), 0 = greedy, run one after the "
                           "other; sampled requests force ignore_eos and get a seed each")
    parser.add_argument("--seed", type=int, default=0,
                        help="sampled requests' seeds: seed * 100003 + prompt index")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", choices=STEP_KINDS, default="drafted",
                        help="the steps timed: those that verify drafts (default), or "
                        "decode steps without drafts (every step of 'none')")
    parser.add_argument("--out", type=Path, default=None, help="write the table as JSON")
    args = parser.parse_args(argv)
    if min(args.temperatures) < 0 or not 0 < args.top_p <= 1:
        parser.error("--temperature: at least 0; --top-p: in (0, 1]")
    args.temperatures = list(dict.fromkeys(args.temperatures))
    return args


def column_name(method: str, temperature: float) -> str:
    """A method's column: its name, plus the temperature when sampled.

    >>> column_name("esp", 0.0), column_name("esp", 0.7)
    ('esp', 'esp T0.7')
    """
    return f"{method} {temperature_label(temperature)}" if temperature else method


def sampling_params_for(decoding, num_prompts: int):
    """One SamplingParams for every prompt (greedy, as always), or one per
    prompt with its seed (sampled)."""
    from vllm import SamplingParams

    if not decoding.sampled:
        return SamplingParams(**decoding.request_options())
    return [SamplingParams(**decoding.request_options(i)) for i in range(num_prompts)]


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # Every engine runs in this process, each after ESP's kernels loaded
    # numba: load llvmlite now so that the shield can cover it.
    import llvmlite.binding.ffi  # noqa: F401

    from vllm_esp.patching import shield_llvmlite_from_kernel_scan

    shield_llvmlite_from_kernel_scan()
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from benchmarks.methods import resolve
    from benchmarks.metrics import Decoding
    from vllm_esp_dev.data import chat_prompt_ids, load_questions_or_exit, select_questions
    from vllm_esp_dev.models import model_path
    from vllm_esp_dev.runs import generate, make_llm, shutdown, warm_up

    questions = load_questions_or_exit(args.dataset)
    path = model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [chat_prompt_ids(tokenizer, q) for q in
               select_questions(questions, args.per_category, skip=args.skip_per_category)]
    methods = [m for m in resolve(args.methods) if m.name in args.methods]
    table: dict[str, list[dict[str, float]]] = {}
    for temperature, round_index in ((t, r) for t in args.temperatures
                                     for r in range(args.rounds)):
        decoding = Decoding.for_temperature(temperature, args.max_tokens, False, args.top_p,
                                            args.seed)
        sampling_params = sampling_params_for(decoding, len(prompts))
        for method in methods if round_index % 2 == 0 else methods[::-1]:
            column = column_name(method.name, temperature)
            llm = make_llm(path, method.speculative_config, max_num_seqs=args.batch_size,
                           dtype=args.dtype)
            try:
                core = llm.llm_engine.engine_core.engine_core
                timers = instrument(core.model_executor.driver_worker.worker.model_runner,
                                    args.steps)
                instrument_engine(timers, llm.llm_engine)
                warm_up(llm, prompts[0][:32])
                if decoding.sampled:  # the sampled path's first calls, untimed too
                    generate(llm, [prompts[0][:32]], SamplingParams(
                        **{**decoding.request_options(), "max_tokens": 8}))
                timers.counting = True
                run = generate(llm, prompts, sampling_params, label=column)
            finally:
                shutdown(llm)
            figures = timers.per_step_ms()
            figures[STEPS_COUNTED[args.steps]] = timers.num_steps
            figures["tokens/s"] = sum(len(t) for t in run.token_ids) / run.seconds
            table.setdefault(column, []).append(figures)
            print(f"{column} round {round_index + 1}: "
                  f"{json.dumps({k: round(v, 3) for k, v in figures.items()})}", flush=True)
    phases = list(dict.fromkeys(p for rounds in table.values() for r in rounds for p in r))
    sampled = [t for t in args.temperatures if t]
    print(f"\n{args.model}, {args.dtype}, batch {args.batch_size}, {args.max_tokens} tokens; "
          + ("greedy" if not sampled else
             f"sampled columns (T): top-p {args.top_p:g}, ignore_eos, a seed per request")
          + "\n")
    print(f"| phase (ms per step, {STEPS_COUNTED[args.steps]} only; rows: per step) | "
          + " | ".join(table) + " |\n|---|" + "---|" * len(table))
    for phase in phases:
        print(f"| {phase} | " + " | ".join(
            " / ".join(f"{r.get(phase, 0.0):.2f}" for r in rounds)
            for rounds in table.values()) + " |")
    if args.out is not None:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                        "table": table}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
