"""ESP scheduler: vLLM's scheduler with spec-decode metrics in tree nodes.

ESP reserves its whole verification block as draft slots: ``Q - 1`` of them,
``T - 1`` tree nodes plus ``k * T`` mask slots. vLLM's scheduler needs that
count for KV allocation and rollback, which this class leaves untouched. Its
metrics would then report mask slots as proposed draft tokens and deflate the
acceptance rate, so only the *reported* count is mapped back to tree nodes:

    num_drafts          = verification steps
    num_draft_tokens    = tree nodes proposed (masks excluded)
    num_accepted_tokens = accepted nodes

and vLLM's mean acceptance length (1 + accepted / drafts) equals ESP's tau.
Blocks that fell back to a plain chain (truncated by the scheduler) carry a
different number of slots and are reported as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.metrics.stats import RequestSpecDecodeMetrics

from vllm_esp.proposer import esp_config_from_vllm


@dataclass
class ESPRequestSpecDecodeMetrics(RequestSpecDecodeMetrics):
    """vLLM's per-request spec-decode metrics with ESP blocks counted as
    tree nodes (``per_request_spec_decode_metrics`` in responses)."""

    esp_block_slots: int = -1
    esp_tree_drafts: int = -1

    def observe(self, num_draft_tokens, num_accepted, detailed=False):
        if num_draft_tokens == self.esp_block_slots:
            num_draft_tokens = self.esp_tree_drafts
        super().observe(num_draft_tokens, num_accepted, detailed)


class ESPScheduler(Scheduler):
    def __init__(self, vllm_config, *args, **kwargs) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        esp_config = esp_config_from_vllm(vllm_config)
        self._esp_block_slots = esp_config.num_draft_slots
        self._esp_tree_drafts = esp_config.node_budget

    def add_request(self, request) -> None:
        super().add_request(request)
        metrics = request.spec_decode_metrics
        if metrics is not None and not isinstance(metrics, ESPRequestSpecDecodeMetrics):
            request.spec_decode_metrics = ESPRequestSpecDecodeMetrics(
                num_spec_tokens=metrics.num_spec_tokens,
                histogram=metrics.histogram,
                esp_block_slots=self._esp_block_slots,
                esp_tree_drafts=self._esp_tree_drafts,
            )

    def make_spec_decoding_stats(self, spec_decoding_stats, num_draft_tokens,
                                 num_accepted_tokens, num_invalid_spec_tokens,
                                 request_id):
        if num_draft_tokens == self._esp_block_slots:
            num_draft_tokens = self._esp_tree_drafts
        return super().make_spec_decoding_stats(
            spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
            num_invalid_spec_tokens, request_id)

