# SPDX-License-Identifier: Apache-2.0
"""ESP scheduler: vLLM's scheduler with spec-decode metrics in tree nodes.

ESP reserves its whole verification block as draft slots: ``Q - 1`` of them,
``n`` tree nodes plus ``k`` mask slots per masked node. vLLM's scheduler
needs that count for KV allocation and rollback, which this class leaves
untouched. Its metrics would then report mask slots as proposed draft tokens
and deflate the acceptance rate, so only the *reported* count is mapped back
to tree nodes:

    num_drafts          = verification steps
    num_draft_tokens    = tree nodes proposed (masks excluded)
    num_accepted_tokens = accepted nodes

and vLLM's mean acceptance length (1 + accepted / drafts) equals ESP's tau.

Under KV pressure, blocks yield first: before each step, drafts that would
need KV blocks the pool no longer has are dropped (largest first) so that a
request is decoded plainly this step rather than another one preempted
(``_fit_drafts_to_free_kv``). Plain vLLM would preempt only for the tokens
it must decode; ESP then preempts no more than that, up to the blocks its
rejected rows still hold.
The runner tells the scheduler how many of each request's drafts are tree
nodes (``ESPDraftTokenIds``). A block the scheduler then truncates (token
budget, ``max_model_len``) is verified as a plain chain and reported as one.

Each new request's ``cache_salt``, which vLLM keeps in the engine's request
only, is copied into its sampling params' ``extra_args``
(``CACHE_SALT_ARG``), where the worker's proposer reads it: prompt lookup
then searches only earlier answers with the same salt (``add_request``).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.metrics.stats import RequestSpecDecodeMetrics

from vllm_esp.containment import Containment
from vllm_esp.proposer import CACHE_SALT_ARG, ESPDraftTokenIds


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


def record_cache_salt(request, salt: str | None) -> None:
    """Put ``salt`` into the request's sampling params (``extra_args``,
    ``CACHE_SALT_ARG``), where the worker's proposer reads it. A client's own
    entry under that key is removed, so no request can name another's answer
    pool; the dict is replaced, not changed (a shallow-cloned
    ``SamplingParams`` shares its caller's)."""
    params = request.sampling_params
    if params is None:
        return
    extra = params.extra_args or {}
    if salt is None and CACHE_SALT_ARG not in extra:
        return
    extra = {key: value for key, value in extra.items() if key != CACHE_SALT_ARG}
    if salt is not None:
        extra[CACHE_SALT_ARG] = salt
    params.extra_args = extra or None


class ESPScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # req_id -> (draft slots, tree nodes) of the block proposed last.
        self._esp_blocks: dict[str, tuple[int, int]] = {}
        # req_id -> (scheduled draft slots, tree nodes) for the step being
        # processed by update_from_output.
        self._esp_step_counts: dict[str, tuple[int, int]] = {}
        # Blocks dropped for lack of KV blocks (see _fit_drafts_to_free_kv).
        self.esp_dropped_blocks = 0
        # ESP's bookkeeping here only counts and trims drafts: where it fails,
        # vLLM's scheduler goes on as without it.
        self.esp_containment = Containment()

    def add_request(self, request) -> None:
        # A session's later chunks keep the salt the session started with,
        # as vLLM's prefix cache does.
        session = self.requests.get(request.request_id)
        record_cache_salt(request, (session or request).cache_salt)
        super().add_request(request)

    def schedule(self, *args, **kwargs):
        try:
            self._fit_drafts_to_free_kv()
        except Exception:
            # vLLM preempts for the drafts, as it would without ESP.
            self.esp_containment.failed("fitting blocks to free KV",
                                        [r.request_id for r in self.running])
        return super().schedule(*args, **kwargs)

    def _fit_drafts_to_free_kv(self) -> None:
        running = self.running
        drafting = [r for r in running if r.spec_token_ids]
        if not drafting:
            return
        block_size = self.block_size
        free = self.kv_cache_manager.block_pool.get_num_free_blocks()
        # Cheap bound first: every request crossing a block boundary with
        # its root and every draft in new blocks.
        worst = len(running) + sum(-(-len(r.spec_token_ids) // block_size) + 1
                                   for r in drafting)
        if worst <= free:
            return

        def blocks(tokens: int) -> int:
            return -(-tokens // block_size)

        def allocated(request) -> int:
            return len(self.kv_cache_manager.get_block_ids(request.request_id)[0])

        plain_need = sum(max(0, blocks(r.num_tokens) - allocated(r)) for r in running)
        extra = []
        for request in drafting:
            have = max(allocated(request), blocks(request.num_tokens))
            need = blocks(request.num_tokens + len(request.spec_token_ids)) - have
            if need > 0:
                extra.append((need, request))
        room = free - plain_need
        total = sum(need for need, _ in extra)
        for need, request in sorted(extra, key=lambda item: -item[0]):
            if total <= room:
                break
            request.spec_token_ids = []  # a plain step for it, this time
            total -= need
            self.esp_dropped_blocks += 1

    def update_draft_token_ids(self, draft_token_ids) -> None:
        super().update_draft_token_ids(draft_token_ids)
        if not isinstance(draft_token_ids, ESPDraftTokenIds) or draft_token_ids.tree_nodes is None:
            return
        try:
            self._record_blocks(draft_token_ids)
        except Exception:
            # Their metrics count every draft slot this step.
            for req_id in draft_token_ids.req_ids:
                self._esp_blocks.pop(req_id, None)
            self.esp_containment.failed("recording blocks", draft_token_ids.req_ids)

    def _record_blocks(self, draft_token_ids: ESPDraftTokenIds) -> None:
        blocks = self._esp_blocks
        for req_id, drafts, nodes in zip(draft_token_ids.req_ids,
                                         draft_token_ids.draft_token_ids,
                                         draft_token_ids.tree_nodes):
            if nodes >= 0:
                blocks[req_id] = (len(drafts), nodes)
            else:
                blocks.pop(req_id, None)

    def update_from_output(self, scheduler_output, model_runner_output):
        try:
            self._esp_step_counts = self._step_counts(scheduler_output)
        except Exception:
            self._esp_step_counts = {}
            self.esp_containment.failed(
                "counting tree nodes", list(scheduler_output.scheduled_spec_decode_tokens))
        try:
            return super().update_from_output(scheduler_output, model_runner_output)
        finally:
            self._esp_step_counts = {}

    def _step_counts(self, scheduler_output) -> dict[str, tuple[int, int]]:
        """Each block's scheduled draft slots and tree nodes this step, also
        set on its request's metrics (``ESPRequestSpecDecodeMetrics``)."""
        counts = {}
        blocks = self._esp_blocks
        for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            slots, nodes = blocks.pop(req_id, (-1, -1))
            # A whole block counts its nodes; a truncated one, every slot.
            counts[req_id] = (len(drafts), nodes if slots == len(drafts) else len(drafts))
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
        for req_id in scheduler_output.finished_req_ids:
            blocks.pop(req_id, None)
        return counts

    def make_spec_decoding_stats(self, spec_decoding_stats, num_draft_tokens,
                                 num_accepted_tokens, num_invalid_spec_tokens,
                                 request_id):
        slots, nodes = self._esp_step_counts.get(request_id, (-1, -1))
        if num_draft_tokens == slots:
            num_draft_tokens = nodes
        return super().make_spec_decoding_stats(
            spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
            num_invalid_spec_tokens, request_id)
