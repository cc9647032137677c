"""The ESP model runner: one forward verifies a tree and probes the next one.

A subclass of vLLM's (legacy V1) model runner, installed by the ESP worker.
It overrides four hooks and leaves the rest of vLLM's step untouched:

``_prepare_inputs``
    Finds the requests whose scheduled drafts are exactly the block ESP
    proposed (truncated, padded or grammar-trimmed blocks are not, and stay
    plain chain rows, which vLLM verifies losslessly). For each ESP block it
    rewrites the RoPE positions to tree positions (the KV slots, already
    derived from linear positions, stay unique), marks the mask rows as
    embedding rows and writes the request's soft mask embedding there, keeps
    logits for the tree-node rows only, and publishes the block layouts for
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
    and computes the logits of the masks of each last accepted node, which
    seed the next tree (see :class:`vllm_esp.proposer.ESPProposer`).
``_update_states``
    Drops the ESP state of finished requests.

Only checked on CPU (vLLM 0.32.0).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from vllm_esp.core.verify import select_chain
from vllm_esp.profiling import scope
from vllm_esp.step import ESPBlock, ESPStep, set_current_step


class ESPModelRunnerMixin:
    def _esp_init(self) -> None:
        from vllm_esp.proposer import ESPProposer

        if not isinstance(getattr(self, "drafter", None), ESPProposer):
            raise RuntimeError("ESP runner needs the ESPProposer drafter")
        if not self.enable_prompt_embeds:
            raise RuntimeError(
                "ESP feeds soft embeddings to mask rows and needs "
                "enable_prompt_embeds; use speculative_config method 'esp', "
                "which sets it.")
        if self.uses_mrope or self.supports_mm_inputs:
            raise ValueError(
                "ESP supports text-only models with standard RoPE; this model "
                "(multimodal or M-RoPE) cannot use speculative_config method "
                "'esp'.")
        self.esp_config = self.drafter.esp_config
        self.drafter.bind(self)
        self._esp_step: ESPStep | None = None
        self._esp_logit_spans: list[tuple[int, int]] = []

    # ---------------------------------------------------------------- states
    def _update_states(self, scheduler_output):
        for req_id in scheduler_output.finished_req_ids:
            self.drafter.drop(req_id)
        return super()._update_states(scheduler_output)

    # ---------------------------------------------------------------- inputs
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        logits_indices, spec_metadata, max_sampled = super()._prepare_inputs(
            scheduler_output, num_scheduled_tokens)
        self._esp_step = None
        set_current_step(None)
        if spec_metadata is None:
            return logits_indices, spec_metadata, max_sampled
        with scope("esp: prepare inputs"):
            return self._esp_prepare_inputs(scheduler_output, num_scheduled_tokens,
                                            logits_indices, spec_metadata, max_sampled)

    def _esp_prepare_inputs(self, scheduler_output, num_scheduled_tokens,
                            logits_indices, spec_metadata, max_sampled):
        blocks = self._find_esp_blocks(scheduler_output, num_scheduled_tokens)
        if not blocks:
            return logits_indices, spec_metadata, max_sampled

        step = ESPStep.build(blocks)
        valid = step.query_valid
        self.positions[step.query_rows[valid]] = (
            step.root_positions[:, None] + step.position_offsets.long())[valid].to(self.positions)
        # Mask rows take the request's soft embedding instead of a token's.
        self.is_token_ids.cpu[step.mask_rows] = False
        self.is_token_ids.gpu[step.mask_rows] = False
        mask_embeddings = torch.stack(
            [self.drafter.mask_embedding(block.req_id) for block in blocks])
        self.inputs_embeds.gpu[step.mask_rows] = mask_embeddings[
            step.mask_row_blocks].to(self.inputs_embeds.gpu)

        node_rows = torch.split(step.node_rows,
                                [block.layout.num_nodes for block in blocks])
        logits_indices = self._esp_logits_indices(spec_metadata, blocks, node_rows)
        self._esp_step = step
        set_current_step(step)
        return logits_indices, spec_metadata, max_sampled

    def _find_esp_blocks(self, scheduler_output, num_scheduled_tokens):
        blocks = []
        for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            if drafts != self.drafter.pending_drafts(req_id):
                continue
            batch_index = self.input_batch.req_id_to_index[req_id]
            tree = self.drafter.pending_tree(req_id)
            if num_scheduled_tokens[batch_index] != tree.layout.block_size:
                continue
            blocks.append(ESPBlock(
                req_id=req_id,
                batch_index=batch_index,
                row_start=int(self.query_start_loc.np[batch_index]),
                root_position=int(
                    self.input_batch.num_computed_tokens_cpu[batch_index]),
                draft_tree=tree,
            ))
        blocks.sort(key=lambda block: block.batch_index)
        return blocks

    def _esp_logits_indices(self, spec_metadata, blocks, node_rows):
        """Logits rows per request: tree nodes for ESP blocks (masks are
        computed later, only for the accepted node), vLLM's rows otherwise.

        vLLM's grammar bitmask addresses logits rows by draft counts
        (``1 + len(drafts)`` rows per request), so a step that holds a
        structured-output request keeps vLLM's rows (the whole block) for
        every request; tree-node rows come first in a block either way.
        """
        num_sampled = np.asarray(spec_metadata.num_draft_tokens) + 1
        ends = np.cumsum(num_sampled)
        vllm_rows = spec_metadata.logits_indices
        if self._batch_has_structured_output():
            self._esp_logit_spans = [(int(end - n), int(n))
                                     for end, n in zip(ends, num_sampled)]
            return vllm_rows
        esp_rows = {b.batch_index: rows for b, rows in zip(blocks, node_rows)}
        segments, spans, start = [], [], 0
        for index, end in enumerate(ends):
            rows = esp_rows.get(index)
            if rows is None:
                rows = vllm_rows[end - num_sampled[index]:end]
            rows = rows.to(vllm_rows)
            segments.append(rows)
            spans.append((start, rows.numel()))
            start += rows.numel()
        self._esp_logit_spans = spans
        return torch.cat(segments)

    def _batch_has_structured_output(self) -> bool:
        from vllm_esp.proposer import has_structured_output

        return any(has_structured_output(self.requests[req_id])
                   for req_id in self.input_batch.req_ids)

    # --------------------------------------------------------------- forward
    def execute_model(self, scheduler_output, intermediate_tensors=None):
        try:
            output = super().execute_model(scheduler_output, intermediate_tensors)
        finally:
            set_current_step(None)
        step = self._esp_step
        if step is not None and self.execute_model_state is not None:
            step.hidden_states = self.execute_model_state.hidden_states
            step.slot_mappings = self.execute_model_state.slot_mappings
        return output

    # ---------------------------------------------------------------- verify
    def _sample(self, logits, spec_decode_metadata):
        step = self._esp_step
        if step is None:
            return super()._sample(logits, spec_decode_metadata)
        self._esp_step = None

        with scope("esp: verify"):
            return self._esp_sample(step, logits, spec_decode_metadata)

    def _esp_sample(self, step, logits, spec_decode_metadata):
        esp_blocks = {block.batch_index: block for block in step.blocks}
        vllm_drafts = spec_decode_metadata.draft_token_ids
        vllm_draft_ends = np.cumsum(spec_decode_metadata.num_draft_tokens)
        compact_rows, chain_drafts, chains = [], [], {}
        for index, (start, count) in enumerate(self._esp_logit_spans):
            block = esp_blocks.get(index)
            if block is None:
                compact_rows.append(torch.arange(start, start + count))
                end = int(vllm_draft_ends[index])
                chain_drafts.append(vllm_drafts[end - (count - 1):end].to(torch.int32))
                continue
            node_logits = logits[start:start + block.layout.num_nodes]
            chain = select_chain(block.draft_tree, node_logits)
            chains[index] = chain
            compact_rows.append(start + chain)
            chain_drafts.append(block.draft_tree.tokens[chain[1:]].to(torch.int32))

        compact_logits = logits[torch.cat(compact_rows).to(logits.device)]
        chain_metadata = chain_spec_decode_metadata(chain_drafts, logits.device)
        sampling_metadata = self.input_batch.sampling_metadata
        if sampling_metadata.spec_token_ids is not None:
            # Penalties and bad words must see the chain being verified, not
            # the block's slots.
            sampling_metadata = dataclasses.replace(
                sampling_metadata,
                spec_token_ids=[d.tolist() for d in chain_drafts])
        with scope("esp: sampler"):
            sampler_output = self.rejection_sampler(
                chain_metadata, None, compact_logits, sampling_metadata)
        with scope("esp: after verification"):
            self._esp_after_verification(step, chains, sampler_output)
        return sampler_output

    def _esp_after_verification(self, step, chains, sampler_output) -> None:
        num_emitted = (sampler_output.sampled_token_ids >= 0).sum(dim=1).cpu()
        moved_sources, moved_rows, probe_rows, probe_blocks = [], [], [], []
        for block_number, block in enumerate(step.blocks):
            chain = chains[block.batch_index]
            num_accepted = int(num_emitted[block.batch_index]) - 1
            accepted_path = chain[:num_accepted + 1]
            depths = torch.arange(accepted_path.numel())
            # Node at depth d must end up in the d-th slot after the root.
            moved = accepted_path != depths
            moved_sources.append(block.row_start + accepted_path[moved])
            moved_rows.append(block.row_start + depths[moved])
            last_node = int(accepted_path[-1])
            # A hybrid tree carries masks only on some nodes; when the last
            # accepted node has none, the next tree is built without ESP
            # candidates (prompt lookup, or the placeholder tree).
            if block.layout.has_masks[last_node]:
                probe_rows.append(block.row_start + block.layout.mask_rows[last_node])
                probe_blocks.append(block)
        with scope("esp: relocate kv"):
            self._relocate_kv(step, torch.cat(moved_sources), torch.cat(moved_rows))

        k = self.esp_config.masks_per_node
        if k == 0 or not probe_rows:  # no mask rows to probe
            return
        with scope("esp: mask probe"):
            hidden_states = step.hidden_states[torch.cat(probe_rows).to(
                step.hidden_states.device)]
            mask_logits = self.model.compute_logits(hidden_states)
            for block_number, block in enumerate(probe_blocks):
                self.drafter.mask_logits[block.req_id] = mask_logits[
                    block_number * k:(block_number + 1) * k].cpu()

    def _relocate_kv(self, step, source_rows, destination_rows) -> None:
        """Copy accepted nodes' K/V from their block rows' slots to the
        slots right after the root, in every layer's cache. Nodes were
        computed at their final positions, so a copy is exact. Moves are in
        increasing destination order per block, so no source is overwritten
        before it is read (a source row is never before its destination)."""
        if source_rows.numel() == 0:
            return
        layers = self.compilation_config.static_forward_context
        # Layers of one KV-cache group share one slot mapping.
        groups: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        for layer_name, slot_mapping in step.slot_mappings.items():
            entry = groups.setdefault(id(slot_mapping), (slot_mapping, []))
            entry[1].append(layers[layer_name].kv_cache)
        for slot_mapping, caches in groups.values():
            torch.ops.vllm_esp.copy_slots(caches, slot_mapping[source_rows].long(),
                                          slot_mapping[destination_rows].long())


def chain_spec_decode_metadata(chain_drafts: list[torch.Tensor],
                               device: torch.device) -> SpecDecodeMetadata:
    """vLLM chain metadata over a compact logits tensor in which request i
    owns ``len(chain_drafts[i]) + 1`` consecutive rows (drafts, then bonus).
    Consecutive rows per request are what vLLM's logprobs code expects."""
    num_draft_tokens = [int(d.numel()) for d in chain_drafts]
    num_sampled = np.asarray(num_draft_tokens, dtype=np.int64) + 1
    cu_num_sampled = np.cumsum(num_sampled)
    sampled_starts = cu_num_sampled - num_sampled
    target_logits_indices = np.concatenate(
        [start + np.arange(n) for start, n in zip(sampled_starts, num_draft_tokens)]
        or [np.zeros(0, dtype=np.int64)])
    to_device = lambda array: torch.as_tensor(array, dtype=torch.int32,
                                              device=device)
    return SpecDecodeMetadata(
        draft_token_ids=torch.cat(chain_drafts).to(device=device, dtype=torch.int32),
        num_draft_tokens=num_draft_tokens,
        cu_num_draft_tokens=to_device(np.cumsum(num_draft_tokens)),
        cu_num_sampled_tokens=to_device(cu_num_sampled),
        target_logits_indices=to_device(target_logits_indices),
        bonus_logits_indices=to_device(cu_num_sampled - 1),
        logits_indices=to_device(np.arange(int(cu_num_sampled[-1]))),
    )


class ESPCPUModelRunner(ESPModelRunnerMixin, CPUModelRunner):
    def __init__(self, vllm_config, device) -> None:
        super().__init__(vllm_config, device)
        self._esp_init()
