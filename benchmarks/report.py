# SPDX-License-Identifier: Apache-2.0
"""Results: greedy-match checks, results.json, results.md and the PNG plots.

Everything but ``write_plots`` is pure (dicts and strings), so the tests can
check it without vLLM or matplotlib.

A run may hold passes at several temperatures (``--temperature``): every
table is then given once per temperature, greedy first as it always was.
The output check against ``none`` is a correctness check for greedy passes
only; sampled passes report their fraction of identical outputs for
information. results.json files written before passes had a temperature
read as greedy.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.methods import BASELINE
from benchmarks.metrics import (
    SEED_STRIDE,
    MatchResult,
    PassResult,
    compare_outputs,
    pass_key,
    temperature_label,
)

LOUD = "!" * 78


# ---------------------------------------------------------------- match check
def check_matches(passes: Sequence[PassResult]) -> dict[tuple[str, str], MatchResult]:
    """Compare every non-baseline pass with the baseline pass of the same
    workload, level, temperature and round (falling back to the baseline's
    other rounds at that level, then to its first pass at that
    temperature). Keys: (method, pass key); the rounds of one method and
    level add up into one result. For sampled passes the result is for
    information only (``failed_checks``)."""
    same_round: dict[tuple[str, int], PassResult] = {}
    any_round: dict[str, PassResult] = {}
    first: dict[float, PassResult] = {}
    for p in passes:
        if p.method == BASELINE:
            same_round.setdefault((p.key, p.round), p)
            any_round.setdefault(p.key, p)
            first.setdefault(p.temperature, p)
    results: dict[tuple[str, str], MatchResult] = {}
    for p in passes:
        if p.method == BASELINE:
            continue
        reference = same_round.get((p.key, p.round),
                                   any_round.get(p.key, first.get(p.temperature)))
        if reference is None:
            continue
        match = compare_outputs(reference.records, p.records)
        earlier = results.get((p.method, p.key))
        if earlier is not None:
            match = earlier + match
        results[(p.method, p.key)] = match
    return results


def failed_checks(passes: Sequence[PassResult]) -> list[tuple[str, str, MatchResult]]:
    """(method, pass key, match) of every greedy pass whose outputs differ
    from ``none``'s: the failures of the output check. Sampled passes never
    fail it (their outputs legitimately differ; ``sampled_matches``)."""
    greedy = {p.key for p in passes if not p.temperature}
    return [(method, key, match) for (method, key), match in check_matches(passes).items()
            if key in greedy and not match.ok]


def sampled_matches(passes: Sequence[PassResult]) -> dict[tuple[str, str], MatchResult]:
    """The sampled passes' comparisons with ``none``: how many outputs
    came out identical, for information, not a correctness check."""
    sampled = {p.key for p in passes if p.temperature}
    return {k: m for k, m in check_matches(passes).items() if k[1] in sampled}


def pool_rounds(passes: Sequence[PassResult]) -> list[PassResult]:
    """One pass per method and level: the rounds of a level (``--rounds``)
    pooled, in the order the levels first appear. A pooled pass's seconds,
    requests, counters and worker row counts are the rounds' sums, so its
    tokens per second is all rounds' output tokens over all their seconds;
    ``round_figures`` keeps each round's own seconds and output tokens. A
    level run once is returned as it is."""
    groups: dict[tuple[str, str], list[PassResult]] = {}
    for p in passes:
        groups.setdefault((p.method, p.key), []).append(p)
    pooled = []
    for group in groups.values():
        if len(group) == 1:
            pooled.append(group[0])
            continue
        first = group[0]
        counters: dict[str, float] = {}
        for p in group:
            for name, value in p.counters.items():
                counters[name] = counters.get(name, 0.0) + value
        row_counts = None
        if all(p.row_counts is not None for p in group):
            row_counts = {name: sum(p.row_counts.get(name, 0) for p in group)
                          for name in first.row_counts}
        startups = [p.startup_seconds for p in group if p.startup_seconds is not None]
        pooled.append(PassResult(
            method=first.method, workload=first.workload, level=first.level,
            seconds=sum(p.seconds for p in group),
            records=[r for p in group for r in p.records],
            counters=counters,
            notes=[f"round {p.round + 1}: {note}" for p in group for note in p.notes],
            startup_seconds=sum(startups) / len(startups) if startups else None,
            row_counts=row_counts,
            round_figures=[{"round": p.round, "seconds": round(p.seconds, 3),
                            "output_tokens": sum(r.num_output_tokens for r in p.records)}
                           for p in group],
            temperature=first.temperature))
    return pooled


def baseline_consistency(passes: Sequence[PassResult]) -> dict[str, MatchResult]:
    """The baseline's own passes against its first pass at the same
    temperature: differences here come from batching numerics, not from
    speculation, and explain (without excusing) mismatches seen at the same
    level. (Sampled requests carry fixed seeds, so plain vLLM repeats them
    up to the same numerics.)"""
    first: dict[float, PassResult] = {}
    out: dict[str, MatchResult] = {}
    for p in passes:
        if p.method != BASELINE:
            continue
        if p.temperature not in first:
            first[p.temperature] = p
            continue
        key = p.key if p.round == 0 else f"{p.key} round {p.round + 1}"
        out[key] = compare_outputs(first[p.temperature].records, p.records)
    return out


def mismatch_banner(method: str, key: str, match: MatchResult) -> str:
    lines = [LOUD, f"!!! GREEDY OUTPUT MISMATCH: {method} [{key}] vs {BASELINE}: "
             f"{match.matched}/{match.compared} prompts identical. This is a bug."]
    for m in match.mismatches[:10]:
        lines.append(f"!!!   prompt {m.index} ({m.category}): first difference at "
                     f"token {m.first_difference} ({m.reference_tokens} vs "
                     f"{m.candidate_tokens} tokens)")
    if len(match.mismatches) > 10:
        lines.append(f"!!!   ... and {len(match.mismatches) - 10} more")
    if match.missing:
        lines.append(f"!!!   prompts missing on one side: {match.missing}")
    lines.append(LOUD)
    return "\n".join(lines)


# ----------------------------------------------------------------------- JSON
def build_results(meta: dict, config: dict, prompts: list[dict], methods: dict,
                  passes: Sequence[PassResult], include_tokens: bool = False) -> dict:
    matches = check_matches(passes)
    consistency = baseline_consistency(passes)
    out_passes = []
    for p in pool_rounds(passes):
        match = matches.get((p.method, p.key))
        out_passes.append({
            "method": p.method, "workload": p.workload, "level": p.level,
            "temperature": p.temperature,
            "key": p.key, "notes": p.notes, "rounds": p.round_figures,
            "startup_seconds": None if p.startup_seconds is None else round(p.startup_seconds, 1),
            "summary": p.summary(),
            "match_vs_baseline": match.to_json() if match else None,
            # False: a sampled pass, whose comparison is for information.
            "match_is_check": not p.temperature,
            "records": [r.to_json(include_tokens) for r in p.records],
        })
    return {
        "meta": meta, "config": config, "prompts": prompts, "methods": methods,
        "baseline_consistency": {k: v.to_json() for k, v in consistency.items()},
        "passes": out_passes,
    }


def write_json(results: dict, path: Path) -> None:
    path.write_text(json.dumps(results, indent=1, sort_keys=False) + "\n")


# ------------------------------------------------------------------- markdown
def _fmt(value: Any, digits: int = 2, suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}{suffix}"
    return f"{value}{suffix}"


def _temperature(p: dict) -> float:
    """A results.json pass's temperature (0.0 in files from before sampled
    passes existed)."""
    return p.get("temperature") or 0.0


def temperatures(results: dict) -> list[float]:
    """The run's temperatures in the order its passes ran them."""
    return list(dict.fromkeys(_temperature(p) for p in results["passes"])) or [0.0]


def _passes_by(results: dict, temperature: float | None = None) -> dict[str, dict[str, dict]]:
    """method -> pass key -> pass, at one temperature (every pass: None)."""
    table: dict[str, dict[str, dict]] = {}
    for p in results["passes"]:
        if temperature is None or _temperature(p) == temperature:
            table.setdefault(p["method"], {})[p["key"]] = p
    return table


def _levels(results: dict, workload: str, temperature: float | None = None) -> list[int]:
    return sorted({p["level"] for p in results["passes"] if p["workload"] == workload
                   and (temperature is None or _temperature(p) == temperature)})


def _reference_pass(passes: dict[str, dict], temperature: float = 0.0) -> dict | None:
    """The pass whose tau / per-category figures represent a method: offline
    batch 1 if present, else the first one."""
    for key in (pass_key("offline", 1, temperature), pass_key("online", 1, temperature)):
        if key in passes:
            return passes[key]
    return next(iter(passes.values()), None)


def _match_cell(passes: dict[str, dict], check: bool = True) -> str:
    """matched/compared over a method's passes; a failed check is loud. Not
    a check (sampled passes): the plain fraction."""
    compared = matched = 0
    for p in passes.values():
        m = p.get("match_vs_baseline")
        if m:
            compared += m["compared"]
            matched += m["matched"]
    if not compared:
        return "(reference)" if passes and next(iter(passes.values()))["method"] == BASELINE else "-"
    cell = f"{matched}/{compared}"
    return cell if matched == compared or not check else f"**{cell} MISMATCH**"


def decoding_text(config: dict, show_ignore_eos: bool = True) -> str:
    """How a run's requests decoded, from its config: ``greedy`` (as runs
    always said), then any sampled temperatures and what they force."""
    temps = config.get("temperatures") or [config.get("temperature") or 0.0]
    parts = []
    if 0 in temps:
        parts.append("greedy" + (", ignore_eos" if show_ignore_eos and config.get("ignore_eos")
                                 else ""))
    sampled = [t for t in temps if t]
    if sampled:
        parts.append(
            f"sampled at temperature {', '.join(f'{t:g}' for t in sampled)} "
            f"(top-p {config.get('top_p', 1.0):g}; ignore_eos forced, so every request "
            f"makes all {config.get('max_tokens')} tokens with every method; a fixed "
            f"seed per request: --seed * {SEED_STRIDE} + prompt index)")
    return "; ".join(parts)


def _selection(config: dict) -> str:
    """Which questions of every category a run took."""
    per_category, skip = config.get("per_category"), config.get("skip_per_category") or 0
    if not per_category:
        return ""
    first = skip + 1
    return f"; questions {first}-{skip + per_category} of every category"


def _temperature_tables(results: dict, temperature: float, titled: bool) -> list[str]:
    """The overall, every-level and per-category tables of the passes at
    one temperature; ``titled``: the run has several (or sampled) ones, so
    the section titles name it."""
    by_method = _passes_by(results, temperature)
    offline_levels = _levels(results, "offline", temperature)
    online_levels = _levels(results, "online", temperature)
    check = not temperature
    title = ""
    if titled:
        title = (", greedy (temperature 0)" if check
                 else f", temperature {temperature:g} (sampled)")
    lines: list[str] = []

    def key(workload: str, level: int) -> str:
        return pass_key(workload, level, temperature)

    # Overall table.
    header = ["method", "tau", "tok/step", "fwd/tok"]
    for b in offline_levels:
        header += [f"tok/s b{b}", f"speedup b{b}"]
    top_c = online_levels[-1] if online_levels else None
    if online_levels:
        if online_levels[0] != top_c:
            header += [f"tok/s c{online_levels[0]}"]
        header += [f"tok/s c{top_c}", f"speedup c{top_c}", f"p50 / p99 latency c{top_c} (s)",
                   f"TPOT c{top_c} (ms)"]
    header += ["greedy match" if check else "same as `none` (not a check)"]
    lines += [f"## Overall{title}", "", "| " + " | ".join(header) + " |",
              "|" + "---|" * len(header)]
    base = by_method.get(BASELINE, {})

    def speed(passes, key):
        p = passes.get(key)
        return p["summary"]["tokens_per_s"] if p else None

    def ratio(passes, key):
        a, b = speed(passes, key), speed(base, key)
        return f"{a / b:.2f}x" if a and b else "-"

    for method, passes in by_method.items():
        ref = _reference_pass(passes, temperature)
        s = ref["summary"] if ref else {}
        # An online pass of a method without ESP's worker count only bounds
        # its forwards from below (metrics.py): mark the bounds.
        bound = s.get("forwards_exact") is False
        row = [f"`{method}`", _fmt(s.get("tau")),
               ("≤ " if bound else "") + _fmt(s.get("tokens_per_step")),
               ("≥ " if bound else "") + _fmt(s.get("forwards_per_token"))]
        for b in offline_levels:
            row += [_fmt(speed(passes, key("offline", b)), 1),
                    ratio(passes, key("offline", b))]
        if online_levels:
            if online_levels[0] != top_c:
                row += [_fmt(speed(passes, key("online", online_levels[0])), 1)]
            top = passes.get(key("online", top_c), {}).get("summary", {})
            row += [_fmt(top.get("tokens_per_s"), 1), ratio(passes, key("online", top_c)),
                    f"{_fmt(top.get('latency_p50_s'))} / {_fmt(top.get('latency_p99_s'))}",
                    _fmt(top.get("tpot_mean_ms"), 1)]
        row.append(_match_cell(passes, check))
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")

    # Every level: speed-up over `none` and rows per request-step.
    level_keys = ([key("offline", b) for b in offline_levels]
                  + [key("online", c) for c in online_levels])
    if len(level_keys) > 1:
        lines += [f"## Speed-up and rows per step at every level{title}", "",
                  "speed-up over `none` (rows per request per decode step: 1 + "
                  "verified draft slots, ESP's mask rows included / decode steps)",
                  "", "| method | " + " | ".join(level_keys) + " |",
                  "|---|" + "---|" * len(level_keys)]
        for method, passes in by_method.items():
            row = [f"`{method}`"]
            for level_key in level_keys:
                p = passes.get(level_key)
                rows = _fmt(p["summary"].get("rows_per_step")) if p else "-"
                row.append(f"{ratio(passes, level_key)} ({rows})")
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    if not check and level_keys:
        # Under sampling, what a method's verification accepts is the
        # question (`esp` walks its trees, `esp-chain` verifies one chain).
        lines += [f"## Tokens per decode step at every level{title}", "",
                  "output tokens per decode step (≤: a bound, see above)", "",
                  "| method | " + " | ".join(level_keys) + " |",
                  "|---|" + "---|" * len(level_keys)]
        for method, passes in by_method.items():
            row = [f"`{method}`"]
            for level_key in level_keys:
                summary = passes.get(level_key, {}).get("summary", {})
                bound = "≤ " if summary.get("forwards_exact") is False else ""
                row.append(bound + _fmt(summary.get("tokens_per_step")))
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")

    # Per-category tau and tokens per decode step.
    categories = list(dict.fromkeys(p["category"] for p in results["prompts"]))
    spec_methods = [m for m in by_method if m != BASELINE]
    if spec_methods:
        ref_keys = {m: (_reference_pass(by_method[m], temperature) or {}).get("key")
                    for m in spec_methods}
        source = ("From each method's " + ", ".join(sorted(set(filter(None, ref_keys.values()))))
                  + " pass.")
        for metric, heading in (("tau", "tau per category"),
                                ("tokens_per_step", "tokens per decode step per category")):
            lines += [f"## {heading}{title}", "", source, "",
                      "| category | " + " | ".join(f"`{m}`" for m in spec_methods) + " |",
                      "|---|" + "---|" * len(spec_methods)]
            for category in categories + ["overall"]:
                row = [category if category != "overall" else "**overall**"]
                for m in spec_methods:
                    ref = _reference_pass(by_method[m], temperature)
                    if not ref:
                        row.append("-")
                    elif category == "overall":
                        row.append(_fmt(ref["summary"].get(metric)))
                    else:
                        row.append(_fmt(ref["summary"]["per_category"].get(
                            category, {}).get(metric)))
                lines.append("| " + " | ".join(row) + " |")
            lines.append("")

    return lines


def render_markdown(results: dict) -> str:
    meta, config = results["meta"], results["config"]
    by_method = _passes_by(results)
    temps = temperatures(results)
    lines = [f"# Spec-Bench: vllm-esp ({meta.get('timestamp', '')})", ""]
    lines += [
        f"- command: `{meta.get('command', '')}`",
        f"- git: `{meta.get('git_commit', '?')}`{' (dirty)' if meta.get('git_dirty') else ''}",
        f"- vLLM {meta.get('vllm_version', '?')}, torch {meta.get('torch_version', '?')}",
        f"- model: `{config.get('model')}`, dtype {config.get('dtype')}, "
        f"{'torch.compile' if config.get('compile') else 'eager'}, "
        f"prefix caching {'on' if config.get('prefix_caching') else 'off'}",
        f"- prompts: {len(results['prompts'])} ({config.get('prompt_source')}"
        f"{_selection(config)}), "
        f"max {config.get('max_tokens')} new tokens, {decoding_text(config)}",
        f"- machine: {meta.get('machine', {}).get('summary', '?')}; load average "
        f"at start {meta.get('loadavg_start')}, at end {meta.get('loadavg_end')}",
    ]
    if (config.get("rounds") or 1) > 1:
        lines.append(
            f"- rounds: {config['rounds']} per level, the methods' order reversed "
            "every other round; seconds and requests pooled over the rounds "
            "(each round's speed-up: the Rounds section)")
    lines += [
        "",
        "tau = 1 + accepted / verification steps with drafts (vLLM's mean "
        "acceptance length). tok/step = output tokens per decode step, every "
        "decode step counted (Spec-Bench's mean accepted length; the fair "
        "comparison between methods that always draft and methods that "
        "sometimes do not). fwd/tok = target forwards (prefill + every decode "
        "or verification step) per output token; 1.00 without speculation. "
        "Both count the steps that emitted each request's tokens (vLLM's "
        "accepted count includes drafts that max_tokens then cut); where only "
        "a bound was counted (online, methods other than ESP) they are "
        "marked ≤ / ≥ and the per-category figures are bounds too. "
        "Speedup = tokens/s over `none` at the same level. Definitions: "
        "`benchmarks/metrics.py`.",
        "",
    ]
    if any(temps):
        lines += [
            "Every table is given per temperature; a sampled pass's key ends in its "
            "temperature (`offline-b8-T0.7`), and its speed-up is over `none` at the "
            "same level and temperature. Sampled outputs legitimately differ from "
            "`none`'s (speculative sampling keeps the distribution, not the tokens): "
            "their identical fraction is shown for information and is **not a "
            "correctness check**. The output check is the greedy passes' only. "
            "vLLM's `ngram` accepted counts are not replayed in sampled passes (the "
            "replay assumes greedy acceptance), so their tau may count drafts "
            "accepted past max_tokens; tok/step and fwd/tok are counted steps either "
            "way.",
            "",
        ]
    for temperature in temps:
        lines += _temperature_tables(results, temperature, titled=any(temps))

    # Every pass.
    lines += ["## Every pass", "",
              "| method | pass | requests | tokens | s | tok/s | ms/tok | tau | tau (counters) "
              "| fwd/tok | p50 / p99 latency (s) | TTFT p50 (s) | TPOT mean (ms) | match "
              "| start-up (s) |",
              "|" + "---|" * 15]
    for method, passes in by_method.items():
        for key, p in passes.items():
            s = p["summary"]
            m = p.get("match_vs_baseline")
            match = "-" if not m else (f"{m['matched']}/{m['compared']}" + (
                " (sampled: not a check)" if _temperature(p)
                else "" if m["ok"] else " **MISMATCH**"))
            lat = (f"{_fmt(s.get('latency_p50_s'))} / {_fmt(s.get('latency_p99_s'))}"
                   if "latency_p50_s" in s else "-")
            lines.append("| " + " | ".join([
                f"`{method}`", key, str(s["num_requests"]), str(s["output_tokens"]),
                _fmt(s["seconds"], 1), _fmt(s["tokens_per_s"], 1),
                _fmt(s["ms_per_output_token"], 1), _fmt(s["tau"]), _fmt(s["tau_counters"]),
                _fmt(s["forwards_per_token"]), lat, _fmt(s.get("ttft_p50_s")),
                _fmt(s.get("tpot_mean_ms"), 1), match,
                _fmt(p.get("startup_seconds"), 0)]) + " |")
    lines.append("")
    lines += _rounds_section(by_method)

    # Notes.
    notes = []
    for name, info in results["methods"].items():
        if info.get("status") != "ran":
            notes.append(f"- `{name}` {info.get('status')}: {info.get('reason', '')}")
    for p in results["passes"]:
        for note in p["notes"]:
            notes.append(f"- `{p['method']}` {p['key']}: {note}")
    for key, m in results.get("baseline_consistency", {}).items():
        if not m["ok"]:
            notes.append(f"- `{BASELINE}` {key} differs from its own first pass on "
                         f"{m['compared'] - m['matched']} prompt(s): batching numerics")
    if notes:
        lines += ["## Notes", ""] + notes + [""]
    lines += ["## Methods", ""]
    for name, info in results["methods"].items():
        config_json = json.dumps(info.get("speculative_config"))
        lines.append(f"- `{name}`: `{config_json}`: {info.get('description', '')}")
    lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------- plots
def _rounds_section(by_method: dict[str, dict[str, dict]]) -> list[str]:
    """Each round's speed-up over the same round's `none`, for levels run
    in several rounds: how far the machine drifted between them."""
    base = by_method.get(BASELINE, {})
    rows = []
    for method, passes in by_method.items():
        if method == BASELINE:
            continue
        for key, p in passes.items():
            mine, theirs = p.get("rounds"), base.get(key, {}).get("rounds")
            if not mine or not theirs:
                continue
            reference = {r["round"]: r["output_tokens"] / r["seconds"] for r in theirs}
            cells = [f"{r['output_tokens'] / r['seconds'] / reference[r['round']]:.2f}x"
                     if r["round"] in reference else "-" for r in mine]
            rows.append(f"| `{method}` | {key} | {' / '.join(cells)} |")
    if not rows:
        return []
    return ["## Rounds", "",
            "Each round's speed-up over `none` in the same round (the tables "
            "above pool the rounds).", "",
            "| method | pass | speed-up per round |", "|---|---|---|"] + rows + [""]


def plot_names(temperature: float) -> tuple[str, str]:
    """The two plots' file names at one temperature: greedy's as they
    always were, a sampled temperature's with it appended.

    >>> plot_names(0.7)
    ('tau_per_category_T0.7.png', 'tokens_per_s_vs_concurrency_T0.7.png')
    """
    suffix = f"_{temperature_label(temperature)}" if temperature else ""
    return f"tau_per_category{suffix}.png", f"tokens_per_s_vs_concurrency{suffix}.png"


def write_plots(results: dict, out_dir: Path) -> list[Path]:
    """tau_per_category.png and tokens_per_s_vs_concurrency.png, once per
    temperature (``plot_names``)."""
    written: list[Path] = []
    for temperature in temperatures(results):
        written += _write_plots_at(results, out_dir, temperature)
    return written


def _write_plots_at(results: dict, out_dir: Path, temperature: float) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    by_method = _passes_by(results, temperature)
    tau_name, speed_name = plot_names(temperature)
    at = f", temperature {temperature:g}" if temperature else ""
    categories = list(dict.fromkeys(p["category"] for p in results["prompts"]))
    spec_methods = [m for m in by_method if m != BASELINE]

    if spec_methods:
        labels = categories + ["overall"]
        width = 0.8 / len(spec_methods)
        panels = (("tau", "vLLM tau (tokens per verification step with drafts)"),
                  ("tokens_per_step", "tokens per decode step (every step counted)"))
        fig, axes = plt.subplots(2, 1, figsize=(max(8, 0.9 * len(labels) + 2), 8.5),
                                 sharex=True)
        for ax, (metric, ylabel) in zip(axes, panels):
            for i, method in enumerate(spec_methods):
                ref = _reference_pass(by_method[method], temperature)
                values = []
                for category in labels:
                    if ref is None:
                        values.append(0)
                    elif category == "overall":
                        values.append(ref["summary"].get(metric) or 0)
                    else:
                        values.append(ref["summary"]["per_category"].get(
                            category, {}).get(metric) or 0)
                ax.bar([x + (i - (len(spec_methods) - 1) / 2) * width
                        for x in range(len(labels))], values, width, label=method)
            ax.axhline(1.0, color="grey", linewidth=0.8)
            ax.set_ylabel(ylabel, fontsize=9)
            ax.legend(fontsize=8, ncol=min(4, len(spec_methods)))
        axes[-1].set_xticks(range(len(labels)))
        axes[-1].set_xticklabels(labels, rotation=35, ha="right")
        axes[0].set_title(f"acceptance per Spec-Bench category "
                          f"({results['config'].get('model_name')}{at})")
        fig.tight_layout()
        path = out_dir / tau_name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    workloads = [w for w in ("offline", "online") if _levels(results, w, temperature)]
    if workloads:
        fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.2),
                                 squeeze=False)
        for ax, workload in zip(axes[0], workloads):
            levels = _levels(results, workload, temperature)
            for method, passes in by_method.items():
                xs, ys = [], []
                for level in levels:
                    key = pass_key(workload, level, temperature)
                    if key in passes:
                        xs.append(level)
                        ys.append(passes[key]["summary"]["tokens_per_s"])
                if xs:
                    ax.plot(xs, ys, marker="o", label=method,
                            linestyle="--" if method == BASELINE else "-")
            ax.set_xscale("log", base=2)
            ax.set_xticks(levels)
            ax.set_xticklabels([str(x) for x in levels])
            ax.set_xlabel("max batch size" if workload == "offline" else "client concurrency")
            ax.set_ylabel("output tokens/s")
            ax.set_title(f"{workload}: output tokens/s{at}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / speed_name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def rerender(out_dir: Path) -> None:
    """Rewrite results.md and the plots of a finished run from its JSON."""
    results = json.loads((out_dir / "results.json").read_text())
    (out_dir / "results.md").write_text(render_markdown(results))
    write_plots(results, out_dir)


if __name__ == "__main__":
    import sys

    for folder in sys.argv[1:]:
        rerender(Path(folder))
