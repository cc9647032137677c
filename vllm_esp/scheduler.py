"""ESP scheduler: vLLM's scheduler with spec-decode metrics in tree nodes.

ESP reserves its whole verification block as draft slots: ``Q - 1`` of them,
``n`` tree nodes plus ``k * (n + 1)`` mask slots. vLLM's scheduler needs that
count for KV allocation and rollback, which this class leaves untouched. Its
metrics would then report mask slots as proposed draft tokens and deflate the
acceptance rate, so only the *reported* count is mapped back to tree nodes:

    num_drafts          = verification steps
    num_draft_tokens    = tree nodes proposed (masks excluded)
    num_accepted_tokens = accepted nodes

and vLLM's mean acceptance length (1 + accepted / drafts) equals ESP's tau.
The node count is read off each step's scheduled draft list
(``tree_node_count``), so hybrid trees of any size are counted right. Blocks
that fell back to a plain chain (truncated by the scheduler) are reported as
they are.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.metrics.stats import RequestSpecDecodeMetrics

from vllm_esp.proposer import esp_config_from_vllm, tree_node_count


@dataclass
class ESPRequestSpecDecodeMetrics(RequestSpecDecodeMetrics):
    """vLLM's per-request spec-decode metrics with ESP blocks counted as
    tree nodes (``per_request_spec_decode_metrics`` in responses)."""

    # This step's scheduled draft slots and the tree nodes among them, set
    # by the scheduler right before vLLM calls observe().
    esp_step_slots: int = -1
    esp_step_nodes: int = -1

    def observe(self, num_draft_tokens, num_accepted, detailed=False):
        if num_draft_tokens == self.esp_step_slots:
            num_draft_tokens = self.esp_step_nodes
        super().observe(num_draft_tokens, num_accepted, detailed)


class ESPScheduler(Scheduler):
    def __init__(self, vllm_config, *args, **kwargs) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        self._esp_masks_per_node = esp_config_from_vllm(vllm_config).masks_per_node
        # req_id -> (scheduled draft slots, tree nodes) for the step being
        # processed by update_from_output.
        self._esp_step_counts: dict[str, tuple[int, int]] = {}

    def update_from_output(self, scheduler_output, model_runner_output):
        counts = {}
        for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            counts[req_id] = (len(drafts),
                              tree_node_count(drafts, self._esp_masks_per_node))
            request = self.requests.get(req_id)
            metrics = None if request is None else request.spec_decode_metrics
            if metrics is None:
                continue
            if not isinstance(metrics, ESPRequestSpecDecodeMetrics):
                metrics = request.spec_decode_metrics = ESPRequestSpecDecodeMetrics(
                    num_spec_tokens=metrics.num_spec_tokens,
                    histogram=metrics.histogram,
                    num_draft_tokens=metrics.num_draft_tokens,
                    per_step_accepted=metrics.per_step_accepted,
                    per_step_drafted=metrics.per_step_drafted,
                )
            metrics.esp_step_slots, metrics.esp_step_nodes = counts[req_id]
        self._esp_step_counts = counts
        try:
            return super().update_from_output(scheduler_output, model_runner_output)
        finally:
            self._esp_step_counts = {}

    def make_spec_decoding_stats(self, spec_decoding_stats, num_draft_tokens,
                                 num_accepted_tokens, num_invalid_spec_tokens,
                                 request_id):
        slots, nodes = self._esp_step_counts.get(request_id, (-1, -1))
        if num_draft_tokens == slots:
            num_draft_tokens = nodes
        return super().make_spec_decoding_stats(
            spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
            num_invalid_spec_tokens, request_id)
