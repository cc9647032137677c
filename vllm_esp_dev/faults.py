# SPDX-License-Identifier: Apache-2.0
"""A tree proposer with an injected fault, for the fault-isolation test.

It proposes like ESP's own (:class:`vllm_esp.core.batch.TreeProposer`) but
raises whenever a request in the batch has ``POISON`` in its history, as a
bug in ESP's per-step path would. Injected through
``additional_config["esp_candidate_source"]``; not a user feature.
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
