# SPDX-License-Identifier: Apache-2.0
"""``ESPStep.rows`` and ``mask_rows``: every block row's flat row and
tree position, and the mask rows, from one compiled pass, against the
per-row numpy computation on random hybrid trees."""

from __future__ import annotations

import numpy as np

from vllm_esp.core.batch import TreeBatch
from vllm_esp.step import ESPStep


def test_flat_rows_and_mask_rows_match_numpy_on_random_trees():
    rng = np.random.default_rng(0)
    for _ in range(30):
        batch, width, k = int(rng.integers(1, 7)), int(rng.integers(1, 8)), int(rng.integers(0, 3))
        trees = TreeBatch.empty(batch, width, k)
        for block in range(batch):
            num_nodes = int(rng.integers(1, width + 1))
            trees.num_nodes[block] = num_nodes
            trees.parents[block, 0] = -1
            for node in range(1, num_nodes):
                trees.parents[block, node] = rng.integers(0, node)
            trees.masked[block, :num_nodes] = rng.random(num_nodes) < 0.5
        sizes = trees.block_sizes()
        row_starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]) + 3
        root_positions = rng.integers(5, 100, batch)
        step = ESPStep.build(np.arange(batch), np.arange(batch), trees,
                             row_starts=row_starts, root_positions=root_positions)

        rows, positions = step.rows()
        mask_rows, mask_blocks = step.mask_rows()

        num_rows = step.layouts.num_rows.astype(np.int64)
        np.testing.assert_array_equal(num_rows, sizes)
        block = np.repeat(np.arange(batch), num_rows)
        within = np.arange(block.shape[0]) - np.repeat(np.cumsum(num_rows) - num_rows,
                                                       num_rows)
        np.testing.assert_array_equal(rows, row_starts[block] + within)
        np.testing.assert_array_equal(
            positions, root_positions[block] + step.layouts.position_offsets[block, within])
        is_mask = within >= trees.num_nodes[block]
        np.testing.assert_array_equal(mask_rows, (row_starts[block] + within)[is_mask])
        np.testing.assert_array_equal(mask_blocks, block[is_mask])
        assert step.has_mask_rows == bool(is_mask.any())
