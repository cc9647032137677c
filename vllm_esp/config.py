# SPDX-License-Identifier: Apache-2.0
"""User-facing ESP configuration: parsing, defaults and validation.

This module has no vLLM import. The vLLM adapter feeds it the keys a user put
next to ``"method": "esp"`` in ``--speculative-config``; the reference decoder
builds it directly. Every error names the offending key and what is allowed,
and is raised at start-up, never mid-request.

Block geometry (docs/design.md)::

    k  = num_mask_tokens            masks after every tree node
    T  = 1 + sum(tree)              tree nodes, root included
    Q  = (k + 1) * T                block size = tokens per request per step
    N  = Q - 1                      draft slots vLLM reserves per request

Example: ``ESPConfig.from_dict({"tree": [4]})`` gives k=1, T=5, Q=10, N=9,
with the default ``candidates=("esp", "ngram")`` (the hybrid: prompt-lookup
chains and mask candidates compete for the Q rows, and masks ride only on
the nodes likely to be the last accepted one, so a hybrid tree has between
1 and Q - 1 draft nodes). The dataclass default, ``ESPConfig()``, is the
paper's ESP alone.
With ``block_complexity`` instead of ``tree`` the tree is built dynamically
(paper Algorithm 1) with node budget ``T - 1 = BC // (k + 1) - 1``.

The default is ``"block_complexity": "auto"``: every step sizes each
request's block for the step's goodput (``core.goodput``), from zero draft
rows (a plain step) up to ``max_block_complexity`` rows. Internally an auto
config is a dynamic one whose ``block_complexity`` is that cap, with
``auto=True``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

MASK_INITS = ("mean", "last", "sample", "zero")
CANDIDATE_SOURCES = ("esp", "ngram")
# What users get from {"method": "esp"}: the hybrid, which accepts more
# tokens per step than ESP alone or prompt lookup alone (docs/results.md).
# ESPConfig() itself stays the paper's ESP.
DEFAULT_CANDIDATES = ("esp", "ngram")
ALLOWED_KEYS = (
    "num_mask_tokens",
    "tree",
    "block_complexity",
    "mask_init",
    "ema",
    "candidates",
    "max_block_complexity",
    "lookup_cache_tokens",
    "sampling_verification",
)
AUTO = "auto"
# How a sampled request's tree is verified: "tree" walks it, drawing at each
# node (vllm_esp.sampling: a level is accepted with the sum of its
# children's probabilities); "chain" reduces it to one chain for vLLM's
# rejection sampler (the highest-logit child at each level). Greedy requests
# are verified exactly either way.
SAMPLING_VERIFICATIONS = ("tree", "chain")
# The largest block 'auto' may give one request. On the 2-core CPU this was
# built on, the goodput allocation rarely wants more than ~20 rows even at
# batch 1; larger caps only reserve KV slots (num_speculative_tokens).
DEFAULT_MAX_BLOCK_COMPLEXITY = 32
# vLLM's RejectionSampler asserts at most 128 drafts per request, and our
# fallback path hands it whole blocks as chains.
MAX_DRAFT_SLOTS = 128
MAX_MASK_TOKENS = 3
# Tokens of earlier requests' answers that prompt lookup also searches
# (core.hybrid.AnswerCorpus); 0 turns the cross-request cache off. Lookup
# scans the cache once per request and step, so it is bounded.
DEFAULT_LOOKUP_CACHE_TOKENS = 8192
MAX_LOOKUP_CACHE_TOKENS = 65536

# A valid static tree for each num_mask_tokens, quoted in the 'tree' error
# message as an example.
DEFAULT_TREES: dict[int, tuple[int, ...]] = {1: (4,), 2: (3, 1), 3: (2, 1, 1)}


class ESPConfigError(ValueError):
    """A bad ESP option. The message names the key and the allowed values."""


def _fail(key: str, value: Any, allowed: str) -> ESPConfigError:
    return ESPConfigError(
        f"ESP speculative_config: invalid value for '{key}': {value!r}. "
        f"Allowed: {allowed}."
    )


@dataclass(frozen=True)
class ESPConfig:
    num_mask_tokens: int = 1
    tree: tuple[int, ...] | None = (4,)
    block_complexity: int | None = None
    mask_init: str = "mean"
    ema: float = 0.1
    # Where tree candidates come from: ESP's mask rows and/or prompt lookup
    # (the hybrid, vllm_esp.core.hybrid). Stored in CANDIDATE_SOURCES order.
    candidates: tuple[str, ...] = field(default=("esp",))
    # Goodput-sized blocks per request and step, up to block_complexity rows.
    auto: bool = False
    # Earlier answers kept for prompt lookup across requests (hybrid only).
    lookup_cache_tokens: int = 0
    sampling_verification: str = "tree"

    def __post_init__(self) -> None:
        self._validate()

    # ---------------------------------------------------------------- parsing
    @classmethod
    def from_dict(cls, options: Mapping[str, Any] | None) -> ESPConfig:
        """Build from user options (the keys beside ``"method": "esp"``)."""
        options = dict(options or {})
        unknown = sorted(set(options) - set(ALLOWED_KEYS))
        if unknown:
            raise ESPConfigError(
                f"ESP speculative_config: unknown key(s) {unknown}. "
                f"Allowed keys: {list(ALLOWED_KEYS)} (plus vLLM's own "
                "'method', and optionally 'num_speculative_tokens', which "
                "must then equal the block's draft slots)."
            )
        tree = options.get("tree")
        block_complexity = options.get("block_complexity")
        auto = block_complexity == AUTO or (tree is None and block_complexity is None)
        if "max_block_complexity" in options and not auto:
            raise ESPConfigError(
                "ESP speculative_config: 'max_block_complexity' caps the "
                "'auto' block size; it cannot be combined with 'tree' or an "
                "int 'block_complexity'. Allowed: leave 'block_complexity' "
                "out or set it to \"auto\".")
        if auto:
            block_complexity = options.get("max_block_complexity",
                                           DEFAULT_MAX_BLOCK_COMPLEXITY)
            if tree is not None:
                raise ESPConfigError(
                    "ESP speculative_config: 'tree' and 'block_complexity' "
                    "\"auto\" are exclusive. Give 'tree' (a static tree), an "
                    "int 'block_complexity' (a fixed dynamic tree), or neither "
                    "(auto).")
        elif block_complexity is not None and isinstance(block_complexity, str):
            raise _fail("block_complexity", block_complexity,
                        f"\"auto\" or an int from 4 to {MAX_DRAFT_SLOTS + 1}")
        if tree is not None and block_complexity is not None:
            raise ESPConfigError(
                "ESP speculative_config: 'tree' and 'block_complexity' are "
                "exclusive. Give 'tree' (per-level widths, a static tree) or "
                "'block_complexity' (a block budget, a dynamic tree), not both."
            )
        if tree is not None:
            if isinstance(tree, (str, bytes)) or not isinstance(tree, Sequence):
                raise _fail("tree", tree, "a list of positive ints, one per "
                            "mask token, e.g. [4] or [15, 4]")
            tree = tuple(tree)

        if "num_mask_tokens" in options:
            num_mask_tokens = options["num_mask_tokens"]
        elif tree is not None:
            num_mask_tokens = len(tree)
        else:
            num_mask_tokens = 1
        _check_int("num_mask_tokens", num_mask_tokens, 1, MAX_MASK_TOKENS)

        candidates = options.get("candidates", list(DEFAULT_CANDIDATES))
        if (isinstance(candidates, (str, bytes)) or not isinstance(candidates, Sequence)
                or not candidates
                or any(not isinstance(c, str) or c not in CANDIDATE_SOURCES
                       for c in candidates)
                or len(set(candidates)) != len(candidates)):
            raise _fail("candidates", candidates,
                        f"a non-empty list of distinct names from "
                        f"{list(CANDIDATE_SOURCES)}, e.g. [\"esp\", \"ngram\"]")
        if "lookup_cache_tokens" in options and "ngram" not in candidates:
            raise ESPConfigError(
                "ESP speculative_config: 'lookup_cache_tokens' sizes prompt "
                "lookup's cache of earlier answers; it needs \"ngram\" in "
                f"'candidates' (got {list(candidates)}).")
        lookup_cache_tokens = options.get(
            "lookup_cache_tokens",
            DEFAULT_LOOKUP_CACHE_TOKENS if "ngram" in candidates else 0)
        return cls(
            num_mask_tokens=num_mask_tokens,
            tree=tree,
            block_complexity=block_complexity,
            auto=auto,
            mask_init=options.get("mask_init", "mean"),
            ema=options.get("ema", 0.1),
            candidates=tuple(c for c in CANDIDATE_SOURCES if c in candidates),
            lookup_cache_tokens=lookup_cache_tokens,
            sampling_verification=options.get("sampling_verification", "tree"),
        )

    def _validate(self) -> None:
        k = self.num_mask_tokens
        _check_int("num_mask_tokens", k, 1, MAX_MASK_TOKENS)
        if (self.tree is None) == (self.block_complexity is None):
            raise ESPConfigError(
                "ESP speculative_config: exactly one of 'tree' and "
                "'block_complexity' must be set."
            )
        if self.tree is not None:
            widths_ok = all(
                isinstance(w, int) and not isinstance(w, bool) and w >= 1
                for w in self.tree
            )
            if not widths_ok or len(self.tree) != k:
                raise _fail(
                    "tree", list(self.tree),
                    f"a list of {k} positive int(s), one width per mask "
                    f"token (num_mask_tokens={k}), e.g. "
                    f"{list(DEFAULT_TREES[k])}",
                )
        else:
            low = 2 * (k + 1)
            high = MAX_DRAFT_SLOTS + 1
            _check_int("max_block_complexity" if self.auto else "block_complexity",
                       self.block_complexity, low, high,
                       hint=f" (with num_mask_tokens={k}: at least 2 tree "
                       f"nodes, block at most {high} tokens)")
        if self.mask_init not in MASK_INITS:
            raise _fail("mask_init", self.mask_init, " | ".join(MASK_INITS))
        if (isinstance(self.ema, bool) or not isinstance(self.ema, (int, float))
                or not math.isfinite(self.ema) or not 0.0 <= self.ema <= 1.0):
            raise _fail("ema", self.ema, "a number in [0, 1] (paper: 0.1)")
        bad = [c for c in self.candidates if c not in CANDIDATE_SOURCES]
        if bad or not self.candidates:
            raise _fail("candidates", list(self.candidates),
                        f"a non-empty subset of {list(CANDIDATE_SOURCES)}")
        _check_int("lookup_cache_tokens", self.lookup_cache_tokens, 0,
                   MAX_LOOKUP_CACHE_TOKENS, hint=" (0: no cache)")
        if self.sampling_verification not in SAMPLING_VERIFICATIONS:
            raise _fail("sampling_verification", self.sampling_verification,
                        " | ".join(f'"{v}"' for v in SAMPLING_VERIFICATIONS))
        if self.num_draft_slots > MAX_DRAFT_SLOTS:
            raise ESPConfigError(
                f"ESP speculative_config: the block has {self.block_size} "
                f"tokens ((num_mask_tokens + 1) * (1 + sum(tree)) = "
                f"{self.block_size}), over vLLM's limit of "
                f"{MAX_DRAFT_SLOTS + 1}. Use a smaller 'tree' or "
                "'block_complexity'."
            )

    # --------------------------------------------------------------- geometry
    @property
    def tree_sampling(self) -> bool:
        """Sampled requests' trees are walked (``vllm_esp.sampling``)."""
        return self.sampling_verification == "tree"

    @property
    def num_nodes(self) -> int:
        """T: tree nodes per step, root included."""
        if self.tree is not None:
            return 1 + sum(self.tree)
        return self.block_complexity // (self.num_mask_tokens + 1)

    @property
    def node_budget(self) -> int:
        """Draft nodes per step (T - 1), the dynamic tree's budget B."""
        return self.num_nodes - 1

    @property
    def masks_per_node(self) -> int:
        """Mask rows after each tree node: k, or 0 for prompt lookup alone
        (``candidates=["ngram"]``), which has no use for mask logits."""
        return self.num_mask_tokens if "esp" in self.candidates else 0

    @property
    def is_hybrid(self) -> bool:
        return self.candidates != ("esp",)

    @property
    def block_size(self) -> int:
        """Q = (k + 1) * T: rows per request per verification forward (with
        ``candidates=["ngram"]``, T: no mask rows)."""
        return (self.masks_per_node + 1) * self.num_nodes

    @property
    def num_draft_slots(self) -> int:
        """N = Q - 1: what vLLM sees as num_speculative_tokens."""
        return self.block_size - 1

    @classmethod
    def from_serialized(cls, data: Mapping[str, Any]) -> ESPConfig:
        """Inverse of :meth:`to_dict` (the engine passes the validated
        config to its workers as ``additional_config["esp"]``)."""
        tree = data.get("tree")
        return cls(
            num_mask_tokens=data["num_mask_tokens"],
            tree=None if tree is None else tuple(tree),
            block_complexity=data.get("max_block_complexity", data.get("block_complexity")),
            auto=data.get("block_complexity") == AUTO,
            mask_init=data["mask_init"],
            ema=data["ema"],
            candidates=tuple(data.get("candidates", ("esp",))),
            lookup_cache_tokens=data.get("lookup_cache_tokens", 0),
            sampling_verification=data.get("sampling_verification", "tree"),
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "num_mask_tokens": self.num_mask_tokens,
            "mask_init": self.mask_init,
            "ema": self.ema,
            "candidates": list(self.candidates),
            "lookup_cache_tokens": self.lookup_cache_tokens,
            "sampling_verification": self.sampling_verification,
        }
        if self.tree is not None:
            out["tree"] = list(self.tree)
        elif self.auto:
            out["block_complexity"] = AUTO
            out["max_block_complexity"] = self.block_complexity
        else:
            out["block_complexity"] = self.block_complexity
        return out


def _check_int(key: str, value: Any, low: int, high: int, hint: str = "") -> None:
    if (isinstance(value, bool) or not isinstance(value, int)
            or not low <= value <= high):
        raise _fail(key, value, f"an int from {low} to {high}{hint}")
