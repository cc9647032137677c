# SPDX-License-Identifier: Apache-2.0
"""Benchmark arithmetic: pure functions over per-request records, no vLLM.

Definitions (per request, then summed over requests: token-weighted)
---------------------------------------------------------------------
``n``             output tokens of the request.
``spec_steps``    verification steps that carried at least one draft token
                  (vLLM's per-request ``num_spec_steps``: the sum of its
                  acceptance histogram). vLLM only counts a step when the
                  request had drafts; an n-gram miss is a plain decode step
                  and is *not* counted.
``accepted``      draft tokens accepted over those steps (bonus excluded).
``draft_tokens``  draft tokens proposed. For ESP this counts tree nodes, not
                  the mask slots of its block (see vllm_esp/scheduler.py).

tau (mean acceptance length, vLLM's definition)::

    tau = 1 + sum(accepted) / sum(spec_steps)

the mean number of tokens a verification step emits. Steps without drafts do
not enter it, so for methods that sometimes do not draft (n-gram, suffix)
tau overstates the saving; ``forwards_per_token`` below does not.

target forwards (the target model's forward passes the request took part in,
prefill included)::

    forwards = max(n - accepted, 1 + spec_steps)

Why: the prefill forward emits the first token, every later forward emits
one token plus the drafts it accepted, so ``n = forwards + accepted``
exactly when nothing was cut. When ``max_tokens`` (or a stop token) cuts the
last step short, vLLM has already counted the accepted tokens that were then
dropped, and ``n - accepted`` can undercount; it can never fall below the
``1 + spec_steps`` forwards the request certainly made, hence the ``max``.
For vLLM's ``ngram`` the cut is corrected exactly: its drafter is replayed on
the finished greedy output (``replay_chain_drafts``), which gives the accepted
tokens that were actually emitted; the replay must reproduce vLLM's
``spec_steps`` and never exceed its accepted count, or the run fails. vLLM's
own count stays in ``accepted_tokens_reported`` (and in the counters).
The replay assumes greedy acceptance (a draft is accepted when it equals the
output's next token). Under sampling a draft that equals the next token may
have been rejected and the token then drawn anew, so sampled passes
(temperature > 0) are not replayed: their tau keeps vLLM's count, and their
tokens per step and forwards come from the counted steps below, which do not
depend on how tokens were accepted.
Methods that draft at every step (ESP, the hybrid) make no plain decode
steps, so for them ``1 + spec_steps`` is exact and the ``max`` already
corrects the cut.
Without speculation ``forwards = n``. A chunked prefill (long prompts beyond
the scheduler's token budget) would add forwards that are not counted here.

That estimate is only a fallback. vLLM counts a step's accepted drafts
before ``max_tokens`` or a stop token cuts them, and a method that draws no
drafts on some steps (``suffix``, ``ngram``, ESP under ``"auto"``) makes
plain steps that ``1 + spec_steps`` does not see, so ``n - accepted``
undercounts the forwards of every cut request. On Gemma-3-270M's repetitive
answers this made ESP's tokens per step 4.26 where a step-by-step trace of
the engine counted 3.43 (``suffix``: 3.70 against 3.42). The benchmarks
therefore count the forwards where the output is produced:

- offline, the front end counts, per request, the engine steps whose output
  carried tokens for it (``vllm_esp_dev.runs.generate``): exact
  (``emitting_steps`` with ``emitting_steps_exact``);
- online, the client counts streamed chunks with tokens. vLLM merges a
  request's outputs when the client falls behind, so this is a lower bound
  and ``target_forwards`` takes the larger of it and the estimate;
- ESP's worker counts its decode request-steps (``esp_row_counts``); a pass
  with that count takes its aggregate figures from it, exactly, online too.

forwards per output token::

    forwards_per_token = sum(forwards) / sum(n)     (1.0 without speculation)

tokens per decode step (Spec-Bench's and the paper's mean accepted length,
which counts every decode step, drafted or not)::

    tokens_per_step = sum(n - 1) / sum(forwards - 1)   (1.0 without speculation)

the fair way to compare a method that always drafts (ESP) with one that
sometimes does not (n-gram, suffix), whose vLLM tau skips the misses.

Throughput: ``tokens_per_s = sum(n) / wall_seconds`` of the whole pass (all
requests of one workload at one batch size / concurrency). ``time per output
token``: offline, ``1000 * wall_seconds / sum(n)`` (ms, aggregate); online,
per request ``(latency - ttft) / (n - 1)`` (ms; TPOT as vLLM's bench tools
define it), reported as mean and percentiles. Percentiles use linear
interpolation between order statistics (numpy's default).

Greedy match: a method's outputs are compared token for token with the
``none`` (no speculation) outputs of the same prompts; greedy speculative
decoding must reproduce them exactly, so any mismatch is a bug (in fp32; in
bf16, near-ties can flip). Sampled passes (temperature > 0) are compared the
same way, for information only: speculative sampling keeps the distribution
of the outputs, not the outputs, so they legitimately differ from ``none``'s
even with the same per-request seeds; their identical fraction is not a
correctness check.

Sampled passes: every request generates exactly ``max_tokens`` tokens
(``ignore_eos``), so every method makes the same number of tokens and the
speeds compare the same work; each request has a fixed seed
(``request_seed``), the same for every method, level and round.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

SPEC_COUNTER_NAMES = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)


@dataclass
class RequestRecord:
    """One request of one pass. Spec fields are ``None`` without speculation."""

    index: int
    category: str
    output_token_ids: list[int]
    spec_steps: int | None = None
    accepted_tokens: int | None = None
    draft_tokens: int | None = None
    latency_s: float | None = None
    ttft_s: float | None = None
    # vLLM's accepted count when it differs from ``accepted_tokens`` (drafts
    # accepted past max_tokens or a stop token; see ``with_replayed_drafts``).
    accepted_tokens_reported: int | None = None
    # Engine steps whose output carried tokens for this request (the prefill's
    # included): counted by the front end offline (exact), from the stream
    # online (a lower bound: vLLM merges outputs the client has not read yet).
    emitting_steps: int | None = None
    emitting_steps_exact: bool = False

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @classmethod
    def from_spec_metrics(cls, index: int, category: str,
                          output_token_ids: Sequence[int],
                          spec_metrics: Mapping[str, Any] | None,
                          **timing: float | None) -> RequestRecord:
        """Build from vLLM's per-request spec-decode metrics: the dict of
        ``RequestSpecDecodeMetrics.to_dict()`` offline, or the response's
        ``metrics.speculative_decoding`` online (same keys)."""
        steps = accepted = drafts = None
        if spec_metrics:
            if "num_spec_steps" in spec_metrics:
                steps = int(spec_metrics["num_spec_steps"])
                accepted = int(spec_metrics["num_accepted_draft_tokens"])
            else:  # the raw histogram form
                histogram = spec_metrics["acceptance_histogram"]
                steps = sum(histogram)
                accepted = sum(j * c for j, c in enumerate(histogram))
            drafts = int(spec_metrics.get("num_draft_tokens", 0))
        return cls(index=index, category=category,
                   output_token_ids=list(output_token_ids), spec_steps=steps,
                   accepted_tokens=accepted, draft_tokens=drafts, **timing)

    def with_emitting_steps(self, steps: int | None, exact: bool) -> RequestRecord:
        return replace(self, emitting_steps=steps, emitting_steps_exact=exact)

    def to_json(self, include_tokens: bool = False) -> dict[str, Any]:
        out = asdict(self)
        tokens = out.pop("output_token_ids")
        out["num_output_tokens"] = len(tokens)
        out["output_sha1"] = token_digest(tokens)
        out["target_forwards"] = target_forwards(self)
        if include_tokens:
            out["output_token_ids"] = tokens
        return out


def token_digest(token_ids: Sequence[int]) -> str:
    return hashlib.sha1(",".join(map(str, token_ids)).encode()).hexdigest()[:16]


# ----------------------------------------------------------------- per request
def target_forwards(record: RequestRecord) -> int:
    """Target-model forward passes of one request (see module docstring):
    the counted steps when exact, else the estimate from vLLM's spec-decode
    metrics, raised to a lower bound counted from the stream."""
    if record.emitting_steps_exact and record.emitting_steps is not None:
        return record.emitting_steps
    n = record.num_output_tokens
    estimate = n
    if record.spec_steps:
        estimate = max(n - (record.accepted_tokens or 0), 1 + record.spec_steps)
    return max(estimate, record.emitting_steps or 0)


def replay_chain_drafts(prompt_ids: Sequence[int], output_ids: Sequence[int],
                        propose: Callable[[list[int]], Sequence[int]]) -> tuple[int, int]:
    """``(spec_steps, accepted)`` of greedy speculative decoding with a
    deterministic chain drafter, replayed on the finished greedy output.

    Each step drafts ``propose(prompt + output so far)``; greedy verification
    accepts the drafts' longest prefix that the output continues with, then
    emits one more token. A step without drafts is a plain decode step. The
    output's last token counts as the bonus token of the step that emitted it
    (a cut step's later tokens were dropped), so ``n = forwards + accepted``
    holds exactly. Example, output ``a b c d``, a drafter that always
    proposes ``b c x``: after the prefill's ``a`` one step accepts ``b c``
    and emits ``d`` (1 step, 2 accepted, 2 forwards). With output ``a b c``
    the same step accepts ``b`` and ``c`` is its last token (1 step, 1
    accepted).
    """
    output = list(output_ids)
    history = list(prompt_ids) + output[:1]  # the prefill emits the first token
    emitted, spec_steps, accepted = 1, 0, 0
    while emitted < len(output):
        drafts = list(propose(history))
        hits = 0
        for draft in drafts:
            if emitted + hits + 1 >= len(output) or draft != output[emitted + hits]:
                break
            hits += 1
        spec_steps += bool(drafts)
        accepted += hits
        history.extend(output[emitted:emitted + hits + 1])
        emitted += hits + 1
    return spec_steps, accepted


def with_replayed_drafts(record: RequestRecord, prompt_ids: Sequence[int],
                         propose: Callable[[list[int]], Sequence[int]]) -> RequestRecord:
    """``record`` with the accepted tokens that were emitted, from a replay of
    its (greedy, deterministic) chain drafter; vLLM's count is kept in
    ``accepted_tokens_reported`` when it differs. Raises if the replay does
    not reproduce vLLM's verification steps or exceeds its accepted count:
    then the drafter or the decoding was not what the replay assumes."""
    if not record.spec_steps or record.num_output_tokens == 0:
        return record
    spec_steps, accepted = replay_chain_drafts(prompt_ids, record.output_token_ids,
                                               propose)
    if spec_steps != record.spec_steps or accepted > (record.accepted_tokens or 0):
        raise ValueError(
            f"request {record.index}: replaying the drafter gave {spec_steps} "
            f"steps / {accepted} accepted, vLLM reported {record.spec_steps} / "
            f"{record.accepted_tokens}")
    if accepted == record.accepted_tokens:
        return record
    return replace(record, accepted_tokens=accepted,
                   accepted_tokens_reported=record.accepted_tokens)


def request_tpot_s(record: RequestRecord) -> float | None:
    """Time per output token after the first: (latency - ttft) / (n - 1)."""
    if (record.latency_s is None or record.ttft_s is None
            or record.num_output_tokens < 2):
        return None
    return (record.latency_s - record.ttft_s) / (record.num_output_tokens - 1)


# ------------------------------------------------------------------ aggregates
def tau(records: Iterable[RequestRecord]) -> float | None:
    """1 + sum(accepted) / sum(spec_steps); None when nothing was drafted."""
    steps = accepted = 0
    for record in records:
        if record.spec_steps:
            steps += record.spec_steps
            accepted += record.accepted_tokens or 0
    return 1.0 + accepted / steps if steps else None


def draft_acceptance_rate(records: Iterable[RequestRecord]) -> float | None:
    drafts = accepted = 0
    for record in records:
        drafts += record.draft_tokens or 0
        accepted += record.accepted_tokens or 0
    return accepted / drafts if drafts else None


def forwards_per_token(records: Iterable[RequestRecord]) -> float | None:
    records = list(records)
    tokens = sum(r.num_output_tokens for r in records)
    if not tokens:
        return None
    return sum(target_forwards(r) for r in records) / tokens


def tokens_per_step(records: Iterable[RequestRecord]) -> float | None:
    """sum(n - 1) / sum(forwards - 1): tokens per decode forward, every decode
    step counted (the prefill's token and forward excluded)."""
    tokens = steps = 0
    for record in records:
        if record.num_output_tokens < 2:
            continue
        tokens += record.num_output_tokens - 1
        steps += target_forwards(record) - 1
    return tokens / steps if steps else None


def rows_per_step(records: Iterable[RequestRecord]) -> float | None:
    """Verification rows per request per decode step of a chain method: 1 +
    drafts / decode steps (1.0 without speculation). A step's cost grows
    with the batch's rows. ESP's drafts count tree nodes only; its rows,
    mask rows included, come from the worker (``esp_row_counts``)."""
    slots = steps = 0
    for record in records:
        if record.num_output_tokens < 2:
            continue
        slots += record.draft_tokens or 0
        steps += target_forwards(record) - 1
    return 1.0 + slots / steps if steps else None


def tokens_per_second(records: Iterable[RequestRecord], seconds: float) -> float | None:
    tokens = sum(r.num_output_tokens for r in records)
    return tokens / seconds if seconds > 0 else None


def percentile(values: Sequence[float], q: float) -> float | None:
    """q-th percentile (0..100), linear interpolation (numpy's default)."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    position = (len(values) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (position - low)


def tau_from_counters(counters: Mapping[str, float]) -> float | None:
    """vLLM's global counters (deltas over a pass): 1 + accepted / drafts."""
    drafts = counters.get("vllm:spec_decode_num_drafts", 0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0)
    return 1.0 + accepted / drafts if drafts else None


def counter_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    return {name: after.get(name, 0) - before.get(name, 0)
            for name in set(before) | set(after)}


def parse_prometheus_counters(text: str,
                              names: Sequence[str] = SPEC_COUNTER_NAMES) -> dict[str, float]:
    """Sum the ``<name>_total`` samples (all label sets) of each counter in a
    Prometheus text exposition, e.g. ``vllm:spec_decode_num_drafts_total{...} 3``.
    Names are matched exactly (``..._accepted_tokens_per_pos`` is another
    metric)."""
    wanted = {f"{name}_total": name for name in names}
    totals: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        metric, _, rest = line.partition(" ")
        metric = metric.split("{", 1)[0]
        if metric not in wanted:
            continue
        if "}" in line:  # labels may contain spaces: value follows the brace
            rest = line.rsplit("}", 1)[1]
        value = rest.split()[0]
        totals[wanted[metric]] = totals.get(wanted[metric], 0.0) + float(value)
    return totals


def _rounded(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def summarize(records: Sequence[RequestRecord], seconds: float,
              counters: Mapping[str, float] | None = None) -> dict[str, Any]:
    """All figures of one pass, overall and per category (JSON-ready)."""
    tokens = sum(r.num_output_tokens for r in records)
    latencies = [r.latency_s for r in records if r.latency_s is not None]
    ttfts = [r.ttft_s for r in records if r.ttft_s is not None]
    tpots = [t for t in map(request_tpot_s, records) if t is not None]
    summary: dict[str, Any] = {
        "num_requests": len(records),
        "output_tokens": tokens,
        "seconds": _rounded(seconds),
        "tokens_per_s": _rounded(tokens_per_second(records, seconds), 3),
        "ms_per_output_token": _rounded(1000.0 * seconds / tokens if tokens else None, 3),
        "tau": _rounded(tau(records)),
        "tau_counters": _rounded(tau_from_counters(counters or {})),
        "draft_acceptance_rate": _rounded(draft_acceptance_rate(records)),
        "forwards_per_token": _rounded(forwards_per_token(records)),
        "tokens_per_step": _rounded(tokens_per_step(records)),
        "rows_per_step": _rounded(rows_per_step(records)),
        "target_forwards": sum(target_forwards(r) for r in records),
        # True when every request's forwards were counted, not estimated.
        "forwards_exact": all(r.emitting_steps_exact for r in records),
        "spec_steps": sum(r.spec_steps or 0 for r in records),
        "accepted_tokens": sum(r.accepted_tokens or 0 for r in records),
        "counters": dict(counters or {}),
    }
    if latencies:
        summary.update({
            "latency_p50_s": _rounded(percentile(latencies, 50)),
            "latency_p99_s": _rounded(percentile(latencies, 99)),
            "latency_mean_s": _rounded(sum(latencies) / len(latencies)),
            "ttft_p50_s": _rounded(percentile(ttfts, 50)),
            "tpot_mean_ms": _rounded(1000 * sum(tpots) / len(tpots)) if tpots else None,
            "tpot_p50_ms": _rounded(1000 * percentile(tpots, 50)) if tpots else None,
            "tpot_p99_ms": _rounded(1000 * percentile(tpots, 99)) if tpots else None,
        })
    per_category: dict[str, dict[str, Any]] = {}
    for category in dict.fromkeys(r.category for r in records):
        group = [r for r in records if r.category == category]
        per_category[category] = {
            "num_requests": len(group),
            "output_tokens": sum(r.num_output_tokens for r in group),
            "tau": _rounded(tau(group)),
            "forwards_per_token": _rounded(forwards_per_token(group)),
            "tokens_per_step": _rounded(tokens_per_step(group)),
        }
    summary["per_category"] = per_category
    return summary


# ---------------------------------------------------------------- greedy match
@dataclass
class Mismatch:
    index: int
    category: str
    first_difference: int  # first differing position (or the shorter length)
    reference_tokens: int
    candidate_tokens: int


@dataclass
class MatchResult:
    compared: int = 0
    matched: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)  # prompts absent on one side

    @property
    def rate(self) -> float | None:
        return self.matched / self.compared if self.compared else None

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.missing

    def __add__(self, other: MatchResult) -> MatchResult:
        """Both comparisons together (the rounds of one level)."""
        return MatchResult(self.compared + other.compared, self.matched + other.matched,
                           self.mismatches + other.mismatches,
                           sorted(set(self.missing) | set(other.missing)))

    def to_json(self) -> dict[str, Any]:
        return {"compared": self.compared, "matched": self.matched,
                "rate": self.rate, "ok": self.ok,
                "mismatches": [asdict(m) for m in self.mismatches],
                "missing": self.missing}


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First index where ``a`` and ``b`` differ; None when identical."""
    for position, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return position
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_outputs(reference: Sequence[RequestRecord],
                    candidate: Sequence[RequestRecord]) -> MatchResult:
    """Token-for-token comparison of two passes over the same prompts,
    matched by prompt ``index``."""
    ref = {r.index: r for r in reference}
    cand = {r.index: r for r in candidate}
    result = MatchResult(missing=sorted(set(ref) ^ set(cand)))
    for index in sorted(set(ref) & set(cand)):
        a, b = ref[index].output_token_ids, cand[index].output_token_ids
        result.compared += 1
        position = first_difference(a, b)
        if position is None:
            result.matched += 1
        else:
            result.mismatches.append(Mismatch(index, ref[index].category,
                                              position, len(a), len(b)))
    return result


# ------------------------------------------------------------------ decoding
SEED_STRIDE = 100003


def request_seed(run_seed: int, prompt_index: int) -> int:
    """A sampled request's seed: fixed by the run's ``--seed`` and the
    prompt, the same for every method, level and round, so that a method
    whose sampling is reproducible repeats its outputs from run to run.

    >>> request_seed(0, 5), request_seed(1, 5)
    (5, 100008)
    """
    return run_seed * SEED_STRIDE + prompt_index


def temperature_label(temperature: float) -> str:
    """``"T0.7"``: how results name a temperature (``""`` for greedy,
    whose labels stay as they were before sampled passes existed).

    >>> temperature_label(0.7), temperature_label(1.0), temperature_label(0.0)
    ('T0.7', 'T1', '')
    """
    return f"T{temperature:g}" if temperature else ""


def add_sampling_arguments(parser, temperature_help: str) -> None:
    """``--temperature T [T ...]`` (into ``temperatures``) and ``--top-p``,
    as every benchmark takes them."""
    parser.add_argument("--temperature", dest="temperatures", type=float, nargs="+",
                        default=[0.0], metavar="T", help=temperature_help)
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="nucleus sampling of sampled requests (T > 0)")


@dataclass(frozen=True)
class Decoding:
    """How the requests of one pass decode. Greedy (temperature 0) sends
    what the harness always sent: temperature 0, ``max_tokens`` and the
    run's ``ignore_eos``. A sampled pass (``for_temperature`` with
    temperature > 0) forces ``ignore_eos``, so that every method makes
    exactly ``max_tokens`` tokens per request, and gives each request its
    ``request_seed``."""

    temperature: float = 0.0
    max_tokens: int = 128
    ignore_eos: bool = False
    top_p: float = 1.0
    seed: int = 0

    @classmethod
    def for_temperature(cls, temperature: float, max_tokens: int, ignore_eos: bool = False,
                        top_p: float = 1.0, seed: int = 0) -> Decoding:
        sampled = temperature > 0
        return cls(temperature, max_tokens, ignore_eos or sampled,
                   top_p if sampled else 1.0, seed)

    @property
    def sampled(self) -> bool:
        return self.temperature > 0

    def request_options(self, prompt_index: int | None = None) -> dict[str, Any]:
        """Keyword arguments of vLLM's ``SamplingParams`` for one request,
        which are also the fields of the same names of an OpenAI completion
        request. Sampled requests add ``top_p`` and, given a prompt index
        (>= 0: the warm-up prompt, -1, goes unseeded), their seed."""
        options: dict[str, Any] = {"temperature": self.temperature,
                                   "max_tokens": self.max_tokens,
                                   "ignore_eos": self.ignore_eos}
        if self.sampled:
            options["top_p"] = self.top_p
            if prompt_index is not None and prompt_index >= 0:
                options["seed"] = request_seed(self.seed, prompt_index)
        return options


# ------------------------------------------------------------------ containers
@dataclass
class Prompt:
    """One benchmark prompt: token ids with the chat template applied."""

    index: int
    category: str
    question_id: Any
    token_ids: list[int]


@dataclass
class PassResult:
    """One method over the whole prompt set in one workload at one level
    (offline: max batch size; online: client concurrency)."""

    method: str
    workload: str  # "offline" | "online"
    level: int
    seconds: float
    records: list[RequestRecord]
    counters: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # Seconds to start the engine / server this pass ran on (including its
    # warm-up request); None when the pass reused one.
    startup_seconds: float | None = None
    # ESP's worker row counts over the pass (``esp_row_counts``): its
    # per-request metrics count tree nodes, not mask rows.
    row_counts: dict[str, int] | None = None
    # Which round of its level this pass was (``--rounds``); a pass pooled
    # from several rounds (``report.pool_rounds``) lists each round's
    # seconds and output tokens in ``round_figures`` instead.
    round: int = 0
    round_figures: list[dict[str, float]] | None = None
    # The requests' sampling temperature (0: greedy).
    temperature: float = 0.0

    @property
    def key(self) -> str:
        """``offline-b8``, ``online-c4``; a sampled pass adds its
        temperature: ``offline-b8-T0.7``."""
        return pass_key(self.workload, self.level, self.temperature)

    def summary(self) -> dict[str, Any]:
        summary = summarize(self.records, self.seconds, self.counters)
        decode_steps = (self.row_counts or {}).get("decode_request_steps")
        if decode_steps:
            summary["rows_per_step"] = _rounded(self.row_counts["rows"] / decode_steps)
            if not summary["forwards_exact"]:
                # The worker's count is exact where the stream's is not.
                emitting = [r for r in self.records if r.num_output_tokens]
                forwards = len(emitting) + decode_steps
                tokens = summary["output_tokens"]
                summary.update(
                    forwards_exact=True, target_forwards=forwards,
                    forwards_per_token=_rounded(forwards / tokens),
                    tokens_per_step=_rounded(
                        sum(r.num_output_tokens - 1 for r in emitting) / decode_steps))
        return summary


def pass_key(workload: str, level: int, temperature: float = 0.0) -> str:
    """The key of a pass in results.json and the tables.

    >>> pass_key("offline", 8), pass_key("online", 4, 0.7)
    ('offline-b8', 'online-c4-T0.7')
    """
    key = f"{workload}-{'b' if workload == 'offline' else 'c'}{level}"
    return f"{key}-{temperature_label(temperature)}" if temperature else key


def row_count_delta(before: Mapping[str, int] | None,
                    after: Mapping[str, int] | None) -> dict[str, int] | None:
    if before is None or after is None:
        return None
    return {name: after[name] - before.get(name, 0) for name in after}
