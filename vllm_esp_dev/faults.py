# SPDX-License-Identifier: Apache-2.0
"""Injected faults: a tree proposer that fails on a poisoned request (the
fault-isolation test), and ``inject_fault`` for any phase of ESP's step (the
fault-containment tests). Not user features.

``FaultyTreeProposer`` proposes like ESP's own
(:class:`vllm_esp.core.batch.TreeProposer`) but raises whenever a request in
the batch has ``POISON`` in its history, as a bug in ESP's per-step path
would. Injected through ``additional_config["esp_candidate_source"]``.
"""

from __future__ import annotations

import numpy as np

from vllm_esp.core.batch import TreeProposer

POISON = (13, 37, 13, 37)


class FaultyTreeProposer(TreeProposer):
    def propose(self, histories, history_rows, history_starts, history_ends, roots,
                *args, **kwargs):
        poison = np.asarray(POISON)
        for row, start, end in zip(history_rows, history_starts, history_ends):
            history = histories[row, start:end]
            windows = np.lib.stride_tricks.sliding_window_view(history, len(poison))
            if (windows == poison).all(axis=1).any():
                raise ValueError("injected fault in the ESP proposer")
        return super().propose(histories, history_rows, history_starts, history_ends,
                               roots, *args, **kwargs)


class InjectedFault(RuntimeError):
    """The error an injected fault raises."""


def inject_fault(monkeypatch, owner, name: str, calls, *, run_original: bool = False):
    """Make ``owner.name`` (a method) raise ``InjectedFault`` on its calls
    numbered in ``calls`` (1-based), after running the original when
    ``run_original`` (a fault that strikes after the method's effects),
    instead of it otherwise. Returns a dict counting ``calls`` and
    ``raised``. For in-process engines (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
    through pytest's ``monkeypatch``."""
    original = getattr(owner, name)
    counts = {"calls": 0, "raised": 0}
    calls = set(calls)

    def faulty(self, *args, **kwargs):
        counts["calls"] += 1
        if counts["calls"] not in calls:
            return original(self, *args, **kwargs)
        if run_original:
            original(self, *args, **kwargs)
        counts["raised"] += 1
        raise InjectedFault(f"injected fault in {owner.__name__}.{name}")

    monkeypatch.setattr(owner, name, faulty)
    return counts
