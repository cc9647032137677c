# SPDX-License-Identifier: Apache-2.0
"""The benchmark harness's arithmetic and reporting, on synthetic runs.

No engine, no model: benchmarks.metrics / methods / report are pure.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

# benchmarks/ is a top-level folder of the repository, not an installed
# package: make it importable however pytest is invoked.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import methods, report
from benchmarks.metrics import (
    Decoding,
    PassResult,
    RequestRecord,
    compare_outputs,
    first_difference,
    forwards_per_token,
    parse_prometheus_counters,
    percentile,
    replay_chain_drafts,
    request_tpot_s,
    row_count_delta,
    rows_per_step,
    summarize,
    target_forwards,
    tau,
    tau_from_counters,
    tokens_per_second,
    tokens_per_step,
    with_replayed_drafts,
)


def spec_record(index, category, n, steps, accepted, drafts=None, **timing):
    return RequestRecord(index, category, list(range(100, 100 + n)), steps, accepted,
                         drafts, **timing)


# ---------------------------------------------------------------- arithmetic
def test_tau_and_forwards_on_known_steps():
    # 21 tokens: prefill emits 1, then 5 verification steps emitting
    # 4, 4, 4, 4, 4 (3 accepted + bonus each): 1 + 5 * 4 = 21.
    a = spec_record(0, "writing", n=21, steps=5, accepted=15, drafts=20)
    assert target_forwards(a) == 6                     # prefill + 5 steps
    assert tau([a]) == pytest.approx(4.0)
    assert forwards_per_token([a]) == pytest.approx(6 / 21)

    # n-gram style: 10 tokens = prefill 1 + 2 drafted steps (1 + 2 accepted,
    # 1 + 0 accepted) + 4 plain steps without drafts. vLLM counts 2 steps.
    b = spec_record(1, "coding", n=10, steps=2, accepted=2, drafts=6)
    assert target_forwards(b) == 8                     # 1 + 2 + 4 (= n - accepted)
    assert tau([b]) == pytest.approx(2.0)              # overstates: plain steps excluded
    assert forwards_per_token([b]) == pytest.approx(0.8)

    # Token-weighted across requests (vLLM's global definition).
    assert tau([a, b]) == pytest.approx(1 + 17 / 7)
    assert forwards_per_token([a, b]) == pytest.approx(14 / 31)

    # Tokens per decode step counts b's 4 plain steps too: 9 tokens after
    # the prefill over 7 decode forwards, where vLLM's tau says 2.0.
    assert tokens_per_step([a]) == pytest.approx(20 / 5)
    assert tokens_per_step([b]) == pytest.approx(9 / 7)
    assert tokens_per_step([a, b]) == pytest.approx(29 / 12)
    assert tokens_per_step([RequestRecord(2, "qa", list(range(8)))]) == 1.0

    # Rows per request-step: a's 5 steps verify 20 drafts (5 rows each);
    # b's 7 decode steps verify 6 drafts in 2 of them.
    assert rows_per_step([a]) == pytest.approx(1 + 20 / 5)
    assert rows_per_step([b]) == pytest.approx(1 + 6 / 7)
    assert rows_per_step([RequestRecord(2, "qa", list(range(8)))]) == 1.0


def test_esp_rows_come_from_the_worker_counts():
    # ESP's per-request drafts count tree nodes only; the worker's counts
    # (mask rows included) replace them for the pass.
    record = spec_record(0, "qa", n=11, steps=5, accepted=5, drafts=10)
    chain = PassResult("esp", "offline", 8, 1.0, [record])
    assert chain.summary()["rows_per_step"] == pytest.approx(1 + 10 / 5)
    counts = row_count_delta({"decode_request_steps": 100, "rows": 300},
                             {"decode_request_steps": 140, "rows": 620})
    assert counts == {"decode_request_steps": 40, "rows": 320}
    worker = PassResult("esp", "offline", 8, 1.0, [record], row_counts=counts)
    assert worker.summary()["rows_per_step"] == pytest.approx(8.0)
    assert row_count_delta(None, {"rows": 1}) is None


def test_forwards_when_max_tokens_cuts_the_last_step():
    # 3 steps each accepted 4 drafts (5 tokens), but max_tokens=12 kept only
    # 12 of the 1 + 15 tokens: vLLM still counts 12 accepted. n - accepted = 0
    # would be absurd; the request made at least 1 + 3 forwards.
    r = spec_record(0, "qa", n=12, steps=3, accepted=12)
    assert target_forwards(r) == 4


def test_counted_steps_replace_the_estimate_from_spec_metrics():
    # A suffix-like request: 2 plain steps, then 2 verification steps that
    # accepted 3 and 4 drafts, the last cut by max_tokens after 2 of them.
    # Tokens: 1 (prefill) + 1 + 1 + 4 + 3 = 10; forwards 5. vLLM counts 7
    # accepted, so the estimate gives max(10 - 7, 1 + 2) = 3.
    r = spec_record(0, "qa", n=10, steps=2, accepted=7, drafts=9)
    assert target_forwards(r) == 3
    exact = r.with_emitting_steps(5, exact=True)
    assert target_forwards(exact) == 5
    assert tokens_per_step([exact]) == pytest.approx(9 / 4)
    assert rows_per_step([exact]) == pytest.approx(1 + 9 / 4)
    # Online, the stream's chunk count is a lower bound: it raises the
    # estimate, and cannot lower it.
    assert target_forwards(r.with_emitting_steps(4, exact=False)) == 4
    assert target_forwards(r.with_emitting_steps(2, exact=False)) == 3
    assert target_forwards(RequestRecord(1, "qa", [1, 2, 3]).with_emitting_steps(
        3, exact=True)) == 3
    assert summarize([exact], 1.0)["forwards_exact"] is True
    assert summarize([exact, r], 1.0)["forwards_exact"] is False
    assert summarize([exact], 1.0)["target_forwards"] == 5


def test_esp_worker_count_makes_online_figures_exact():
    # Two online ESP requests whose streams were merged: the records only
    # bound the forwards; the worker's count of decode request-steps (19
    # over both) gives the pass's exact figures.
    records = [spec_record(0, "qa", n=20, steps=5, accepted=15).with_emitting_steps(
                   5, exact=False),
               spec_record(1, "qa", n=12, steps=4, accepted=6).with_emitting_steps(
                   6, exact=False)]
    estimated = PassResult("esp", "online", 4, 1.0, records).summary()
    assert estimated["forwards_exact"] is False
    assert estimated["target_forwards"] == 6 + 6
    counts = {"decode_request_steps": 19, "rows": 57}
    exact = PassResult("esp", "online", 4, 1.0, records, row_counts=counts).summary()
    assert exact["forwards_exact"] is True
    assert exact["target_forwards"] == 2 + 19
    assert exact["tokens_per_step"] == pytest.approx(30 / 19, abs=1e-4)
    assert exact["forwards_per_token"] == pytest.approx(21 / 32, abs=1e-4)
    assert exact["rows_per_step"] == pytest.approx(3.0)
    # Offline records are exact already: the worker's count does not
    # replace them.
    offline = [r.with_emitting_steps(7, exact=True) for r in records]
    summary = PassResult("esp", "offline", 4, 1.0, offline, row_counts=counts).summary()
    assert summary["target_forwards"] == 14


def _lookup_drafter(k):
    """A deterministic chain drafter: the k tokens after the latest earlier
    occurrence of the last token (plain prompt lookup, 1-gram)."""
    def propose(history):
        for start in range(len(history) - 2, -1, -1):
            if history[start] == history[-1]:
                return history[start + 1:start + 1 + k]
        return []
    return propose


def test_replay_worked_examples():
    always = lambda history: [2, 3, 99]  # noqa: E731  ("b c x")
    assert replay_chain_drafts([7], [1, 2, 3, 4], always) == (1, 2)
    # Output "a b c": the step's last token is its bonus, b is accepted.
    assert replay_chain_drafts([7], [1, 2, 3], always) == (1, 1)
    # Nothing drafted: plain decode steps, none counted as spec steps.
    assert replay_chain_drafts([7], [1, 5, 6], lambda h: []) == (0, 0)
    assert replay_chain_drafts([7], [], always) == (0, 0)


def test_replay_forwards_equal_a_step_by_step_count():
    """n - accepted from the replay equals the forwards of a decoder that
    runs the same drafter step by step, whatever cut the output has."""
    import random

    rng = random.Random(0)
    for trial in range(200):
        prompt = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
        full = [rng.randrange(4) for _ in range(50)]
        n = rng.randrange(1, 40)
        propose = _lookup_drafter(rng.randrange(1, 6))
        # Decoder: every forward emits accepted drafts + 1, then the cut.
        tokens, forwards, steps = full[:1], 1, 0
        while len(tokens) < n:
            drafts = propose(prompt + tokens)
            hits = 0
            while hits < len(drafts) and drafts[hits] == full[len(tokens) + hits]:
                hits += 1
            tokens += full[len(tokens):len(tokens) + hits + 1]
            forwards += 1
            steps += bool(drafts)
        output = tokens[:n]
        spec_steps, accepted = replay_chain_drafts(prompt, output, propose)
        assert spec_steps == steps, trial
        assert len(output) - accepted == forwards, trial
        # vLLM may count drafts accepted past the cut: more, never fewer.
        record = RequestRecord(trial, "qa", output, steps, accepted + rng.randrange(3))
        if steps:
            fixed = with_replayed_drafts(record, prompt, propose)
            assert target_forwards(fixed) == forwards
            assert fixed.accepted_tokens == accepted


def test_replay_refuses_counts_it_cannot_reproduce():
    propose = _lookup_drafter(3)
    prompt, output = [1, 2, 3], [1, 2, 3, 9]
    steps, accepted = replay_chain_drafts(prompt, output, propose)
    assert (steps, accepted) == (1, 2)
    record = RequestRecord(0, "qa", output, spec_steps=1, accepted_tokens=2)
    assert with_replayed_drafts(record, prompt, propose) is record  # no cut
    cut = RequestRecord(0, "qa", output, spec_steps=1, accepted_tokens=5)
    fixed = with_replayed_drafts(cut, prompt, propose)
    assert (fixed.accepted_tokens, fixed.accepted_tokens_reported) == (2, 5)
    for wrong in (RequestRecord(0, "qa", output, spec_steps=2, accepted_tokens=2),
                  RequestRecord(0, "qa", output, spec_steps=1, accepted_tokens=1)):
        with pytest.raises(ValueError, match="replaying the drafter"):
            with_replayed_drafts(wrong, prompt, propose)


def test_vllm_ngram_drafter_is_vllms_rule():
    """The replayed drafter is vLLM's own function with the method's
    settings: longest suffix n-gram, its earliest occurrence, k tokens."""
    drafter = methods.METHODS["ngram-k3"].chain_drafter()
    #          0  1  2  3  4  5  6  7  8  9
    history = [5, 6, 7, 8, 5, 6, 9, 1, 5, 6]
    assert drafter(history) == [7, 8, 5]   # "5 6" first occurs at 0
    assert drafter([1, 2, 3]) == []
    assert methods.METHODS["esp-4"].chain_drafter() is None
    assert methods.METHODS["none"].chain_drafter() is None


def test_no_speculation_is_one_forward_per_token():
    r = RequestRecord(0, "math", list(range(32)))
    assert target_forwards(r) == 32
    assert forwards_per_token([r]) == 1.0
    assert tau([r]) is None
    assert target_forwards(RequestRecord(1, "math", [])) == 0


def test_from_spec_metrics_both_shapes():
    summary = {"mean_acceptance_length": 2.5, "num_spec_steps": 4,
               "num_accepted_draft_tokens": 6, "num_draft_tokens": 16,
               "acceptance_histogram": [1, 0, 2, 1, 0]}
    r = RequestRecord.from_spec_metrics(3, "rag", [1, 2, 3], summary, latency_s=1.0)
    assert (r.spec_steps, r.accepted_tokens, r.draft_tokens, r.latency_s) == (4, 6, 16, 1.0)
    raw = {"acceptance_histogram": [1, 0, 2, 1, 0], "num_draft_tokens": 16}
    r2 = RequestRecord.from_spec_metrics(3, "rag", [1, 2, 3], raw)
    assert (r2.spec_steps, r2.accepted_tokens) == (4, 7)  # 0*1 + 2*2 + 3*1
    assert RequestRecord.from_spec_metrics(0, "x", [1], None).spec_steps is None


def test_percentiles_linear_interpolation():
    values = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 5.0
    assert percentile(values, 25) == 2.0
    assert percentile([10.0, 20.0], 99) == pytest.approx(19.9)
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_throughput_tpot_and_summary():
    records = [
        spec_record(0, "writing", n=11, steps=2, accepted=8, latency_s=2.0, ttft_s=0.5),
        spec_record(1, "writing", n=21, steps=5, accepted=15, latency_s=3.0, ttft_s=1.0),
        spec_record(2, "coding", n=8, steps=7, accepted=0, latency_s=4.0, ttft_s=0.5),
    ]
    assert tokens_per_second(records, 4.0) == pytest.approx(10.0)  # 40 tokens / 4 s
    assert request_tpot_s(records[0]) == pytest.approx(0.15)       # 1.5 s / 10
    s = summarize(records, 4.0, counters={"vllm:spec_decode_num_drafts": 14,
                                          "vllm:spec_decode_num_accepted_tokens": 23})
    assert s["output_tokens"] == 40
    assert s["tokens_per_s"] == pytest.approx(10.0)
    assert s["ms_per_output_token"] == pytest.approx(100.0)
    assert s["tau"] == pytest.approx(1 + 23 / 14, abs=1e-4)
    assert s["tau_counters"] == pytest.approx(1 + 23 / 14, abs=1e-4)
    assert s["target_forwards"] == 3 + 6 + 8
    assert s["forwards_per_token"] == pytest.approx(17 / 40, abs=1e-4)
    assert s["latency_p50_s"] == 3.0
    assert s["latency_p99_s"] == pytest.approx(3.98)
    assert s["ttft_p50_s"] == 0.5
    tpots = [1.5 / 10, 2.0 / 20, 3.5 / 7]
    assert s["tpot_mean_ms"] == pytest.approx(1000 * sum(tpots) / 3, abs=1e-3)
    assert s["per_category"]["writing"]["tau"] == pytest.approx(1 + 23 / 7, abs=1e-4)
    assert s["per_category"]["coding"]["tau"] == pytest.approx(1.0)
    assert s["per_category"]["coding"]["forwards_per_token"] == pytest.approx(1.0)
    json.dumps(s)  # JSON-ready


def test_counters_from_prometheus_text():
    text = """
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="bench"} 40.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="bench"} 160.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="bench"} 60.0
vllm:spec_decode_num_accepted_tokens_created{engine="0",model_name="bench"} 1.7e9
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="bench",position="0"} 30.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="a b"} 10.0
"""
    counters = parse_prometheus_counters(text)
    assert counters == {"vllm:spec_decode_num_drafts": 50.0,
                        "vllm:spec_decode_num_draft_tokens": 160.0,
                        "vllm:spec_decode_num_accepted_tokens": 60.0}
    assert tau_from_counters(counters) == pytest.approx(2.2)
    assert tau_from_counters({}) is None


# -------------------------------------------------------------- greedy match
def _pass(method, outputs, key_level=1, workload="offline"):
    records = [RequestRecord(i, "writing" if i % 2 else "coding", list(tokens))
               for i, tokens in enumerate(outputs)]
    return PassResult(method, workload, key_level, 1.0, records)


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2


def test_broken_method_is_flagged_as_mismatch():
    reference = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
    broken = [[1, 2, 3, 4], [5, 6, 0, 8], [9, 10, 11]]   # 2 of 3 differ
    passes = [_pass("none", reference), _pass("esp-4", reference),
              _pass("broken", broken)]
    matches = report.check_matches(passes)
    assert matches[("esp-4", "offline-b1")].ok
    bad = matches[("broken", "offline-b1")]
    assert not bad.ok and bad.matched == 1 and bad.compared == 3
    assert [(m.index, m.first_difference) for m in bad.mismatches] == [(1, 2), (2, 2)]
    banner = report.mismatch_banner("broken", "offline-b1", bad)
    assert "MISMATCH" in banner and "prompt 1" in banner and "This is a bug" in banner

    results = report.build_results({"timestamp": "t"}, {"model": "m"},
                                   [{"index": i, "category": "c"} for i in range(3)],
                                   {"none": {"status": "ran"}, "esp-4": {"status": "ran"},
                                    "broken": {"status": "ran"}}, passes)
    markdown = report.render_markdown(results)
    assert "**2/3 MISMATCH**" not in markdown  # 1 of 3 matched
    assert "**1/3 MISMATCH**" in markdown
    assert "| `esp-4` |" in markdown and "3/3" in markdown
    json.dumps(results)


def test_match_uses_the_baseline_of_the_same_level():
    ref_b1, ref_b8 = [[1, 2, 3]], [[1, 2, 4]]  # batching changed the baseline
    passes = [_pass("none", ref_b1, 1), _pass("none", ref_b8, 8),
              _pass("esp-4", ref_b8, 8)]
    assert report.check_matches(passes)[("esp-4", "offline-b8")].ok
    consistency = report.baseline_consistency(passes)
    assert not consistency["offline-b8"].ok


def test_missing_prompt_is_not_a_match():
    result = compare_outputs(_pass("none", [[1], [2]]).records,
                             _pass("x", [[1]]).records)
    assert result.missing == [1] and not result.ok


def test_report_tables_and_json_roundtrip():
    none_recs = [RequestRecord(0, "writing", [1, 2, 3, 4]),
                 RequestRecord(1, "coding", [5, 6, 7, 8])]
    esp_recs = [spec_record(0, "writing", 4, 1, 2, drafts=2),
                spec_record(1, "coding", 4, 3, 0, drafts=0)]
    esp_recs[0].output_token_ids = [1, 2, 3, 4]
    esp_recs[1].output_token_ids = [5, 6, 7, 8]
    passes = [PassResult("none", "offline", 1, 2.0, none_recs),
              PassResult("esp-4", "offline", 1, 1.0, esp_recs),
              PassResult("none", "online", 4, 1.0, none_recs),
              PassResult("esp-4", "online", 4, 0.5, esp_recs)]
    results = report.build_results({}, {"model": "m"},
                                   [{"index": 0, "category": "writing"},
                                    {"index": 1, "category": "coding"}],
                                   {"none": {"status": "ran"}, "esp-4": {"status": "ran"},
                                    "suffix": {"status": "skipped", "reason": "no pkg"}},
                                   passes)
    md = report.render_markdown(results)
    assert "tok/s b1" in md and "tok/s c4" in md and "speedup c4" in md
    assert "2.00x" in md                          # 8 tok/s vs 4 tok/s offline
    assert "| writing | 3.00 |" in md             # 1 + 2/1
    assert "| coding | 1.00 |" in md
    # Tokens per decode step: writing 3 tokens over 1 step; coding 3 tokens
    # over max(4 - 0, 1 + 3) - 1 = 3 steps.
    assert "## tokens per decode step per category" in md
    assert "| writing | 3.00 |" in md.split("## tokens per decode step")[1]
    assert "| **overall** | 1.50 |" in md.split("## tokens per decode step")[1]
    assert "`suffix` skipped: no pkg" in md
    # Every level: speed-up and rows per step (esp-4: 2 drafts over 1 + 3
    # decode steps, 1 + 2 / 4 rows).
    levels = md.split("## Speed-up and rows per step at every level")[1]
    assert "| `esp-4` | 2.00x (1.50) | 2.00x (1.50) |" in levels
    loaded = json.loads(json.dumps(results))
    assert loaded["passes"][1]["records"][0]["target_forwards"] == 2


# ----------------------------------------------------------------- methods
def test_method_registry():
    names = [m.name for m in methods.resolve(["esp-4", "none", "esp-4"])]
    assert names == ["none", "esp-4"]
    assert {m.name for m in methods.resolve(["all"])} == set(methods.METHODS)
    assert [m.name for m in methods.resolve(["default"])] == list(methods.DEFAULT_METHODS)
    with pytest.raises(ValueError, match="unknown method"):
        methods.resolve(["esp-5"])
    assert methods.METHODS["hybrid-bc30"].unavailable_reason() is None
    assert methods.METHODS["esp-4"].unavailable_reason() is None
    assert methods.METHODS["suffix"].cross_request_state


def test_esp_method_configs_are_valid():
    from vllm_esp.config import ESPConfig

    for m in methods.METHODS.values():
        config = m.speculative_config
        if config and config["method"] == "esp":
            options = {k: v for k, v in config.items() if k != "method"}
            esp = ESPConfig.from_dict(options)  # raises on a bad tree / budget
            # A method whose lookup caches earlier answers must get a fresh
            # engine per pass, or a pass would draft from the answers of the
            # same prompts in the pass before.
            assert m.cross_request_state == (esp.lookup_cache_tokens > 0), m.name


def test_serve_command_and_request_payload(monkeypatch):
    from benchmarks.online import completion_payload, serve_args

    options = {"dtype": "float32", "seed": 0, "max_model_len": 2048,
               "enforce_eager": True, "enable_prefix_caching": False}
    args = serve_args("/models/m", methods.METHODS["esp-4"], 8123, options, max_num_seqs=4)
    assert args[1:3] == ["serve", "/models/m"]
    joined = " ".join(args)
    for flag in ("--port 8123", "--host 127.0.0.1", "--max-num-seqs 4", "--dtype float32",
                 "--enforce-eager", "--no-enable-prefix-caching",
                 "--per-request-spec-decode-metrics summary"):
        assert flag in joined
    assert json.loads(args[args.index("--speculative-config") + 1]) == {
        "method": "esp", "candidates": ["esp"], "tree": [4]}
    plain = serve_args("/models/m", methods.METHODS["none"], 8123, options, max_num_seqs=4)
    assert "--speculative-config" not in plain
    # Only ESP servers open the dev-mode /collective_rpc (row counts).
    from benchmarks.online import Server, is_esp
    assert is_esp(args) and not is_esp(plain)
    assert not is_esp(serve_args("/models/m", methods.METHODS["ngram-k3"], 8123, options,
                                 max_num_seqs=4))
    assert Server(args, 8123, Path("log")).env()["VLLM_SERVER_DEV_MODE"] == "1"
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    assert "VLLM_SERVER_DEV_MODE" not in Server(plain, 8123, Path("log")).env()
    assert "--per-request-spec-decode-metrics" not in plain  # vLLM rejects it alone

    payload = completion_payload([1, 2, 3], Decoding(max_tokens=64).request_options(0))
    assert payload["prompt"] == [1, 2, 3] and payload["temperature"] == 0.0
    assert payload["return_token_ids"] and payload["stream_options"]["include_usage"]
    # Greedy requests send what they always sent: no seed, no top_p.
    assert set(payload) == {"model", "prompt", "max_tokens", "temperature", "stream",
                            "return_token_ids", "stream_options", "ignore_eos"}
    assert (payload["max_tokens"], payload["ignore_eos"]) == (64, False)
    # Sampled: vLLM's OpenAI fields top_p and seed, ignore_eos forced.
    sampled = Decoding.for_temperature(0.7, 64, ignore_eos=False, top_p=0.9, seed=2)
    payload = completion_payload([1, 2, 3], sampled.request_options(5))
    assert (payload["temperature"], payload["top_p"], payload["seed"],
            payload["ignore_eos"], payload["max_tokens"]) == (0.7, 0.9, 2 * 100003 + 5,
                                                              True, 64)
    assert payload["stream"] and payload["prompt"] == [1, 2, 3]


# ------------------------------------------------------------ clean shutdown
_SIGTERM_SCRIPT = r"""
import sys, time
from pathlib import Path
from benchmarks.online import Server, free_port
from benchmarks.spec_bench import exit_on_sigterm
if sys.argv[2] == "handler":
    exit_on_sigterm()
root = Path(sys.argv[1])
(root / "health").write_text("ok")
port = free_port()
command = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
           "--directory", str(root)]
with Server(command, port, root / "server.log", startup_timeout=60) as server:
    print(server.process.pid, flush=True)
    time.sleep(600)
"""


def _group_alive(group: int) -> bool:
    import os

    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("mode", ["handler", "no-handler"])
def test_sigterm_stops_the_server_process_group(tmp_path, mode):
    """A benchmark killed with SIGTERM must not leave `vllm serve` (here a
    stand-in HTTP server in the same Server wrapper) running. The control
    case without the handler shows the orphan the handler prevents."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "bench_stub.py"
    script.write_text(_SIGTERM_SCRIPT)
    repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    bench = subprocess.Popen([sys.executable, str(script), str(tmp_path), mode],
                             stdout=subprocess.PIPE, text=True, cwd=repo_root,
                             env={**os.environ, "PYTHONPATH": repo_root})
    server_group = int(bench.stdout.readline())
    assert _group_alive(server_group)
    bench.send_signal(signal.SIGTERM)
    bench.wait(timeout=90)
    time.sleep(0.5)
    try:
        if mode == "handler":
            assert not _group_alive(server_group), "server outlived the benchmark"
        else:
            assert _group_alive(server_group)
    finally:
        if _group_alive(server_group):
            os.killpg(server_group, signal.SIGKILL)


def test_select_questions_skips_the_first_of_every_category():
    from benchmarks.report import _selection
    from vllm_esp_dev.data import select_questions

    questions = [{"category": c, "id": f"{c}{i}"} for c in "ab" for i in range(6)]
    assert [q["id"] for q in select_questions(questions, 2)] == ["a0", "b0", "a1", "b1"]
    assert [q["id"] for q in select_questions(questions, 2, skip=4)] == [
        "a4", "b4", "a5", "b5"]
    assert [q["id"] for q in select_questions(questions, 3, skip=4)] == [
        "a4", "b4", "a5", "b5"]  # only 6 per category
    assert _selection({"per_category": 2, "skip_per_category": 4}) == (
        "; questions 5-6 of every category")
    assert _selection({"per_category": None}) == ""


def test_step_cost_table_ratios_and_missing_methods():
    from benchmarks.step_cost import ratio_table, render_markdown

    def cell(method, rows, seconds, scheduled):
        return {"method": method, "batch": 8, "context": 128, "rows": rows,
                "median_seconds": seconds, "median_scheduled_tokens": scheduled,
                "mean_context": 130.0}

    cells = [cell("plain", 1, 0.100, 8), cell("esp", 1, 0.102, 8),
             cell("plain", 10, 0.100, 8), cell("chain", 10, 0.250, 80),
             cell("esp", 10, 0.230, 80)]
    table = {row["rows"]: row for row in ratio_table(cells)}
    assert abs(table[10]["esp_vs_chain"] - 0.92) < 1e-9
    assert abs(table[10]["chain_vs_plain"] - 2.5) < 1e-9
    assert abs(table[1]["esp_vs_plain"] - 1.02) < 1e-9
    assert "esp_vs_chain" not in table[1]
    text = render_markdown({"meta": {"date": "d", "command": "c", "commit": "x",
                                     "machine": "m"}, "cells": cells})
    assert "| 8 | 128 | 1 | - | 1.02x | - | 8 / - | 130 |" in text
    assert "| 8 | 128 | 10 | 0.92x | 2.30x | 2.50x | 80 / 80 | 130 |" in text
    assert "nan" not in text
    assert "Only the first" not in text
    mixed = render_markdown({"meta": {"date": "d", "command": "c", "commit": "x",
                                      "machine": "m", "args": {"drafting_requests": 2}},
                             "cells": cells})
    assert "Only the first 2 requests of each step draft" in mixed


def test_step_cost_profile_tables_set_each_engine_against_one_chain_step():
    from benchmarks.step_cost import profile_tables

    def profile(method, seconds):  # seconds over 4 steps, per part
        return {"method": method, "batch": 4, "context": 256, "rows": 4, "steps": 4,
                "seconds": seconds}

    chain = profile("chain", {"model matmuls": 0.6, "stock attention": 0.2, "other": 0.0})
    esp = profile("esp", {"model matmuls": 0.6, "tree attention": 0.6, "other": 0.2})
    lines = profile_tables([esp, chain])
    assert "## Where a step goes: batch 4, context 256, 4 rows" in lines
    assert "| part | chain | esp |" in lines
    # One chain step is 0.2 s: ESP's tree attention is 0.15 s a step.
    assert "| model matmuls | 0.750 | 0.750 |" in lines
    assert "| stock attention | 0.250 | 0.000 |" in lines
    assert "| tree attention | 0.000 | 0.750 |" in lines
    assert "| total | 1.000 | 1.750 |" in lines
    assert not any(line.startswith("| sampler") for line in lines)
    # Without chain, ESP's own step is the unit.
    alone = profile_tables([esp])
    assert "| total | 1.000 |" in alone


def test_step_cost_plot_skips_runs_without_chain(tmp_path):
    """``--methods plain esp`` has no ESP / chain ratio to plot: the run
    used to die in matplotlib after writing its tables."""
    from benchmarks.step_cost import plot

    def cell(method, rows, seconds):
        return {"method": method, "batch": 8, "context": 128, "rows": rows,
                "median_seconds": seconds, "median_scheduled_tokens": 8 * rows,
                "mean_context": 130.0}

    without_chain = [cell("plain", 1, 0.1), cell("esp", 1, 0.1), cell("plain", 4, 0.1),
                     cell("esp", 4, 0.12)]
    assert plot({"cells": without_chain}, tmp_path / "none.png") is False
    assert not (tmp_path / "none.png").exists()
    assert plot({"cells": without_chain + [cell("chain", 4, 0.13)]},
                tmp_path / "chain.png") is True
    assert (tmp_path / "chain.png").stat().st_size > 0


def test_offline_runs_every_method_continuously_at_each_batch_size(monkeypatch):
    """Each offline batch size b gets a fresh engine with max_num_seqs b and
    one generate call over every prompt, whatever the method: static waves
    for some methods and continuous batching for others made unequal
    comparisons (suffix against the rest, before 2026-12-02)."""
    from types import SimpleNamespace

    from benchmarks import offline
    from benchmarks.metrics import Prompt
    from vllm_esp_dev import runs

    engines, calls = [], []

    def make_llm(model, speculative_config, max_num_seqs, **kwargs):
        engine = SimpleNamespace(
            max_num_seqs=max_num_seqs, closed=False,
            llm_engine=SimpleNamespace(vllm_config=SimpleNamespace(additional_config={})))
        engines.append(engine)
        return engine

    def generate(llm, prompts_token_ids, sampling_params, label=""):
        assert not llm.closed
        calls.append((llm.max_num_seqs, len(prompts_token_ids)))
        return runs.GenerationRun(label, [[1, 2]] * len(prompts_token_ids),
                                  [""] * len(prompts_token_ids), 1.5)

    monkeypatch.setattr(runs, "make_llm", make_llm)
    monkeypatch.setattr(runs, "generate", generate)
    monkeypatch.setattr(runs, "warm_up", lambda llm, ids: None)
    monkeypatch.setattr(runs, "shutdown", lambda llm: setattr(llm, "closed", True))
    prompts = [Prompt(i, "writing", i, [5, 6, i]) for i in range(5)]
    for name in ("ngram-k3", "suffix"):
        engines.clear()
        calls.clear()
        passes = offline.run_offline(methods.METHODS[name], "model", prompts, [1, 4, 8],
                                     None, [1], {})
        assert calls == [(1, 5), (4, 5), (8, 5)], name
        assert all(engine.closed for engine in engines)
        assert [(p.level, len(p.records), p.seconds) for p in passes] == [
            (1, 5, 1.5), (4, 5, 1.5), (8, 5, 1.5)]


@pytest.mark.parametrize("module", ["spec_bench", "reference_tau", "calibrate_hybrid"])
def test_missing_spec_bench_stops_at_once_with_where_to_get_it(module, tmp_path,
                                                               monkeypatch):
    """Every command that reads Spec-Bench stops when the file is missing
    and says how to give it."""
    import importlib

    # spec_bench.main sets these and a SIGTERM handler for its own process;
    # setenv first, so that monkeypatch restores them even when unset now.
    for name in ("VLLM_LOGGING_LEVEL", "TOKENIZERS_PARALLELISM"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    benchmark = importlib.import_module(f"benchmarks.{module}")
    if hasattr(benchmark, "exit_on_sigterm"):
        monkeypatch.setattr(benchmark, "exit_on_sigterm", lambda: None)
    missing = tmp_path / "question.jsonl"
    main = benchmark.main
    with pytest.raises(SystemExit) as stop:
        main(["--dataset", str(missing)])
    message = str(stop.value)
    assert message.startswith("error: Spec-Bench questions not found at " + str(missing))
    assert "--dataset PATH" in message and "VLLM_ESP_SPEC_BENCH" in message


def test_levels_run_one_after_another_with_every_method_in_each():
    """Every method runs a level before any method runs the next, so that a
    method and its ``none`` are timed minutes apart; a method that fails is
    marked failed, keeps its earlier levels and skips the later ones."""
    from benchmarks import spec_bench

    schedule = spec_bench.pass_schedule([1, 8], [4])
    assert schedule == [("offline", 1, 0.0), ("offline", 8, 0.0), ("online", 4, 0.0)]
    runnable = [methods.METHODS[name] for name in ("none", "esp", "suffix")]
    info = {m.name: {"status": "ran"} for m in runnable}
    calls, checkpoints = [], []

    def run_pass(method, workload, level, temperature, round_index):
        assert round_index == 0 and temperature == 0.0
        calls.append((workload, level, method.name))
        if method.name == "esp" and level == 8:
            raise RuntimeError("engine died")
        return [(method.name, workload, level)]

    passes = spec_bench.run_levels(runnable, schedule, run_pass, info,
                                   lambda done: checkpoints.append(len(done)))
    assert calls == [("offline", 1, "none"), ("offline", 1, "esp"), ("offline", 1, "suffix"),
                     ("offline", 8, "none"), ("offline", 8, "esp"), ("offline", 8, "suffix"),
                     ("online", 4, "none"), ("online", 4, "suffix")]
    assert ("esp", "offline", 1) in passes and len(passes) == 7
    assert info["esp"]["status"] == "failed" and "engine died" in info["esp"]["reason"]
    assert info["none"]["status"] == info["suffix"]["status"] == "ran"
    assert checkpoints == [3, 5, 7]


def test_rounds_reverse_the_order_and_a_failure_skips_later_rounds():
    """With ``rounds=2`` every level runs none, esp, suffix and then suffix,
    esp, none, so a drift within the level weighs on every method alike; a
    method failing in the second round keeps its first and skips the rest."""
    from benchmarks import spec_bench

    runnable = [methods.METHODS[name] for name in ("none", "esp", "suffix")]
    info = {m.name: {"status": "ran"} for m in runnable}
    calls = []

    def run_pass(method, workload, level, temperature, round_index):
        calls.append((level, round_index, method.name))
        if method.name == "esp" and (level, round_index) == (4, 1):
            raise RuntimeError("engine died")
        return [(method.name, level, round_index)]

    passes = spec_bench.run_levels(runnable, [("offline", 1, 0.0), ("offline", 4, 0.0)],
                                   run_pass, info, rounds=2)
    assert calls == [(1, 0, "none"), (1, 0, "esp"), (1, 0, "suffix"),
                     (1, 1, "suffix"), (1, 1, "esp"), (1, 1, "none"),
                     (4, 0, "none"), (4, 0, "esp"), (4, 0, "suffix"),
                     (4, 1, "suffix"), (4, 1, "esp"), (4, 1, "none")]
    assert ("esp", 4, 0) in passes and ("esp", 4, 1) not in passes
    assert info["esp"]["status"] == "failed"
    with pytest.raises(SystemExit):
        spec_bench.parse_args(["--rounds", "0"])


def test_rounds_pool_seconds_and_check_every_round():
    """Pooled speed is all rounds' tokens over all their seconds (not a mean
    of ratios); every round's outputs are checked against the same round's
    baseline, so a mismatch in one round only is still reported."""
    outputs = [[1, 2, 3, 4], [5, 6, 7, 8]]
    wrong = [[1, 2, 3, 4], [5, 6, 0, 8]]

    def timed(method, seconds, round_index, tokens=outputs):
        result = _pass(method, tokens)
        result.seconds, result.round = seconds, round_index
        return result

    passes = [timed("none", 2.0, 0), timed("esp", 1.0, 0), timed("broken", 1.0, 0),
              timed("broken", 4.0, 1, wrong), timed("esp", 3.0, 1), timed("none", 2.0, 1)]
    matches = report.check_matches(passes)
    assert matches[("esp", "offline-b1")].ok
    assert matches[("esp", "offline-b1")].compared == 4
    broken = matches[("broken", "offline-b1")]
    assert not broken.ok and (broken.matched, broken.compared) == (3, 4)

    pooled = {p.method: p for p in report.pool_rounds(passes)}
    assert pooled["esp"].seconds == 4.0 and len(pooled["esp"].records) == 4
    assert [r["seconds"] for r in pooled["esp"].round_figures] == [1.0, 3.0]
    # 16 tokens in 4 s against 16 in 4 s: 1.00x pooled, where the mean of
    # the rounds' ratios (2.0x, 0.67x) would say 1.33x.
    assert pooled["esp"].summary()["tokens_per_s"] == pooled["none"].summary()["tokens_per_s"]

    results = report.build_results({}, {"model": "m", "rounds": 2},
                                   [{"index": i, "category": "c"} for i in range(2)],
                                   {name: {"status": "ran"} for name in pooled}, passes)
    assert len(results["passes"]) == 3
    markdown = report.render_markdown(results)
    assert "- rounds: 2 per level" in markdown
    assert "| `esp` | offline-b1 | 2.00x / 0.67x |" in markdown
    assert "**3/4 MISMATCH**" in markdown
    single = report.build_results({}, {"model": "m"}, [{"index": 0, "category": "c"}],
                                  {"none": {"status": "ran"}}, [_pass("none", [[1]])])
    assert "## Rounds" not in report.render_markdown(single)


def test_step_phases_count_only_steps_that_verify_drafts(monkeypatch):
    """The phase timers charge each wrapped phase's time to its step and
    keep only the steps that scheduled drafts: vLLM builds spec-decode
    metadata for a prefill too once speculation is on, and such a step
    must not count. With the engine instrumented, a step ends after the
    engine's whole step, scheduling included."""
    from types import SimpleNamespace

    from benchmarks import step_phases

    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(step_phases.time, "perf_counter", lambda: clock.now)
    # Step 0: a 20-token prefill (metadata, no drafts); step 1: a root and
    # 3 drafts of one request.
    steps = [SimpleNamespace(scheduled_spec_decode_tokens={"a": []},
                             total_num_scheduled_tokens=20),
             SimpleNamespace(scheduled_spec_decode_tokens={"a": [5, 6, 7]},
                             total_num_scheduled_tokens=4)]

    class Model:
        def compute_logits(self, hidden_states):
            clock.now += 0.005

    class Runner:
        drafter = SimpleNamespace()
        model = Model()

        def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
            clock.now += 0.001
            return None, "metadata", None

        def _model_forward(self, step):
            clock.now += 0.010 * (step + 1)

        def sample_tokens(self, step):
            clock.now += 0.002

    class Scheduler:
        def schedule(self):
            clock.now += 0.0005

        def update_from_output(self):
            clock.now += 0.0001

    runner = Runner()
    core = SimpleNamespace(scheduler=Scheduler(), post_step=lambda: None)
    engine = SimpleNamespace(engine_core=SimpleNamespace(engine_core=core))

    def core_step(step):
        core.scheduler.schedule()
        runner._prepare_inputs(steps[step], None)
        runner._model_forward(step)
        runner.model.compute_logits(
            SimpleNamespace(shape=(steps[step].total_num_scheduled_tokens,)))
        runner.sample_tokens(step)
        core.scheduler.update_from_output()

    core.step_fn = core_step

    def engine_step(step):
        core.step_fn(step)
        clock.now += 0.0003  # the front end's output processing

    engine.step = engine_step
    timers = step_phases.instrument(runner)
    step_phases.instrument_engine(timers, engine)
    timers.counting = True
    for step in (0, 1):
        engine.step(step)
    assert timers.num_steps == 1
    figures = timers.per_step_ms()
    assert figures["forward"] == pytest.approx(20.0)
    assert figures["prepare_inputs"] == pytest.approx(1.0)
    assert figures["sample_tokens"] == pytest.approx(2.0)
    assert figures["compute_logits"] == pytest.approx(5.0)
    assert figures["engine: schedule"] == pytest.approx(0.5)
    assert figures["engine: update_from_output"] == pytest.approx(0.1)
    assert figures["engine: core step"] == pytest.approx(28.6)
    assert figures["engine step"] == pytest.approx(28.9)
    assert figures["forward rows"] == 4
    assert figures["logits rows"] == 4


def test_step_phases_undrafted_keeps_only_decode_steps_without_drafts(monkeypatch):
    """``--steps undrafted`` times the steps a plain engine would take: a
    decode step without drafts counts, a prefill (even beside decodes)
    and a step with drafts do not, and an unknown kind is refused."""
    from types import SimpleNamespace

    from benchmarks import step_phases

    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(step_phases.time, "perf_counter", lambda: clock.now)
    steps = [
        # a prefill beside a decode
        SimpleNamespace(scheduled_spec_decode_tokens={}, total_num_scheduled_tokens=21,
                        num_scheduled_tokens={"a": 20, "b": 1}),
        # two decodes without drafts (plain vLLM: no spec metadata at all)
        SimpleNamespace(scheduled_spec_decode_tokens={}, total_num_scheduled_tokens=2,
                        num_scheduled_tokens={"a": 1, "b": 1}),
        # ESP's step without drafts: empty draft lists
        SimpleNamespace(scheduled_spec_decode_tokens={"a": [], "b": []},
                        total_num_scheduled_tokens=2, num_scheduled_tokens={"a": 1, "b": 1}),
        # a step with drafts
        SimpleNamespace(scheduled_spec_decode_tokens={"a": [5, 6]}, total_num_scheduled_tokens=4,
                        num_scheduled_tokens={"a": 3, "b": 1}),
    ]

    class Runner:
        model = SimpleNamespace(compute_logits=lambda hidden_states: None)

        def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
            return None, "metadata", None

        def _model_forward(self, step):
            clock.now += 0.010 * (step + 1)

        def sample_tokens(self, step):
            clock.now += 0.001

    runner = Runner()
    timers = step_phases.instrument(runner, "undrafted")
    timers.counting = True
    for step, scheduler_output in enumerate(steps):
        runner._prepare_inputs(scheduler_output, None)
        runner._model_forward(step)
        runner.sample_tokens(step)
    assert timers.num_steps == 2
    figures = timers.per_step_ms()
    assert figures["forward"] == pytest.approx((20.0 + 30.0) / 2)
    assert figures["forward rows"] == 2
    drafted = step_phases.PhaseTimers()
    drafted.counting = True
    for scheduler_output in steps:
        drafted.mark(scheduler_output)
        drafted.end_step()
    assert drafted.num_steps == 1  # the default kind: the last step alone
    with pytest.raises(ValueError, match="undrafted"):
        step_phases.PhaseTimers("plain")


def test_step_phases_count_mask_rows_and_drafts_by_source():
    """ESP's blocks per step: mask rows, and drafted and accepted nodes by
    candidate source, taken from what ESP's own periodic log line is given
    (the drafter's real ``observe_verification`` on a hand-built block)."""
    from types import SimpleNamespace

    import numpy as np

    from benchmarks import step_phases
    from vllm_esp.core.batch import TreeBatch
    from vllm_esp.core.goodput import (
        SOURCE_CORPUS,
        SOURCE_ESP,
        SOURCE_LOOKUP,
        SamplingCalibration,
    )
    from vllm_esp.proposer import AutoStats, ESPProposer

    class Drafter:
        observe_verification = ESPProposer.observe_verification

        def __init__(self):
            self.calibration = SamplingCalibration(0.1)
            self.sampling_band = np.zeros(1, np.int64)
            self.cost_model = None
            self.stats = AutoStats()

    # root -> e1 (ESP) -> c1 (cached answers), root -> l1 (lookup); two
    # masks (k = 2) on e1: 4 nodes, 6 rows.
    trees = TreeBatch(np.array([[-1, 0, 1, 0]]), np.zeros((1, 4), np.int64),
                      np.array([[False, True, False, False]]), np.array([4]),
                      num_mask_tokens=2, reach=np.ones((1, 4), np.float32),
                      sources=np.array([[0, SOURCE_ESP, SOURCE_CORPUS, SOURCE_LOOKUP]],
                                       np.int8))
    runner = SimpleNamespace(drafter=Drafter(), model=SimpleNamespace(
        compute_logits=lambda hidden_states: None),
        _prepare_inputs=lambda *args: None, sample_tokens=lambda *args: None)
    timers = step_phases.instrument(runner)
    timers.counting = timers.keep_step = True
    # The chain root -> e1 -> c1, e1 accepted.
    runner.drafter.observe_verification(trees, np.array([[0, 1, 2]]), np.array([1]),
                                        np.array([True]), np.array([0]))
    timers.end_step()
    # The log line's own counts still ran.
    assert runner.drafter.stats.mask_rows == 2
    assert runner.drafter.stats.accepted_by_source.tolist() == [1, 0, 0]
    figures = timers.per_step_ms()
    assert figures["esp: mask rows"] == 2
    assert figures["esp: drafted from esp"] == 1
    assert figures["esp: drafted from cached answers"] == 1
    assert figures["esp: drafted from lookup"] == 1
    assert figures["esp: accepted from esp"] == 1
    assert figures["esp: accepted from cached answers"] == 0
    assert figures["esp: accepted from lookup"] == 0


def test_the_machine_summary_names_the_vector_extensions():
    """Results name AVX-512 or AVX2 (and AMX): the same CPU model name has
    come with either on this project's machines, and the kernels differ."""
    from benchmarks.spec_bench import machine_summary, vector_isa

    assert vector_isa({"sse2", "avx2", "avx512f", "avx512bw"}) == "AVX-512"
    assert vector_isa({"sse2", "avx2"}) == "AVX2"
    assert vector_isa({"avx2", "avx512f", "amx_tile", "amx_bf16"}) == "AVX-512, AMX"
    assert vector_isa({"neon"}) == ""
    machine = machine_summary()
    if machine["vector_isa"]:
        assert f", {machine['vector_isa']})" in machine["summary"]


# ---------------------------------------------------------- sampled passes
def test_several_temperatures_are_each_a_set_of_levels_in_order():
    """``--temperature 0 0.7``: every method at each of T=0's levels, then
    every method at each of T=0.7's, and a pass is labelled with its
    temperature (greedy keys stay as they always were)."""
    from benchmarks import spec_bench
    from benchmarks.metrics import pass_key, temperature_label

    schedule = spec_bench.pass_schedule([1, 8], [4], [0.0, 0.7])
    assert schedule == [("offline", 1, 0.0), ("offline", 8, 0.0), ("online", 4, 0.0),
                        ("offline", 1, 0.7), ("offline", 8, 0.7), ("online", 4, 0.7)]
    runnable = [methods.METHODS[name] for name in ("none", "esp", "esp-chain")]
    info = {m.name: {"status": "ran"} for m in runnable}
    calls = []

    def run_pass(method, workload, level, temperature, round_index):
        calls.append((pass_key(workload, level, temperature), method.name))
        return [PassResult(method.name, workload, level, 1.0, [], temperature=temperature)]

    passes = spec_bench.run_levels(runnable, schedule, run_pass, info, rounds=2)
    keys = list(dict.fromkeys(key for key, _ in calls))
    assert keys == ["offline-b1", "offline-b8", "online-c4",
                    "offline-b1-T0.7", "offline-b8-T0.7", "online-c4-T0.7"]
    assert calls[:6] == [("offline-b1", "none"), ("offline-b1", "esp"),
                         ("offline-b1", "esp-chain"), ("offline-b1", "esp-chain"),
                         ("offline-b1", "esp"), ("offline-b1", "none")]
    assert [p.key for p in passes][-1] == "online-c4-T0.7"
    assert (temperature_label(0.7), temperature_label(1.0), temperature_label(0.0)) == (
        "T0.7", "T1", "")
    assert PassResult("esp", "online", 4, 1.0, [], temperature=1.0).key == "online-c4-T1"
    assert PassResult("esp", "offline", 8, 1.0, []).key == "offline-b8"

    args = spec_bench.parse_args(["--temperature", "0", "0.7", "0.7", "--top-p", "0.9"])
    assert (args.temperatures, args.top_p) == ([0.0, 0.7], 0.9)
    assert spec_bench.parse_args([]).temperatures == [0.0]
    for bad in (["--temperature", "-1"], ["--top-p", "0"], ["--top-p", "1.5"]):
        with pytest.raises(SystemExit):
            spec_bench.parse_args(bad)


def test_sampled_requests_make_max_tokens_with_a_fixed_seed_each():
    """Greedy requests decode as they always did; sampled ones force
    ignore_eos (every method makes exactly max_tokens tokens) and carry a
    seed fixed by the run's seed and the prompt."""
    from benchmarks.metrics import request_seed

    greedy = Decoding.for_temperature(0.0, 32, ignore_eos=False, top_p=0.5, seed=3)
    assert greedy.request_options(4) == {"temperature": 0.0, "max_tokens": 32,
                                         "ignore_eos": False}
    assert Decoding.for_temperature(0.0, 32, ignore_eos=True).request_options(4)[
        "ignore_eos"] is True
    sampled = Decoding.for_temperature(0.7, 32, ignore_eos=False, top_p=0.5, seed=3)
    assert sampled.sampled and not greedy.sampled
    assert sampled.request_options(4) == {"temperature": 0.7, "max_tokens": 32,
                                          "ignore_eos": True, "top_p": 0.5,
                                          "seed": 3 * 100003 + 4}
    # The warm-up prompt (index -1) and a request without an index go unseeded.
    assert "seed" not in sampled.request_options(-1)
    assert "seed" not in sampled.request_options()
    # Deterministic and distinct per prompt and run seed.
    seeds = [request_seed(s, i) for s in range(3) for i in range(50)]
    assert len(set(seeds)) == len(seeds)
    assert seeds == [request_seed(s, i) for s in range(3) for i in range(50)]
    assert request_seed(0, 7) == 7 and request_seed(1, 0) == 100003


def _two_temperature_passes(sampled_outputs):
    outputs = [[1, 2, 3, 4], [5, 6, 7, 8]]
    passes = []
    for temperature, candidate in ((0.0, outputs), (0.7, sampled_outputs)):
        for method, tokens in (("none", outputs), ("esp", candidate),
                               ("esp-chain", candidate)):
            result = _pass(method, tokens)
            result.temperature = temperature
            passes.append(result)
    return passes


def test_sampled_outputs_are_compared_for_information_not_checked():
    """A sampled pass whose outputs differ from none's is no failure: the
    output check covers greedy passes only, and the report labels the
    sampled passes' identical fraction as no correctness check."""
    passes = _two_temperature_passes([[1, 2, 3, 4], [5, 9, 9, 9]])
    assert report.failed_checks(passes) == []
    info = report.sampled_matches(passes)
    assert set(info) == {("esp", "offline-b1-T0.7"), ("esp-chain", "offline-b1-T0.7")}
    assert (info[("esp", "offline-b1-T0.7")].matched,
            info[("esp", "offline-b1-T0.7")].compared) == (1, 2)
    # Sampled passes are compared with the sampled none, not the greedy one.
    assert report.check_matches(passes)[("esp", "offline-b1")].ok
    # A greedy mismatch still fails.
    broken = _two_temperature_passes([[1, 2, 3, 4], [5, 6, 7, 8]])
    broken[1].records[1].output_token_ids = [5, 0, 0, 0]
    assert [(m, k) for m, k, _ in report.failed_checks(broken)] == [("esp", "offline-b1")]

    config = {"model": "m", "max_tokens": 4, "temperatures": [0.0, 0.7],
              "temperature": [0.0, 0.7], "top_p": 0.9}
    results = report.build_results({}, config, [{"index": i, "category": "c"}
                                                for i in range(2)],
                                   {n: {"status": "ran"} for n in ("none", "esp", "esp-chain")},
                                   passes)
    by_key = {(p["method"], p["key"]): p for p in results["passes"]}
    assert by_key[("esp", "offline-b1-T0.7")]["temperature"] == 0.7
    assert by_key[("esp", "offline-b1-T0.7")]["match_is_check"] is False
    assert by_key[("esp", "offline-b1")]["match_is_check"] is True
    md = report.render_markdown(json.loads(json.dumps(results)))
    assert "## Overall, greedy (temperature 0)" in md
    assert "## Overall, temperature 0.7 (sampled)" in md
    assert "## tokens per decode step per category, temperature 0.7 (sampled)" in md
    assert "same as `none` (not a check)" in md
    assert "MISMATCH" not in md
    assert "1/2 (sampled: not a check)" in md
    assert "**not a correctness check**" in md
    assert "sampled at temperature 0.7 (top-p 0.9; ignore_eos forced" in md
    # Tokens per step at every sampled level (the walk / chain A/B); greedy
    # sections keep their tables.
    assert "## Tokens per decode step at every level, temperature 0.7 (sampled)" in md
    assert "## Tokens per decode step at every level, greedy" not in md
    sampled_table = md.split("## Overall, temperature 0.7 (sampled)")[1].split("##")[0]
    assert "| `esp` |" in sampled_table and "| 1/2 |" in sampled_table
    # The baseline's own consistency is within one temperature.
    assert report.baseline_consistency(passes) == {}


def test_greedy_only_results_and_old_files_render_as_before():
    """A greedy-only run's report has no temperature titles or labels, and
    a results.json written before passes had a temperature renders the same
    as a new one."""
    passes = [_pass("none", [[1, 2, 3]]), _pass("esp", [[1, 2, 3]])]
    results = report.build_results({}, {"model": "m", "max_tokens": 3, "temperature": 0.0},
                                   [{"index": 0, "category": "c"}],
                                   {"none": {"status": "ran"}, "esp": {"status": "ran"}},
                                   passes)
    md = report.render_markdown(results)
    assert "## Overall\n" in md and "greedy match" in md and "temperature" not in md
    assert "max 3 new tokens, greedy\n" in md
    old = json.loads(json.dumps(results))
    for p in old["passes"]:
        del p["temperature"], p["match_is_check"]
    assert report.render_markdown(old) == md
    assert report.temperatures(old) == [0.0]
    assert report.plot_names(0.0) == ("tau_per_category.png",
                                      "tokens_per_s_vs_concurrency.png")
    assert report.plot_names(0.7)[0] == "tau_per_category_T0.7.png"


def test_ngram_replay_is_skipped_for_sampled_passes():
    """The replay of vLLM's ngram drafter assumes greedy acceptance; a
    sampled pass keeps vLLM's counts (here counts a greedy replay would
    reject) and says so."""
    from benchmarks.metrics import Prompt
    from benchmarks.spec_bench import correct_cut_last_steps

    prompt = Prompt(0, "qa", None, [1, 2, 3])
    record = RequestRecord(0, "qa", [1, 2, 3, 9], spec_steps=2, accepted_tokens=3)
    sampled = PassResult("ngram-k3", "offline", 1, 1.0, [record], temperature=0.7)
    correct_cut_last_steps(methods.METHODS["ngram-k3"], [sampled], [prompt])
    assert sampled.records == [record]
    assert any("not replayed" in note for note in sampled.notes)
    greedy = PassResult("ngram-k3", "offline", 1, 1.0, [record])
    with pytest.raises(ValueError, match="replaying the drafter"):
        correct_cut_last_steps(methods.METHODS["ngram-k3"], [greedy], [prompt])
    # Tokens per step needs no replay: the counted steps are the same either way.
    counted = record.with_emitting_steps(3, exact=True)
    assert tokens_per_step([counted]) == pytest.approx(3 / 2)


def test_esp_chain_is_the_default_with_sampled_chains():
    from vllm_esp.config import ESPConfig

    method = methods.METHODS["esp-chain"]
    assert method.speculative_config == {"method": "esp", "sampling_verification": "chain"}
    assert "chain" in method.description and "sampling" in method.description
    assert method.cross_request_state
    assert not ESPConfig.from_dict({"sampling_verification": "chain"}).tree_sampling
    assert ESPConfig.from_dict({}).tree_sampling
    assert "esp-chain" not in methods.DEFAULT_METHODS


def test_offline_sampled_pass_warms_the_sampled_path_and_is_labelled(monkeypatch):
    from types import SimpleNamespace

    from benchmarks import offline
    from benchmarks.metrics import Prompt
    from vllm_esp_dev import runs

    calls = []

    def make_llm(model, speculative_config, max_num_seqs, **kwargs):
        return SimpleNamespace(
            llm_engine=SimpleNamespace(vllm_config=SimpleNamespace(additional_config={})))

    def generate(llm, prompts_token_ids, sampling_params, label=""):
        calls.append(sampling_params)
        return runs.GenerationRun(label, [[1, 2]] * len(prompts_token_ids),
                                  [""] * len(prompts_token_ids), 1.5)

    monkeypatch.setattr(runs, "make_llm", make_llm)
    monkeypatch.setattr(runs, "generate", generate)
    monkeypatch.setattr(runs, "warm_up", lambda llm, ids: None)
    monkeypatch.setattr(runs, "shutdown", lambda llm: None)
    prompts = [Prompt(i, "writing", i, [5, 6, i]) for i in range(3)]
    passes = offline.run_offline(methods.METHODS["esp"], "model", prompts, [2],
                                 ["p0", "p1", "p2"], [1], {}, temperature=0.7,
                                 warmup_params="warm")
    assert calls == ["warm", ["p0", "p1", "p2"]]
    assert passes[0].temperature == 0.7 and passes[0].key == "offline-b2-T0.7"


def test_spec_bench_sampled_run_end_to_end_without_engines(monkeypatch, tmp_path, capsys):
    """The harness's main with the engines replaced: the schedule, the
    requests' sampling parameters, the labels, results.json's config, and
    the exit status: a sampled pass whose outputs differ from none's does
    not make it 1, a greedy one does."""
    from types import SimpleNamespace

    import transformers

    from benchmarks import offline, online, spec_bench
    from vllm_esp_dev import data

    for name in ("VLLM_LOGGING_LEVEL", "TOKENIZERS_PARALLELISM"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(spec_bench, "exit_on_sigterm", lambda: None)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        staticmethod(lambda model: SimpleNamespace()))
    monkeypatch.setattr(data, "chat_prompt_ids", lambda tokenizer, q: [1, 2, 3])
    monkeypatch.setattr(report, "write_plots", lambda results, out: [])
    seen = []
    greedy_bug = {"on": False}

    def outputs(method, temperature, n):
        if temperature and method != "none":
            return [[7, 7, 7]] * n          # sampled: legitimately different
        if greedy_bug["on"] and method == "esp":
            return [[9, 9, 9]] * n
        return [[4, 5, 6]] * n

    def fake_offline(m, model, prompts, levels, sampling, warmup_ids, llm_options,
                     progress=None, temperature=0.0, warmup_params=None):
        seen.append(("offline", m.name, levels[0], temperature, sampling, warmup_params))
        records = [RequestRecord(p.index, p.category, t) for p, t in
                   zip(prompts, outputs(m.name, temperature, len(prompts)))]
        return [PassResult(m.name, "offline", levels[0], 1.0, records,
                           temperature=temperature)]

    def fake_online(m, model, prompts, levels, decoding, warmup_ids, llm_options, log_dir,
                    progress=None):
        seen.append(("online", m.name, levels[0], decoding.temperature, decoding, None))
        records = [RequestRecord(p.index, p.category, t) for p, t in
                   zip(prompts, outputs(m.name, decoding.temperature, len(prompts)))]
        return [PassResult(m.name, "online", levels[0], 1.0, records,
                           temperature=decoding.temperature)]

    monkeypatch.setattr(offline, "run_offline", fake_offline)
    monkeypatch.setattr(online, "run_online", fake_online)
    argv = ["--dataset", "bundled", "--per-category", "1", "--categories", "writing",
            "coding", "--model", str(tmp_path / "model"), "--max-tokens", "3",
            "--methods", "esp", "--batch-sizes", "2", "--concurrency", "2",
            "--temperature", "0", "0.7", "--top-p", "0.9", "--seed", "1",
            "--out", str(tmp_path / "out")]
    assert spec_bench.main(argv) == 0
    printed = capsys.readouterr().out
    assert [(w, m, level, t) for w, m, level, t, _, _ in seen] == [
        ("offline", "none", 2, 0.0), ("offline", "esp", 2, 0.0),
        ("online", "none", 2, 0.0), ("online", "esp", 2, 0.0),
        ("offline", "none", 2, 0.7), ("offline", "esp", 2, 0.7),
        ("online", "none", 2, 0.7), ("online", "esp", 2, 0.7)]
    greedy_params, sampled_params = seen[0][4], seen[4][4]
    assert greedy_params.temperature == 0.0 and greedy_params.seed is None
    assert not greedy_params.ignore_eos and seen[0][5] is None
    assert [p.seed for p in sampled_params] == [100003, 100004]
    assert all(p.ignore_eos and p.max_tokens == 3 and p.temperature == 0.7
               and p.top_p == 0.9 for p in sampled_params)
    assert seen[4][5].max_tokens == 8 and seen[4][5].temperature == 0.7  # warm-up
    assert seen[6][4] == Decoding(0.7, 3, True, 0.9, 1)
    assert "sampled at temperature 0.7" in printed and "ignore_eos forced" in printed
    assert "[esp] offline-b2: " in printed and "offline-b2-T0.7" in printed
    assert "NOT a correctness check" in printed and "esp offline-b2-T0.7 0/2" in printed
    assert "MISMATCH" not in printed
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["config"]["temperatures"] == [0.0, 0.7]
    assert results["config"]["sampled_passes"]["ignore_eos"] is True
    assert {p["key"] for p in results["passes"]} == {
        "offline-b2", "online-c2", "offline-b2-T0.7", "online-c2-T0.7"}

    seen.clear()
    greedy_bug["on"] = True
    assert spec_bench.main(argv[:-1] + [str(tmp_path / "out2")]) == 1
    assert "GREEDY OUTPUT MISMATCH: esp [offline-b2]" in capsys.readouterr().out


def test_step_cost_labels_temperature_and_dtype():
    from benchmarks.step_cost import parse_args, profile_tables, ratio_table, render_markdown

    def cell(method, temperature, seconds):
        return {"method": method, "batch": 8, "context": 128, "rows": 10,
                "temperature": temperature, "median_seconds": seconds,
                "median_scheduled_tokens": 80, "mean_context": 130.0}

    cells = [cell("chain", 0.0, 0.25), cell("esp", 0.0, 0.23),
             cell("chain", 0.7, 0.30), cell("esp", 0.7, 0.24)]
    table = ratio_table(cells)
    assert [(r["temperature"], round(r["esp_vs_chain"], 3)) for r in table] == [
        (0.0, 0.92), (0.7, 0.8)]
    meta = {"date": "d", "command": "c", "commit": "x", "machine": "m",
            "args": {"model": "smollm2-135m", "dtype": "bfloat16",
                     "temperatures": [0.0, 0.7], "top_p": 1.0}}
    text = render_markdown({"meta": meta, "cells": cells})
    assert "dtype bfloat16" in text and "greedy and sampled at temperature 0.7" in text
    assert "| T | batch |" in text
    assert "| 0.7 | 8 | 128 | 10 | 0.80x |" in text
    assert "| 0 | 8 | 128 | 10 | 0.92x |" in text
    # Greedy-only cells (and cells from before temperatures) keep the old table.
    greedy = [{k: v for k, v in c.items() if k != "temperature"} for c in cells[:2]]
    assert "| T |" not in render_markdown({"meta": meta, "cells": greedy})
    profile = {"method": "esp", "batch": 4, "context": 256, "rows": 4, "steps": 1,
               "seconds": {"other": 0.1}, "temperature": 0.7}
    assert ("## Where a step goes: batch 4, context 256, 4 rows, temperature 0.7"
            in profile_tables([profile]))
    args = parse_args(["--dtype", "bfloat16", "--temperature", "0", "1"])
    assert (args.dtype, args.temperatures, args.top_p) == ("bfloat16", [0.0, 1.0], 1.0)
    with pytest.raises(SystemExit):
        parse_args(["--temperature", "-0.5"])


def test_step_phases_sampling_options():
    from benchmarks import step_phases

    args = step_phases.parse_args(["--temperature", "0", "0.7", "--dtype", "bfloat16",
                                   "--top-p", "0.8"])
    assert (args.temperatures, args.dtype, args.top_p, args.seed) == (
        [0.0, 0.7], "bfloat16", 0.8, 0)
    assert step_phases.parse_args([]).temperatures == [0.0]
    assert step_phases.column_name("esp", 0.0) == "esp"
    assert step_phases.column_name("esp-chain", 0.7) == "esp-chain T0.7"
    params = step_phases.sampling_params_for(
        Decoding.for_temperature(0.7, 16, top_p=0.8, seed=1), 3)
    assert [p.seed for p in params] == [100003, 100004, 100005]
    assert all(p.ignore_eos and p.top_p == 0.8 for p in params)
    greedy = step_phases.sampling_params_for(Decoding.for_temperature(0.0, 16), 3)
    assert greedy.temperature == 0.0 and not greedy.ignore_eos and greedy.seed is None
