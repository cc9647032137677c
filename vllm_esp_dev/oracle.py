# SPDX-License-Identifier: Apache-2.0
"""A test-only candidate source that knows the right answer.

Given the greedy continuations of plain decoding, it builds each step's tree
with the true next tokens hidden among random distractors at random sibling
positions, and hangs the deeper levels under the true node (not under the
first sibling, as ESP's top-1 expansion would). If tree attention isolated
siblings wrongly, used wrong positions, or the accepted path's KV were not
moved to its linear slots, acceptance would drop or the output would change.
With everything right, every step accepts the tree's full depth and the
output equals plain decoding.

Injected into the vLLM engine through
``additional_config["esp_candidate_source"]`` (see
:func:`vllm_esp.proposer.tree_proposer_from_vllm`), which takes the batch
interface of :class:`vllm_esp.core.batch.TreeProposer`; ``propose`` here
loops over the batch in Python, which is fine for a test. Not a user
feature.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_esp.config import ESPConfig
from vllm_esp.core.batch import TreeBatch
from vllm_esp.core.proposal import DraftTree
from vllm_esp.core.tree import TreeSpec
from vllm_esp_dev.sources import ProposalContext


class OracleSource:
    def __init__(self, config: ESPConfig, continuations: list[list[list[int]]],
                 vocab_size: int, seed: int = 0) -> None:
        """``continuations``: pairs ``[prompt_ids, greedy_output_ids]``."""
        self.config = config
        self.continuations = [(list(p), list(c)) for p, c in continuations]
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(seed)
        if config.tree is not None:
            self.widths = list(config.tree)
        else:  # same node count as the dynamic budget, as a deep tree
            k = config.num_mask_tokens
            self.widths = [config.node_budget - (k - 1)] + [1] * (k - 1)
        self.max_nodes = 1 + sum(self.widths)
        self.candidate_width = 1

    def propose(self, histories, history_rows, history_starts, history_ends, roots,
                cand_tokens, cand_log_probs, has_candidates, vocab_size, out=None,
                **unused):
        trees = [self.propose_one(ProposalContext(
                     histories[row, start:end], int(root)))
                 for row, start, end, root in zip(history_rows, history_starts,
                                                  history_ends, roots)]
        return TreeBatch.from_trees(trees, self.config.num_mask_tokens)

    def _true_tokens(self, history: list[int]) -> list[int] | None:
        for prompt, output in self.continuations:
            if history[:len(prompt)] == prompt:
                generated = history[len(prompt):]
                if output[:len(generated)] == generated:
                    return output[len(generated):]
        return None

    def propose_one(self, context: ProposalContext) -> DraftTree:
        history = [int(t) for t in np.asarray(context.token_ids)]
        truth = self._true_tokens(history) or []
        parents, tokens = [-1], [context.root_token]
        parent = 0
        for level, width in enumerate(self.widths):
            true_token = truth[level] if level < len(truth) else None
            distractors = [t for t in self.rng.permutation(self.vocab_size)[:width + 1]
                           if t != true_token][:width]
            true_slot = int(self.rng.integers(width))
            level_start = len(tokens)
            for slot in range(width):
                parents.append(parent)
                tokens.append(true_token if (slot == true_slot and true_token is not None)
                              else int(distractors[slot]))
            parent = level_start + true_slot
        tree_spec = TreeSpec(tuple(parents), num_mask_tokens=self.config.num_mask_tokens)
        return DraftTree(tree_spec, torch.tensor(tokens))


class LikelyTokensSource:
    """A test-only source whose trees hold the target's likely next tokens.

    ``table`` pairs a token history with the tokens to draft after it (say
    the target's top tokens there, read from a plain run's logprobs). Each
    request's tree hangs ``table[history]`` under the root and, under each
    of those children, ``table[history + child]``, and so on; a request
    whose history is not in the table gets no tree. With sampling most
    draws then land on a child: the tree walk's accept path is taken often,
    at several depths. Injected like :class:`OracleSource`.
    """

    def __init__(self, config: ESPConfig, table: list[list[list[int]]]) -> None:
        self.config = config
        self.table = {tuple(history): list(tokens) for history, tokens in table}
        self.max_nodes = config.num_nodes
        self.candidate_width = 1

    def propose(self, histories, history_rows, history_starts, history_ends, roots,
                cand_tokens, cand_log_probs, has_candidates, vocab_size, out=None,
                **unused):
        trees = []
        for row, start, end, root in zip(history_rows, history_starts, history_ends, roots):
            history = tuple(int(t) for t in histories[row, start:end])
            parents, tokens, contexts = [-1], [int(root)], [history]
            node = 0
            while node < len(tokens):
                for token in self.table.get(contexts[node], []):
                    if len(tokens) < self.max_nodes:
                        parents.append(node)
                        tokens.append(token)
                        contexts.append(contexts[node] + (token,))
                node += 1
            trees.append(None if len(tokens) == 1 else DraftTree(
                TreeSpec(tuple(parents), num_mask_tokens=self.config.num_mask_tokens),
                torch.tensor(tokens)))
        return TreeBatch.from_trees(trees, self.config.num_mask_tokens)


class NoTreeSource:
    """A candidate source that proposes no tree for any request, so that
    every step is a plain decoding step through ESP's runner (and the
    start-up warm-up gets no tree either)."""

    def __init__(self, config: ESPConfig) -> None:
        self.config = config
        self.max_nodes = 1
        self.candidate_width = 1

    def propose(self, histories, history_rows, history_starts, history_ends, roots,
                cand_tokens, cand_log_probs, has_candidates, vocab_size, out=None,
                **unused) -> TreeBatch:
        return TreeBatch.empty(roots.shape[0], self.max_nodes, 1)
