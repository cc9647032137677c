# SPDX-License-Identifier: Apache-2.0
"""ESP drafts for vLLM: the ``custom_class`` proposer and ESP's engine state.

vLLM calls ``propose`` once per step, after the step's tokens are committed,
and schedules exactly ``1 + len(drafts)`` query slots per request next step.
ESP asks for its whole block through that list:

    drafts = tree node tokens (T - 1)  +  mask slots (k per masked node)

so the scheduler reserves the block's ``Q`` KV slots with no scheduler
change. The mask slots carry a placeholder id (``MASK_SLOT_TOKEN``) that is
never embedded: the runner feeds those rows the request's soft mask
embedding. How many of the drafts are tree nodes reaches the scheduler
through an explicit channel (:class:`ESPDraftTokenIds`), for vLLM's
metrics.

Example, ESP alone with ``tree=[4]`` (k = 1, T = 5, Q = 10), root token 42,
mask-1 top candidates [17, 42, 9, 3, 88]: pruning drops 42 (equal to its
parent, the root), so the tree is 42 -> {17, 9, 3, 88} and the drafts are
``[17, 9, 3, 88, 0, 0, 0, 0, 0]`` (4 nodes, 5 mask slots).

Everything per step is batched: the mask embeddings' EMA in one embedding
call and one update, the next trees of all requests in one compiled call
(``core.batch.TreeProposer``). The proposer keeps each request's state in a
*slot* of preallocated arrays: its mask embedding, its pending block (the
tree whose drafts it returned last), and the candidate table the runner
filled from the masks of its last accepted node.
"""

from __future__ import annotations

import logging
import time
import zlib
from dataclasses import dataclass

import numpy as np
import torch
from vllm.v1.outputs import DraftTokenIds

from vllm_esp.config import ESPConfig
from vllm_esp.containment import Containment
from vllm_esp.core.batch import (
    TreeBatch,
    TreeProposer,
    chain_rows,
    child_score_indices,
    select_chains_flat,
)
from vllm_esp.core.goodput import (
    NUM_SOURCES,
    SOURCE_CORPUS,
    SOURCE_ESP,
    SOURCE_LOOKUP,
    SamplingCalibration,
    StepBudget,
    StepCostModel,
    drain_token_values,
    reach_band_labels,
    sampling_band_labels,
    sampling_bands,
    tally_verification,
)
from vllm_esp.core.hybrid import MASK_VALUE, AnswerPools
from vllm_esp.core.mask_embedding import (
    ema_update_packed,
    embedding_table_sums,
    initial_mask_embedding,
    table_stats_from_sums,
)
from vllm_esp.profiling import scope
from vllm_esp.step import ESPStep

# Under "vllm." so that vLLM's logging configuration (format, level,
# VLLM_LOGGING_LEVEL) applies to ESP's messages too.
logger = logging.getLogger("vllm.esp")

# Token id of the mask slots in a draft list. Any valid id works (those rows
# are fed the soft embedding); it must not be -1, vLLM's padding.
MASK_SLOT_TOKEN = 0

# Proposals without an admission after which a batch with free seats is
# taken to be draining. A served client sends its next request when one
# ends: at concurrency 4 and ~70 steps a request, one arrives every ~18
# steps, so that batch keeps the goodput aim.
DRAIN_STEPS = 32
# A batch whose requests all started within this many proposals of each
# other is one wave (an offline generate of fewer prompts than seats, whose
# prefills may take a few steps): it drains from its first step.
WAVE_STEPS = 4


@dataclass
class ESPDraftTokenIds(DraftTokenIds):
    """vLLM's drafts plus, per request, how many of them are tree nodes (-1:
    not an ESP block). The ESP scheduler reads it for its metrics."""

    tree_nodes: list[int] | None = None


def esp_config_from_vllm(vllm_config) -> ESPConfig:
    return ESPConfig.from_serialized(vllm_config.additional_config["esp"])


def tree_proposer_from_vllm(vllm_config, esp_config: ESPConfig):
    """The configured proposer (ESP masks, or the hybrid with prompt lookup),
    unless a test or benchmark injects another through
    ``additional_config["esp_candidate_source"] = {"class": "pkg.Cls",
    "kwargs": {...}}``: a class taking ``(esp_config, **kwargs)`` with
    ``TreeProposer``'s ``propose`` and ``candidate_width`` (the oracle test,
    the step-cost benchmark; not a user option)."""
    override = (vllm_config.additional_config or {}).get("esp_candidate_source")
    if override is None:
        return TreeProposer(esp_config)
    from vllm.utils.import_utils import resolve_obj_by_qualname

    source_cls = resolve_obj_by_qualname(override["class"])
    logger.warning("ESP: tree proposer overridden by %s (testing hook)",
                   override["class"])
    return source_cls(esp_config, **override.get("kwargs", {}))


class AutoStats:
    """Rows per step and the chosen budget, logged every ``interval`` s."""

    def __init__(self, interval: float = 30.0) -> None:
        self._clock = time.monotonic
        self.interval = interval
        self._last = self._clock()
        self._reset()

    def _reset(self) -> None:
        self.num_steps = self.num_rows = self.num_blocks = self.draining_steps = 0
        self.block_rows = self.accepted = self.mask_rows = 0
        # Drafted and accepted nodes per candidate source (SOURCE_*): where
        # the accepted tokens come from, so that a user can see whether the
        # masks earn their rows on their model.
        self.drafted_by_source = np.zeros(NUM_SOURCES, np.int64)
        self.accepted_by_source = np.zeros(NUM_SOURCES, np.int64)

    def blocks(self, block_sizes: np.ndarray, accepted: np.ndarray, num_nodes: np.ndarray,
               drafted_by_source: np.ndarray, accepted_by_source: np.ndarray) -> None:
        """One step's verified blocks: their sizes (rows), drafts accepted
        per block, their tree nodes (the rest of a block's rows are mask
        rows), and the drafted and the accepted nodes per source."""
        self.num_blocks += int(block_sizes.shape[0])
        self.block_rows += int(block_sizes.sum())
        self.accepted += int(accepted.sum())
        self.mask_rows += int((block_sizes - num_nodes).sum())
        self.drafted_by_source += drafted_by_source
        self.accepted_by_source += accepted_by_source

    def step(self, rows: int, proposer: ESPProposer) -> None:
        self.num_steps += 1
        self.num_rows += rows
        now = self._clock()
        if now - self._last < self.interval:
            return
        self._last = now
        cost = proposer.cost_model
        calibration = proposer.calibration
        scales, mask_values = calibration.scales, calibration.mask_values
        band_names = sampling_band_labels()
        logger.info(
            "ESP: %d steps (%d draining), %.1f rows per step; %d blocks of %.1f rows (%d mask "
            "rows), %.2f accepted per block; drafts accepted/drafted by source: "
            "esp %s, lookup %s, cached answers %s%s; calibration by estimated "
            "reach %s: %s",
            self.num_steps, self.draining_steps, self.num_rows / max(self.num_steps, 1),
            self.num_blocks,
            self.block_rows / max(self.num_blocks, 1), self.mask_rows,
            self.accepted / max(self.num_blocks, 1),
            *(f"{self.accepted_by_source[source]}/{self.drafted_by_source[source]}"
              for source in (SOURCE_ESP, SOURCE_LOOKUP, SOURCE_CORPUS)),
            "" if cost is None else
            f"; step cost {cost.fixed * 1e3:.1f} ms + {cost.per_request * 1e3:.2f} ms/request"
            f" + {cost.per_row * 1e3:.2f} ms/row"
            f" + {cost.per_drafted_step * 1e3:.1f} ms when it verifies drafts",
            "/".join(reach_band_labels()),
            "; ".join(
                f"{band_names[band]}: esp x"
                + "/".join(f"{v:.2f}" for v in scales[band, SOURCE_ESP])
                + ", lookup x" + "/".join(f"{v:.2f}" for v in scales[band, SOURCE_LOOKUP])
                + ", cached answers x"
                + "/".join(f"{v:.2f}" for v in scales[band, SOURCE_CORPUS])
                + f", mask rows' value {mask_values[band]:.3f}"
                for band in calibration.observed_bands()) or "no drafts yet")
        self._reset()


def has_sampling_param(request, name: str) -> bool:
    """Whether the request's sampling params set ``name`` (pooling
    requests have none)."""
    params = getattr(request, "sampling_params", None)
    return params is not None and getattr(params, name, None) is not None


# The request's cache_salt, which vLLM keeps in the engine's Request only:
# the ESP scheduler copies it into the request's sampling params under this
# key (``ESPScheduler.add_request``), and the proposer reads it there.
CACHE_SALT_ARG = "vllm_esp.cache_salt"


def request_sampling_band(request) -> int:
    """The calibration band of how ``request`` samples (greedy for requests
    without sampling params)."""
    params = getattr(request, "sampling_params", None)
    temperature = getattr(params, "temperature", None)
    return int(sampling_bands(np.array([0.0 if temperature is None else temperature]))[0])


def request_cache_salt(request) -> str | None:
    """The cache salt the scheduler recorded for ``request`` (None: none)."""
    extra = getattr(getattr(request, "sampling_params", None), "extra_args", None)
    return extra.get(CACHE_SALT_ARG) if extra else None


class ESPProposer:
    """vLLM's ``custom_class`` proposer for ESP: per-request state in slots
    and the batched proposal step. The runner (``vllm_esp.runner``) drives
    the forward and verification and calls back into this object."""

    def __init__(self, vllm_config) -> None:
        self.esp_config = esp_config_from_vllm(vllm_config)
        self.tree_proposer = tree_proposer_from_vllm(vllm_config, self.esp_config)
        self.max_slots = self.max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        self.runner = None
        self.model = None
        self._table_stats = None
        config = self.esp_config
        slots = self.max_slots
        self.slot_of: dict[str, int] = {}
        self.free_slots = list(range(slots - 1, -1, -1))
        self.masks_per_node = config.masks_per_node
        # Pending blocks: the trees whose drafts propose() returned last.
        self.pending = TreeBatch.empty(slots, self.tree_proposer.max_nodes,
                                       self.masks_per_node)
        self.pending_drafts: list[list[int] | None] = [None] * slots
        # Candidate tables from the masks of each request's last accepted
        # node (filled by the runner after verification, used once).
        width = self.tree_proposer.candidate_width
        levels = max(config.num_mask_tokens, 1)
        self.cand_tokens = np.zeros((slots, levels, width), np.int64)
        self.cand_log_probs = np.zeros((slots, levels, width), np.float32)
        self.has_candidates = np.zeros(slots, np.bool_)
        # Mask embeddings (fp32) and how many output tokens each has folded.
        self.mask_embeddings: torch.Tensor | None = None
        self.initialized = np.zeros(slots, np.bool_)
        self.num_folded = np.zeros(slots, np.int64)
        # Where prompt lookup starts in each request's token history
        # (prompt-embeds requests: after the prompt, whose ids are unknown).
        self.history_starts = np.zeros(slots, np.int64)
        # No block for these: structured output (the grammar validates
        # chains only), and requests whose proposal failed (plain decoding
        # for good).
        self.structured = np.zeros(slots, np.bool_)
        self.no_block = np.zeros(slots, np.bool_)
        # Seeded requests draft from their own history only: vLLM's rejection
        # sampler draws per draft token, so drafts from other requests'
        # answers would change a seeded request's tokens from run to run.
        self.seeded = np.zeros(slots, np.bool_)
        # How each request samples (core.goodput.sampling_bands): the
        # calibration it is estimated and observed with.
        self.sampling_band = np.zeros(slots, np.int64)
        # Each request's max_tokens and the steps that emitted its tokens:
        # how many steps it still needs, when the batch drains.
        self.max_tokens = np.zeros(slots, np.int64)
        self.decode_steps = np.zeros(slots, np.int64)
        # Rows its blocks had over those steps, root included.
        self.block_rows = np.zeros(slots, np.int64)
        # Proposals since a request was last admitted (see _drain_values).
        self.steps_since_admission = 0
        # 'auto' block complexity: the step-cost model (set by the runner
        # from its start-up profile) and the sources' calibration.
        self.auto = config.auto
        self.cost_model: StepCostModel | None = None
        self.calibration = SamplingCalibration(MASK_VALUE)
        self.max_model_len = vllm_config.model_config.max_model_len
        self.max_step_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self.stats = AutoStats()
        # Finished requests' answers, for prompt lookup across requests:
        # one pool per cache salt (a request searches its own salt's only).
        self.answer_cache = AnswerPools(config.lookup_cache_tokens)
        self.cache_salts: list[str | None] = [None] * slots
        # Faults in ESP's own code, per phase (the runner reports its own).
        self.containment = Containment()

    # ------------------------------------------------------------ engine glue
    def load_model(self, model) -> None:
        self.model = model

    def bind(self, runner) -> None:
        self.runner = runner
        hidden = runner.inputs_embeds.gpu.shape[-1]
        self.mask_embeddings = torch.zeros(self.max_slots, hidden, dtype=torch.float32,
                                           device=runner.device)

    def warm_up(self) -> None:
        """Compile the per-step numba kernels at engine start-up rather than
        in the first requests: on a fresh install that takes about 20 s,
        after which numba's on-disk cache serves them. One proposal, block
        layout, chain selection, chain layout and calibration tally for a
        synthetic request, with the engine's own buffers and dtypes; no
        request state is touched."""
        ends = np.full(1, min(8, self.runner.input_batch.token_ids_cpu.shape[1]), np.int64)
        trees = self._propose_trees(
            np.zeros(1, np.int64), np.zeros(1, np.int64), ends,
            np.zeros_like(self.cand_tokens[:1]), np.zeros_like(self.cand_log_probs[:1]),
            np.ones(1, np.bool_), num_requests=1)
        zero = np.zeros(1, np.int64)
        ESPStep.build(zero, zero, trees, row_starts=zero, root_positions=zero).rows()
        rows, _ = child_score_indices(trees, np.zeros(1, np.int64))
        chains, lengths = select_chains_flat(trees, np.zeros(rows.shape[0], np.float32))
        num_drafts = np.maximum(trees.num_nodes - 1, 0)
        chain_rows(np.zeros(1, np.int64), np.zeros(1, np.int64), num_drafts,
                   np.zeros(int(num_drafts.sum()), np.int64), chains, lengths,
                   trees.tokens, in_place=True)
        tally_verification(trees.num_nodes, trees.sources, trees.reach, chains,
                           np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.bool_))

    def slots(self, req_ids: list[str]) -> np.ndarray:
        """Slots of ``req_ids``, assigning free ones to new requests."""
        slot_of = self.slot_of
        for req_id in req_ids:
            if req_id not in slot_of:
                if not self.free_slots:
                    self._grow()
                slot = self.free_slots.pop()
                slot_of[req_id] = slot
                self.initialized[slot] = False
                self.has_candidates[slot] = False
                self.pending_drafts[slot] = None
                self.pending.num_nodes[slot] = 0
                self.num_folded[slot] = 0
                request = self.runner.requests[req_id]
                self.structured[slot] = has_sampling_param(request, "structured_outputs")
                self.seeded[slot] = has_sampling_param(request, "seed")
                self.sampling_band[slot] = request_sampling_band(request)
                max_tokens = getattr(request.sampling_params, "max_tokens", None)
                self.max_tokens[slot] = self.max_model_len if max_tokens is None else max_tokens
                self.decode_steps[slot] = 0
                self.block_rows[slot] = 0
                self.steps_since_admission = 0
                self.cache_salts[slot] = request_cache_salt(request)
                self.no_block[slot] = self.structured[slot]
                # A prompt given as embeddings has no token ids to look up.
                self.history_starts[slot] = (
                    0 if request.prompt_token_ids is not None
                    else int(request.prompt_embeds.shape[0]))
        return np.fromiter((slot_of[r] for r in req_ids), np.int64, len(req_ids))

    def _grow(self) -> None:
        """Double the slots: preempted requests keep theirs while others run."""
        old = self.max_slots
        self.max_slots = new = 2 * old
        for name in ("cand_tokens", "cand_log_probs", "has_candidates", "initialized",
                     "num_folded", "history_starts", "structured", "no_block", "seeded",
                     "sampling_band", "max_tokens", "decode_steps", "block_rows"):
            array = getattr(self, name)
            grown = np.zeros((new,) + array.shape[1:], array.dtype)
            grown[:old] = array
            setattr(self, name, grown)
        pending = self.pending
        self.pending = TreeBatch.empty(new, pending.parents.shape[1],
                                       pending.num_mask_tokens)
        for name in ("parents", "tokens", "masked", "num_nodes", "reach", "sources"):
            getattr(self.pending, name)[:old] = getattr(pending, name)
        self.pending_drafts += [None] * old
        self.cache_salts += [None] * old
        embeddings = self.mask_embeddings
        self.mask_embeddings = embeddings.new_zeros((new, embeddings.shape[1]))
        self.mask_embeddings[:old] = embeddings
        self.free_slots = list(range(new - 1, old - 1, -1))

    def structured_in_batch(self, req_ids: list[str]) -> bool:
        """Whether a request of the batch has structured output (requests
        new this step have no slot yet: read their sampling params)."""
        slot_of, requests = self.slot_of, self.runner.requests
        return any(bool(self.structured[slot_of[r]]) if r in slot_of
                   else has_sampling_param(requests[r], "structured_outputs")
                   for r in req_ids)

    def tree_node_counts(self, req_ids: list[str], draft_lists: list[list[int]]
                         ) -> list[int]:
        """Tree nodes among each request's drafts, -1 where the drafts are
        not an ESP block (vLLM replaced them, e.g. near max_model_len)."""
        counts = []
        for req_id, drafts in zip(req_ids, draft_lists):
            slot = self.slot_of.get(req_id)
            if slot is not None and drafts and drafts is self.pending_drafts[slot]:
                counts.append(int(self.pending.num_nodes[slot]) - 1)
            else:
                counts.append(-1)
        return counts

    def drop(self, req_ids) -> None:
        """Forget finished requests (their answers join the lookup cache,
        in their cache salt's pool)."""
        requests = self.runner.requests if self.runner is not None else {}
        for req_id in req_ids:
            if req_id in requests:
                request = requests[req_id]
                self.answer_cache.add(request_cache_salt(request), request.output_token_ids)
            slot = self.slot_of.pop(req_id, None)
            if slot is not None:
                self.free_slots.append(slot)

    def matching_blocks(self, req_ids: list[str], scheduled: dict[str, list[int]]
                        ) -> tuple[np.ndarray, np.ndarray]:
        """Batch indices and slots of the requests whose scheduled drafts are
        exactly the block proposed for them. Truncated (token budget,
        ``max_model_len``), padded (resumed) or otherwise changed draft lists
        are not: vLLM verifies those as plain chains, losslessly."""
        indices, slots = [], []
        slot_of, pending = self.slot_of, self.pending_drafts
        for index, req_id in enumerate(req_ids):
            drafts = scheduled.get(req_id)
            slot = slot_of.get(req_id)
            if drafts and slot is not None and drafts == pending[slot]:
                indices.append(index)
                slots.append(slot)
        return np.asarray(indices, np.int64), np.asarray(slots, np.int64)

    def set_candidates(self, slots: np.ndarray, tokens: np.ndarray,
                       log_probs: np.ndarray) -> None:
        """Candidate tables of the masks of these requests' last accepted
        nodes (the next proposal uses each once)."""
        self.cand_tokens[slots, :, :tokens.shape[-1]] = tokens
        self.cand_log_probs[slots, :, :tokens.shape[-1]] = log_probs
        self.has_candidates[slots] = True

    @property
    def candidate_width(self) -> int:
        return self.tree_proposer.candidate_width

    # -------------------------------------------------------------- proposing
    def propose(self, sampled_token_ids, num_tokens_no_spec=None,
                token_ids_cpu=None, slot_mappings=None) -> list[list[int]]:
        """Next blocks, aligned with ``runner.input_batch.req_ids``."""
        with scope("esp: propose"):
            req_ids = list(self.runner.input_batch.req_ids)
            try:
                slots = self.slots(req_ids)
            except Exception:
                self.containment.failed("the request slots", req_ids)
                return [[] for _ in req_ids]
            active = np.fromiter((bool(s) for s in sampled_token_ids), np.bool_,
                                 len(req_ids)) & ~self.no_block[slots]
            try:
                self._propose(req_ids, slots, active)
            except Exception:
                self._isolate_failure(req_ids, slots, active)
            drafts: list[list[int]] = [[] for _ in req_ids]
            pending = self.pending_drafts
            for index in np.flatnonzero(active):
                drafts[index] = pending[slots[index]] or []
            for slot in slots[~active]:
                pending[slot] = None
            # Candidates are used once: the next proposal needs new ones.
            self.has_candidates[slots] = False
            return drafts

    def _propose(self, req_ids: list[str], slots: np.ndarray, active: np.ndarray) -> None:
        runner = self.runner
        indices = np.flatnonzero(active)
        if indices.size == 0:
            return
        active_slots = slots[indices]
        ends = runner.input_batch.num_tokens_no_spec[indices].astype(np.int64)
        self.decode_steps[active_slots] += 1
        self.steps_since_admission += 1
        trees = self._propose_trees(
            indices, self.history_starts[active_slots], ends,
            self.cand_tokens[active_slots], self.cand_log_probs[active_slots],
            self.has_candidates[active_slots], num_requests=len(req_ids),
            corpus_rows=~self.seeded[active_slots],
            salts=[self.cache_salts[slot] for slot in active_slots],
            bands=self.sampling_band[active_slots],
            token_values=self._drain_values(indices, active_slots, ends, len(req_ids)))
        pending = self.pending
        width = trees.parents.shape[1]
        pending.parents[active_slots, :width] = trees.parents
        pending.tokens[active_slots, :width] = trees.tokens
        pending.masked[active_slots, :width] = trees.masked
        pending.num_nodes[active_slots] = trees.num_nodes
        pending.reach[active_slots, :width] = trees.reach
        pending.sources[active_slots, :width] = trees.sources
        block_sizes = trees.block_sizes()
        self.block_rows[active_slots] += np.maximum(block_sizes, 1)
        for row, slot in enumerate(active_slots):
            num_nodes = int(trees.num_nodes[row])
            if num_nodes == 0:
                self.pending_drafts[slot] = None
                continue
            self.pending_drafts[slot] = trees.tokens[row, 1:num_nodes].tolist() + [
                MASK_SLOT_TOKEN] * int(block_sizes[row] - num_nodes)
        # Only blocks with mask rows read the mask embedding: bring those up
        # to date (the others catch up when they next need it).
        with_masks = block_sizes > trees.num_nodes
        if with_masks.any():
            self._update_mask_embeddings([req_ids[i] for i in indices[with_masks]],
                                         active_slots[with_masks])

    def _propose_trees(self, rows: np.ndarray, history_starts: np.ndarray,
                       ends: np.ndarray, cand_tokens: np.ndarray,
                       cand_log_probs: np.ndarray, has_candidates: np.ndarray,
                       num_requests: int, corpus_rows: np.ndarray | None = None,
                       salts: list[str | None] | None = None,
                       bands: np.ndarray | None = None,
                       token_values: np.ndarray | None = None) -> TreeBatch:
        """Trees for the input batch's ``rows`` (histories end at ``ends``);
        lookup searches earlier answers too where ``corpus_rows``: those of
        requests with the same cache salt (``salts``; None: unsalted);
        ``bands``: how each samples (None: greedy); ``token_values``: what
        their accepted tokens save while the batch drains."""
        token_ids = self.runner.input_batch.token_ids_cpu
        corpus, starts, ends_in_corpus = self.answer_cache.corpus(
            [None] * rows.shape[0] if salts is None else salts)
        if corpus_rows is not None:
            ends_in_corpus = np.where(corpus_rows, ends_in_corpus, starts)
        # Near max_model_len a request's block shrinks to what still fits
        # (the scheduler would cut it), instead of speculation stopping for
        # the whole batch.
        return self.tree_proposer.propose(
            token_ids, rows, history_starts, ends,
            token_ids[rows, ends - 1].astype(np.int64),
            cand_tokens, cand_log_probs, has_candidates,
            self.runner.model_config.get_vocab_size(),
            row_caps=self.max_model_len - ends,
            budget=self._step_budget(num_requests, bands, token_values),
            corpus=corpus, corpus_spans=(starts, ends_in_corpus))

    def _drain_values(self, rows: np.ndarray, slots: np.ndarray, ends: np.ndarray,
                      num_requests: int) -> np.ndarray | None:
        """What an accepted token of each request saves (seconds) while the
        batch drains, else None (core.goodput.drain_token_values).

        The batch drains when it has free seats (so nothing waits for one)
        and either no request has been admitted for ``DRAIN_STEPS``
        proposals (so none is arriving, as in a served batch whose clients
        send the next request when one ends) or all its requests started
        within ``WAVE_STEPS`` proposals of each other (one wave)."""
        if not self.auto or self.cost_model is None or num_requests >= self.max_num_seqs:
            return None
        steps = self.decode_steps[slots]
        one_wave = steps.size > 0 and int(steps.max() - steps.min()) <= WAVE_STEPS
        if self.steps_since_admission < DRAIN_STEPS and not one_wave:
            return None
        generated = ends - self.runner.input_batch.num_prompt_tokens[rows]
        remaining = self.max_tokens[slots] - generated
        tokens_per_step = np.maximum(generated, 1) / np.maximum(self.decode_steps[slots], 1)
        # decode_steps already counts this step, whose block is not chosen yet.
        rows_per_step = self.block_rows[slots] / np.maximum(self.decode_steps[slots] - 1, 1)
        cost = self.cost_model
        self.stats.draining_steps += 1
        return drain_token_values(remaining, tokens_per_step, rows_per_step, cost.fixed,
                                  cost.per_request, cost.per_row)

    def _step_budget(self, num_requests: int, bands: np.ndarray | None = None,
                     token_values: np.ndarray | None = None) -> StepBudget | None:
        if not self.auto or self.cost_model is None:
            return None
        # The step's requests are given; only its rows are chosen.
        return StepBudget(self.cost_model.seconds(0, num_requests, drafted=False),
                          self.cost_model.per_row,
                          base_rows=num_requests, max_total_rows=self.max_step_tokens,
                          cost_per_drafted_step=self.cost_model.per_drafted_step,
                          scales=self.calibration.scales,
                          mask_value=self.calibration.mask_values, bands=bands,
                          token_values=token_values)

    def observe_verification(self, trees: TreeBatch, chains: np.ndarray,
                             accepted: np.ndarray, probed: np.ndarray,
                             slots: np.ndarray) -> None:
        """Calibrate the estimates on one step's verified blocks (of the
        requests in ``slots``), each in its request's sampling band: every
        drafted node and whether it was on the accepted path (the sources'
        acceptance), and what ESP's drafts earned against what their rows
        cost (the mask rows' value). ``probed[i]``: block ``i``'s last
        accepted node carried masks, so it seeds the next ESP candidates."""
        if trees.reach is None:
            return
        bands = self.sampling_band[slots]
        tally = tally_verification(trees.num_nodes, trees.sources, trees.reach, chains,
                                   accepted, bands, probed)
        block_sizes = trees.block_sizes()
        price = None
        if self.cost_model is not None and trees.num_mask_tokens > 0:
            has_block = trees.num_nodes > 0
            requests = int(has_block.sum())
            price = self.cost_model.row_price(int(block_sizes.sum()), requests,
                                              requests + int(accepted[has_block].sum()))
        for band in np.flatnonzero(tally.present):
            if tally.drafted[band]:
                self.calibration.acceptance[band].add(tally.predicted[band],
                                                      tally.accepted[band])
            if price is not None:
                self.calibration.mask[band].observe(
                    int(tally.probed[band]), int(tally.esp_accepted[band]),
                    int(tally.esp_drafted[band]), price)
        self.stats.blocks(block_sizes, accepted, trees.num_nodes,
                          tally.drafted_by_source, tally.accepted_by_source)

    def observe_step(self, rows: int, seconds: float, requests: int) -> None:
        """One decode step's measured time (``rows`` in its forward, of
        ``requests`` requests), for the cost model."""
        if self.cost_model is not None:
            self.cost_model.observe(rows, seconds, requests)
        self.stats.step(rows, self)

    def _isolate_failure(self, req_ids, slots, active) -> None:
        """A proposal error must not take the engine down: find the
        request(s) it comes from by proposing for each alone, and decode
        those without a block from now on (plain decoding, lossless)."""
        failing = []
        for index in np.flatnonzero(active):
            one = np.zeros_like(active)
            one[index] = True
            try:
                self._propose(req_ids, slots, one)
            except Exception:
                failing.append(req_ids[index])
                self.no_block[slots[index]] = True
                self.pending_drafts[slots[index]] = None
                active[index] = False
                self.containment.failed("the proposal", [req_ids[index]])
        if not failing:
            # The batch failed where each request alone does not: their
            # blocks, proposed one by one, stand.
            self.containment.failed("the batched proposal", [])

    def stop_blocks(self, req_ids) -> None:
        """These requests decode without blocks from now on (plain
        decoding, lossless): ESP code failed for them."""
        for req_id in req_ids:
            slot = self.slot_of.get(req_id)
            if slot is not None:
                self.no_block[slot] = True
                self.pending_drafts[slot] = None
                self.has_candidates[slot] = False

    def _update_mask_embeddings(self, req_ids: list[str], slots: np.ndarray) -> None:
        """Initialise new requests' mask embeddings from their prompts and
        fold every request's new output tokens into its EMA, in one
        embedding call. The state is a function of the token history, so it
        survives preemption: a resumed request folds what it has not yet."""
        config = self.esp_config
        requests = self.runner.requests
        new = np.flatnonzero(~self.initialized[slots])
        pieces: list[list[int]] = []
        prompt_embeds: dict[int, torch.Tensor] = {}
        for i in new:
            request = requests[req_ids[i]]
            if request.prompt_token_ids is None:
                prompt_embeds[int(i)] = request.prompt_embeds
                pieces.append([])
            else:
                pieces.append(list(request.prompt_token_ids))
        folded = self.num_folded[slots]
        outputs = [requests[r].output_token_ids for r in req_ids]
        fold_tokens = [t for out, start in zip(outputs, folded) for t in out[start:]]
        fold_counts = np.fromiter((len(out) for out in outputs), np.int64, len(outputs))
        embeddings = self._embed([t for piece in pieces for t in piece] + fold_tokens)
        prompt_counts = [len(piece) for piece in pieces]
        prompt_part, fold_part = embeddings.split(
            [sum(prompt_counts), len(fold_tokens)])
        for i, prompt in zip(new, prompt_part.split(prompt_counts)):
            if int(i) in prompt_embeds:
                prompt = prompt_embeds[int(i)].to(prompt_part)
            self.mask_embeddings[slots[i]] = self._initial(requests[req_ids[i]], prompt)
            self.initialized[slots[i]] = True
        if fold_tokens:
            owner = np.repeat(np.arange(len(slots)), fold_counts - folded)
            slot_index = torch.from_numpy(slots)
            self.mask_embeddings[slot_index] = ema_update_packed(
                self.mask_embeddings[slot_index], fold_part, owner, config.ema)
        self.num_folded[slots] = fold_counts

    def _initial(self, request, prompt_embeddings: torch.Tensor) -> torch.Tensor:
        mode = self.esp_config.mask_init
        if mode != "sample":
            return initial_mask_embedding(prompt_embeddings, mode)
        if self._table_stats is None:
            self._table_stats = self._embedding_table_stats()
        mu, sigma = self._table_stats
        # Seeded by the prompt, not the request id: vLLM appends a random
        # suffix to every request id, and the draw must be the same on every
        # TP rank and in every run.
        if request.prompt_token_ids is not None:
            prompt_bytes = np.asarray(request.prompt_token_ids, np.int64).tobytes()
        else:
            prompt_bytes = prompt_embeddings.float().cpu().numpy().tobytes()
        generator = torch.Generator().manual_seed(zlib.crc32(prompt_bytes))
        noise = torch.randn(mu.shape, generator=generator)
        return mu + sigma * noise

    def _embedding_table_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``sample``'s Gaussian, fitted to the whole vocabulary's embedding
        table. Under tensor parallelism each rank holds a slice of the table
        (padded to equal sizes): every rank sums its real rows and the sums
        of all ranks are added, so every rank gets the same statistics."""
        embedding = self._embedding_module()
        weight = embedding.weight
        shard = getattr(embedding, "shard_indices", None)
        if shard is None:
            parts = [weight]
        else:
            added = shard.num_org_elements_padded
            parts = [weight[:shard.num_org_elements],
                     weight[added:added + shard.num_added_elements]]
        sums = [embedding_table_sums(part) for part in parts]
        hidden = weight.shape[1]
        # One vector to all-reduce: [row sums (H), sum of squares, rows].
        totals = torch.cat([sum(s[0] for s in sums).cpu(),
                            sum(s[1] for s in sums).cpu().view(1),
                            torch.tensor([float(sum(s[2] for s in sums))],
                                         dtype=torch.float64)])
        from vllm.distributed import get_tp_group

        group = get_tp_group()
        if group.world_size > 1:
            torch.distributed.all_reduce(totals, group=group.cpu_group)
        # The embedding function's scale (Gemma multiplies by sqrt(hidden)):
        # token 0's embedding against its table row, on the rank holding it.
        probe = self._embed([0])[0]
        row = torch.zeros(weight.shape[1], dtype=torch.float64)
        if shard is None or shard.org_vocab_start_index == 0:
            row = weight[0].double().cpu()
        if group.world_size > 1:
            torch.distributed.all_reduce(row, group=group.cpu_group)
        scale = float(probe.norm() / row.norm().clamp(min=1e-12))
        return table_stats_from_sums(totals[:hidden], totals[hidden], int(totals[-1]), scale)

    def _embedding_module(self):
        """The model's input embedding table: vLLM's models expose
        ``embed_input_ids``, not ``get_input_embeddings``; the table is
        ``model.embed_tokens`` in the usual layout, else the first
        vocabulary-parallel embedding that is not the LM head."""
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            ParallelLMHead,
            VocabParallelEmbedding,
        )

        inner = getattr(self.model, "model", None)
        embedding = getattr(inner, "embed_tokens", None)
        if isinstance(embedding, VocabParallelEmbedding):
            return embedding
        for module in self.model.modules():
            if (isinstance(module, VocabParallelEmbedding)
                    and not isinstance(module, ParallelLMHead)):
                return module
        raise RuntimeError("ESP mask_init 'sample': the model has no input "
                           "embedding table that ESP can read")

    def _embed(self, token_ids: list[int]) -> torch.Tensor:
        """The model's own embedding function (scaling included), in fp32.
        Under tensor parallelism this is a collective: every rank calls it
        with the same tokens."""
        hidden = self.mask_embeddings.shape[1]
        if not token_ids:
            return torch.zeros(0, hidden)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.runner.device)
        with torch.inference_mode():
            return self.model.embed_input_ids(ids).float()
