# SPDX-License-Identifier: Apache-2.0
"""Named speculative-decoding configurations the benchmark can run.

Each method is one ``speculative_config`` (``None``: no speculation), run in
its own fresh vLLM engine. ``--methods`` takes names from ``METHODS``,
``default`` (``DEFAULT_METHODS``) or ``all``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

BASELINE = "none"


@dataclass(frozen=True)
class Method:
    name: str
    speculative_config: dict[str, Any] | None
    description: str
    # Python module the method needs at run time (checked before starting an
    # engine); None: nothing beyond vLLM.
    requires_module: str | None = None
    install_hint: str = ""
    # Keeps state across requests (suffix decoding and ESP's prompt lookup
    # cache earlier answers): every pass then gets a fresh engine so that it
    # only sees its own pass.
    cross_request_state: bool = False
    tags: tuple[str, ...] = field(default=())

    def unavailable_reason(self) -> str | None:
        """Why this method cannot run here, or None when it can."""
        if self.requires_module and importlib.util.find_spec(self.requires_module) is None:
            return (f"{self.name} needs the Python package providing "
                    f"'{self.requires_module}', which is not installed. "
                    f"{self.install_hint}")
        return None

    def chain_drafter(self) -> Callable[[list[int]], list[int]] | None:
        """vLLM's own n-gram drafter with this method's settings, as a
        function of the token history (for ``metrics.with_replayed_drafts``);
        None for other methods."""
        config = self.speculative_config or {}
        if config.get("method") != "ngram":
            return None
        from vllm.v1.spec_decode.ngram_proposer import (
            _find_longest_matched_ngram_and_propose_tokens as propose,
        )

        k = int(config["num_speculative_tokens"])
        lookup_min = int(config["prompt_lookup_min"])
        lookup_max = int(config["prompt_lookup_max"])
        # max_model_len only stops drafting at the context limit, which the
        # benchmark's requests stay below.
        return lambda history: propose(np.asarray(history, dtype=np.int32), lookup_min,
                                       lookup_max, 1 << 30, k).tolist()


def _ngram(k: int, lookup_max: int, lookup_min: int) -> dict[str, Any]:
    return {"method": "ngram", "num_speculative_tokens": k,
            "prompt_lookup_max": lookup_max, "prompt_lookup_min": lookup_min}


def _esp(**options: Any) -> dict[str, Any]:
    # ESP alone unless the method says otherwise (the plugin's default is the
    # hybrid).
    return {"method": "esp", "candidates": ["esp"], **options}


SUFFIX_INSTALL_HINT = (
    "Install it with: bash benchmarks/install_suffix.sh (builds "
    "arctic-inference 0.3.0 from source against the installed torch, ~2-3 "
    "minutes).")

_ALL = [
    Method(BASELINE, None, "vLLM without speculation (the reference for "
           "speed and for the greedy-output check)"),
    Method("ngram-k3", _ngram(3, 3, 1), "vLLM prompt lookup, 3 drafts"),
    Method("ngram-k5", _ngram(5, 4, 1), "vLLM prompt lookup, 5 drafts"),
    Method("ngram-k9", _ngram(9, 3, 1), "vLLM prompt lookup, 9 drafts (block 10, as "
           "esp-4 and hybrid-bc10)"),
    Method("ngram-k29", _ngram(29, 3, 1), "vLLM prompt lookup, 29 drafts (block 30, "
           "as esp-bc30 and hybrid-bc30)"),
    Method("ngram-k10", _ngram(10, 5, 2), "vLLM prompt lookup, 10 drafts"),
    Method("suffix", {"method": "suffix", "num_speculative_tokens": 24,
                      "suffix_decoding_max_tree_depth": 24,
                      "suffix_decoding_max_spec_factor": 1.0,
                      "suffix_decoding_min_token_prob": 0.1},
           "vLLM suffix decoding (Arctic Inference): prompt + earlier "
           "answers; vLLM's defaults spelled out",
           requires_module="arctic_inference", install_hint=SUFFIX_INSTALL_HINT,
           cross_request_state=True),
    Method("esp", {"method": "esp"},
           "the plugin's default: {\"method\": \"esp\"} (auto block "
           "complexity, ESP + prompt-lookup candidates)", cross_request_state=True),
    Method("esp-chain", {"method": "esp", "sampling_verification": "chain"},
           "the plugin's default with sampled requests verified as one chain "
           "(each tree cut to its highest-logit path, checked by vLLM's rejection "
           "sampler) instead of walking the tree: the A/B switch for tokens per "
           "step under sampling; greedy requests decode exactly as `esp`",
           cross_request_state=True),
    Method("esp-4", _esp(tree=[4]), "ESP alone, static tree [4] (k=1, block 10; the paper's method at the CPU default size)"),
    Method("esp-9", _esp(tree=[9]), "ESP static tree [9] (k=1, block 20)"),
    Method("esp-29", _esp(tree=[29]), "ESP static tree [29] (k=1, block 60; the GPU default)"),
    Method("esp-15-4", _esp(tree=[15, 4]), "ESP static tree [15, 4] (k=2, block 60)"),
    Method("esp-bc10", _esp(block_complexity=10), "ESP dynamic tree, block complexity 10"),
    Method("esp-bc30", _esp(block_complexity=30), "ESP dynamic tree, block complexity 30"),
    Method("esp-bc60", _esp(block_complexity=60), "ESP dynamic tree, block complexity 60"),
    Method("hybrid-bc10", _esp(block_complexity=10, candidates=["esp", "ngram"]),
           "ESP + prompt-lookup candidates in one tree, block complexity 10 "
           "(same block as esp-4; what {\"method\": \"esp\"} does on CPU)",
           cross_request_state=True),
    Method("hybrid-bc30", _esp(block_complexity=30, candidates=["esp", "ngram"]),
           "ESP + prompt-lookup candidates in one tree, block complexity 30",
           cross_request_state=True),
    Method("lookup-bc30", _esp(block_complexity=30, candidates=["ngram"]),
           "the hybrid's prompt-lookup source alone (chains of up to 14 "
           "tokens, no masks), for comparison", cross_request_state=True),
]

METHODS: dict[str, Method] = {m.name: m for m in _ALL}

# The plugin's default (hybrid-bc10), ESP alone and vLLM's training-free
# methods. The 60-row blocks (esp-15-4, esp-29) are left out: on 2 CPU cores
# each costs several times the rest of the default run.
DEFAULT_METHODS = ("none", "ngram-k3", "ngram-k9", "suffix", "esp")


def resolve(names: list[str]) -> list[Method]:
    """Method names (or 'all' / 'default') to methods, baseline first, no
    duplicates. Raises ValueError naming unknown methods."""
    expanded: list[str] = []
    for name in names:
        if name == "all":
            expanded.extend(METHODS)
        elif name == "default":
            expanded.extend(DEFAULT_METHODS)
        else:
            expanded.append(name)
    unknown = [n for n in expanded if n not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; known: "
                         f"{', '.join(METHODS)} (or 'all', 'default')")
    ordered = list(dict.fromkeys(expanded))
    if BASELINE in ordered:
        ordered.remove(BASELINE)
        ordered.insert(0, BASELINE)
    return [METHODS[n] for n in ordered]
