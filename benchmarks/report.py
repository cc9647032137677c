# SPDX-License-Identifier: Apache-2.0
"""Results: greedy-match checks, results.json, results.md and the PNG plots.

Everything but ``write_plots`` is pure (dicts and strings), so the tests can
check it without vLLM or matplotlib.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.methods import BASELINE
from benchmarks.metrics import MatchResult, PassResult, compare_outputs

LOUD = "!" * 78


# ---------------------------------------------------------------- match check
def check_matches(passes: Sequence[PassResult]) -> dict[tuple[str, str], MatchResult]:
    """Compare every non-baseline pass with the baseline pass of the same
    workload, level and round (falling back to the baseline's other rounds
    at that level, then to its first pass). Keys: (method, pass key); the
    rounds of one method and level add up into one result."""
    same_round: dict[tuple[str, int], PassResult] = {}
    any_round: dict[str, PassResult] = {}
    for p in passes:
        if p.method == BASELINE:
            same_round.setdefault((p.key, p.round), p)
            any_round.setdefault(p.key, p)
    first = next(iter(any_round.values()), None)
    results: dict[tuple[str, str], MatchResult] = {}
    for p in passes:
        if p.method == BASELINE:
            continue
        reference = same_round.get((p.key, p.round), any_round.get(p.key, first))
        if reference is None:
            continue
        match = compare_outputs(reference.records, p.records)
        earlier = results.get((p.method, p.key))
        if earlier is not None:
            match = earlier + match
        results[(p.method, p.key)] = match
    return results


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
                           for p in group]))
    return pooled


def baseline_consistency(passes: Sequence[PassResult]) -> dict[str, MatchResult]:
    """The baseline's own passes against its first pass: differences here come
    from batching numerics, not from speculation, and explain (without
    excusing) mismatches seen at the same level."""
    own = [p for p in passes if p.method == BASELINE]
    if len(own) < 2:
        return {}
    return {p.key if p.round == 0 else f"{p.key} round {p.round + 1}":
            compare_outputs(own[0].records, p.records) for p in own[1:]}


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
            "key": p.key, "notes": p.notes, "rounds": p.round_figures,
            "startup_seconds": None if p.startup_seconds is None else round(p.startup_seconds, 1),
            "summary": p.summary(),
            "match_vs_baseline": match.to_json() if match else None,
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


def _passes_by(results: dict) -> dict[str, dict[str, dict]]:
    table: dict[str, dict[str, dict]] = {}
    for p in results["passes"]:
        table.setdefault(p["method"], {})[p["key"]] = p
    return table


def _levels(results: dict, workload: str) -> list[int]:
    return sorted({p["level"] for p in results["passes"] if p["workload"] == workload})


def _reference_pass(passes: dict[str, dict]) -> dict | None:
    """The pass whose tau / per-category figures represent a method: offline
    batch 1 if present, else the first one."""
    for key in ("offline-b1", "online-c1"):
        if key in passes:
            return passes[key]
    return next(iter(passes.values()), None)


def _match_cell(passes: dict[str, dict]) -> str:
    compared = matched = 0
    for p in passes.values():
        m = p.get("match_vs_baseline")
        if m:
            compared += m["compared"]
            matched += m["matched"]
    if not compared:
        return "(reference)" if passes and next(iter(passes.values()))["method"] == BASELINE else "-"
    cell = f"{matched}/{compared}"
    return cell if matched == compared else f"**{cell} MISMATCH**"


def _selection(config: dict) -> str:
    """Which questions of every category a run took."""
    per_category, skip = config.get("per_category"), config.get("skip_per_category") or 0
    if not per_category:
        return ""
    first = skip + 1
    return f"; questions {first}-{skip + per_category} of every category"


def render_markdown(results: dict) -> str:
    meta, config = results["meta"], results["config"]
    by_method = _passes_by(results)
    offline_levels = _levels(results, "offline")
    online_levels = _levels(results, "online")
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
        f"max {config.get('max_tokens')} new tokens, greedy"
        f"{', ignore_eos' if config.get('ignore_eos') else ''}",
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
    header += ["greedy match"]
    lines += ["## Overall", "", "| " + " | ".join(header) + " |",
              "|" + "---|" * len(header)]
    base = by_method.get(BASELINE, {})

    def speed(passes, key):
        p = passes.get(key)
        return p["summary"]["tokens_per_s"] if p else None

    def ratio(passes, key):
        a, b = speed(passes, key), speed(base, key)
        return f"{a / b:.2f}x" if a and b else "-"

    for method, passes in by_method.items():
        ref = _reference_pass(passes)
        s = ref["summary"] if ref else {}
        # An online pass of a method without ESP's worker count only bounds
        # its forwards from below (metrics.py): mark the bounds.
        bound = s.get("forwards_exact") is False
        row = [f"`{method}`", _fmt(s.get("tau")),
               ("≤ " if bound else "") + _fmt(s.get("tokens_per_step")),
               ("≥ " if bound else "") + _fmt(s.get("forwards_per_token"))]
        for b in offline_levels:
            row += [_fmt(speed(passes, f"offline-b{b}"), 1), ratio(passes, f"offline-b{b}")]
        if online_levels:
            if online_levels[0] != top_c:
                row += [_fmt(speed(passes, f"online-c{online_levels[0]}"), 1)]
            top = passes.get(f"online-c{top_c}", {}).get("summary", {})
            row += [_fmt(top.get("tokens_per_s"), 1), ratio(passes, f"online-c{top_c}"),
                    f"{_fmt(top.get('latency_p50_s'))} / {_fmt(top.get('latency_p99_s'))}",
                    _fmt(top.get("tpot_mean_ms"), 1)]
        row.append(_match_cell(passes))
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")

    # Every level: speed-up over `none` and rows per request-step.
    level_keys = ([f"offline-b{b}" for b in offline_levels]
                  + [f"online-c{c}" for c in online_levels])
    if len(level_keys) > 1:
        lines += ["## Speed-up and rows per step at every level", "",
                  "speed-up over `none` (rows per request per decode step: 1 + "
                  "verified draft slots, ESP's mask rows included / decode steps)",
                  "", "| method | " + " | ".join(level_keys) + " |",
                  "|---|" + "---|" * len(level_keys)]
        for method, passes in by_method.items():
            row = [f"`{method}`"]
            for key in level_keys:
                p = passes.get(key)
                rows = _fmt(p["summary"].get("rows_per_step")) if p else "-"
                row.append(f"{ratio(passes, key)} ({rows})")
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")

    # Per-category tau and tokens per decode step.
    categories = list(dict.fromkeys(p["category"] for p in results["prompts"]))
    spec_methods = [m for m in by_method if m != BASELINE]
    if spec_methods:
        ref_keys = {m: (_reference_pass(by_method[m]) or {}).get("key") for m in spec_methods}
        source = ("From each method's " + ", ".join(sorted(set(filter(None, ref_keys.values()))))
                  + " pass.")
        for metric, title in (("tau", "tau per category"),
                              ("tokens_per_step", "tokens per decode step per category")):
            lines += [f"## {title}", "", source, "",
                      "| category | " + " | ".join(f"`{m}`" for m in spec_methods) + " |",
                      "|---|" + "---|" * len(spec_methods)]
            for category in categories + ["overall"]:
                row = [category if category != "overall" else "**overall**"]
                for m in spec_methods:
                    ref = _reference_pass(by_method[m])
                    if not ref:
                        row.append("-")
                    elif category == "overall":
                        row.append(_fmt(ref["summary"].get(metric)))
                    else:
                        row.append(_fmt(ref["summary"]["per_category"].get(
                            category, {}).get(metric)))
                lines.append("| " + " | ".join(row) + " |")
            lines.append("")

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
            match = "-" if not m else (f"{m['matched']}/{m['compared']}"
                                       + ("" if m["ok"] else " **MISMATCH**"))
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


def write_plots(results: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    by_method = _passes_by(results)
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
                ref = _reference_pass(by_method[method])
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
                          f"({results['config'].get('model_name')})")
        fig.tight_layout()
        path = out_dir / "tau_per_category.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    workloads = [w for w in ("offline", "online") if _levels(results, w)]
    if workloads:
        fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.2),
                                 squeeze=False)
        for ax, workload in zip(axes[0], workloads):
            levels = _levels(results, workload)
            for method, passes in by_method.items():
                xs, ys = [], []
                for level in levels:
                    key = f"{workload}-{'b' if workload == 'offline' else 'c'}{level}"
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
            ax.set_title(f"{workload}: output tokens/s")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / "tokens_per_s_vs_concurrency.png"
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
