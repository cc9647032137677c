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
4. **Select.** The root plus the ``B`` best-scored nodes (``select_tree``).
   Both sources' scores fall along every path, so the kept set is a tree.
   Every node carries the ``k`` masks, since any node can be the last
   accepted one and its masks seed the next step's ESP candidates.

Worked example, ``B = 4``, ``k = 1``, ``q = (0, .25, .45, .6, .7, .75)``,
ESP weight 0.5, history ``x the cat sat . the cat`` (root ``cat``):

    lookup: the 2-gram "the cat" occurred once, followed by "sat . the cat":
            sat .45, "." .45*.6 = .27, the .27*.7 = .19, cat .19*.75 = .14
    ESP:    mask top candidates is (p .5), sat (.3), was (.1), scaled by .5:
            is .25, sat .15, was .05
    merge:  "sat" is in both: one node, score max(.45, .15) = .45
    select: the best 4 are sat .45, "." .27, is .25, the .19

    tree:   cat -> {sat -> . -> the, is}     (scores shown as probabilities)

With only ``"ngram"`` the tree is exactly ``PromptLookupSource``'s chain of
``B`` tokens (no masks); with only ``"esp"`` the hybrid is not used
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
                                    esp_candidates, select_tree)

__all__ = [
    "LOOKUP_MAX_NGRAM",
    "LOOKUP_MIN_NGRAM",
    "find_ngram_matches",
    "lookup_candidates",
    "lookup_chains",
    "merge_candidates",
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


def hybrid_next_tree(token_ids: np.ndarray, root_token: int,
                     mask_logits: torch.Tensor | None, node_budget: int,
                     num_mask_tokens: int, candidates: Sequence[str],
                     esp_weight: float = ESP_WEIGHT,
                     lookup_accept: Sequence[float] = LOOKUP_ACCEPT,
                     ) -> DraftTree | None:
    """The step's tree from the enabled ``candidates`` ("esp", "ngram").

    ``num_mask_tokens`` masks ride on every node when "esp" is enabled
    (none otherwise). Returns None when no source has a candidate (with
    "esp" enabled that is only the first step after prefill without a lookup
    match; ``HybridSource`` then uses ESP's placeholder tree).
    """
    use_esp = "esp" in candidates
    num_masks = num_mask_tokens if use_esp else 0
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
        # No mask logits yet (first step after prefill), or lookup only.
        scored, chains = chains[0], chains[1:]
    else:
        return None
    for chain in chains:
        scored = merge_candidates(scored, chain)
    return select_tree(scored, node_budget, num_masks)
