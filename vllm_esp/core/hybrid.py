"""Hybrid draft trees: ESP mask candidates and prompt-lookup candidates in
one verification block, under one node budget.

ESP and prompt lookup fail in different places: lookup is strong where the
answer copies earlier text (extraction, summarisation, code edits), ESP where
it does not. Both only propose tokens for the same block, so one block can
hold both and verification keeps whichever is right.

Algorithm (one call per request per step):

1. **Lookup candidates.** The longest suffix n-gram (``max_ngram`` down to
   ``min_ngram``) with an earlier occurrence; its most recent occurrence's
   continuation becomes a chain ``c_1 .. c_L`` (``L <= B``), and so do older
   occurrences' continuations that start with another token (up to
   ``LOOKUP_MAX_CHAINS`` chains). Node ``c_d``
   scores ``sum_{j<=d} log q(n + j - 1) + log f_d``: ``q(m)`` is the
   measured chance that a lookup token is accepted after an ``m``-token
   match (accepting a token lengthens the match), and ``f_d`` the fraction
   of the n-gram's occurrences whose continuation agrees with ``c_1..c_d``
   (the match count signal).
2. **ESP candidates.** The dynamic tree's candidates (paper Algorithm 1,
   ``esp_candidates``): cumulative mask log-probabilities, plus
   ``log ESP_WEIGHT`` (mask probabilities overstate acceptance).
3. **Merge.** The chain is walked down the ESP candidates: where
   ``c_1..c_d`` is also an ESP path, the node is shared and keeps the larger
   score; the rest of the chain hangs below the last shared node.
4. **Allocate.** The block's rows go to the best-scored nodes and to the
   masks of the nodes most likely to be the last accepted one (only that
   node's masks seed the next step's ESP candidates), whichever is worth
   more per row (``allocate_block``). A confident lookup chain can thus
   fill the block; with no lookup match the root keeps its masks and the
   ESP candidates take the rest. Both sources' scores fall along every
   path, so the kept set is a tree.

Worked example, a block of 8 rows, ``k = 1``, ``q = (0, .25, .45, .6, .7,
.75)``, ESP weight 0.5, mask value 0.3, history ``x the cat sat . the cat``
(root ``cat``):

    lookup: the 2-gram "the cat" occurred once, followed by "sat . the cat":
            sat .45, "." .45*.6 = .27, the .27*.7 = .19, cat .19*.75 = .14
    ESP:    mask top candidates is (p .5), sat (.3), was (.1), scaled by .5:
            is .25, sat .15, was .05
    merge:  "sat" is in both: one node, score max(.45, .15) = .45
    allocate (per row): sat .45, "." .27, is .25, the .19, cat .14 (each
            beats every node's masks, e.g. the root's .3 * (1 - .45) after
            sat), then the root's masks (.3 * (1 - .45 - .25) = .09 beats
            was's .05), then is's masks (.3 * .25 = .075 beats was's
            .05 * (1 - .3), now that the root is masked)

    tree:   cat -> {sat -> . -> the -> cat, is}, masks on cat (root) and is:
            6 nodes + 2 mask rows = 8 rows

With only ``"ngram"`` the tree is exactly ``PromptLookupSource``'s chain of
up to ``block_size - 1`` tokens (no masks); with only ``"esp"`` the hybrid is not used
(``candidate_source`` returns ``ESPMaskSource``). Merged nodes are verified
like any node, so the method stays lossless whatever the scores are; the
scores only decide which candidates get the budget.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from vllm_esp.core.proposal import (DraftTree, ScoredCandidates,
                                    esp_candidates, select_tree,
                                    tree_from_candidates)

__all__ = [
    "LOOKUP_MAX_NGRAM",
    "LOOKUP_MIN_NGRAM",
    "find_ngram_matches",
    "lookup_candidates",
    "lookup_chains",
    "merge_candidates",
    "allocate_block",
    "hybrid_next_tree",
]

LOOKUP_MAX_NGRAM = 3
LOOKUP_MIN_NGRAM = 1

# q(m): chance that the next lookup token is accepted after an m-token match
# (m >= len - 1 uses the last entry), when the matched n-gram's occurrences
# agree. Measured with benchmarks/calibrate_hybrid.py on SmolLM2-135M's greedy
# answers to 52 Spec-Bench questions (4 per category; they include the
# benchmark's questions): m=1 .36, 2 .55, 3 .84 (all occurrences agreeing),
# then .81, .87, .92. Only the ranking of candidates depends on these numbers,
# never the output.
LOOKUP_ACCEPT = (0.0, 0.35, 0.55, 0.8, 0.82, 0.87, 0.92)
# Mask probabilities overstate acceptance: a level-1 candidate with mask
# probability p was the next token about 0.35 p of the time (same script).
ESP_WEIGHT = 0.35
# Lookup chains per step beside ESP: the most recent occurrence's, and those
# of older occurrences that continue differently.
LOOKUP_MAX_CHAINS = 3
# Expected extra tokens that ESP candidates bring to the next step, per unit
# of probability that a node is the last accepted one. Mask rows go where
# this beats another draft node (``allocate_block``). Tuned with the
# reference decoder on SmolLM2 (13 Spec-Bench prompts x 64 tokens, block 10,
# tau): 0.0 1.380, 0.1 1.400, 0.3 1.390, 0.6 1.371. Like the other scores it
# only decides the tree's shape, never the output.
MASK_VALUE = 0.1


def _lookup_accept(match_length: np.ndarray, table: Sequence[float]) -> np.ndarray:
    table = np.asarray(table, dtype=np.float64)
    return table[np.minimum(match_length, len(table) - 1)]


def find_ngram_matches(token_ids: np.ndarray, max_ngram: int,
                       min_ngram: int) -> tuple[int, np.ndarray]:
    """The longest suffix n-gram (``max_ngram`` down to ``min_ngram``) that
    occurred before, and where each earlier occurrence's continuation starts
    (ascending, so the most recent is last). ``(0, [])`` if none."""
    num_tokens = token_ids.shape[0]
    for n in range(min(max_ngram, num_tokens - 1), min_ngram - 1, -1):
        suffix = token_ids[num_tokens - n:]
        # Windows starting at 0 .. num_tokens - n - 1: all earlier occurrences,
        # each followed by at least one token. One vectorised compare per n.
        windows = np.lib.stride_tricks.sliding_window_view(token_ids[:-1], n)
        matches = np.flatnonzero((windows == suffix).all(axis=1))
        if matches.size:
            return n, matches + n
    return 0, np.zeros(0, dtype=np.int64)


def lookup_chains(token_ids: np.ndarray, node_budget: int, max_chains: int = 1,
                  max_ngram: int = LOOKUP_MAX_NGRAM,
                  min_ngram: int = LOOKUP_MIN_NGRAM,
                  lookup_accept: Sequence[float] = LOOKUP_ACCEPT,
                  ) -> list[ScoredCandidates]:
    """Prompt-lookup chains as scored candidates (each root first): the
    continuations of the longest matching n-gram's occurrences, most recent
    first, one per distinct first token, at most ``max_chains``."""
    match_length, starts = find_ngram_matches(token_ids, max_ngram, min_ngram)
    if starts.size == 0:
        return []
    num_tokens = token_ids.shape[0]
    length_cap = int(node_budget)
    # Continuations of every occurrence, padded with -1 past the history.
    offsets = starts[:, None] + np.arange(length_cap)[None, :]
    continuations = np.where(offsets < num_tokens,
                             token_ids[np.minimum(offsets, num_tokens - 1)], -1)
    root = int(token_ids[-1])
    chains, first_tokens = [], set()
    for occurrence in range(starts.size - 1, -1, -1):
        if len(chains) == max_chains:
            break
        chain = continuations[occurrence]
        chain = chain[:int(np.argmax(chain < 0))] if (chain < 0).any() else chain
        if int(chain[0]) in first_tokens:
            continue
        first_tokens.add(int(chain[0]))
        length = chain.shape[0]
        agree = np.cumprod(continuations[:, :length] == chain[None, :], axis=1).mean(axis=0)
        accept = _lookup_accept(match_length + np.arange(length), lookup_accept)
        scores = np.cumsum(np.log(accept)) + np.log(agree)
        chains.append(ScoredCandidates(
            parents=torch.arange(-1, length, dtype=torch.long),
            tokens=torch.from_numpy(np.concatenate([[root], chain]).astype(np.int64)),
            scores=torch.from_numpy(np.concatenate([[0.0], scores]).astype(np.float32)),
            depths=torch.arange(length + 1, dtype=torch.long),
        ))
    return chains


def lookup_candidates(token_ids: np.ndarray, node_budget: int,
                      max_ngram: int = LOOKUP_MAX_NGRAM,
                      min_ngram: int = LOOKUP_MIN_NGRAM,
                      lookup_accept: Sequence[float] = LOOKUP_ACCEPT,
                      ) -> ScoredCandidates | None:
    """The most recent occurrence's chain (pure prompt lookup), or None."""
    chains = lookup_chains(token_ids, node_budget, 1, max_ngram, min_ngram, lookup_accept)
    return chains[0] if chains else None


def merge_candidates(tree: ScoredCandidates, chain: ScoredCandidates) -> ScoredCandidates:
    """Hang ``chain`` (a root-first chain) into ``tree``, sharing the prefix
    they have in common; a shared node keeps the larger of the two scores."""
    parents, tokens = tree.parents, tree.tokens
    scores = tree.scores.clone()
    attach = 0  # node of `tree` the rest of the chain hangs below
    depth = 1
    max_depth = int(tree.depths.max())
    chain_length = chain.num_candidates - 1
    # At most the tree's depth: k levels for ESP candidates, more once an
    # earlier chain was merged in (B <= 64).
    while depth <= min(chain_length, max_depth):
        hit = torch.nonzero((parents == attach) & (tokens == chain.tokens[depth]))
        if hit.numel() == 0:
            break
        attach = int(hit[0, 0])
        scores[attach] = torch.maximum(scores[attach], chain.scores[depth])
        depth += 1
    rest = chain_length - depth + 1
    if rest <= 0:
        return ScoredCandidates(parents, tokens, scores, tree.depths)
    first_new = tree.num_candidates
    new_parents = torch.arange(first_new - 1, first_new - 1 + rest, dtype=torch.long)
    new_parents[0] = attach
    return ScoredCandidates(
        parents=torch.cat([parents, new_parents]),
        tokens=torch.cat([tokens, chain.tokens[depth:]]),
        scores=torch.cat([scores, chain.scores[depth:]]),
        depths=torch.cat([tree.depths, chain.depths[depth:]]),
    )


def allocate_block(candidates: ScoredCandidates, block_size: int,
                   num_mask_tokens: int, mask_value: float = MASK_VALUE,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Spend ``block_size`` rows on draft nodes and mask rows, greedily.

    ``r(c) = exp(score)`` estimates the chance that candidate ``c`` is
    accepted; ``last(n) = r(n) - sum of r over n's kept children`` the chance
    that ``n`` is the last accepted node, the only one whose masks are read.
    Each round adds whichever is worth more per row:

    * a candidate whose parent is kept (1 row), worth ``r(c)``, less the
      ``mask_value * r(c)`` it takes from a masked parent's ``last``;
    * the ``k`` masks of a kept node (``k`` rows), worth
      ``mask_value * last(n)``.

    Returns the kept candidates (root first, then in the order added) and
    which candidates carry masks. Worked example, 4 rows, ``k = 1``,
    ``mask_value = 0.3``, one lookup chain with ``r = .8, .6, .3``:

        round 1: chain node 1 (.8)  vs  root masks (.3 * 1 = .3)      -> node
        round 2: chain node 2 (.6)  vs  best masks, node 1's (.3 * .8) -> node
        round 3: chain node 3 (.3)  vs  node 2's masks (.3 * .6 = .18) -> node

    The block is the 3-node chain without masks: a confident chain is worth
    more than the next step's ESP candidates. For a lone candidate with
    ``r = .2`` the root's masks (.3) come first, then the candidate
    (.2 * (1 - .3) = .14), then whatever remains.
    """
    num_candidates = candidates.num_candidates
    parents = candidates.parents.numpy()
    reach = np.exp(candidates.scores.double().numpy())
    reach[0] = 1.0
    # Ties: higher score, then smaller depth, then creation order.
    rank = np.empty(num_candidates, dtype=np.int64)
    rank[np.lexsort((np.arange(num_candidates), candidates.depths.numpy(), -reach))] = \
        np.arange(num_candidates)
    kept = np.zeros(num_candidates, dtype=bool)
    masked = np.zeros(num_candidates, dtype=bool)
    child_reach = np.zeros(num_candidates)
    kept[0] = True
    order = [0]
    rows = 1
    k = num_mask_tokens
    parent_index = np.maximum(parents, 0)
    while rows < block_size:
        addable = ~kept & kept[parent_index]
        addable[0] = False
        node_gain = np.where(addable, reach * (1.0 - mask_value * masked[parent_index]),
                             -np.inf)
        best_node = -1
        if addable.any():
            best = np.flatnonzero(node_gain == node_gain.max())
            best_node = int(best[np.argmin(rank[best])])
        best_mask = -1
        if k and rows + k <= block_size:
            mask_gain = np.where(kept & ~masked,
                                 mask_value * np.maximum(reach - child_reach, 0.0) / k,
                                 -np.inf)
            if np.isfinite(mask_gain).any():
                best_mask = int(np.argmax(mask_gain))
        if best_node < 0 and best_mask < 0:
            break
        if best_mask >= 0 and (best_node < 0 or mask_gain[best_mask] > node_gain[best_node]):
            masked[best_mask] = True
            rows += k
        else:
            kept[best_node] = True
            order.append(best_node)
            child_reach[parents[best_node]] += reach[best_node]
            rows += 1
    return torch.tensor(order, dtype=torch.long), torch.from_numpy(masked)


def hybrid_next_tree(token_ids: np.ndarray, root_token: int,
                     mask_logits: torch.Tensor | None, block_size: int,
                     num_mask_tokens: int, candidates: Sequence[str],
                     esp_weight: float = ESP_WEIGHT,
                     lookup_accept: Sequence[float] = LOOKUP_ACCEPT,
                     mask_value: float = MASK_VALUE,
                     ) -> DraftTree | None:
    """The step's tree from the enabled ``candidates`` ("esp", "ngram"),
    within ``block_size`` rows.

    With "esp", nodes and ``num_mask_tokens`` masks per masked node share
    the rows (``allocate_block``). With "ngram" alone the tree is prompt
    lookup's chain of up to ``block_size - 1`` nodes, no masks. Returns None
    when no source has a candidate (with "esp" enabled that is only a step
    with no mask logits and no lookup match; ``HybridSource`` then uses
    ESP's placeholder tree).
    """
    use_esp = "esp" in candidates
    node_budget = int(block_size) - 1
    chains = []
    if "ngram" in candidates:
        # Alone, lookup is exactly prompt lookup: one chain. Beside ESP, older
        # occurrences with other continuations compete for the budget too.
        chains = lookup_chains(token_ids, node_budget,
                               LOOKUP_MAX_CHAINS if use_esp else 1,
                               lookup_accept=lookup_accept)
    if use_esp and mask_logits is not None:
        scored = esp_candidates(mask_logits, node_budget, root_token)
        scored.scores[1:] += math.log(esp_weight)
    elif chains:
        # No mask logits (first step after prefill, or the last accepted node
        # had no masks), or lookup only.
        scored, chains = chains[0], chains[1:]
    else:
        return None
    for chain in chains:
        scored = merge_candidates(scored, chain)
    if not use_esp:
        return select_tree(scored, node_budget, 0)
    kept, masked = allocate_block(scored, block_size, num_mask_tokens, mask_value)
    return tree_from_candidates(scored, kept, num_mask_tokens, masked)
