# SPDX-License-Identifier: Apache-2.0
"""Lossless verification of a draft tree against the target's distributions.

Every function here takes the ``DraftTree`` that was fed to the model and the
target's per-node logits or probabilities ``[T, V]``: row ``t`` is the
target's distribution of the token *after* node ``t`` (the node rows of the
block), so it verifies ``t``'s children. They return the accepted path (node
indices, root first), the bonus token drawn at the last reached node, and
the emitted tokens (accepted drafts + bonus).

Worked example (greedy). Tree and target argmax per node::

    node:    0 (root, "the")   1 ("cat")   2 ("dog")   3 ("sat", child of 1)
    parent:  -1                0           0           1
    argmax:  "cat"             "sat"       "ran"       "on"

    root: argmax "cat" is child 1   -> move to 1
    1:    argmax "sat" is child 3   -> move to 3
    3:    no children               -> stop; bonus = argmax at 3 = "on"

    accepted_path = [0, 1, 3], emitted_tokens = ["cat", "sat", "on"]

Sampling has two lossless variants (see each function): ``sample_and_match``
draws the target token at each reached node and follows the matching child
(acceptance per level = the sum of p over all children, and with the same
generator it reproduces plain sampling token for token); ``chain_verify_sampling``
first picks one chain without looking at any random draw, then runs standard
speculative sampling with one-hot drafts on it (what vLLM's RejectionSampler
does for chains).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_esp.core.proposal import DraftTree

__all__ = [
    "VerifyResult",
    "greedy_verify",
    "select_chain",
    "chain_rejection_sample",
    "chain_verify_sampling",
    "sample_and_match",
]


@dataclass(frozen=True, eq=False)
class VerifyResult:
    accepted_path: torch.Tensor  # [a + 1] int64 node indices, root first
    bonus_token: int
    emitted_tokens: list[int]    # tokens of accepted_path[1:] + [bonus_token]

    @property
    def last_node(self) -> int:
        """The last reached node, whose mask rows propose the next tree."""
        return int(self.accepted_path[-1])

    @property
    def num_accepted(self) -> int:
        """a: accepted draft tokens (the step emits a + 1)."""
        return self.accepted_path.numel() - 1


def _check_rows(draft_tree: DraftTree, node_values: torch.Tensor) -> None:
    if node_values.dim() != 2 or node_values.shape[0] != draft_tree.num_nodes:
        raise ValueError(
            f"expected per-node target values of shape [{draft_tree.num_nodes}, V], "
            f"got {tuple(node_values.shape)}")


def _child_tokens(draft_tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
    """(children [T, C], their tokens [T, C] with -1 where there is no child)."""
    children = draft_tree.layout.children
    tokens = draft_tree.tokens[children.clamp(min=0)]
    return children, torch.where(children >= 0, tokens, -1)


def _walk(next_node: list[int], max_depth: int) -> list[int]:
    """Follow ``next_node`` pointers from the root until -1 (at most max_depth moves)."""
    path = [0]
    for _ in range(max_depth):
        child = next_node[path[-1]]
        if child < 0:
            break
        path.append(child)
    return path


def _result(draft_tree: DraftTree, path: list[int], bonus_token: int) -> VerifyResult:
    accepted_path = torch.tensor(path, dtype=torch.long)
    emitted = draft_tree.tokens[accepted_path[1:]].tolist() + [int(bonus_token)]
    return VerifyResult(accepted_path, int(bonus_token), emitted)


def greedy_verify(draft_tree: DraftTree, node_logits: torch.Tensor) -> VerifyResult:
    """Greedy tree verification.

    From the root, while the target's argmax at the current node equals one
    of its children's tokens, move to that child (the lowest-index one if
    siblings share a token, which only the placeholder tree does). The argmax
    at the last reached node is the bonus token. The accepted child of every
    node is computed in one shot; the walk is at most ``max_depth`` steps.
    """
    _check_rows(draft_tree, node_logits)
    target = node_logits.argmax(dim=-1).cpu()                  # [T]
    children, child_tokens = _child_tokens(draft_tree)
    hit = child_tokens == target[:, None]                      # [T, C]
    # argmax returns the first maximal index: the lowest-index matching child.
    first_hit = hit.to(torch.uint8).argmax(dim=1, keepdim=True)
    accepted_child = torch.where(hit.any(dim=1),
                                 children.gather(1, first_hit).squeeze(1), -1)
    path = _walk(accepted_child.tolist(), draft_tree.tree_spec.max_depth)
    return _result(draft_tree, path, int(target[path[-1]]))


def select_chain(draft_tree: DraftTree, node_scores: torch.Tensor) -> torch.Tensor:
    """The chain (node indices, root to leaf) that chain reduction verifies.

    From the root, repeatedly go to the child whose token has the highest
    target score (logit or probability: the order is the same) at the current
    node, lowest index on ties. The rule reads only the target's
    distributions, never a random draw, which is what keeps verifying the
    chain lossless.
    """
    _check_rows(draft_tree, node_scores)
    children, child_tokens = _child_tokens(draft_tree)
    scores = node_scores.gather(
        1, child_tokens.clamp(min=0).to(node_scores.device)).float().cpu()
    scores = scores.masked_fill(children < 0, float("-inf"))
    best = scores.argmax(dim=1)
    best_child = torch.where(children[:, 0] >= 0,
                             children.gather(1, best[:, None]).squeeze(1), -1)
    return torch.tensor(_walk(best_child.tolist(), draft_tree.tree_spec.max_depth),
                        dtype=torch.long)


def chain_rejection_sample(chain_tokens: torch.Tensor, chain_probs: torch.Tensor,
                           generator: torch.Generator | None = None
                           ) -> tuple[int, list[int]]:
    """Speculative sampling of a chain of one-hot drafts.

    ``chain_tokens`` [L] are the drafts, ``chain_probs`` [L + 1, V] the
    target's distributions before each draft and after the last one. Draft
    ``d_i`` is accepted with probability ``p_i(d_i)``; on the first rejection
    a correction token is drawn from ``p_i`` with ``d_i`` removed
    (renormalised), and if every draft is accepted a bonus token is drawn
    from ``p_L``. Returns ``(num_accepted, emitted_tokens)``; the emitted
    tokens are distributed exactly as plain sampling from the target.
    """
    if torch.is_tensor(chain_tokens):
        chain_tokens = chain_tokens.tolist()
    chain_tokens = [int(t) for t in chain_tokens]
    if chain_probs.shape[0] != len(chain_tokens) + 1:
        raise ValueError("chain_probs must have one row more than chain_tokens")
    emitted: list[int] = []
    for i, draft in enumerate(chain_tokens):
        probs = chain_probs[i]
        if torch.rand((), generator=generator).item() < float(probs[draft]):
            emitted.append(draft)
            continue
        # max(p - onehot(d), 0) renormalised is p with d zeroed.
        residual = probs.clone()
        residual[draft] = 0.0
        if float(residual.sum()) <= 0.0:  # p(d) == 1 cannot be rejected; be safe
            residual = probs
        emitted.append(int(torch.multinomial(residual, 1, generator=generator)))
        return i, emitted
    emitted.append(int(torch.multinomial(chain_probs[-1], 1, generator=generator)))
    return len(chain_tokens), emitted


def chain_verify_sampling(draft_tree: DraftTree, node_probs: torch.Tensor,
                          generator: torch.Generator | None = None) -> VerifyResult:
    """Chain reduction: ``select_chain`` then ``chain_rejection_sample``."""
    _check_rows(draft_tree, node_probs)
    chain = select_chain(draft_tree, node_probs)
    num_accepted, emitted = chain_rejection_sample(
        draft_tree.tokens[chain[1:]], node_probs[chain], generator)
    return VerifyResult(chain[:num_accepted + 1], emitted[-1], emitted)


def sample_and_match(draft_tree: DraftTree, node_probs: torch.Tensor | None = None,
                     generator: torch.Generator | None = None, *,
                     sample_fn: Callable[[int], int] | None = None) -> VerifyResult:
    """Sample-and-match tree verification.

    At each reached node draw the target's token ``x`` (``sample_fn(node)``
    if given, e.g. an engine sampler that applies penalties along the path;
    otherwise ``torch.multinomial(node_probs[node], 1, generator=generator)``),
    then move to the child whose token is ``x`` if there is one, else stop:
    ``x`` is then the bonus (correction) token. Every emitted token is a
    draw from the target at the right context, so the output is exactly
    plain sampling; with a shared seeded generator it consumes one draw per
    emitted token, like plain sampling, and reproduces it token for token.
    """
    if sample_fn is None:
        if node_probs is None:
            raise ValueError("sample_and_match needs node_probs or sample_fn")
        _check_rows(draft_tree, node_probs)

        def sample_fn(node: int) -> int:
            return int(torch.multinomial(node_probs[node], 1, generator=generator))

    children, child_tokens = _child_tokens(draft_tree)
    children_list = children.tolist()
    child_tokens_list = child_tokens.tolist()
    path = [0]
    while True:
        node = path[-1]
        drawn = sample_fn(node)
        try:
            slot = child_tokens_list[node].index(drawn)  # lowest-index match
        except ValueError:
            return _result(draft_tree, path, drawn)
        path.append(children_list[node][slot])
