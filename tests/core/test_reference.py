# SPDX-License-Identifier: Apache-2.0
"""The reference decoder on tiny random models: tree attention, losslessness."""

from __future__ import annotations

import pytest
import torch
from tiny_models import VOCAB_SIZE, get_model

from vllm_esp.config import ESPConfig
from vllm_esp.core.proposal import DraftTree
from vllm_esp.core.tree import TreeSpec, block_layout, chain_tree, static_tree
from vllm_esp_dev.reference import ReferenceDecoder
from vllm_esp_dev.sources import ProposalContext

CONFIGS = {
    "[4]": ESPConfig(tree=(4,)),
    "[29]": ESPConfig(tree=(29,)),
    "[15,4]": ESPConfig(num_mask_tokens=2, tree=(15, 4)),
    "BC=30": ESPConfig(tree=None, block_complexity=30),
    "k=3": ESPConfig(num_mask_tokens=3, tree=(2, 1, 1)),
    "hybrid BC=30": ESPConfig(tree=None, block_complexity=30,
                              candidates=("esp", "ngram")),
    "hybrid k=2 BC=24": ESPConfig(num_mask_tokens=2, tree=None, block_complexity=24,
                                  candidates=("esp", "ngram")),
}
NEW_TOKENS = 32


def _prompt(seed: int, length: int = 12) -> list[int]:
    g = torch.Generator().manual_seed(100 + seed)
    return torch.randint(0, VOCAB_SIZE, (length,), generator=g).tolist()


# ------------------------------------------------ tree attention == path attention
TREES = [
    static_tree([3, 2]),                                   # k = 2
    TreeSpec((-1, 0, 0, 1, 1, 2, 3, 3, 6), num_mask_tokens=1),
    chain_tree(4),                                         # no masks
]


@pytest.mark.parametrize("model_name", ["llama-sdpa", "llama-eager",
                                        "gemma3-sdpa", "gemma3-eager"])
@pytest.mark.parametrize("tree_spec", TREES, ids=str)
@torch.no_grad()
def test_tree_attention_equals_per_path_attention(model_name, tree_spec):
    """Every block row's hidden state (one forward with a cached prefix and
    the tree mask) equals running that row's own path (root..node, then
    masks 1..j of the node) as a plain causal sequence after the prefix."""
    model = get_model(model_name)
    decoder = ReferenceDecoder(model)
    g = torch.Generator().manual_seed(7)
    prefix_len = 9  # longer than gemma3's 6-token sliding window
    prefix = torch.randint(0, VOCAB_SIZE, (prefix_len,), generator=g)
    tokens = torch.randint(0, VOCAB_SIZE, (tree_spec.num_nodes,), generator=g)
    hidden_size = model.config.hidden_size
    mask_embedding = torch.randn(hidden_size, generator=g)
    layout = block_layout(tree_spec)

    cache = decoder._new_cache()
    prefix_embeds = decoder._embed(prefix)
    decoder._forward(prefix_embeds, torch.arange(prefix_len),
                     torch.ones(prefix_len, prefix_len, dtype=torch.bool).tril(),
                     cache, prefix_len=0)
    rows = torch.empty(layout.block_size, hidden_size)
    rows[layout.node_rows] = decoder._embed(tokens)
    rows[layout.is_mask_row] = mask_embedding
    visible = torch.cat([torch.ones(layout.block_size, prefix_len, dtype=torch.bool),
                         layout.attention_mask], dim=1)
    block_hidden = decoder._forward(rows, layout.positions(prefix_len), visible,
                                    cache, prefix_len=prefix_len)

    parents = tree_spec.parents
    for row in range(layout.block_size):
        node = int(layout.row_owner[row])
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        sequence = torch.cat([
            prefix_embeds,
            decoder._embed(tokens[path[::-1]]),
            mask_embedding.expand(int(layout.mask_number[row]), -1),
        ])
        path_hidden = model.get_decoder()(inputs_embeds=sequence[None]).last_hidden_state[0, -1]
        torch.testing.assert_close(block_hidden[row], path_hidden, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------- greedy losslessness
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_esp_greedy_equals_plain_greedy(llama, name, seed):
    decoder = ReferenceDecoder(llama, CONFIGS[name])
    prompt = _prompt(seed)
    plain = decoder.greedy(prompt, NEW_TOKENS)
    esp = decoder.esp(prompt, NEW_TOKENS, prefill_masks=bool(seed % 2))
    assert esp.tokens == plain.tokens
    assert len(plain.tokens) == NEW_TOKENS and plain.num_steps == NEW_TOKENS - 1
    assert esp.num_forwards == esp.num_steps + 1 == len(esp.accepted_per_step) + 1


@pytest.mark.parametrize("name", ["[4]", "[15,4]"])
def test_esp_greedy_equals_plain_greedy_sliding_window(gemma3, name):
    """Gemma 3 (sliding window 6, scaled embeddings) over a 12-token prompt:
    the plain path uses transformers' own sliding cache and masks."""
    decoder = ReferenceDecoder(gemma3, CONFIGS[name])
    prompt = _prompt(5)
    assert decoder.esp(prompt, NEW_TOKENS).tokens == decoder.greedy(prompt, NEW_TOKENS).tokens


def test_prompt_lookup_equals_plain_greedy(llama):
    decoder = ReferenceDecoder(llama)
    # The tiny model falls into loops, which prompt lookup then predicts.
    prompt = _prompt(0)
    plain = decoder.greedy(prompt, 40)
    lookup = decoder.prompt_lookup(prompt, 40)
    assert lookup.tokens == plain.tokens
    assert lookup.tau > 1.3


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hybrid_ngram_only_keeps_prompt_lookup_output(llama, seed):
    """``candidates=["ngram"]`` (lookup by the most frequent continuation)
    keeps the output of plain prompt lookup, which is greedy decoding's, and
    accepts drafts on the tiny model's loops."""
    config = ESPConfig(tree=None, block_complexity=22, candidates=("ngram",))
    decoder = ReferenceDecoder(llama, config)
    prompt = _prompt(seed)
    hybrid = decoder.esp(prompt, 40)
    lookup = decoder.prompt_lookup(prompt, 40, num_draft_tokens=config.node_budget)
    assert hybrid.tokens == lookup.tokens
    assert sum(hybrid.accepted_per_step) > 0  # the tiny model loops: lookup accepts


def test_hybrid_accepts_at_least_what_either_source_would_on_loops(llama):
    """On the tiny model's repetitive output the hybrid must do at least as
    well as ESP alone at the same block budget (lookup catches the loops)."""
    prompt = _prompt(0)
    esp = ReferenceDecoder(llama, ESPConfig(tree=None, block_complexity=30)).esp(prompt, 40)
    hybrid = ReferenceDecoder(llama, CONFIGS["hybrid BC=30"]).esp(prompt, 40)
    assert hybrid.tokens == esp.tokens
    assert hybrid.num_steps < esp.num_steps


class OracleSource:
    """Test-only source that knows the true continuation and hides it in a
    tree among distractors: root -> {d, TRUE, d}; TRUE -> {d, TRUE};
    TRUE -> {TRUE}. Greedy must then accept 3 tokens every step."""

    SPEC_PARENTS = (-1, 0, 0, 0, 2, 2, 5)
    TRUE_NODES = (2, 5, 6)

    def __init__(self, truth: list[int], prompt_len: int, num_mask_tokens: int):
        self.truth = truth
        self.prompt_len = prompt_len
        self.spec = TreeSpec(self.SPEC_PARENTS, num_mask_tokens)

    def propose(self, context: ProposalContext) -> DraftTree:
        generated = len(context.token_ids) - self.prompt_len
        true_next = self.truth[generated:generated + 3]
        tokens = [(t * 7 + 3) % VOCAB_SIZE for t in range(len(self.SPEC_PARENTS))]
        for node, token in zip(self.TRUE_NODES, true_next):
            tokens[node] = token
        tokens[0] = context.root_token
        for node in (1, 3, 4):  # distractors must differ from the truth
            level = 0 if node in (1, 3) else 1
            if level < len(true_next) and tokens[node] == true_next[level]:
                tokens[node] = (tokens[node] + 1) % VOCAB_SIZE
        return DraftTree(self.spec, torch.tensor(tokens))


@pytest.mark.parametrize("model_name,name", [("llama-sdpa", "[4]"),
                                             ("llama-eager", "[15,4]"),
                                             ("gemma3-sdpa", "k=3")])
def test_oracle_source_reaches_full_acceptance(model_name, name):
    model = get_model(model_name)
    config = CONFIGS[name]
    decoder = ReferenceDecoder(model, config)
    prompt = _prompt(2)
    new_tokens = 22  # 1 (prefill) + 5 steps of 4 + 1 of a truncated step
    truth = decoder.greedy(prompt, new_tokens + 4).tokens
    source = OracleSource(truth, len(prompt), config.num_mask_tokens)
    result = decoder.esp(prompt, new_tokens, source=source)
    assert result.tokens == truth[:new_tokens]
    assert result.accepted_per_step == [3] * 6
    assert result.num_steps == 6 and result.tau == pytest.approx(21 / 6)
    # EOS stops right after the EOS token, mid-step.
    eos = truth[7]
    stop = truth.index(eos)
    result = decoder.esp(prompt, new_tokens, eos_token_id=eos, source=source)
    assert result.tokens == truth[:stop + 1]


# ------------------------------------------------------------ sampling losslessness
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", ["[4]", "[15,4]", "BC=30", "hybrid BC=30"])
def test_sample_and_match_reproduces_plain_sampling(llama, name, seed):
    decoder = ReferenceDecoder(llama, CONFIGS[name])
    prompt = _prompt(seed)
    plain = decoder.sample(prompt, NEW_TOKENS, seed=seed, temperature=0.8)
    esp = decoder.esp_sample(prompt, NEW_TOKENS, seed=seed, temperature=0.8,
                             method="sample_and_match")
    assert esp.tokens == plain.tokens


@pytest.mark.parametrize("seed", [3, 4])
def test_sample_and_match_oracle_reproduces_plain_sampling(llama, seed):
    """With the sampled continuation in the tree, sample-and-match accepts
    it every step and still consumes the generator exactly like plain
    sampling (one draw per token)."""
    config = CONFIGS["[4]"]
    decoder = ReferenceDecoder(llama, config)
    prompt = _prompt(seed)
    truth = decoder.sample(prompt, 26, seed=seed).tokens
    source = OracleSource(truth, len(prompt), config.num_mask_tokens)
    esp = decoder.esp_sample(prompt, 22, seed=seed, source=source)
    assert esp.tokens == truth[:22]
    assert esp.accepted_per_step == [3] * 6


def test_chain_sampling_runs_and_accepts_oracle(llama):
    """Chain reduction is lossless only in distribution (checked on synthetic
    targets in test_verify); here: it runs end to end, and with an oracle
    tree whose true path has the highest target probability it accepts."""
    decoder = ReferenceDecoder(llama, CONFIGS["[15,4]"])
    prompt = _prompt(0)
    result = decoder.esp_sample(prompt, NEW_TOKENS, seed=0, method="chain")
    assert len(result.tokens) == NEW_TOKENS
    assert all(0 <= t < VOCAB_SIZE for t in result.tokens)
    with pytest.raises(ValueError):
        decoder.esp_sample(prompt, 4, method="bogus")


def test_max_new_tokens_edge_cases(llama):
    decoder = ReferenceDecoder(llama, CONFIGS["[4]"])
    prompt = _prompt(0)
    assert decoder.esp(prompt, 0).tokens == []
    one = decoder.esp(prompt, 1)
    assert one.tokens == decoder.greedy(prompt, 1).tokens and one.num_steps == 0
    assert one.num_forwards == 1
