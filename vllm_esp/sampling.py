# SPDX-License-Identifier: Apache-2.0
"""ESP's verification of a step with sampled requests: the tree walk of
``core.tree_walk``, with each draw made as vLLM's own sampler makes it.

A draw at a node takes the node's logits row and applies, in vLLM's
functions, what the request asks for: allowed token ids, bad words and
presence/frequency/repetition penalties over the request's output *and the
path to the node*, stop tokens masked before ``min_tokens``; then greedy
requests take the argmax, and sampled ones divide by their temperature,
apply top-k/top-p and draw by Gumbel-max (vLLM's CPU sampler's own fused
kernel), seeded requests from their own generator. Logprobs are gathered
as vLLM's rejection sampler gathers them (raw or processed, per
``logprobs_mode``), at the row each token was drawn from.

Each level of the walk processes only the rows of the requests still
walking: one row per emitted token, whatever the size of the trees.

What the walk does not honour (:meth:`TreeWalkSampler.unsupported`): a
step where one of these applies is verified as chains by vLLM's
``RejectionSampler``, as every step was before (lossless too, but a tree's
siblings are never accepted when sampling).

Only checked on CPU (vLLM 0.32.0).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from vllm.model_executor.layers.utils import apply_penalties
from vllm.utils.torch_utils import make_tensor_with_pad
from vllm.v1.outputs import LogprobsTensors, SamplerOutput
from vllm.v1.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.ops.bad_words import apply_bad_words
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
from vllm.v1.sample.sampler import Sampler

from vllm_esp.core.greedy import argmax_rows
from vllm_esp.core.tree_walk import VerificationForest, walk

# vLLM's Sampler treats a temperature below this as greedy.
SAMPLING_EPS = 1e-5
# Logits processors whose effect the walk applies itself (min_tokens), or
# which vLLM refuses with speculative decoding (logit_bias, min_p).
BUILTIN_PROCESSORS = (MinTokensLogitsProcessor, LogitBiasLogitsProcessor,
                      MinPLogitsProcessor)


def greedy_requests(sampling_metadata: SamplingMetadata, num_requests: int) -> np.ndarray:
    """Which requests of the batch decode greedily (as vLLM's Sampler
    decides it)."""
    if sampling_metadata.all_greedy:
        return np.ones(num_requests, np.bool_)
    if sampling_metadata.all_random:
        return np.zeros(num_requests, np.bool_)
    temperature = sampling_metadata.temperature[:num_requests].cpu().numpy()
    return temperature < SAMPLING_EPS


def argmax_decides(sampling_metadata: SamplingMetadata) -> bool:
    """Whether every request's next token is the argmax of its raw logits
    row and nobody needs the logits: every request greedy, no logprobs, and
    nothing that moves an argmax (penalties, bad words, allowed token ids,
    a thinking budget, an active min_tokens or logit bias, any other logits
    processor). vLLM's ``Sampler`` and ``RejectionSampler`` then reduce to
    the argmax (``core.greedy``)."""
    metadata = sampling_metadata
    if (not metadata.all_greedy or metadata.max_num_logprobs is not None
            or getattr(metadata, "logprob_token_ids", None) or not metadata.no_penalties
            or metadata.bad_words_token_ids
            or metadata.allowed_token_ids_mask is not None):
        return False
    holder = getattr(metadata, "thinking_budget_state_holder", None)
    if holder is not None and holder.has_tracked_requests():
        return False
    for processor in metadata.logitsprocs.non_argmax_invariant:
        # The builtin processors' per-request state; where a vLLM release
        # names it otherwise, the step goes to vLLM's samplers.
        if isinstance(processor, MinTokensLogitsProcessor):
            requests = getattr(processor, "min_toks", None)
        elif isinstance(processor, LogitBiasLogitsProcessor):
            requests = getattr(processor, "biases", None)
        else:
            return False
        if requests is None or requests:
            return False
    return True


def unsupported(sampling_metadata: SamplingMetadata) -> str | None:
    """Why the walk cannot verify a step with these sampling parameters
    (then its chains go to vLLM's rejection sampler), or None."""
    if sampling_metadata.max_num_logprobs == -1:
        return "full-vocabulary logprobs"
    if sampling_metadata.logprob_token_ids:
        return "logprobs of given token ids"
    holder = sampling_metadata.thinking_budget_state_holder
    if holder is not None and holder.has_tracked_requests():
        return "a thinking budget"
    for processor in sampling_metadata.logitsprocs.all:
        if not isinstance(processor, BUILTIN_PROCESSORS):
            return f"the custom logits processor {type(processor).__name__}"
        if isinstance(processor, MinTokensLogitsProcessor) and any(
                structured for *_, structured in processor.min_toks.values()):
            # vLLM restores a grammar's stop tokens around min_tokens.
            return "min_tokens with structured output"
    return None


@dataclass
class _StepState:
    """What the draws of one step share."""

    logits: torch.Tensor
    forest: VerificationForest
    metadata: SamplingMetadata
    greedy: np.ndarray                      # [R] bool
    seeded: np.ndarray                      # [R] bool
    emitted: torch.Tensor                   # [R, D + 1] int64, filled level by level
    output_tokens: torch.Tensor | None      # [R, L] padded with the vocabulary size
    min_tokens: dict                        # request -> (min_tokens, output, stop ids)
    logprob_rows: list                      # per level: (flat positions, LogprobsTensors)


class TreeWalkSampler:
    """Verifies a step's forest by walking it (``core.tree_walk.walk``),
    drawing at each node as vLLM's ``Sampler`` would."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self.logprobs_mode = sampler.logprobs_mode
        # vLLM's CPU sampler draws with this fused Gumbel-max kernel.
        self.fused_gumbel = (not getattr(sampler, "use_fp64_gumbel", False)
                             and hasattr(torch.ops._C, "fused_gumbel_argmax"))

    def __call__(self, logits: torch.Tensor, forest: VerificationForest,
                 sampling_metadata: SamplingMetadata
                 ) -> tuple[SamplerOutput, np.ndarray, np.ndarray]:
        """The step's output (tokens ``[R, longest]``, -1 padded, and
        logprobs if asked for), each request's path (``walk``'s ``paths``)
        and the tokens each emitted."""
        num_requests = forest.num_requests
        metadata = sampling_metadata
        width = forest.max_depth + 1
        output_tokens = None
        if not metadata.no_penalties:
            output_tokens = make_tensor_with_pad(
                metadata.output_token_ids[:num_requests], pad=logits.shape[-1],
                device="cpu", dtype=torch.int64).to(logits.device)
        min_tokens = {}
        for processor in metadata.logitsprocs.non_argmax_invariant:
            if isinstance(processor, MinTokensLogitsProcessor):
                min_tokens = {index: (minimum, output, list(stop_ids))
                              for index, (minimum, output, stop_ids, _)
                              in processor.min_toks.items()}
        seeded = np.zeros(num_requests, np.bool_)
        seeded[[i for i in metadata.generators if i < num_requests]] = True
        state = _StepState(
            logits, forest, metadata, greedy_requests(metadata, num_requests), seeded,
            torch.full((num_requests, width), -1, dtype=torch.int64),
            output_tokens, min_tokens, [])
        emitted, paths, lengths = walk(
            forest, lambda nodes, requests, level: self._draw(state, nodes, requests, level))
        longest = int(lengths.max()) if num_requests else 1
        sampled = torch.from_numpy(emitted[:, :longest].astype(np.int32)).to(logits.device)
        logprobs = None
        if metadata.max_num_logprobs is not None:
            logprobs = self._assemble_logprobs(state, num_requests, width, longest)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs), paths, lengths

    # ------------------------------------------------------------- one level
    def _draw(self, state: _StepState, nodes: np.ndarray, requests: np.ndarray,
              level: int) -> np.ndarray:
        metadata = state.metadata
        device = state.logits.device
        rows = state.logits.index_select(
            0, torch.from_numpy(state.forest.node_rows[nodes]).to(device)).to(torch.float32)
        requests_t = torch.from_numpy(requests).to(device)
        wants_logprobs = metadata.max_num_logprobs is not None
        raw_logprobs = None
        if wants_logprobs and self.logprobs_mode == "raw_logprobs":
            raw_logprobs = self.sampler.compute_logprobs(rows)
        elif wants_logprobs and self.logprobs_mode == "raw_logits":
            raw_logprobs = rows.clone()
        self._constrain(state, rows, requests, requests_t, level)

        tokens = torch.empty(requests.shape[0], dtype=torch.int64, device=device)
        processed = rows if self.logprobs_mode in ("processed_logits",
                                                   "processed_logprobs") else None
        greedy = state.greedy[requests]
        if greedy.any():
            index = torch.from_numpy(np.flatnonzero(greedy)).to(device)
            tokens[index] = torch.from_numpy(argmax_rows(rows.index_select(0, index))
                                             ).to(device)
        if not greedy.all():
            random = np.flatnonzero(~greedy)
            index = torch.from_numpy(random).to(device)
            sampled_rows = rows if random.shape[0] == rows.shape[0] else rows.index_select(0, index)
            tokens[index], sampled_rows = self._sample_random(state, sampled_rows,
                                                              requests[random])
            if processed is not None:
                processed = processed.index_copy(0, index, sampled_rows)
        if wants_logprobs:
            source = raw_logprobs
            if self.logprobs_mode == "processed_logprobs":
                source = self.sampler.compute_logprobs(processed)
            elif self.logprobs_mode == "processed_logits":
                source = processed
            positions = requests_t * state.emitted.shape[1] + level
            state.logprob_rows.append((positions, self.sampler.gather_logprobs(
                source, metadata.max_num_logprobs, tokens)))
        state.emitted[requests_t, level] = tokens
        return tokens.cpu().numpy()

    def _constrain(self, state: _StepState, rows: torch.Tensor, requests: np.ndarray,
                   requests_t: torch.Tensor, level: int) -> None:
        """What vLLM applies before its greedy or random choice: allowed
        token ids, bad words, min_tokens' stop tokens, penalties. Each node
        is judged with the path to it: ``level`` tokens emitted this step."""
        metadata = state.metadata
        if metadata.allowed_token_ids_mask is not None:
            rows.masked_fill_(metadata.allowed_token_ids_mask[requests_t], float("-inf"))
        local = None
        if metadata.bad_words_token_ids or state.min_tokens:
            local = {int(r): i for i, r in enumerate(requests)}
        if metadata.bad_words_token_ids:
            bad_words, past = {}, {}
            for request, words in metadata.bad_words_token_ids.items():
                i = local.get(request)
                if i is not None:
                    bad_words[i] = words
                    past[i] = (list(metadata.output_token_ids[request])
                               + state.emitted[request, :level].tolist())
            if bad_words:
                apply_bad_words(rows, bad_words, past)
        for request, (minimum, output, stop_ids) in state.min_tokens.items():
            i = local.get(request)
            if i is not None and len(output) + level < minimum:
                rows[i, stop_ids] = float("-inf")
        if state.output_tokens is not None:
            outputs = state.output_tokens.index_select(0, requests_t)
            if level:
                outputs = torch.cat((outputs, state.emitted[requests_t, :level].to(
                    outputs.device)), dim=1)
            apply_penalties(rows, metadata.prompt_token_ids.index_select(0, requests_t),
                            outputs, metadata.presence_penalties[requests_t],
                            metadata.frequency_penalties[requests_t],
                            metadata.repetition_penalties[requests_t])

    def _sample_random(self, state: _StepState, rows: torch.Tensor, requests: np.ndarray
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Temperature, top-k/top-p and a Gumbel-max draw, as vLLM's CPU
        sampler; returns the tokens and the processed rows."""
        metadata = state.metadata
        requests_t = torch.from_numpy(requests).to(rows.device)
        rows.div_(metadata.temperature[requests_t].unsqueeze(1))
        top_k = None if metadata.top_k is None else metadata.top_k[requests_t]
        top_p = None if metadata.top_p is None else metadata.top_p[requests_t]
        rows = apply_top_k_top_p(rows, top_k, top_p)
        seeded = np.flatnonzero(state.seeded[requests])
        generators = metadata.generators
        if self.fused_gumbel:
            seeds = torch.randint(0, 2**31, (rows.shape[0],), dtype=torch.long)
            for i in seeded:
                seeds[i] = torch.randint(0, 2**31, (1,), dtype=torch.long,
                                         generator=generators[int(requests[i])]).item()
            return torch.ops._C.fused_gumbel_argmax(rows, seeds), rows
        # Elsewhere vLLM's native sampler: the exponential race.
        probs = rows.softmax(dim=-1, dtype=torch.float32)
        noise = torch.empty_like(probs).exponential_()
        for i in seeded:
            noise[i].exponential_(generator=generators[int(requests[i])])
        return probs.div_(noise).argmax(dim=-1), rows

    @staticmethod
    def _assemble_logprobs(state: _StepState, num_requests: int, width: int,
                           longest: int) -> LogprobsTensors:
        """vLLM's layout: one row per request and position up to the
        longest output (``parse_output`` drops the padding)."""
        first = state.logprob_rows[0][1]
        columns = first.logprob_token_ids.shape[1]
        device = first.logprobs.device
        token_ids = torch.zeros(num_requests * width, columns, dtype=torch.int32,
                                device=device)
        values = torch.zeros(num_requests * width, columns, dtype=torch.float32,
                             device=device)
        ranks = torch.zeros(num_requests * width, dtype=first.selected_token_ranks.dtype,
                            device=device)
        for positions, tensors in state.logprob_rows:
            token_ids[positions] = tensors.logprob_token_ids
            values[positions] = tensors.logprobs.to(torch.float32)
            ranks[positions] = tensors.selected_token_ranks
        keep = (torch.arange(num_requests, device=device)[:, None] * width
                + torch.arange(longest, device=device)[None, :]).reshape(-1)
        return LogprobsTensors(token_ids[keep], values[keep], ranks[keep])
