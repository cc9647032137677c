# SPDX-License-Identifier: Apache-2.0
"""Hybrid draft trees: ESP mask candidates and prompt-lookup candidates in
one verification block, under one node budget.

ESP and prompt lookup fail in different places: lookup is strong where the
answer copies earlier text (extraction, summarisation, code edits), ESP where
it does not. Both only propose tokens for the same block, so one block can
hold both and verification keeps whichever is right.

Algorithm (one call per request per step):

1. **Lookup candidates** (suffix decoding's path, by frequency). The
   earlier occurrences of the history's last token, in the request's own
   history and in earlier requests' answers (``AnswerCorpus``), each with
   the context ``m`` it shares with the history's end (up to 16 tokens).
   For every ``m`` they have, the occurrences sharing at least ``m`` tokens
   vote token by token: the path takes the continuation most of them
   share, for at most ``m + LOOKUP_EXTEND`` tokens (a short context
   predicts a short way), while the share ``f_d`` that agrees with the
   whole path is at least ``LOOKUP_MIN_SHARE``. The path whose first ``m``
   tokens have the largest total share wins, the own history's among
   equals. Node ``c_d`` scores ``sum_{j<=d} log q(m + j - 1) + log f_d``:
   ``q(m)`` is the measured chance that a lookup token is accepted after
   an ``m``-token context (accepting a token lengthens it). Past ``m`` the
   scores keep falling, so only cheap rows go there.
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
(root ``cat``), ``LOOKUP_EXTEND`` 4:

    lookup: "cat" occurred once, after "the" like the history's end (2
            tokens of context), followed by "sat . the cat" and the
            history's end: a path of at most 2 + 4 tokens, here 4, each
            with share 1: sat .45, "." .45*.6 = .27, the .27*.7 = .189,
            cat .189*.75 = .142
    ESP:    mask top candidates is (p .5), sat (.3), was (.1), scaled by .5:
            is .25, sat .15, was .05
    merge:  "sat" is in both: one node, score max(.45, .15) = .45
    allocate (per row): sat .45 (beats the root's masks, .3), "." .27 (beats
            the root's .3 * (1 - .45)), is .25, the .189, cat .142, then
            masks: the root's (.3 * (1 - .45 - .25) = .09) and is's (.3 *
            .25 = .075), each beating was's .05 * (1 - .3) = .035 and the
            other nodes' masks (sat's .3 * (.45 - .27) = .054 and less)

    tree:   cat -> {sat -> . -> the -> cat, is}, the root and "is" masked:
            6 nodes + 2 mask rows = 8 rows

With only ``"ngram"`` the tree is the first lookup chain (step 1) of
up to ``block_size - 1`` tokens (no masks); with only ``"esp"`` the hybrid is not used
(``core.batch.TreeProposer`` builds the paper's static or dynamic tree). Merged nodes are verified
like any node, so the method stays lossless whatever the scores are; the
scores only decide which candidates get the budget.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Hashable, Sequence

import numpy as np
import torch
from numba import njit

from vllm_esp.core.goodput import SOURCE_CORPUS, SOURCE_LOOKUP
from vllm_esp.core.proposal import (
    ScoredCandidates,
)

__all__ = [
    "AnswerCorpus",
    "AnswerPools",
    "LOOKUP_MAX_CONTEXT",
    "LOOKUP_MAX_NGRAM",
    "LOOKUP_MIN_NGRAM",
    "find_ngram_matches",
    "lookup_occurrences",
    "lookup_candidates",
    "lookup_chains",
    "merge_candidates",
    "allocate_block",
]

# Lookup matches the history's last token (a 1-gram) and ranks its earlier
# occurrences by how much context they share (LOOKUP_ACCEPT), which does what
# a longer n-gram would and also finds continuations with less context.
LOOKUP_MAX_NGRAM = 1
LOOKUP_MIN_NGRAM = 1

# q(m): chance that the next lookup token is accepted when the chain's
# occurrence shares m tokens of context with the history's end (accepted
# chain tokens lengthen it; m >= len - 1 uses the last entry, which also caps
# how far back contexts are compared). Fitted with
# benchmarks/calibrate_hybrid.py's lookup_rates on SmolLM2-135M's greedy
# answers (vLLM, fp32) to Spec-Bench questions 1-4 of each category (52
# prompts, 128 tokens; the benchmarks' tables use questions 5-6), made
# non-decreasing by pooling neighbours. With 'auto' blocks they are rescaled online from the engine's
# verification outcomes (core.goodput). Only the ranking of candidates
# depends on these numbers, never the output.
LOOKUP_ACCEPT = (0.0, 0.23, 0.49, 0.655, 0.66, 0.77, 0.82, 0.82, 0.84, 0.84, 0.84,
                 0.84, 0.9, 0.9, 0.92, 0.92, 0.96)
# How many tokens of context lookup compares at most (the table's last entry).
LOOKUP_MAX_CONTEXT = len(LOOKUP_ACCEPT) - 1
# Occurrences that vote on a lookup path, at most, per source (the longest
# contexts first): a frequent token can occur thousands of times.
LOOKUP_MAX_PEERS = 64
# A lookup path stops where less than this share of its occurrences agree
# with it (suffix decoding's min_token_prob default).
LOOKUP_MIN_SHARE = 0.1
# A lookup path may run this many tokens past the context ``m`` it matched
# (suffix decoding stops at ``m``). Those tokens are right less often, and
# their estimates fall with them, so the allocation buys them only where
# rows are cheap (batch 1 on CPU: a row there costs about 1% of a step).
# In a replay of greedy answers to Spec-Bench questions 1-4 (not the
# benchmark's; no model; docs/results.md, "Where the accepted tokens come
# from") they added 5% (SmolLM2) to 10% (Gemma-3) tokens per step at a
# threshold of 0.05 on the estimates, and almost none at 0.3.
LOOKUP_EXTEND = 4
# Mask probabilities overstate acceptance: a level-1 candidate with mask
# probability p was the next token about 0.35 p of the time (same script).
ESP_WEIGHT = 0.35
# Lookup chains per step: the better of the own history's and the answer
# corpus's paths. A second chain (the other source's) bought fewer tokens
# per row in a replay of greedy answers to Spec-Bench questions 3-4
# (docs/results.md, "Lookup by frequency").
LOOKUP_MAX_CHAINS = 1
# Expected extra tokens that ESP candidates bring to the next step, per unit
# of probability that a node is the last accepted one. Mask rows go where
# this beats another draft node (``allocate_block``). Chosen with the
# reference decoder on SmolLM2 (benchmarks/reference_tau.py); like the other
# scores it only decides the tree's shape, never the output. With 'auto'
# blocks it is only the prior: core.goodput.MaskValueCalibration learns the
# value from what the masks' candidates earn.
MASK_VALUE = 0.1



# ----------------------------------------------------------- compiled core
# Functions of one request's arrays (vllm_esp.core.batch runs them over a
# batch); the wrappers below serve one request.

@njit(cache=True)
def ngram_matches_kernel(history, max_ngram, min_ngram, starts):
    """The longest suffix n-gram of ``history`` (``max_ngram`` down to
    ``min_ngram``) with an earlier occurrence followed by at least one
    token. Writes where each occurrence's continuation starts into
    ``starts`` (ascending: the most recent last); returns ``(n, count)``,
    ``(0, 0)`` if none."""
    size = history.shape[0]
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        count = 0
        for start in range(size - n):
            same = True
            for j in range(n):
                if history[start + j] != history[size - n + j]:
                    same = False
                    break
            if same:
                starts[count] = start + n
                count += 1
        if count > 0:
            return n, count
    return 0, 0


@njit(cache=True)
def lookup_occurrences_kernel(history, max_ngram, min_ngram, max_context, starts,
                              contexts):
    """The longest suffix n-gram's occurrences (``ngram_matches_kernel``),
    ordered by how much context they share with the end of ``history``:
    each occurrence's match is extended backwards token by token (up to
    ``max_context``), and the occurrences are sorted by that length, the
    most recent first among equals. Writes ``starts`` (where each
    continuation starts) and ``contexts`` (the lengths) in that order;
    returns their count."""
    size = history.shape[0]
    found = np.empty(max(size, 1), np.int64)
    match_length, count = ngram_matches_kernel(history, max_ngram, min_ngram, found)
    if count == 0:
        return 0
    lengths = np.empty(count, np.int64)
    for i in range(count):
        end = found[i]
        length = match_length
        # Separators (-1, between the answers of an answer corpus) end a
        # context on either side.
        while (length < max_context and end - length - 1 >= 0
               and history[size - length - 1] >= 0
               and history[end - length - 1] == history[size - length - 1]):
            length += 1
        lengths[i] = length
    # Longest context first; among equals the most recent (larger start).
    order = np.argsort(-(lengths * (size + 1) + found[:count]))
    for i in range(count):
        starts[i] = found[order[i]]
        contexts[i] = lengths[order[i]]
    return count


@njit(cache=True)
def frequency_path_kernel(history, starts, contexts, count, node_budget, lookup_accept,
                          path_tokens, path_scores):
    """The most frequent continuation of some of the history's contexts
    (suffix decoding's path, see the module docstring), into
    ``path_tokens/path_scores``; returns ``(length, total share)``.

    ``starts/contexts[:count]``: occurrences of the history's last token
    (where each continuation starts, how many tokens of context it shares
    with the history's end), the longest context first. For each context
    length ``m`` they have, the occurrences sharing at least ``m`` tokens
    (a prefix of the list) vote token by token: the path takes the
    continuation most of them share (the earliest listed among ties), for
    at most ``m + LOOKUP_EXTEND`` tokens, while the share ``f_d`` that
    agrees with the whole path so far is at least ``LOOKUP_MIN_SHARE``. The
    ``m`` whose path has the largest total share over its first ``m``
    tokens wins, the longer context among equals (so the extension never
    changes which ``m`` wins). Node ``d`` scores ``sum_{j <= d} log q(m + j
    - 1) + log f_d``."""
    size = history.shape[0]
    table_size = lookup_accept.shape[0]
    alive = np.empty(max(count, 1), np.bool_)
    tokens_here = np.empty(max(count, 1), np.int64)
    best_length = 0
    best_total = 0.0
    end = count
    while end > 0:
        context = contexts[end - 1]
        # members: the occurrences sharing at least `context` tokens.
        members = end
        while end > 0 and contexts[end - 1] == context:
            end -= 1
        limit = min(node_budget, context + LOOKUP_EXTEND)
        for j in range(members):
            alive[j] = True
        total = 0.0
        log_accept = 0.0
        length = 0
        for d in range(limit):
            for j in range(members):
                position = starts[j] + d
                tokens_here[j] = history[position] if (alive[j] and position < size) else -1
            best_token = -1
            best_votes = 0
            for j in range(members):
                token = tokens_here[j]
                if token < 0 or token == best_token:
                    continue
                votes = 0
                for other in range(j, members):
                    if tokens_here[other] == token:
                        votes += 1
                if votes > best_votes:
                    best_token = token
                    best_votes = votes
            share = best_votes / members
            if best_token < 0 or share < LOOKUP_MIN_SHARE:
                break
            for j in range(members):
                alive[j] = tokens_here[j] == best_token
            log_accept += math.log(lookup_accept[min(context + d, table_size - 1)])
            path_tokens[d] = best_token
            path_scores[d] = np.float32(log_accept + math.log(share))
            if d < context:
                total += share
            length += 1
        if total > best_total:
            best_total = total
            best_length = length
            # Kept in the slots past node_budget until a better path comes.
            for d in range(length):
                path_tokens[node_budget + d] = path_tokens[d]
                path_scores[node_budget + d] = path_scores[d]
    for d in range(best_length):
        path_tokens[d] = path_tokens[node_budget + d]
        path_scores[d] = path_scores[node_budget + d]
    return best_length, best_total


@njit(cache=True)
def lookup_chains_kernel(history, corpus_size, node_budget, max_chains, lookup_accept,
                         chain_tokens, chain_scores, chain_lengths, chain_sources):
    """Lookup chains into ``chain_tokens/chain_scores`` (rows of
    ``node_budget``; the root excluded): the most frequent continuation
    (``frequency_path_kernel``) among the occurrences in the request's own
    history and, separately, among those in the answer corpus; the larger
    total share first (the own history's among equals), the other one
    second if ``max_chains`` allows and it starts with another token.
    Returns the number of chains.

    ``history`` may start with an answer corpus (``corpus_size`` tokens,
    earlier requests' answers each followed by a -1 separator): paths stop
    at a separator, and ``chain_sources`` says where each chain came from
    (``SOURCE_LOOKUP`` or ``SOURCE_CORPUS``)."""
    size = history.shape[0]
    starts = np.empty(max(size, 1), np.int64)
    contexts = np.empty(max(size, 1), np.int64)
    num_matches = lookup_occurrences_kernel(history, LOOKUP_MAX_NGRAM, LOOKUP_MIN_NGRAM,
                                            lookup_accept.shape[0] - 1, starts, contexts)
    # Per source (0: the own history, 1: the answer corpus), the
    # LOOKUP_MAX_PEERS longest contexts vote; occurrences followed by a
    # separator have no continuation.
    cap = min(num_matches, LOOKUP_MAX_PEERS)
    voter_starts = np.empty((2, max(cap, 1)), np.int64)
    voter_contexts = np.empty((2, max(cap, 1)), np.int64)
    num_voters = np.zeros(2, np.int64)
    for i in range(num_matches):
        source = 1 if starts[i] < corpus_size else 0
        if history[starts[i]] < 0 or num_voters[source] == cap:
            continue
        voter_starts[source, num_voters[source]] = starts[i]
        voter_contexts[source, num_voters[source]] = contexts[i]
        num_voters[source] += 1
    path_tokens = np.empty((2, 2 * node_budget), np.int64)
    path_scores = np.empty((2, 2 * node_budget), np.float32)
    lengths = np.zeros(2, np.int64)
    totals = np.zeros(2)
    for source in range(2):
        lengths[source], totals[source] = frequency_path_kernel(
            history, voter_starts[source], voter_contexts[source], num_voters[source],
            node_budget, lookup_accept, path_tokens[source], path_scores[source])
    num_chains = 0
    # The larger total share first, the own history's among equals.
    first = 0 if totals[0] >= totals[1] else 1
    for source in (first, 1 - first):
        length = lengths[source]
        if num_chains == max_chains or length == 0:
            continue
        if num_chains == 1 and chain_tokens[0, 0] == path_tokens[source, 0]:
            continue
        for d in range(length):
            chain_tokens[num_chains, d] = path_tokens[source, d]
            chain_scores[num_chains, d] = path_scores[source, d]
        chain_lengths[num_chains] = length
        chain_sources[num_chains] = SOURCE_CORPUS if source == 1 else SOURCE_LOOKUP
        num_chains += 1
    return num_chains


@njit(cache=True)
def merge_chain_kernel(parents, tokens, scores, priors, depths, count, chain_tokens,
                       chain_scores, chain_priors, chain_length, sources, chain_source):
    """Hang a chain (tokens/scores of depths 1..L under the root) into the
    candidates, sharing the prefix they have in common; a shared node keeps
    the larger score (and the prior score, in ``priors``, and the source tag,
    in ``sources``, of the source that gave it). Appends the rest; returns
    the new count."""
    max_depth = 0
    for i in range(count):
        max_depth = max(max_depth, depths[i])
    attach = 0
    depth = 1
    while depth <= min(chain_length, max_depth):
        hit = -1
        for i in range(count):
            if parents[i] == attach and tokens[i] == chain_tokens[depth - 1]:
                hit = i
                break
        if hit < 0:
            break
        attach = hit
        if chain_scores[depth - 1] > scores[attach]:
            scores[attach] = chain_scores[depth - 1]
            priors[attach] = chain_priors[depth - 1]
            sources[attach] = chain_source
        depth += 1
    for d in range(depth, chain_length + 1):
        parents[count] = attach
        tokens[count] = chain_tokens[d - 1]
        scores[count] = chain_scores[d - 1]
        priors[count] = chain_priors[d - 1]
        depths[count] = d
        sources[count] = chain_source
        attach = count
        count += 1
    return count


@njit(cache=True)
def allocate_block_kernel(parents, scores, depths, count, block_size, num_mask_tokens,
                    mask_value, kept, masked, gains):
    """Greedy row allocation (see ``allocate_block``). Writes the kept
    candidates in the order added into ``kept``, the mask flags into
    ``masked`` and each row's gain, in the order the rows were added, into
    ``gains`` (``block_size - 1`` entries at most; a node's gain is its
    expected accepted tokens, a mask row's its share of the masks' value);
    returns how many candidates were kept."""
    reach = np.exp(scores[:count].astype(np.float64))
    reach[0] = 1.0
    # Ties: higher score, then smaller depth, then creation order.
    rank = np.empty(count, np.int64)
    by_index = np.arange(count)
    order = by_index[np.argsort(depths[:count], kind="mergesort")]
    order = order[np.argsort(-reach[order], kind="mergesort")]
    for position in range(count):
        rank[order[position]] = position
    is_kept = np.zeros(count, np.bool_)
    child_reach = np.zeros(count)
    for i in range(count):
        masked[i] = False
    is_kept[0] = True
    kept[0] = 0
    num_kept = 1
    rows = 1
    k = num_mask_tokens
    while rows < block_size:
        best_node = -1
        best_gain = -np.inf
        for c in range(1, count):
            if is_kept[c] or not is_kept[parents[c]]:
                continue
            gain = reach[c] * (1.0 - mask_value * masked[parents[c]])
            if best_node < 0 or gain > best_gain or (gain == best_gain
                                                    and rank[c] < rank[best_node]):
                best_node = c
                best_gain = gain
        best_mask = -1
        best_mask_gain = -np.inf
        if k > 0 and rows + k <= block_size:
            for c in range(count):
                if is_kept[c] and not masked[c]:
                    gain = mask_value * max(reach[c] - child_reach[c], 0.0) / k
                    if best_mask < 0 or gain > best_mask_gain:
                        best_mask = c
                        best_mask_gain = gain
        if best_node < 0 and best_mask < 0:
            break
        if best_mask >= 0 and (best_node < 0 or best_mask_gain > best_gain):
            masked[best_mask] = True
            for j in range(k):
                gains[rows - 1 + j] = best_mask_gain
            rows += k
        else:
            is_kept[best_node] = True
            kept[num_kept] = best_node
            num_kept += 1
            child_reach[parents[best_node]] += reach[best_node]
            gains[rows - 1] = best_gain
            rows += 1
    return num_kept


# ------------------------------------------------------------ answer corpus
class AnswerCorpus:
    """Earlier requests' answers, for prompt lookup across requests.

    Answers to similar prompts repeat each other's phrases (a greeting, a
    code idiom, a list's format), which the request's own history cannot
    know yet; vLLM's ``suffix`` method keeps a global tree of earlier
    answers for the same reason. ``tokens`` holds the most recent answers,
    each followed by a -1 separator, oldest first, at most ``max_tokens``
    in all (an answer longer than that keeps its end). Lookup searches it
    before the request's own history (``lookup_chains_kernel``); the own
    history wins ties, being more recent.

    Example, ``max_tokens=8``: ``add([5, 6, 7])``, then ``add([8, 9])``,
    gives ``[5, 6, 7, -1, 8, 9, -1]``; ``add([1, 2, 3])`` then drops the
    oldest answer: ``[8, 9, -1, 1, 2, 3, -1]``.
    """

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max(int(max_tokens), 0)
        self._answers: collections.deque[np.ndarray] = collections.deque()
        self._size = 0
        self.tokens = np.zeros(0, np.int64)

    def add(self, token_ids: Sequence[int]) -> None:
        if self.max_tokens < 2 or len(token_ids) == 0:
            return
        answer = np.asarray(token_ids[-(self.max_tokens - 1):], np.int64)
        self._answers.append(np.append(answer, -1))
        self._size += answer.size + 1
        while self._size > self.max_tokens:
            self._size -= self._answers.popleft().size
        self.tokens = np.concatenate(self._answers)


# Answer pools kept at most (one per cache salt, the unsalted one included)
# and how long a salt may go unseen before its pool is dropped. With the
# default lookup_cache_tokens (8192) 64 full pools hold 512 Ki tokens, about
# 8 MiB as int64 (an AnswerCorpus keeps its answers and their concatenation).
MAX_ANSWER_POOLS = 64
ANSWER_POOL_IDLE_SECONDS = 3600.0


class AnswerPools:
    """Answer corpora kept apart by tenant, as vLLM keeps its prefix cache
    apart by ``cache_salt``: a request's lookup searches only the answers of
    earlier requests that carried the same salt, and requests without one
    share the unsalted pool (key ``None``). One tenant's drafts, and so how
    fast its requests are accepted, then never depend on another tenant's
    text.

    Each pool is an ``AnswerCorpus`` of up to ``max_tokens`` tokens, so a
    tenant's cache does not shrink when others ask more. At most
    ``max_pools`` pools are kept: a new salt evicts the pool seen least
    recently, and a pool whose salt was not seen (a request of it proposed
    for, or finished) for ``max_idle`` seconds is dropped.

    Example, ``max_tokens=8``: ``add("a", [5, 6])``, ``add(None, [7])``;
    ``corpus(["a", None, "b", "a"])`` gives the tokens
    ``[5, 6, -1, 7, -1]`` and the spans ``[0, 3, 0, 0]`` to ``[3, 5, 0, 3]``
    (salt ``"b"`` has no pool yet: an empty span).
    """

    def __init__(self, max_tokens: int, max_pools: int = MAX_ANSWER_POOLS,
                 max_idle: float = ANSWER_POOL_IDLE_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_tokens = max(int(max_tokens), 0)
        self.max_pools = max(int(max_pools), 1)
        self.max_idle = float(max_idle)
        self._clock = clock
        # salt -> (pool, last seen), least recently seen first.
        self._pools: collections.OrderedDict[Hashable, list] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._pools)

    def __contains__(self, salt: Hashable) -> bool:
        return salt in self._pools

    def add(self, salt: Hashable, token_ids: Sequence[int]) -> None:
        """A finished request's answer joins its salt's pool."""
        if self.max_tokens < 2 or len(token_ids) == 0:
            return
        now = self._clock()
        entry = self._pools.get(salt)
        if entry is None:
            entry = self._pools[salt] = [AnswerCorpus(self.max_tokens), now]
        self._touch(salt, entry, now)
        entry[0].add(token_ids)
        self._evict(now)

    def tokens(self, salt: Hashable) -> np.ndarray:
        """The pool of ``salt`` (``AnswerCorpus.tokens``; empty if none)."""
        tokens, _, _ = self.corpus([salt])
        return tokens

    def corpus(self, salts: Sequence[Hashable]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The pools of one step's requests (``salts[i]``: request ``i``'s
        salt) in one array, and where request ``i``'s pool lies in it:
        ``tokens[starts[i]:ends[i]]``, empty where its salt has no pool.
        Each pool appears once, however many requests share it."""
        count = len(salts)
        starts = np.zeros(count, np.int64)
        ends = np.zeros(count, np.int64)
        if not self._pools:
            return np.zeros(0, np.int64), starts, ends
        now = self._clock()
        spans: dict[Hashable, tuple[int, int]] = {}
        parts: list[np.ndarray] = []
        size = 0
        for i, salt in enumerate(salts):
            span = spans.get(salt)
            if span is None:
                entry = self._pools.get(salt)
                span = (0, 0)
                if entry is not None:
                    self._touch(salt, entry, now)
                    pool = entry[0].tokens
                    span = (size, size + pool.shape[0])
                    parts.append(pool)
                    size += pool.shape[0]
                spans[salt] = span
            starts[i], ends[i] = span
        self._evict(now)
        if len(parts) == 1:
            return parts[0], starts, ends
        tokens = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return tokens, starts, ends

    def _touch(self, salt: Hashable, entry: list, now: float) -> None:
        entry[1] = now
        self._pools.move_to_end(salt)

    def _evict(self, now: float) -> None:
        pools = self._pools
        while len(pools) > self.max_pools:
            pools.popitem(last=False)
        while pools:
            salt, (_, seen) = next(iter(pools.items()))
            if now - seen <= self.max_idle:
                break
            del pools[salt]


# ------------------------------------------------------------- one request
def _lookup_accept(table: Sequence[float]) -> np.ndarray:
    return np.asarray(table, dtype=np.float64)


def find_ngram_matches(token_ids: np.ndarray, max_ngram: int,
                       min_ngram: int) -> tuple[int, np.ndarray]:
    """The longest suffix n-gram (``max_ngram`` down to ``min_ngram``) that
    occurred before, and where each earlier occurrence's continuation starts
    (ascending, so the most recent is last). ``(0, [])`` if none."""
    history = np.asarray(token_ids, dtype=np.int64)
    starts = np.empty(max(history.shape[0], 1), np.int64)
    n, count = ngram_matches_kernel(history, max_ngram, min_ngram, starts)
    return n, starts[:count].copy()


def lookup_occurrences(token_ids: np.ndarray, max_ngram: int = LOOKUP_MAX_NGRAM,
                       min_ngram: int = LOOKUP_MIN_NGRAM,
                       max_context: int = LOOKUP_MAX_CONTEXT,
                       ) -> tuple[np.ndarray, np.ndarray]:
    """The longest suffix n-gram's earlier occurrences in the order lookup
    uses them: where each continuation starts, and how many tokens of
    context each shares with the end of the history (at most
    ``max_context``), the longest context first, the most recent first
    among equals."""
    history = np.asarray(token_ids, dtype=np.int64)
    starts = np.empty(max(history.shape[0], 1), np.int64)
    contexts = np.empty(max(history.shape[0], 1), np.int64)
    count = lookup_occurrences_kernel(history, max_ngram, min_ngram, max_context,
                                      starts, contexts)
    return starts[:count].copy(), contexts[:count].copy()


def lookup_chains(token_ids: np.ndarray, node_budget: int,
                  max_chains: int = LOOKUP_MAX_CHAINS,
                  lookup_accept: Sequence[float] = LOOKUP_ACCEPT,
                  corpus: np.ndarray | None = None,
                  ) -> list[ScoredCandidates]:
    """Lookup chains as scored candidates (each root first): the most
    frequent continuation in the request's own history and in ``corpus``
    (an answer corpus, ``AnswerCorpus.tokens``), the better one first, at
    most ``max_chains`` (``lookup_chains_kernel``)."""
    history = np.asarray(token_ids, dtype=np.int64)
    corpus_size = 0
    if corpus is not None and len(corpus):
        corpus_size = len(corpus)
        history = np.concatenate([np.asarray(corpus, np.int64), history])
    budget = int(node_budget)
    chain_tokens = np.empty((max_chains, budget), np.int64)
    chain_scores = np.empty((max_chains, budget), np.float32)
    chain_lengths = np.empty(max_chains, np.int64)
    chain_sources = np.empty(max_chains, np.int8)
    num_chains = lookup_chains_kernel(history, corpus_size, budget, max_chains,
                                      _lookup_accept(lookup_accept), chain_tokens,
                                      chain_scores, chain_lengths, chain_sources)
    root = int(history[-1])
    chains = []
    for c in range(num_chains):
        length = int(chain_lengths[c])
        chains.append(ScoredCandidates(
            parents=torch.arange(-1, length, dtype=torch.long),
            tokens=torch.from_numpy(np.concatenate([[root], chain_tokens[c, :length]])),
            scores=torch.from_numpy(np.concatenate(
                [np.zeros(1, np.float32), chain_scores[c, :length]])),
            depths=torch.arange(length + 1, dtype=torch.long),
        ))
    return chains


def lookup_candidates(token_ids: np.ndarray, node_budget: int,
                      lookup_accept: Sequence[float] = LOOKUP_ACCEPT,
                      ) -> ScoredCandidates | None:
    """The request's own lookup chain, or None."""
    chains = lookup_chains(token_ids, node_budget, 1, lookup_accept)
    return chains[0] if chains else None


def merge_candidates(tree: ScoredCandidates, chain: ScoredCandidates) -> ScoredCandidates:
    """Hang ``chain`` (a root-first chain) into ``tree``, sharing the prefix
    they have in common; a shared node keeps the larger of the two scores."""
    count = tree.num_candidates
    capacity = count + chain.num_candidates
    parents, tokens, scores, depths = (np.resize(a, capacity) for a in tree.arrays())
    _, chain_tokens, chain_scores, _ = chain.arrays()
    sources = np.zeros(capacity, np.int8)
    # Uncalibrated here: every prior score is the score itself.
    priors = scores.copy()
    count = merge_chain_kernel(parents, tokens, scores, priors, depths, count,
                               chain_tokens[1:], chain_scores[1:], chain_scores[1:],
                               chain.num_candidates - 1, sources, 1)
    return ScoredCandidates.from_arrays(parents, tokens, scores, depths, count)


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
    parents, _, scores, depths = candidates.arrays()
    count = candidates.num_candidates
    kept = np.empty(count, np.int64)
    masked = np.empty(count, np.bool_)
    gains = np.empty(max(int(block_size), 1), np.float64)
    num_kept = allocate_block_kernel(parents, scores, depths, count, int(block_size),
                                     int(num_mask_tokens), float(mask_value), kept, masked,
                                     gains)
    return torch.from_numpy(kept[:num_kept].copy()), torch.from_numpy(masked)
