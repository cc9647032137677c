"""ESP drafts for vLLM: the ``custom_class`` proposer.

vLLM calls ``propose`` once per step, after the step's tokens are committed,
and schedules exactly ``1 + len(drafts)`` query slots per request next step.
ESP asks for its whole block through that list:

    drafts = tree node tokens (T - 1)  +  mask slots (k per masked node)

so the scheduler reserves the block's ``Q`` KV slots with no scheduler
change. The mask slots' token id is never embedded: the runner gives those
rows the request's soft mask embedding. The mask slots hold the block's
draft-node count (``mask_slot_tokens``), which lets the scheduler (in another
process) tell nodes from mask slots without knowing the tree
(``tree_node_count``).

Example, ESP alone with ``tree=[4]`` (k = 1, T = 5, Q = 10), root token 42,
mask-1 top candidates [17, 42, 9, 3, 88]: pruning drops 42 (equal to its
parent, the root), so the tree is 42 -> {17, 9, 3, 88} and the drafts are
``[17, 9, 3, 88, 4, 4, 4, 4, 5]``.

The proposer is a thin holder of per-request engine state (the mask
embedding and the block proposed last); the algorithm lives in
:mod:`vllm_esp.core`. The runner hands it the mask logits of each request's
last accepted node after verification.
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass

import torch

from vllm_esp.config import ESPConfig
from vllm_esp.core.mask_embedding import (
    embedding_table_stats,
    ema_update,
    initial_mask_embedding,
)
from vllm_esp.core.proposal import DraftTree
from vllm_esp.core.sources import (CandidateSource, ProposalContext,
                                   candidate_source)

logger = logging.getLogger("vllm_esp")



def mask_slot_tokens(num_draft_nodes: int, num_mask_slots: int) -> list[int]:
    """A block's mask slots: its draft-node count ``n``, repeated, and
    ``n + 1`` in the last slot.

    Mask rows are fed the soft embedding, so any valid vocabulary id works
    (``n + 1 <= 128`` is one in every model; non-negative keeps vLLM's
    padding logic, -1, out of the way). These ids tell the scheduler where
    the nodes end, which a hybrid tree (masks on some nodes only) cannot
    convey by its length, and the distinct last id tells a whole block from
    one the scheduler truncated inside its mask slots.
    """
    if num_mask_slots == 0:
        return []
    return [num_draft_nodes] * (num_mask_slots - 1) + [num_draft_nodes + 1]


@dataclass
class ESPRequestState:
    mask_embedding: torch.Tensor  # [H] fp32
    num_folded_outputs: int  # output tokens already folded into the EMA
    pending_tree: DraftTree | None = None
    pending_drafts: list[int] | None = None


def esp_config_from_vllm(vllm_config) -> ESPConfig:
    return ESPConfig.from_serialized(vllm_config.additional_config["esp"])


def candidate_source_from_vllm(vllm_config, esp_config: ESPConfig) -> CandidateSource:
    """The configured source (ESP masks, or the hybrid with prompt lookup),
    unless a test injects another source through
    ``additional_config["esp_candidate_source"] = {"class": "pkg.Cls",
    "kwargs": {...}}`` (used by the oracle test; not a user option)."""
    override = (vllm_config.additional_config or {}).get("esp_candidate_source")
    if override is None:
        return candidate_source(esp_config)
    from vllm.utils.import_utils import resolve_obj_by_qualname

    source_cls = resolve_obj_by_qualname(override["class"])
    logger.warning("ESP: candidate source overridden by %s (testing hook)",
                   override["class"])
    return source_cls(esp_config, **override.get("kwargs", {}))


class ESPProposer:
    def __init__(self, vllm_config) -> None:
        self.esp_config = esp_config_from_vllm(vllm_config)
        self.source = candidate_source_from_vllm(vllm_config, self.esp_config)
        self.states: dict[str, ESPRequestState] = {}
        # req_id -> [k, V] logits of the masks of the last accepted node,
        # set by the runner after verification and consumed by propose().
        self.mask_logits: dict[str, torch.Tensor] = {}
        self.runner = None
        self.model = None
        self._table_stats = None

    # ------------------------------------------------------------ engine glue
    def load_model(self, model) -> None:
        self.model = model

    def bind(self, runner) -> None:
        self.runner = runner

    def drop(self, req_id: str) -> None:
        self.states.pop(req_id, None)
        self.mask_logits.pop(req_id, None)

    def pending_drafts(self, req_id: str) -> list[int] | None:
        state = self.states.get(req_id)
        return None if state is None else state.pending_drafts

    def pending_tree(self, req_id: str) -> DraftTree | None:
        return self.states[req_id].pending_tree

    def mask_embedding(self, req_id: str) -> torch.Tensor:
        return self.states[req_id].mask_embedding

    # -------------------------------------------------------------- proposing
    def propose(self, sampled_token_ids, num_tokens_no_spec=None,
                token_ids_cpu=None, slot_mappings=None) -> list[list[int]]:
        """Next blocks, aligned with ``runner.input_batch.req_ids``."""
        from vllm_esp.profiling import scope

        with scope("esp: propose"):
            return self._propose(sampled_token_ids)

    def _propose(self, sampled_token_ids) -> list[list[int]]:
        runner = self.runner
        req_ids = list(runner.input_batch.req_ids)
        drafts: list[list[int]] = []
        active: list[str] = []
        for req_id, sampled in zip(req_ids, sampled_token_ids):
            request = runner.requests[req_id]
            if not sampled or has_structured_output(request):
                # Mid-prefill, or a grammar that validates chains only: no
                # block this step (lossless plain decoding).
                self.mask_logits.pop(req_id, None)
                if req_id in self.states:
                    self.states[req_id].pending_drafts = None
                drafts.append([])
                continue
            active.append(req_id)
            drafts.append(None)  # filled below
        self._update_mask_embeddings(active)
        token_ids = runner.input_batch.token_ids_cpu
        num_tokens = runner.input_batch.num_tokens_no_spec
        for index, req_id in enumerate(req_ids):
            if drafts[index] is not None:
                continue
            state = self.states[req_id]
            mask_logits = self.mask_logits.pop(req_id, None)
            history = token_ids[index, :num_tokens[index]]
            tree = self.source.propose(ProposalContext(
                token_ids=history, root_token=int(history[-1]),
                mask_logits=None if mask_logits is None else mask_logits.float()))
            if tree is None or tree.layout.block_size > self.esp_config.block_size:
                state.pending_tree = state.pending_drafts = None
                drafts[index] = []
                continue
            num_draft_nodes = tree.num_nodes - 1
            mask_slots = mask_slot_tokens(num_draft_nodes,
                                          tree.layout.block_size - tree.num_nodes)
            state.pending_tree = tree
            state.pending_drafts = tree.draft_tokens.tolist() + mask_slots
            drafts[index] = state.pending_drafts
        return drafts

    def _update_mask_embeddings(self, req_ids: list[str]) -> None:
        """Create missing states and fold new output tokens into the EMA.

        The state is a deterministic function of the token history, so it
        survives preemption: a resumed request simply folds what it has not
        folded yet. One embedding call covers every request of the step.
        """
        runner = self.runner
        config = self.esp_config
        new_prompts: list[str] = [r for r in req_ids if r not in self.states]
        pieces: list[list[int]] = []
        for req_id in new_prompts:
            pieces.append(list(runner.requests[req_id].prompt_token_ids))
        folds: list[tuple[str, int]] = []
        for req_id in req_ids:
            outputs = runner.requests[req_id].output_token_ids
            start = (0 if req_id in new_prompts
                     else self.states[req_id].num_folded_outputs)
            folds.append((req_id, len(outputs)))
            pieces.append(list(outputs[start:]))
        embeddings = self._embed(pieces)
        for req_id, prompt_embeddings in zip(new_prompts, embeddings):
            self.states[req_id] = ESPRequestState(
                mask_embedding=self._initial(req_id, prompt_embeddings),
                num_folded_outputs=0)
        for (req_id, num_outputs), token_embeddings in zip(
                folds, embeddings[len(new_prompts):]):
            state = self.states[req_id]
            state.mask_embedding = ema_update(state.mask_embedding,
                                              token_embeddings, config.ema)
            state.num_folded_outputs = num_outputs

    def _initial(self, req_id: str, prompt_embeddings: torch.Tensor) -> torch.Tensor:
        mode = self.esp_config.mask_init
        if mode != "sample":
            return initial_mask_embedding(prompt_embeddings, mode)
        if self._table_stats is None:
            weight = self.model.get_input_embeddings().weight
            probe = self._embed([[0]])[0][0]
            scale = float(probe.norm() / weight[0].float().norm().clamp(min=1e-12))
            self._table_stats = embedding_table_stats(weight, scale)
        mu, sigma = self._table_stats
        # A stable hash: every TP rank must draw the same vector.
        generator = torch.Generator().manual_seed(zlib.crc32(req_id.encode()))
        noise = torch.randn(mu.shape, generator=generator)
        return mu + sigma * noise

    def _embed(self, pieces: list[list[int]]) -> list[torch.Tensor]:
        """The model's own embedding function (scaling included), in fp32."""
        flat = [t for piece in pieces for t in piece]
        if not flat:
            hidden = self.runner.inputs_embeds.gpu.shape[-1]
            return [torch.zeros(0, hidden) for _ in pieces]
        device = self.runner.device
        ids = torch.tensor(flat, dtype=torch.long, device=device)
        with torch.inference_mode():
            embedded = self.model.embed_input_ids(ids).float().cpu()
        return list(torch.split(embedded, [len(p) for p in pieces]))


def tree_node_count(drafts, masks_per_node: int) -> int:
    """Draft tree nodes in a scheduled draft list.

    A whole ESP block is ``n`` node tokens followed by its mask slots
    (``mask_slot_tokens``: ``n`` repeated, then ``n + 1``), a multiple of
    ``masks_per_node`` of them. Anything else is verified as a plain chain
    (a block the scheduler truncated, or a lookup-only chain) and counts
    every slot. A chain is only mistaken for a block if its tail happens to
    have exactly that form.
    """
    num_slots = len(drafts)
    if masks_per_node == 0 or num_slots == 0:
        return num_slots
    num_nodes = int(drafts[-1]) - 1
    if (0 <= num_nodes < num_slots
            and (num_slots - num_nodes) % masks_per_node == 0
            and set(drafts[num_nodes:-1]) <= {num_nodes}):
        return num_nodes
    return num_slots


def has_structured_output(request) -> bool:
    params = getattr(request, "sampling_params", None)
    return params is not None and getattr(params, "structured_outputs", None) is not None
