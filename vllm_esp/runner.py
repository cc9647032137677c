# SPDX-License-Identifier: Apache-2.0
"""The ESP model runner: one forward verifies a tree and probes the next one.

A subclass of vLLM's (legacy V1) model runner, installed by the ESP worker.
It overrides a few hooks and leaves the rest of vLLM's step untouched:

``_prepare_inputs``
    Finds the requests whose scheduled drafts are exactly the block ESP
    proposed (truncated, padded or grammar-trimmed blocks are not, and stay
    plain chain rows, which vLLM verifies losslessly). For their blocks, all
    at once, it rewrites the RoPE positions to tree positions (the KV slots,
    already derived from linear positions, stay unique), marks the mask rows
    as embedding rows and writes each request's soft mask embedding there,
    keeps logits for the tree-node rows only, and publishes the blocks for
    the tree-attention backend.
``execute_model``
    Keeps the hidden states and slot mappings for the steps after sampling.
``_sample``
    Scorer adapter. Each tree is reduced to one chain chosen from the raw
    target logits alone (from the root, follow the child whose token has the
    highest logit), and the chains go through vLLM's own ``RejectionSampler``
    on a compact logits tensor. Greedy: this is exact tree verification (the
    argmax, if among the children, has the highest logit among them).
    Sampling: the chain does not depend on the sampler's draws, so one-hot
    rejection sampling stays exactly the target distribution, and
    temperature, top-p/k, penalties, seeds and logprobs work as in vLLM.
    Then it moves the accepted nodes' KV to the linear slots after the root,
    and computes the logits of the masks of each last accepted node, whose
    top candidates seed the next tree (:class:`vllm_esp.proposer.ESPProposer`).
``take_draft_token_ids``
    Tells the scheduler how many of each request's drafts are tree nodes.

Mask rows need a soft embedding, so the runner always feeds the model input
embeddings (vLLM's prompt-embeds input path, switched on inside this runner
only): clients still cannot send prompt embeddings unless the user enabled
them.

Every step's work is batched (no Python per block or node). Only checked on
CPU (vLLM 0.32.0).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import platform
import time

import numpy as np
import torch
from vllm.v1.outputs import SamplerOutput
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from vllm_esp.core.batch import (
    ChainRows,
    TreeBatch,
    chain_rows,
    chain_trees,
    child_score_indices,
    select_chains_flat,
)
from vllm_esp.core.goodput import StepCostModel
from vllm_esp.core.greedy import argmax_rows, greedy_chain_tokens
from vllm_esp.core.proposal import mask_candidates
from vllm_esp.core.tree_walk import verification_forest
from vllm_esp.kernels import cache_root, cpu_fingerprint
from vllm_esp.profiling import scope
from vllm_esp.proposer import ESPDraftTokenIds, ESPProposer
from vllm_esp.sampling import TreeWalkSampler, argmax_decides, greedy_requests, unsupported
from vllm_esp.step import ESPStep

# Under "vllm." so that vLLM's logging configuration (format, level,
# VLLM_LOGGING_LEVEL) applies to ESP's messages too.
logger = logging.getLogger("vllm.esp")

# Token counts the start-up profile times one forward for ('auto' blocks).
PROFILE_TOKENS = (1, 8, 32, 64, 128)
# Bump when what the profile times changes, so cached profiles are redone.
# 2: the LM head over every row is timed too (a verification step computes
# logits for all its rows; without it the prior per-row cost was about half
# of what whole decode steps measured, and the allocation gave too many rows
# at batch 4 and 8: docs/results.md).
PROFILE_VERSION = 2
PROFILE_REPEATS = 3
# A cached profile is re-checked at every start by timing this one point
# again (a fraction of a second), and redone when the cached time is above
# the new one by more than PROFILE_STALE_RATIO: a profile taken while
# something else ran would otherwise keep its too-high prior for as long as
# it is cached (docs/results.md, "A stale step-cost profile").
PROFILE_CHECK_TOKENS = 8
PROFILE_STALE_RATIO = 1.25

# Mask rows whose logits are worth computing in the main logits pass rather
# than in a second one after verification. A second pass re-reads the whole
# lm_head weight, which costs about as much as 2 * (FLOP rate / memory
# bandwidth in bytes) extra rows of one pass: about 8 for fp32 weights on the
# 2-core CPU this was measured on (benchmarks/step_cost.py). So when a step's
# mask rows exceed the one row per block the probe needs by fewer than this,
# all mask rows get logits in the main pass and the probe reads them there.
FUSED_PROBE_EXTRA_ROWS = 8


def parse_profile(text: str) -> list[list[float]] | None:
    """A cached profile's ``[tokens, seconds]`` points, or None if the
    file is not one (then the profile is measured again)."""
    try:
        points = json.loads(text)["points"]
        points = [[float(tokens), float(seconds)] for tokens, seconds in points]
    except (ValueError, KeyError, TypeError):
        return None
    if not points or not all(t >= 1 and s > 0 and math.isfinite(s) for t, s in points):
        return None
    return points


def cached_time_ratio(cached: list[list[float]], check: list[float]) -> float | None:
    """A cached profile's time at the check's token count over the check's
    time, or None if the profile has no such point."""
    tokens, seconds = check
    cached_seconds = dict(cached).get(tokens)
    return None if cached_seconds is None else cached_seconds / seconds


def profile_is_stale(cached: list[list[float]], check: list[float]) -> bool:
    """Whether a cached profile must be redone: its time at the check's
    token count is above the check's by more than ``PROFILE_STALE_RATIO``.

    Only a cached time that is too high counts: other work on the machine
    only ever adds time, so a profile above a fresh measurement was taken
    under load. A check above the cache (this start is the busy one) keeps
    the cache; the online fit corrects the level either way."""
    ratio = cached_time_ratio(cached, check)
    return ratio is not None and ratio > PROFILE_STALE_RATIO


def merged_profile(cached: list[list[float]], fresh: list[list[float]]
                   ) -> list[list[float]]:
    """Per token count, the lower of two profiles' times (load only adds
    time); counts in one profile only are kept as they are."""
    merged = {n: s for n, s in cached}
    for tokens, seconds in fresh:
        merged[tokens] = min(seconds, merged.get(tokens, seconds))
    return [[n, merged[n]] for n in sorted(merged)]


class ESPModelRunnerMixin:
    def _esp_init(self) -> None:
        if not isinstance(getattr(self, "drafter", None), ESPProposer):
            raise RuntimeError("ESP runner needs the ESPProposer drafter")
        if self.uses_mrope or self.supports_mm_inputs:
            raise ValueError(
                "ESP supports text-only models with standard RoPE; this model "
                "(multimodal or M-RoPE) cannot use speculative_config method "
                "'esp'.")
        # Mask rows are fed a soft embedding: the model always takes input
        # embeddings from this runner. This is the runner's own switch; the
        # model config (what clients may send) is left as the user set it.
        self.enable_prompt_embeds = True
        self.esp_config = self.drafter.esp_config
        self.drafter.bind(self)
        self._esp_step: ESPStep | None = None
        self._esp_logit_starts: np.ndarray | None = None
        self._esp_step_started: float | None = None
        self._esp_step_rows = self._esp_step_requests = 0
        self._esp_tensor_parallel = self.parallel_config.tensor_parallel_size > 1
        self._esp_decode_request_steps = self._esp_decode_rows = 0
        self._esp_walk_steps = self._esp_undrafted_steps = self._esp_argmax_steps = 0
        self.esp_tree_sampler = TreeWalkSampler(self.sampler)
        self._esp_chain_reasons: set[str] = set()

    # ---------------------------------------------------------------- states
    def _update_states(self, scheduler_output):
        try:
            self.drafter.drop(scheduler_output.finished_req_ids)
        except Exception:
            # Finished requests only: their slots may stay taken.
            self.drafter.containment.failed("forgetting finished requests",
                                            scheduler_output.finished_req_ids)
        return super()._update_states(scheduler_output)

    # ---------------------------------------------------------------- inputs
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        logits_indices, spec_metadata, max_sampled = super()._prepare_inputs(
            scheduler_output, num_scheduled_tokens)
        self._esp_step = None
        self._esp_publish_step(None)
        if spec_metadata is None:
            return logits_indices, spec_metadata, max_sampled
        with scope("esp: prepare inputs"):
            step = None
            try:
                step = self._esp_begin_step(scheduler_output, num_scheduled_tokens)
                if step is None:
                    return logits_indices, spec_metadata, max_sampled
                esp_logits_indices = self._esp_logits_indices(spec_metadata, step)
                self._esp_write_inputs(step)
            except Exception:
                # vLLM verifies the scheduled drafts as chains, causally:
                # lossless whatever they hold.
                if step is not None:
                    self._esp_restore_chain_inputs(step)
                self._esp_contain("the block inputs",
                                  list(scheduler_output.scheduled_spec_decode_tokens))
                return logits_indices, spec_metadata, max_sampled
            self._esp_step = step
            self._esp_publish_step(step)
        return esp_logits_indices, spec_metadata, max_sampled

    def _preprocess(self, scheduler_output, num_input_tokens, intermediate_tensors=None):
        # The input-embeddings path costs a gather and a scatter of every
        # row's embedding per step; only mask rows and requests whose
        # prompt came as embeddings need it. Any other step takes vLLM's
        # token-id path, as without ESP (the same embedding function).
        step = self._esp_step
        if ((step is not None and step.has_mask_rows)
                or self.input_batch.req_prompt_embeds):
            return super()._preprocess(scheduler_output, num_input_tokens,
                                       intermediate_tensors)
        self.enable_prompt_embeds = False
        try:
            return super()._preprocess(scheduler_output, num_input_tokens,
                                       intermediate_tensors)
        finally:
            self.enable_prompt_embeds = True

    def _esp_contain(self, phase: str, req_ids, error: BaseException | None = None) -> None:
        """From an ``except`` block (or with its ``error``): ``req_ids``
        decode without blocks from now on, and the failure is logged
        (``vllm_esp.containment``)."""
        self.drafter.stop_blocks(req_ids)
        self.drafter.containment.failed(phase, req_ids, error)

    def _esp_publish_step(self, step: ESPStep | None) -> None:
        """Give this step's blocks to the runner's own attention metadata
        builders (``vllm_esp.attention``), which build the tree-attention
        metadata from them; None takes them back."""
        for groups in self.attn_groups:
            for group in groups:
                for builder in group.metadata_builders:
                    if hasattr(builder, "esp_step"):
                        builder.esp_step = step

    def _esp_begin_step(self, scheduler_output, num_scheduled_tokens) -> ESPStep | None:
        drafter = self.drafter
        batch_indices, slots = drafter.matching_blocks(
            self.input_batch.req_ids, scheduler_output.scheduled_spec_decode_tokens)
        if batch_indices.size == 0:
            return None
        pending = drafter.pending
        trees = TreeBatch(pending.parents[slots], pending.tokens[slots],
                          pending.masked[slots], pending.num_nodes[slots],
                          pending.num_mask_tokens, pending.reach[slots],
                          pending.sources[slots])
        # The scheduler may cut a block short of its rows (token budget,
        # max_model_len); the runner only sees whole blocks here, because the
        # drafts matched, but checks the row count all the same.
        whole = num_scheduled_tokens[batch_indices] == trees.block_sizes()
        if not whole.all():
            batch_indices, slots = batch_indices[whole], slots[whole]
            trees = TreeBatch(trees.parents[whole], trees.tokens[whole],
                              trees.masked[whole], trees.num_nodes[whole],
                              trees.num_mask_tokens, trees.reach[whole],
                              trees.sources[whole])
            if batch_indices.size == 0:
                return None
        step = ESPStep.build(
            batch_indices, slots, trees,
            row_starts=self.query_start_loc.np[batch_indices].astype(np.int64),
            root_positions=self.input_batch.num_computed_tokens_cpu[
                batch_indices].astype(np.int64))
        return step

    def _esp_write_inputs(self, step: ESPStep) -> None:
        """The blocks' rows get their tree positions, and mask rows the
        request's soft embedding instead of a token's."""
        rows, positions = step.rows()
        self.positions[torch.from_numpy(rows)] = torch.from_numpy(positions).to(
            self.positions.dtype)
        mask_rows, mask_blocks = step.mask_rows()
        if mask_rows.size:
            self.is_token_ids.np[mask_rows] = False
            mask_rows_t = torch.from_numpy(mask_rows)
            self.is_token_ids.gpu[mask_rows_t] = False
            self.inputs_embeds.gpu[mask_rows_t] = self.drafter.mask_embeddings[
                torch.from_numpy(step.slots[mask_blocks])].to(self.inputs_embeds.gpu)

    def _esp_restore_chain_inputs(self, step: ESPStep) -> None:
        """Undo ``_esp_write_inputs``: every row of the blocks back at its
        chain position (vLLM's), and a token row."""
        rows, _ = step.rows()
        block = np.repeat(np.arange(step.num_blocks), step.layouts.num_rows.astype(np.int64))
        positions = step.root_positions[block] + (rows - step.row_starts[block])
        rows_t = torch.from_numpy(rows)
        self.positions[rows_t] = torch.from_numpy(positions).to(self.positions.dtype)
        self.is_token_ids.np[rows] = True
        self.is_token_ids.gpu[rows_t] = True

    def _esp_logits_indices(self, spec_metadata, step: ESPStep) -> torch.Tensor:
        """Logits rows per request: tree nodes for ESP blocks (masks are
        computed later, only for the accepted node), vLLM's rows otherwise.

        vLLM's grammar bitmask addresses logits rows by draft counts
        (``1 + len(drafts)`` rows per request), so a step that holds a
        structured-output request keeps vLLM's rows (the whole block) for
        every request; tree-node rows come first in a block either way.
        """
        num_sampled = np.asarray(spec_metadata.num_draft_tokens, np.int64) + 1
        starts = np.cumsum(num_sampled) - num_sampled
        if self.drafter.structured_in_batch(self.input_batch.req_ids):
            self._esp_logit_starts = starts
            step.fused_probe = True  # vLLM's rows cover whole blocks
            return spec_metadata.logits_indices
        counts = num_sampled.copy()
        mask_rows = step.layouts.num_rows.astype(np.int64) - step.trees.num_nodes
        extra = int(mask_rows.sum()) - step.num_blocks * self.drafter.masks_per_node
        step.fused_probe = bool(mask_rows.any()) and extra < FUSED_PROBE_EXTRA_ROWS
        counts[step.batch_indices] = (step.layouts.num_rows if step.fused_probe
                                      else step.trees.num_nodes)
        new_starts = np.cumsum(counts) - counts
        # Flat position of every kept logits row: vLLM's rows keep their
        # order; an ESP block keeps its first T rows (its nodes).
        request = np.repeat(np.arange(counts.shape[0]), counts)
        within = np.arange(request.shape[0]) - new_starts[request]
        vllm_rows = spec_metadata.logits_indices
        self._esp_logit_starts = new_starts
        return vllm_rows[torch.from_numpy(starts[request] + within)]

    # ------------------------------------------------------- step cost model
    def esp_profile_step_cost(self) -> None:
        """The 'auto' cost model's prior: one forward's time at a few token
        counts, measured once per model, dtype and machine and cached under
        ``~/.cache/vllm-esp/step-cost``; at each start one point is timed
        again and the profile redone if the cache was taken under load
        (``profile_is_stale``). The online fit corrects it from the engine's
        own step times (single-rank engines; under tensor parallelism every
        rank must size blocks identically, so the ranks average the profile
        and keep it, unchecked)."""
        if not self.esp_config.auto:
            return
        key = json.dumps([str(self.model_config.model), str(self.model_config.dtype),
                          platform.machine(), cpu_fingerprint(), os.cpu_count(),
                          torch.get_num_threads(), self.parallel_config.tensor_parallel_size,
                          PROFILE_TOKENS, PROFILE_VERSION])
        cache = (cache_root() / "step-cost"
                 / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json"))
        points = None
        if cache.is_file():
            try:
                points = parse_profile(cache.read_text())
            except OSError:
                points = None
        started = time.perf_counter()
        measured = points is None
        if measured:
            points = self._esp_time_forwards()
        elif not self._esp_tensor_parallel:
            check = self._esp_time_forwards([PROFILE_CHECK_TOKENS])
            if check and profile_is_stale(points, check[0]):
                logger.info("ESP: the cached step-cost profile takes %.2fx this start's "
                            "time at %d tokens: profiling again",
                            cached_time_ratio(points, check[0]), PROFILE_CHECK_TOKENS)
                points = merged_profile(points, self._esp_time_forwards())
                measured = True
        if measured:
            try:
                cache.parent.mkdir(parents=True, exist_ok=True)
                cache.write_text(json.dumps({"key": key, "points": points}))
            except OSError:
                pass
            logger.info("ESP: profiled the step cost in %.1f s", time.perf_counter() - started)
        rows, seconds = np.asarray(points, np.float64).T
        self.drafter.cost_model = model = StepCostModel.fit(rows, seconds)
        logger.info("ESP auto blocks: step cost prior %.2f ms + %.3f ms per row (%s)",
                    model.fixed * 1e3, model.per_row * 1e3, cache)

    def _esp_forward_with_logits(self, num_tokens: int) -> None:
        # Every row of a decode step gets logits (tree nodes and roots; mask
        # rows mostly too), so a row's cost includes the LM head.
        hidden_states, _ = self._dummy_run(num_tokens, force_attention=True)
        self.model.compute_logits(hidden_states)

    def _esp_time_forwards(self, token_counts=PROFILE_TOKENS) -> list[list[float]]:
        limit = min(self.max_num_tokens, self.scheduler_config.max_num_batched_tokens)
        points = []
        for num_tokens in [n for n in token_counts if n <= limit]:
            self._esp_forward_with_logits(num_tokens)
            times = []
            for _ in range(PROFILE_REPEATS):
                started = time.perf_counter()
                self._esp_forward_with_logits(num_tokens)
                times.append(time.perf_counter() - started)
            points.append([float(num_tokens), float(np.median(times))])
        if self._esp_tensor_parallel:
            from vllm.distributed import get_tp_group

            values = torch.tensor([p[1] for p in points], dtype=torch.float64)
            group = get_tp_group()
            torch.distributed.all_reduce(values, group=group.cpu_group)
            values /= group.world_size
            points = [[p[0], float(v)] for p, v in zip(points, values)]
        return points

    def _input_fits_in_drafter(self, common_attn_metadata) -> bool:
        """vLLM stops drafting for the whole batch once the longest request
        plus ``num_speculative_tokens`` passes ``max_model_len``. ESP sizes
        each request's block to what fits (``ESPProposer``), so the batch
        keeps speculating."""
        return common_attn_metadata is not None

    # --------------------------------------------------------------- forward
    def esp_row_counts(self) -> dict[str, int]:
        return {"decode_request_steps": self._esp_decode_request_steps,
                "rows": self._esp_decode_rows, "walk_steps": self._esp_walk_steps,
                "steps_without_drafts": self._esp_undrafted_steps,
                "argmax_steps": self._esp_argmax_steps}

    def _count_decode_rows(self, scheduler_output) -> int:
        """Add this step's decoding requests and their verification rows to
        ``esp_row_counts``. Returns the step's rows when every scheduled
        request decodes (no prefill chunk), else 0."""
        scheduled = scheduler_output.num_scheduled_tokens
        drafts = scheduler_output.scheduled_spec_decode_tokens
        total = scheduler_output.total_num_scheduled_tokens
        if total and total == len(scheduled) + sum(len(d) for d in drafts.values()):
            self._esp_decode_request_steps += len(scheduled)
            self._esp_decode_rows += total
            return total
        # A request decodes when it verifies drafts or schedules one token
        # (a one-token prefill chunk is counted too: rare).
        for req_id, tokens in scheduled.items():
            if tokens == 1 or req_id in drafts:
                self._esp_decode_request_steps += 1
                self._esp_decode_rows += tokens
        return 0

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        self._esp_step_started = None
        rows = self._count_decode_rows(scheduler_output)
        if (rows and self.drafter.auto and not self._esp_tensor_parallel
                and not scheduler_output.scheduled_new_reqs):
            # Only steps of decoding requests (no prefill chunk) teach the
            # cost model: their rows are blocks and roots.
            self._esp_step_started = time.perf_counter()
            self._esp_step_rows = rows
            self._esp_step_requests = len(scheduler_output.num_scheduled_tokens)
        try:
            output = super().execute_model(scheduler_output, intermediate_tensors)
        finally:
            self._esp_publish_step(None)
        step = self._esp_step
        if step is not None and self.execute_model_state is not None:
            step.hidden_states = self.execute_model_state.hidden_states
            step.slot_mappings = self.execute_model_state.slot_mappings
        return output

    def sample_tokens(self, grammar_output):
        output = super().sample_tokens(grammar_output)
        started, self._esp_step_started = self._esp_step_started, None
        if started is not None:
            self.drafter.observe_step(self._esp_step_rows, time.perf_counter() - started,
                                      self._esp_step_requests)
        return output

    # ---------------------------------------------------------------- verify
    def _sample(self, logits, spec_decode_metadata):
        step = self._esp_step
        if step is None:
            if spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0:
                self._esp_undrafted_steps += 1
                return self._esp_sample_without_drafts(logits)
            return super()._sample(logits, spec_decode_metadata)
        self._esp_step = None
        if step.failure is not None:  # plain causal attention ran (vllm_esp.attention)
            self._esp_contain("the tree-attention metadata", self._esp_req_ids(step),
                              step.failure)
            return self._esp_roots_only(step, logits)
        try:
            return self._esp_verify(step, logits, spec_decode_metadata)
        except Exception:
            self._esp_contain("the verification", self._esp_req_ids(step))
            return self._esp_roots_only(step, logits)

    def _esp_req_ids(self, step: ESPStep) -> list[str]:
        req_ids = self.input_batch.req_ids
        return [req_ids[i] for i in step.batch_indices]

    def _esp_roots_only(self, step: ESPStep, logits):
        """Every request of the step emits one token, drawn from its first
        logits row (for a block, its root's: the one row whose logits do not
        depend on its tree), and accepts no draft: lossless after any
        failure in the step's trees. Their KV beyond the root is never
        committed."""
        rows = torch.from_numpy(self._esp_logit_starts[:self.input_batch.num_reqs])
        return self._esp_sample_without_drafts(logits[rows.to(logits.device)])

    def _esp_verify(self, step: ESPStep, logits, spec_decode_metadata):
        sampling_metadata = self.input_batch.sampling_metadata
        if self._esp_walks(step, sampling_metadata):
            return self._esp_walk(step, logits, spec_decode_metadata, sampling_metadata)
        with scope("esp: verify"):
            chains, lengths = self._esp_select_chains(step, logits)
            # The sampler copies out only the rows the metadata names, so
            # without logprobs it reads the block's rows in place: one copy
            # of rows x vocab floats less per step, which matters with a
            # large vocabulary such as Gemma-3's (docs/results.md). vLLM's
            # logprobs code wants each request's rows consecutive, so with
            # logprobs compact them.
            in_place = sampling_metadata.max_num_logprobs is None
            layout = chain_rows(
                step.batch_indices, self._esp_logit_starts,
                np.asarray(spec_decode_metadata.num_draft_tokens, np.int64),
                spec_decode_metadata.draft_token_ids.cpu().numpy(), chains, lengths,
                step.trees.tokens, in_place)
        if self._esp_argmax_decides(sampling_metadata):
            with scope("esp: argmax verification"):
                self._esp_argmax_steps += 1
                # Over every logits row, off-chain nodes included: an argmax
                # costs about half a gather of the same row.
                tokens = greedy_chain_tokens(argmax_rows(logits)[layout.rows],
                                             layout.draft_token_ids, layout.num_draft_tokens)
                sampler_output = SamplerOutput(
                    sampled_token_ids=torch.from_numpy(tokens).to(logits.device),
                    logprobs_tensors=None)
        else:
            sampler_output = self._esp_rejection_sample(layout, in_place, logits,
                                                        sampling_metadata)
        with scope("esp: after verification"):
            self._esp_after_verification(step, chains, sampler_output, logits)
        return sampler_output

    def _esp_rejection_sample(self, layout, in_place: bool, logits, sampling_metadata):
        """vLLM's ``RejectionSampler`` on the step's chains."""
        with scope("esp: verify"):
            verified_logits = (logits if in_place
                               else logits[torch.from_numpy(layout.rows).to(logits.device)])
            chain_metadata = chain_spec_decode_metadata(layout, logits.device)
            if sampling_metadata.spec_token_ids is not None:
                # Penalties and bad words must see the chain being verified,
                # not the block's slots.
                ends = layout.cu_num_draft_tokens
                flat = layout.draft_token_ids.tolist()
                sampling_metadata = dataclasses.replace(
                    sampling_metadata,
                    spec_token_ids=[flat[e - n:e] for e, n in
                                    zip(ends.tolist(), layout.num_draft_tokens.tolist())])
        with scope("esp: sampler"):
            return self.rejection_sampler(chain_metadata, None, verified_logits,
                                          sampling_metadata)

    def _esp_sample_without_drafts(self, logits):
        """A step in which no request has drafts, sampled as vLLM samples
        without speculation. With a speculative config vLLM sends every
        step through its RejectionSampler, drafts or not, and on CPU that
        costs a full batch x vocabulary exponential draw (and its
        reciprocal) whenever a request samples, which made such a step
        dearer than plain vLLM's (docs/design.md, "One step"). With
        no drafts its output is the Sampler's anyway (the bonus token), so
        this is the same tokens and logprobs without that work."""
        # Not the argmax verification (core.greedy) here: cheaper steps
        # without drafts made "auto" buy more rows at b32, which cost more
        # than they earned there (docs/results.md, "Large batches").
        self.input_batch.update_async_output_token_ids()
        return self.sampler(logits=logits, sampling_metadata=self.input_batch.sampling_metadata)

    def _esp_argmax_decides(self, sampling_metadata) -> bool:
        """Whether the step's tokens are its rows' argmax (``argmax_decides``;
        not in vLLM's synthetic-acceptance test mode). Then ESP takes the
        argmax itself: vLLM's samplers copy the rows and use torch's argmax,
        which CPUs run unvectorised (``core.greedy``)."""
        return (not getattr(self.rejection_sampler, "synthetic_mode", False)
                and argmax_decides(sampling_metadata))

    def _esp_walks(self, step: ESPStep, sampling_metadata) -> bool:
        """Whether this step is verified by the tree walk: some block's
        request samples (greedy trees reduce to a chain exactly, and vLLM's
        sampler verifies those as before), and the sampling parameters are
        ones the walk honours (``vllm_esp.sampling.unsupported``)."""
        if sampling_metadata.all_greedy or not self.esp_config.tree_sampling:
            return False
        greedy = greedy_requests(sampling_metadata, self.input_batch.num_reqs)
        if greedy[step.batch_indices].all():
            return False
        reason = unsupported(sampling_metadata)
        if reason is not None:
            if reason not in self._esp_chain_reasons:
                self._esp_chain_reasons.add(reason)
                logger.info("ESP: sampled trees are verified as chains in steps with %s "
                            "(the tree walk does not honour it)", reason)
            return False
        return True

    def _esp_walk(self, step: ESPStep, logits, spec_decode_metadata, sampling_metadata):
        """Verify every request of the step by walking its tree
        (``core.tree_walk``): blocks their trees, other requests the chain
        of their drafts or their root alone."""
        self._esp_walk_steps += 1
        with scope("esp: tree walk"):
            forest = verification_forest(
                self._esp_logit_starts, step.batch_indices, step.trees.parents,
                step.trees.tokens, step.trees.num_nodes,
                np.asarray(spec_decode_metadata.num_draft_tokens, np.int64),
                spec_decode_metadata.draft_token_ids.cpu().numpy())
            sampler_output, paths, _ = self.esp_tree_sampler(logits, forest,
                                                             sampling_metadata)
            # Each block's accepted path as node indices of its tree.
            width = step.trees.parents.shape[1]
            chains = np.zeros((step.num_blocks, width), np.int64)
            depth = min(width, paths.shape[1])
            chains[:, :depth] = (paths[step.batch_indices, :depth]
                                 - forest.node_starts[step.batch_indices, None])
        with scope("esp: after verification"):
            self._esp_after_verification(step, chains, sampler_output, logits)
        return sampler_output

    def _esp_select_chains(self, step: ESPStep, logits: torch.Tensor):
        """Chain reduction of every block: each node's score is its token's
        logit at its parent's row."""
        chains = chain_trees(step.trees)
        if chains is not None:
            return chains
        rows, columns = child_score_indices(
            step.trees, self._esp_logit_starts[step.batch_indices])
        scores = logits[torch.from_numpy(rows).to(logits.device),
                        torch.from_numpy(columns).to(logits.device)]
        return select_chains_flat(step.trees, scores.float().cpu().numpy())

    def _esp_after_verification(self, step: ESPStep, chains, sampler_output,
                                logits: torch.Tensor) -> None:
        num_emitted = (sampler_output.sampled_token_ids >= 0).sum(dim=1).cpu().numpy()
        accepted = num_emitted[step.batch_indices] - 1  # drafts accepted per block
        try:
            depth = np.arange(chains.shape[1])
            # Node at depth d of the accepted path moves to the d-th slot
            # after the root (nothing to do where it already is).
            moves = (depth[None, :] <= accepted[:, None]) & (chains != depth[None, :])
            block, moved_depth = np.nonzero(moves)
            with scope("esp: relocate kv"):
                self._relocate_kv(step, step.row_starts[block] + chains[block, moved_depth],
                                  step.row_starts[block] + moved_depth)
        except Exception:
            # The accepted nodes' K/V may not be where the next steps read
            # it: keep only each block's first token (drawn at the root,
            # whose K/V is in place) and drop the rest as rejected.
            sampler_output.sampled_token_ids[torch.from_numpy(step.batch_indices), 1:] = -1
            self._esp_contain("the KV relocation", self._esp_req_ids(step))
            return
        try:
            self._esp_probe_masks(step, chains, accepted, logits)
        except Exception:
            # No candidates from this step's masks: the next trees come
            # from lookup alone, or none.
            self._esp_contain("the mask probe", self._esp_req_ids(step))

    def _esp_probe_masks(self, step: ESPStep, chains, accepted, logits) -> None:
        last_node = chains[np.arange(step.num_blocks), accepted]
        k = self.drafter.masks_per_node
        # Blocks whose last accepted node carried masks: their logits give
        # the request's next ESP candidates.
        probe_rows = step.layouts.mask_rows[np.arange(step.num_blocks), last_node, :k]
        probed = probe_rows[:, 0] >= 0 if k else np.zeros(step.num_blocks, np.bool_)
        self.drafter.observe_verification(step.trees, chains, accepted, probed, step.slots)
        if not probed.any():
            return
        with scope("esp: mask probe"):
            if step.fused_probe:  # computed in the main pass, block rows in order
                starts = self._esp_logit_starts[step.batch_indices[probed]]
                rows = (starts[:, None] + probe_rows[probed]).reshape(-1)
                mask_logits = logits[torch.from_numpy(rows)]
            else:
                rows = (step.row_starts[probed, None] + probe_rows[probed]).reshape(-1)
                mask_logits = self.model.compute_logits(
                    step.hidden_states[torch.from_numpy(rows)])
            tokens, log_probs = mask_candidates(
                mask_logits.view(-1, k, mask_logits.shape[-1]),
                self.drafter.candidate_width)
            self.drafter.set_candidates(step.slots[probed], tokens, log_probs)

    def _relocate_kv(self, step: ESPStep, source_rows: np.ndarray,
                     destination_rows: np.ndarray) -> None:
        """Copy accepted nodes' K/V from their block rows' slots to the
        slots right after the root, in every layer's cache. Nodes were
        computed at their final positions, so a copy is exact. Moves are in
        increasing destination order per block, so no source is overwritten
        before it is read (a source row is never before its destination)."""
        if source_rows.size == 0:
            return
        source_rows = torch.from_numpy(source_rows)
        destination_rows = torch.from_numpy(destination_rows)
        layers = self.compilation_config.static_forward_context
        # Layers of one KV-cache group share one slot mapping.
        groups: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        for layer_name, slot_mapping in step.slot_mappings.items():
            entry = groups.setdefault(id(slot_mapping), (slot_mapping, []))
            entry[1].append(layers[layer_name].kv_cache)
        for slot_mapping, caches in groups.values():
            torch.ops.vllm_esp.copy_slots(caches, slot_mapping[source_rows].long(),
                                          slot_mapping[destination_rows].long())

    # ------------------------------------------------------------- scheduler
    def take_draft_token_ids(self):
        drafts = super().take_draft_token_ids()
        if drafts is None:
            return None
        try:
            nodes = self.drafter.tree_node_counts(drafts.req_ids, drafts.draft_token_ids)
        except Exception:
            # vLLM's metrics then count every draft slot of these blocks.
            self.drafter.containment.failed("the tree node counts", drafts.req_ids)
            nodes = None
        return ESPDraftTokenIds(drafts.req_ids, drafts.draft_token_ids, nodes)


def chain_spec_decode_metadata(layout: ChainRows, device: torch.device
                               ) -> SpecDecodeMetadata:
    """vLLM's chain metadata for the step's chains (``core.batch.chain_rows``)."""

    def to_device(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(device)

    return SpecDecodeMetadata(
        draft_token_ids=to_device(layout.draft_token_ids),
        num_draft_tokens=layout.num_draft_tokens.tolist(),
        cu_num_draft_tokens=to_device(layout.cu_num_draft_tokens),
        cu_num_sampled_tokens=to_device(layout.cu_num_sampled_tokens),
        target_logits_indices=to_device(layout.target_logits_indices),
        bonus_logits_indices=to_device(layout.bonus_logits_indices),
        logits_indices=to_device(layout.logits_indices),
    )


class ESPCPUModelRunner(ESPModelRunnerMixin, CPUModelRunner):
    def __init__(self, vllm_config, device) -> None:
        super().__init__(vllm_config, device)
        self._esp_init()
