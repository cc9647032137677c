# SPDX-License-Identifier: Apache-2.0
"""Faults in ESP's own code end in plain decoding, not in a dead engine.

Every phase of ESP's step (the scheduler's bookkeeping, the proposal, the
runner's block inputs, the attention split, the verification, the KV
relocation, the mask probe) catches its own exceptions. What the affected
requests then get is always lossless: they are decoded without blocks from
then on, and a step whose forward already ran with tree attention emits,
for each of its blocks, only the token drawn at the root (the one row
whose logits do not depend on the tree). The other requests keep ESP and
the engine keeps serving.

Each phase logs its first failure with the traceback and the request ids;
later failures of the same phase are logged at debug level only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

logger = logging.getLogger("vllm.esp")

# Request ids named in one log line, at most.
MAX_LOGGED_IDS = 16


class Containment:
    """Which phases have failed, for logging each one once."""

    def __init__(self) -> None:
        self.failures: dict[str, int] = {}

    def failed(self, phase: str, req_ids: Iterable[str],
               error: BaseException | None = None) -> None:
        """``phase`` failed for ``req_ids``, which continue as plain
        decoding: call from its ``except`` block, or give the ``error``."""
        exc_info = error if error is not None else True
        ids = sorted(str(req_id) for req_id in req_ids)
        shown = ", ".join(ids[:MAX_LOGGED_IDS]) + (
            f" and {len(ids) - MAX_LOGGED_IDS} more" if len(ids) > MAX_LOGGED_IDS else "")
        count = self.failures.get(phase, 0)
        self.failures[phase] = count + 1
        if count == 0:
            logger.error("ESP: %s failed; requests %s continue as plain decoding "
                         "(lossless). Please report this error.", phase, shown or "-",
                         exc_info=exc_info)
        else:
            logger.debug("ESP: %s failed again (%d times); requests %s continue as plain "
                         "decoding", phase, count + 1, shown or "-", exc_info=exc_info)
