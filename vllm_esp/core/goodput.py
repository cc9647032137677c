# SPDX-License-Identifier: Apache-2.0
"""Goodput-aware block sizes: how many rows each request verifies this step.

Speculation pays only while a row's chance of being accepted is worth its
cost, and the cost depends on the hardware and the load. With ``auto``
block complexity, every step allocates rows across the whole batch to
maximise expected tokens per second (SmartSpec's goodput, Sequoia's
hardware-aware tree size):

* **Gains.** The tree proposer ranks each request's possible rows greedily
  (``core.hybrid.allocate_block_kernel``): a draft node's gain is the estimated
  chance it is accepted (its path's reach); a mask row's gain is the value
  of the next step's ESP candidates it seeds. A request's gains are
  non-increasing along its ranking, so any prefix is a tree (ancestors
  first) and the first ``n`` rows are the best ``n``.
* **Cost.** :class:`StepCostModel`: step time ``t(R, B, D) = fixed +
  per_request * B + per_row * R + per_drafted_step * D`` for ``R`` rows
  (tokens) in the forward, ``B`` requests and ``D`` = 1 when the step
  verifies drafts, from a start-up profile and corrected online from
  measured step times.
* **Allocation.** :func:`allocate_rows`: every request keeps its root row
  (it emits one token in any case); extra rows are taken in order of gain
  across the batch, and the allocation stops at the count that maximises
  ``(requests + sum of gains) / t(rows)``. A request may get no extra row
  (a plain decoding step), and so may the whole batch.
* **Draining.** That goodput is the right aim while a request that
  finishes makes room for one that waits. Once the batch only drains (no
  request waits or arrives: the last wave of an offline ``generate``),
  the run ends when its slowest request does, and a token accepted for any
  other request saves only that request's part of a step (``per_request``
  and its rows), not a share of the step's fixed cost, which is paid until
  the end. :func:`drain_token_values` prices each request's
  tokens so, and :func:`allocate_rows` then buys the rows whose expected
  savings exceed their cost (docs/design.md, "Draining batches").
* **Calibration.** :class:`AcceptanceCalibration` scales the estimates of
  each candidate source, for each band of temperature
  (:func:`sampling_bands`), in each band of estimated reach (below 0.1, 0.1 to
  0.2, 0.2 to 0.35, 0.35 to 0.55, above) by how often such drafts were
  really accepted, so the priors only matter for the first steps. Bands of
  reach, not of depth: the rows the allocation weighs last are the ones
  with low estimates, and those were the most overrated, at every depth
  (docs/results.md, "The cost model's slope").
  Bands of temperature, because a sampled request accepts a draft with the
  target's probability of its token, not whenever it is the argmax: the
  same lookup chain is worth less the hotter a request samples, and one
  estimate pooled over greedy and sampled requests bought rows for sampled
  requests that did not pay.

Worked example: 2 requests, cost ``t(R) = 1 + 0.1 R``; request 0's gains
``[.9, .5, .05]``, request 1's ``[.3]``::

    rows  tokens expected         t     goodput
    2     2                       1.2   1.667
    3     2.9 (+.9, request 0)    1.3   2.231
    4     3.4 (+.5, request 0)    1.4   2.429
    5     3.7 (+.3, request 1)    1.5   2.467   <- best
    6     3.75 (+.05)             1.6   2.344

    -> request 0 gets 2 extra rows, request 1 gets 1.

Only the block shapes depend on these estimates; verification stays
lossless whatever they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit

__all__ = ["StepCostModel", "AcceptanceCalibration", "MaskValueCalibration", "StepBudget",
           "SamplingCalibration", "VerificationTally", "tally_verification",
           "allocate_rows", "drain_token_values", "CRITICAL_SHARE",
           "sampling_bands", "sampling_band_labels", "NUM_SAMPLING_BANDS", "GREEDY_BAND",
           "SOURCE_ESP", "SOURCE_LOOKUP", "SOURCE_CORPUS", "NUM_SOURCES", "REACH_EDGES",
           "NUM_REACH_BUCKETS", "reach_buckets", "reach_band_labels"]

# Candidate sources (node tags written by the hybrid kernel): ESP's mask
# candidates, lookup in the request's own history, lookup in earlier
# requests' answers (core.hybrid.AnswerCorpus).
SOURCE_ESP, SOURCE_LOOKUP, SOURCE_CORPUS = 0, 1, 2
NUM_SOURCES = 3
# Calibration cells per source: bands of a node's prior estimated reach
# (its chance of being accepted, before calibration).
# The compiled proposal kernels bucket with the same array and call.
REACH_EDGES = np.array([0.1, 0.2, 0.35, 0.55])
NUM_REACH_BUCKETS = len(REACH_EDGES) + 1


# Calibration by how a request samples: band 0 is greedy (vLLM's sampler
# treats a temperature below 1e-5 as greedy), then temperatures below 0.5,
# from 0.5 to 0.9 (chat front-ends), and 0.9 and above (OpenAI clients'
# default of 1).
GREEDY_BAND = 0
GREEDY_TEMPERATURE = 1e-5
TEMPERATURE_EDGES = np.array([0.5, 0.9])
NUM_SAMPLING_BANDS = len(TEMPERATURE_EDGES) + 2


def sampling_bands(temperatures: np.ndarray) -> np.ndarray:
    """Calibration band of requests sampling at ``temperatures``."""
    temperatures = np.asarray(temperatures, np.float64)
    sampled = 1 + np.searchsorted(TEMPERATURE_EDGES, temperatures, side="right")
    return np.where(temperatures < GREEDY_TEMPERATURE, GREEDY_BAND, sampled).astype(np.int64)


def sampling_band_labels() -> list[str]:
    """The sampling bands, for logs: ``greedy``, ``T<0.5``, ..."""
    edges = [f"{edge:g}" for edge in TEMPERATURE_EDGES]
    return (["greedy", f"T<{edges[0]}"] + [f"T {lo}-{hi}" for lo, hi in zip(edges, edges[1:])]
            + [f"T>={edges[-1]}"])


def reach_buckets(reach: np.ndarray) -> np.ndarray:
    """Calibration cell of drafted nodes whose prior estimate is ``reach``."""
    return np.searchsorted(REACH_EDGES, np.asarray(reach, np.float64), side="right")


def reach_band_labels() -> list[str]:
    """The calibration cells' bands, for logs: ``<0.1``, ``0.1-0.2``, ..."""
    edges = [f"{edge:g}" for edge in REACH_EDGES]
    return ([f"<{edges[0]}"] + [f"{lo}-{hi}" for lo, hi in zip(edges, edges[1:])]
            + [f">={edges[-1]}"])


@dataclass(frozen=True)
class StepBudget:
    """What one step's allocation needs: the cost model's current fit, the
    rows the step has without drafts, a cap on its total rows (the
    scheduler's token budget), the calibration scales
    (``[NUM_SOURCES, NUM_REACH_BUCKETS]`` for every request, or
    ``[NUM_SAMPLING_BANDS, NUM_SOURCES, NUM_REACH_BUCKETS]`` with each
    request's band in ``bands``; None for all 1), the mask rows' value
    (one, or one per band) and, while the batch drains, what each request's
    accepted tokens save (``token_values``)."""

    fixed_cost: float
    cost_per_row: float
    base_rows: int
    max_total_rows: int | None = None
    # What a step costs more once it verifies drafts (StepCostModel).
    cost_per_drafted_step: float = 0.0
    scales: np.ndarray | None = None
    # What mask rows are worth (MaskValueCalibration); None: the prior.
    mask_value: float | np.ndarray | None = None
    # [B] each request's sampling band (sampling_bands), indexing the
    # leading axis of 3-d scales and of an array mask_value.
    bands: np.ndarray | None = None
    # [B] seconds an accepted token of each request saves while the batch
    # drains (drain_token_values); None: the goodput aim.
    token_values: np.ndarray | None = None


def allocate_rows(gains: np.ndarray, num_gains: np.ndarray, base_rows: int,
                  fixed_cost: float, cost_per_row: float,
                  max_total_rows: int | None = None,
                  cost_per_drafted_step: float = 0.0,
                  token_values: np.ndarray | None = None) -> np.ndarray:
    """Extra rows per request that maximise expected tokens per unit time.

    ``gains[i, :num_gains[i]]``: request ``i``'s candidate rows in its
    greedy order (expected accepted tokens each). ``base_rows``: rows the
    step has in any case (every request's root, other requests' tokens);
    each request in ``gains`` emits one token without drafts. Returns
    ``[B]`` extra-row counts (prefixes of each request's order).

    Rows are taken by decreasing gain (a request's own in its order: its
    gains are first made non-increasing, so that every prefix stays
    intact), lower position first on ties, then lower request, and the
    count taken is the goodput argmax (the first, on ties). Any extra row
    also costs ``cost_per_drafted_step`` once (the step then verifies
    drafts).

    ``token_values`` (``[B]`` seconds, :func:`drain_token_values`): what an
    accepted token of each request saves while the batch drains. Rows are
    then ranked by gain times their request's value and the count taken
    maximises the savings less the rows' cost (``fixed_cost`` is not used):
    none unless they exceed ``cost_per_drafted_step`` too.
    """
    batch = gains.shape[0]
    extra = np.zeros(batch, np.int64)
    by_value = token_values is not None
    if batch == 0 or cost_per_row <= 0 or (fixed_cost <= 0 and not by_value):
        return extra
    room = -1 if max_total_rows is None else max(int(max_total_rows) - int(base_rows), 0)
    values = (np.ones(batch) if token_values is None
              else np.asarray(token_values, np.float64))
    allocate_rows_kernel(np.asarray(gains, np.float64), np.asarray(num_gains, np.int64),
                         values, by_value, int(base_rows), float(fixed_cost),
                         float(cost_per_row), max(float(cost_per_drafted_step), 0.0), room,
                         extra)
    return extra


@njit(cache=True)
def allocate_rows_kernel(gains, num_gains, token_values, by_value, base_rows, fixed_cost,
                         cost_per_row, cost_per_drafted_step, room, out_extra):
    batch = gains.shape[0]
    size = 0
    for i in range(batch):
        size += num_gains[i]
    requests = np.empty(size, np.int64)
    positions = np.empty(size, np.int64)
    values = np.empty(size, np.float64)
    count = 0
    for i in range(batch):
        running = np.inf
        for j in range(num_gains[i]):
            gain = gains[i, j]
            if gain != gain or gain < running:  # NaN sticks: it ends the rows
                running = gain
            if running > 0:
                requests[count] = i
                positions[count] = j
                values[count] = running * token_values[i]
                count += 1
    requests, positions, values = requests[:count], positions[:count], values[:count]
    # Stable sorts: by position, then by decreasing value; candidates start
    # in request order, so ties end ordered by (position, request).
    order = np.argsort(positions, kind="mergesort")
    order = order[np.argsort(-values[order], kind="mergesort")]
    if room >= 0 and order.shape[0] > room:
        order = order[:room]
    best = 0
    gained = 0.0
    if by_value:
        best_net = 0.0
        for n in range(order.shape[0]):
            gained += values[order[n]]
            net = gained - cost_per_drafted_step - cost_per_row * (n + 1)
            if net > best_net:
                best_net = net
                best = n + 1
    else:
        best_goodput = batch / (fixed_cost + cost_per_row * base_rows)
        for n in range(order.shape[0]):
            gained += values[order[n]]
            goodput = (batch + gained) / (fixed_cost + cost_per_drafted_step
                                          + cost_per_row * (base_rows + n + 1))
            if goodput > best_goodput:
                best_goodput = goodput
                best = n + 1
    for n in range(best):
        out_extra[requests[order[n]]] += 1


# While a batch drains, the requests expected to need at least this share
# of the slowest one's remaining steps count as its equals: the run ends
# with whichever of them is last.
CRITICAL_SHARE = 0.85


def drain_token_values(remaining_tokens: np.ndarray, tokens_per_step: np.ndarray,
                       rows_per_step: np.ndarray, fixed_cost: float,
                       cost_per_request: float, cost_per_row: float,
                       critical_share: float = CRITICAL_SHARE) -> np.ndarray:
    """Seconds one accepted token of each request saves while the batch
    drains (no request waits to take a finished one's place).

    Every request is expected to need ``remaining_tokens / tokens_per_step``
    more steps; the steps run until the slowest request is done. A request
    that makes ``tokens_per_step`` tokens a step needs ``1 /
    tokens_per_step`` of a step less for one more accepted token, so a
    token is worth that fraction of what the request's steps cost: its own
    part of a step (``cost_per_request`` plus ``cost_per_row`` for each of
    the ``rows_per_step`` rows its blocks have, root included) and, for the
    critical requests, part of the fixed cost. The fixed cost is saved only
    when the last request finishes a step earlier: it is split over the
    ``k`` critical requests, those expected to need at least
    ``critical_share`` of the slowest one's steps (all ``k`` must gain for
    the run to lose a step). For alike requests this is the goodput aim's
    price: the step's time per token.

    Example: fixed 50 ms, 1.6 ms a request and 2 ms a row; 100, 100 and 20
    tokens to go at 1.0, 1.1 and 2.0 tokens per step from 1.0, 1.5 and 2.5
    rows per step: 100, 91 and 10 steps; the first two are critical
    (91 >= 0.85 * 100)::

        values = [(1.6 + 2 * 1.0 + 50 / 2) / 1.0,
                  (1.6 + 2 * 1.5 + 50 / 2) / 1.1,
                  (1.6 + 2 * 2.5) / 2.0] ms = [28.6, 26.9, 3.3] ms
    """
    tokens_per_step = np.maximum(np.asarray(tokens_per_step, np.float64), 1.0)
    steps = np.maximum(np.asarray(remaining_tokens, np.float64), 0.0) / tokens_per_step
    values = float(cost_per_request) + float(cost_per_row) * np.maximum(
        np.asarray(rows_per_step, np.float64), 1.0)
    if steps.shape[0] == 0:
        return values
    critical = steps >= critical_share * steps.max()
    values[critical] += float(fixed_cost) / int(critical.sum())
    return values / tokens_per_step


class StepCostModel:
    """``t(R, B, D) = fixed + per_request * B + per_row * R + per_drafted_step * D``:
    seconds of a step with ``R`` rows (tokens) in its forward, of which
    ``B`` are requests (their roots), and ``D`` = 1 when it verifies drafts.

    Least squares over the measured ``(R, B, D, t)`` with exponential
    forgetting (recent steps weigh more: the context grows, the machine's
    load changes), started from a prior fit (the start-up profile) that
    counts as ``prior_weight`` observations at 1 and ``2 * prior_rows``
    rows, of one request, without drafts.

    The prior's points stay close together so that they pin the level and
    only weakly the slope. A real step's cost per row is above the
    profile's (tree attention, verification and proposals grow with the
    rows), and a step's rows vary over a narrow range. With the prior
    spread over the profile's whole range (1 to 128 rows) its leverage held
    the slope near the profile's for hundreds of steps; the allocation then
    bought rows that did not pay (docs/results.md, "The cost model's
    slope").

    The allocation only chooses rows; a step's requests are given. But a
    request costs more than a draft row (its sampling, its own attention
    over its context), and in a pass the number of requests changes (a
    batch fills, its tail drains). A fit on rows alone charged that to the
    rows and overpriced a draft row (docs/results.md, "Cost per request").

    A step that verifies drafts also costs something of its own, whatever
    its rows: the verification (the tree walk or vLLM's rejection sampler),
    the blocks' layout and tree-attention metadata, the accepted path's KV:
    the first draft row of every request costs more than the next ones.
    ``per_drafted_step`` holds that difference, so that the allocation
    weighs a plain step (no extra rows) at its real, lower cost.

    ``per_request`` and ``per_drafted_step`` are held at zero by a small
    ridge that is not forgotten, so that each stays zero where its feature
    never varies (batch 1; every step drafting), and neither is ever
    negative: where the best fit asks for a negative one, it is left out of
    the fit (the least squares under that bound).
    """

    def __init__(self, fixed: float, per_row: float, prior_weight: float = 20.0,
                 forgetting: float = 0.99, prior_rows: float = 8.0,
                 request_ridge: float = 1.0) -> None:
        self.forgetting = forgetting
        self.prior = (fixed, per_row)
        # Weighted least squares on the features (1, R, B, D): the normal
        # equations' Gram matrix and moment vector.
        self._gram = np.zeros((4, 4))
        self._moment = np.zeros(4)
        for rows in (1.0, 2.0 * prior_rows):
            self._add(rows, 1.0, 0.0, fixed + per_row * rows, prior_weight / 2)
        self._ridge = np.array([0.0, 0.0, float(request_ridge), float(request_ridge)])
        self._solution = np.zeros(4)
        self.fixed, self.per_row = fixed, per_row
        self.per_request = self.per_drafted_step = 0.0

    def _add(self, rows: float, requests: float, drafted: float, seconds: float,
             weight: float) -> None:
        features = np.array([1.0, rows, requests, drafted])
        self._gram += weight * np.outer(features, features)
        self._moment += weight * seconds * features

    def observe(self, rows: int, seconds: float, requests: int = 1,
                drafted: bool | None = None) -> None:
        """One step's time with ``rows`` in its forward, ``requests`` of
        them roots; ``drafted``: it verified drafts (default: it had rows
        besides the roots)."""
        if not (seconds > 0 and math.isfinite(seconds)) or rows <= 0 or requests <= 0:
            return
        if drafted is None:
            drafted = rows > requests
        # Once per decode step: one compiled call, not a dozen numpy ones.
        solved = cost_fit_update(self._gram, self._moment, self.forgetting, float(rows),
                                 float(requests), float(drafted), float(seconds),
                                 self._ridge, self._solution)
        if not solved:
            return
        fixed, per_row, per_request, per_drafted_step = self._solution
        # A step never gets cheaper with more rows, and always costs
        # something. (The fit itself keeps the other terms >= 0.)
        self.per_row = max(float(per_row), 1e-3 * self.prior[1], 1e-9)
        self.per_request = float(per_request)
        self.per_drafted_step = float(per_drafted_step)
        self.fixed = max(float(fixed), 0.05 * self.prior[0], 1e-9)

    def seconds(self, rows: float, requests: float = 1, drafted: bool | None = None) -> float:
        """A step's predicted time (``drafted`` by default: rows besides
        the roots)."""
        if drafted is None:
            drafted = rows > requests
        return (self.fixed + self.per_request * requests + self.per_row * rows
                + self.per_drafted_step * float(drafted))

    def row_price(self, rows: float, requests: float, tokens: float) -> float:
        """What one more row costs, in tokens, in a step of ``rows`` and
        ``requests`` that emitted ``tokens``: the step's goodput times a
        row's seconds. Example: 2 ms fixed, 1 ms per row, 10 rows, 4
        tokens: 4 / 12 ms * 1 ms = 1/3 token."""
        return tokens / self.seconds(rows, requests) * self.per_row

    @classmethod
    def fit(cls, rows: np.ndarray, seconds: np.ndarray, **kwargs) -> StepCostModel:
        """The prior from profiled ``(rows, seconds)`` points."""
        rows = np.asarray(rows, np.float64)
        seconds = np.asarray(seconds, np.float64)
        per_row, fixed = np.polyfit(rows, seconds, 1)
        per_row = max(per_row, 1e-9)
        fixed = max(fixed, 0.05 * float(seconds.min()), 1e-9)
        return cls(fixed, per_row, **kwargs)


@njit(cache=True)
def _solve_active(gram, moment, ridge, active, out_solution):
    """Ridge-regularised normal equations on the ``active`` features alone
    (the others 0), by Gaussian elimination with partial pivoting. False
    where they are singular."""
    index = np.flatnonzero(active)
    size = index.shape[0]
    system = np.empty((size, size + 1))
    for i in range(size):
        for j in range(size):
            system[i, j] = gram[index[i], index[j]]
        system[i, i] += ridge[index[i]]
        system[i, size] = moment[index[i]]
    scale = 0.0
    for i in range(size):
        scale = max(scale, abs(system[i, i]))
    for column in range(size):
        pivot = column
        for row in range(column + 1, size):
            if abs(system[row, column]) > abs(system[pivot, column]):
                pivot = row
        if abs(system[pivot, column]) <= 1e-12 * max(scale, 1e-300):
            return False
        if pivot != column:
            for j in range(size + 1):
                system[column, j], system[pivot, j] = system[pivot, j], system[column, j]
        for row in range(column + 1, size):
            factor = system[row, column] / system[column, column]
            for j in range(column, size + 1):
                system[row, j] -= factor * system[column, j]
    values = np.zeros(size)
    for i in range(size - 1, -1, -1):
        total = system[i, size]
        for j in range(i + 1, size):
            total -= system[i, j] * values[j]
        values[i] = total / system[i, i]
    out_solution[:] = 0.0
    for i in range(size):
        out_solution[index[i]] = values[i]
    return True


@njit(cache=True)
def cost_fit_update(gram, moment, forgetting, rows, requests, drafted, seconds, ridge,
                    out_solution):
    """Forget, add one observation of features ``(1, rows, requests,
    drafted)`` at weight 1, and solve the normal equations (``ridge`` on the
    diagonal) into ``out_solution``, with the ridged terms never negative: a
    ridged term the unconstrained fit makes negative is left out (0) and
    the rest solved again. False (nothing solved) while rows have not
    varied enough to separate the fixed cost from the per-row cost."""
    features = np.array([1.0, rows, requests, drafted])
    for i in range(4):
        moment[i] = forgetting * moment[i] + seconds * features[i]
        for j in range(4):
            gram[i, j] = forgetting * gram[i, j] + features[i] * features[j]
    if gram[0, 0] * gram[1, 1] - gram[0, 1] * gram[1, 0] <= 1e-12:
        return False
    active = np.ones(4, np.bool_)
    # At most one pass per ridged term: each drops one that is negative.
    for _ in range(3):
        if not _solve_active(gram, moment, ridge, active, out_solution):
            return False
        # A request never makes a step cheaper, nor do drafts: the least
        # squares under those bounds lie on the bound. Clamping the negative
        # term instead would keep the fixed cost it offsets (a 1-request
        # prior's fixed cost above what a full batch's whole steps took).
        worst, worst_value = -1, 0.0
        for i in range(2, 4):
            if active[i] and out_solution[i] < worst_value:
                worst, worst_value = i, out_solution[i]
        if worst < 0:
            return True
        active[worst] = False
    return True


@dataclass
class VerificationTally:
    """One step's verified blocks, counted per sampling band for the
    calibrations and per source for the log (:func:`tally_verification`)."""

    present: np.ndarray      # [NUM_SAMPLING_BANDS] bool: a block of the band
    drafted: np.ndarray      # [NUM_SAMPLING_BANDS] drafted nodes
    predicted: np.ndarray    # [NUM_SAMPLING_BANDS, NUM_SOURCES, NUM_REACH_BUCKETS]
    accepted: np.ndarray     # same: drafted nodes on the accepted path
    probed: np.ndarray       # [NUM_SAMPLING_BANDS] blocks whose last node had masks
    esp_drafted: np.ndarray  # [NUM_SAMPLING_BANDS] ESP-sourced drafted nodes
    esp_accepted: np.ndarray  # [NUM_SAMPLING_BANDS] of them accepted
    drafted_by_source: np.ndarray   # [NUM_SOURCES]
    accepted_by_source: np.ndarray  # [NUM_SOURCES]


@njit(cache=True)
def tally_verification_kernel(num_nodes, sources, reach, chains, accepted, bands, probed,
                              out_present, out_drafted, out_predicted, out_accepted,
                              out_probed, out_esp_drafted, out_esp_accepted,
                              out_drafted_by_source, out_accepted_by_source):
    width = sources.shape[1]
    on_path = np.zeros(width, np.bool_)
    for block in range(num_nodes.shape[0]):
        band = bands[block]
        out_present[band] = True
        if probed[block]:
            out_probed[band] += 1
        on_path[:] = False
        for depth in range(1, min(accepted[block], chains.shape[1] - 1) + 1):
            on_path[chains[block, depth]] = True
        for node in range(1, num_nodes[block]):
            source = sources[block, node]
            estimate = reach[block, node]
            bucket = np.searchsorted(REACH_EDGES, estimate, side="right")  # reach_buckets
            out_drafted[band] += 1
            out_drafted_by_source[source] += 1
            out_predicted[band, source, bucket] += estimate
            if on_path[node]:
                out_accepted[band, source, bucket] += 1.0
                out_accepted_by_source[source] += 1
            if source == SOURCE_ESP:
                out_esp_drafted[band] += 1
                if on_path[node]:
                    out_esp_accepted[band] += 1


def tally_verification(num_nodes: np.ndarray, sources: np.ndarray, reach: np.ndarray,
                       chains: np.ndarray, accepted: np.ndarray, bands: np.ndarray,
                       probed: np.ndarray) -> VerificationTally:
    """Count one step's verified blocks in one compiled pass: block ``i``
    (``num_nodes[i]`` nodes, its nodes' ``sources`` and prior ``reach``)
    had the chain ``chains[i]`` verified, ``accepted[i]`` of its drafts
    accepted; it samples in band ``bands[i]``; ``probed[i]``: its last
    accepted node carried masks. A drafted node is any but the root; it
    counts in its source's cell of reach (:func:`reach_buckets`).

    >>> tally = tally_verification(np.array([3]), np.array([[0, 1, 0]]),
    ...     np.array([[1.0, 0.5, 0.05]], np.float32), np.array([[0, 1, 2]]),
    ...     np.array([1]), np.array([0]), np.array([True]))
    >>> int(tally.drafted[0]), float(tally.accepted[0].sum()), int(tally.esp_drafted[0])
    (2, 1.0, 1)
    """
    bands_count = NUM_SAMPLING_BANDS
    tally = VerificationTally(
        np.zeros(bands_count, np.bool_), np.zeros(bands_count, np.int64),
        np.zeros((bands_count, NUM_SOURCES, NUM_REACH_BUCKETS)),
        np.zeros((bands_count, NUM_SOURCES, NUM_REACH_BUCKETS)),
        np.zeros(bands_count, np.int64), np.zeros(bands_count, np.int64),
        np.zeros(bands_count, np.int64), np.zeros(NUM_SOURCES, np.int64),
        np.zeros(NUM_SOURCES, np.int64))
    tally_verification_kernel(
        np.asarray(num_nodes, np.int64), np.asarray(sources, np.int8),
        np.asarray(reach, np.float32), np.asarray(chains, np.int64),
        np.asarray(accepted, np.int64), np.asarray(bands, np.int64),
        np.asarray(probed, np.bool_), tally.present, tally.drafted,
        tally.predicted, tally.accepted, tally.probed, tally.esp_drafted,
        tally.esp_accepted, tally.drafted_by_source, tally.accepted_by_source)
    return tally


class AcceptanceCalibration:
    """Per candidate source and band of prior reach, how much the estimated
    acceptance should be scaled: ``(accepted + prior) / (predicted +
    prior)`` over recent steps.

    ``predicted`` sums the *prior* estimates (reach before any scaling) of
    the cell's drafted nodes; ``accepted`` counts those on the accepted
    path. (Summing the scaled estimates instead would feed the scale back
    into itself: it would settle at the square root of the true ratio.)
    With no data the scale is 1 (the priors in ``core.hybrid`` stand).
    Clamped to ``[min_scale, max_scale]`` so that one unlucky run cannot
    switch a source off for good.
    """

    def __init__(self, prior: float = 5.0, forgetting: float = 0.995,
                 min_scale: float = 0.1, max_scale: float = 3.0) -> None:
        self.prior = prior
        self.forgetting = forgetting
        self.min_scale, self.max_scale = min_scale, max_scale
        self.predicted = np.zeros((NUM_SOURCES, NUM_REACH_BUCKETS))
        self.accepted = np.zeros((NUM_SOURCES, NUM_REACH_BUCKETS))

    def observe(self, sources: np.ndarray, reach: np.ndarray,
                accepted: np.ndarray) -> None:
        """One step's drafted nodes: source tag, prior estimated reach,
        and whether each was accepted (flat arrays)."""
        if sources.size == 0:
            return
        reach = np.asarray(reach, np.float64)
        cells = np.asarray(sources, np.int64) * NUM_REACH_BUCKETS + reach_buckets(reach)
        size = NUM_SOURCES * NUM_REACH_BUCKETS
        self.add(np.bincount(cells, weights=reach, minlength=size).reshape(
                     NUM_SOURCES, NUM_REACH_BUCKETS),
                 np.bincount(cells, weights=accepted.astype(np.float64),
                             minlength=size).reshape(NUM_SOURCES, NUM_REACH_BUCKETS))

    def add(self, predicted: np.ndarray, accepted: np.ndarray) -> None:
        """One step's sums per cell (``[NUM_SOURCES, NUM_REACH_BUCKETS]``):
        the drafted nodes' prior reach and how many were accepted."""
        self.predicted *= self.forgetting
        self.accepted *= self.forgetting
        self.predicted += predicted
        self.accepted += accepted

    @property
    def scales(self) -> np.ndarray:
        scale = (self.accepted + self.prior) / (self.predicted + self.prior)
        return np.clip(scale, self.min_scale, self.max_scale)


class MaskValueCalibration:
    """What mask rows are worth, learnt from what their candidates earned.

    A node's masks matter only if the node ends up the last accepted one:
    then their logits are the next step's ESP candidates. The allocation
    values them at ``mask_value`` tokens per unit of that probability
    (``core.hybrid.allocate_block_kernel``). What they really bring is the next
    step's *surplus* from those candidates: the ESP-sourced drafts accepted,
    less the rows they took, each priced at what a row costs in tokens at
    the step's goodput (``price``). Valued by their probabilities alone
    the masks' rows were bought where they did not pay (docs/results.md,
    "ESP's mask rows do not pay on SmolLM2").

    ``value = (surplus + prior * prior_value) / (seeded + prior)`` over
    recent steps, where ``seeded`` counts the blocks whose last accepted
    node carried masks; clamped to ``[0, max_value]``. When the value
    reaches 0 no masks are bought, nothing is seeded and the data fades:
    the value drifts back towards the prior and the masks are tried again
    (after about ``log(seeded / prior) / (1 - forgetting)`` steps).

    ESP-sourced drafts include those another source also proposed with a
    lower score (``core.hybrid.merge_chain_kernel`` keeps the higher
    score's tag), so the surplus is an upper bound on what the masks alone
    add.
    """

    def __init__(self, prior_value: float, prior: float = 5.0,
                 forgetting: float = 0.995, max_value: float = 0.5) -> None:
        self.prior_value = prior_value
        self.prior = prior
        self.forgetting = forgetting
        # Below 1: a masked node's accepted child is worth 1 - value (it
        # takes the masks' place as the last accepted node).
        self.max_value = max_value
        self.seeded = 0.0
        self.surplus = 0.0

    def observe(self, seeded: int, esp_accepted: int, esp_rows: int,
                price: float) -> None:
        """One step: blocks whose last accepted node carried masks, ESP
        drafts accepted, rows of ESP drafts, and a row's price in tokens."""
        self.seeded = self.seeded * self.forgetting + seeded
        self.surplus = self.surplus * self.forgetting + esp_accepted - price * esp_rows

    @property
    def value(self) -> float:
        value = (self.surplus + self.prior * self.prior_value) / (self.seeded + self.prior)
        return min(max(value, 0.0), self.max_value)


class SamplingCalibration:
    """The calibrations per sampling band (:func:`sampling_bands`): the
    sources' acceptance and the mask rows' value, learnt apart for greedy
    requests and for each band of temperature, since a draft is worth less
    the hotter a request samples."""

    def __init__(self, mask_prior_value: float) -> None:
        self.acceptance = [AcceptanceCalibration() for _ in range(NUM_SAMPLING_BANDS)]
        self.mask = [MaskValueCalibration(mask_prior_value)
                     for _ in range(NUM_SAMPLING_BANDS)]

    @property
    def scales(self) -> np.ndarray:
        """``[NUM_SAMPLING_BANDS, NUM_SOURCES, NUM_REACH_BUCKETS]``."""
        return np.stack([calibration.scales for calibration in self.acceptance])

    @property
    def mask_values(self) -> np.ndarray:
        """``[NUM_SAMPLING_BANDS]``."""
        return np.array([calibration.value for calibration in self.mask])

    def observed_bands(self) -> list[int]:
        """Bands that have seen drafts (for logs)."""
        return [band for band, calibration in enumerate(self.acceptance)
                if calibration.predicted.sum() > 0]
