# SPDX-License-Identifier: Apache-2.0
"""Reference ESP decoder on Hugging Face transformers (batch size 1).

This is the executable specification the vLLM adapter is tested against. It
runs the target model with a real KV cache (``DynamicCache``) and does one
forward per verification step over the whole block (tree nodes + ``k`` mask
rows per node, in ``BlockLayout`` order), with a 4D attention mask: full
access to the cached prefix plus the block's tree mask, and position ids
``p + position_offsets``.

One ESP step, for a root at position ``p`` (the cache holds positions < p)::

    1. tree     = source.propose(history, root, mask logits of the last step)
    2. rows     = embed(tree tokens) on node rows, the mask embedding on mask rows
    3. hidden   = decoder(rows, positions p + offsets, prefix + tree mask)
    4. verify   node-row logits (greedy / sample-and-match / chain)
    5. cache    keep prefix + rows of the accepted path (root..n_a); drop the rest
    6. next     mask logits = lm_head(mask rows of n_a)
    7. commit   emitted tokens (accepted + bonus): EMA-update the mask embedding;
                the bonus is the next root

Conventions shared with the vLLM adapter (so step counts agree):

* The prefill forward produces the first token (it counts as a forward but not
  as a verification step). ``tau`` = tokens emitted by verification steps /
  steps.
* The first decode step verifies ``placeholder_tree`` (no mask logits exist
  yet). ``prefill_masks=True`` instead appends ``k`` mask rows to the prefill
  (the paper's variant; causal attention is already right there) and builds
  the first tree from them.
* The mask embedding starts from the prompt (``config.mask_init``) and is
  EMA-updated with every committed token, the prefill's token included,
  before the next forward uses it.
* A step's emitted tokens are cut at ``max_new_tokens`` and after EOS, as
  vLLM does.

``logits`` are computed only for the rows that need them (node rows, then
the masks of the last reached node), which matters for large vocabularies.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from vllm_esp.config import ESPConfig
from vllm_esp.core.mask_embedding import MaskEmbeddingState, initial_mask_embedding
from vllm_esp.core.proposal import DraftTree
from vllm_esp.core.tree import chain_tree
from vllm_esp_dev.sources import (
    CandidateSource,
    PromptLookupSource,
    ProposalContext,
    candidate_source,
)
from vllm_esp_dev.verify import (
    VerifyResult,
    chain_verify_sampling,
    greedy_verify,
    sample_and_match,
)

__all__ = ["DecodeResult", "ReferenceDecoder"]

SAMPLING_METHODS = ("sample_and_match", "chain")


@dataclass
class DecodeResult:
    tokens: list[int] = field(default_factory=list)
    num_forwards: int = 0       # target forwards, prefill included
    num_steps: int = 0          # verification steps (decode forwards)
    # Accepted drafts per step (a), before the max_new_tokens / EOS cut.
    accepted_per_step: list[int] = field(default_factory=list)
    # Draft tree nodes per step (root excluded), what vLLM reports as drafted.
    drafted_per_step: list[int] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Mean tokens emitted per verification step (the prefill's token excluded)."""
        if self.num_steps == 0:
            return float("nan")
        return (len(self.tokens) - 1) / self.num_steps


def _eos_set(eos_token_id: int | Iterable[int] | None) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, int):
        return frozenset([eos_token_id])
    return frozenset(int(t) for t in eos_token_id)


def _commit(tokens: list[int], new_tokens: Sequence[int], max_new_tokens: int,
            eos: frozenset[int]) -> tuple[list[int], bool]:
    """Append ``new_tokens`` up to the length limit or an EOS; return (added, done)."""
    added = []
    for token in new_tokens:
        tokens.append(int(token))
        added.append(int(token))
        if len(tokens) >= max_new_tokens or token in eos:
            return added, True
    return added, False


class ReferenceDecoder:
    """Greedy / sampling / ESP / prompt-lookup decoding of one sequence.

    ``model`` is a transformers causal LM (Llama, Gemma 3, ...), used as is
    (use fp32 for exact comparisons). Models with sliding-window layers get
    a per-layer-type mask with the window applied to absolute positions.
    """

    def __init__(self, model: torch.nn.Module, config: ESPConfig | None = None,
                 mask_seed: int = 0) -> None:
        self.model = model.eval()
        self.config = config if config is not None else ESPConfig()
        self.mask_seed = mask_seed
        self._decoder = model.get_decoder()
        self._embedding = model.get_input_embeddings()
        self._lm_head = model.get_output_embeddings()
        text_config = model.config.get_text_config()
        self._dtype = self._embedding.weight.dtype
        self._softcap = getattr(text_config, "final_logit_softcapping", None)
        layer_types = getattr(text_config, "layer_types", None) or ["full_attention"]
        unknown = set(layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise NotImplementedError(f"layer types {sorted(unknown)} are not supported")
        self._layer_types = tuple(sorted(set(layer_types)))
        self._sliding_window = getattr(text_config, "sliding_window", None)
        # Gemma's embedding module scales the table; `sample` init needs it.
        self._embedding_scale = float(getattr(self._embedding, "scalar_embed_scale", 1.0))

    # ----------------------------------------------------------- model calls
    def _embed(self, token_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
        token_ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        return self._embedding(token_ids)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._lm_head(hidden).float()
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    def _attention_mask(self, visible: torch.Tensor, query_positions: torch.Tensor,
                        key_positions: torch.Tensor):
        """Additive 4D mask(s) from a [q, kv] bool "may attend" matrix.

        transformers returns a 4D mask as is (no causal mask added), for
        eager and sdpa alike. Models with sliding layers take a dict keyed by
        layer type; a sliding layer also hides keys at positions
        ``<= query position - window``, as transformers' own masks do.
        """
        min_value = torch.finfo(self._dtype).min

        def additive(allowed: torch.Tensor) -> torch.Tensor:
            bias = torch.zeros(allowed.shape, dtype=self._dtype)
            return bias.masked_fill(~allowed, min_value)[None, None]

        if self._layer_types == ("full_attention",):
            return additive(visible)
        masks = {}
        for layer_type in self._layer_types:
            allowed = visible
            if layer_type == "sliding_attention":
                allowed = allowed & (key_positions[None, :]
                                     > query_positions[:, None] - self._sliding_window)
            masks[layer_type] = additive(allowed)
        return masks

    def _forward(self, embeds: torch.Tensor, positions: torch.Tensor,
                 visible: torch.Tensor, cache, prefix_len: int) -> torch.Tensor:
        """Hidden states [n, H] of ``embeds`` [n, H] after a cached prefix."""
        key_positions = torch.cat([torch.arange(prefix_len), positions])
        out = self._decoder(
            inputs_embeds=embeds[None].to(self._dtype),
            attention_mask=self._attention_mask(visible, positions, key_positions),
            position_ids=positions[None],
            past_key_values=cache,
            use_cache=True,
        )
        return out.last_hidden_state[0]

    @staticmethod
    def _keep_in_cache(cache, prefix_len: int, block_rows: torch.Tensor) -> None:
        """Keep the prefix and the given block rows of every layer's K/V.

        Accepted rows were computed at their final positions, so their
        post-RoPE K/V are kept as they are.
        """
        keep = torch.cat([torch.arange(prefix_len), prefix_len + block_rows])
        for layer in cache.layers:
            layer.keys = layer.keys.index_select(-2, keep)
            layer.values = layer.values.index_select(-2, keep)

    def _new_cache(self):
        from transformers import DynamicCache

        # Full (non-sliding) layers everywhere: rows are dropped after each
        # step, which DynamicSlidingWindowLayer cannot do once the window is
        # full. Sliding windows are applied through the mask instead.
        return DynamicCache()

    def _initial_mask_state(self, prompt_embeds: torch.Tensor) -> MaskEmbeddingState:
        generator = torch.Generator().manual_seed(self.mask_seed)
        mask_embedding = initial_mask_embedding(
            prompt_embeds, self.config.mask_init,
            embedding_weight=self._embedding.weight.detach(),
            generator=generator, embedding_scale=self._embedding_scale)
        return MaskEmbeddingState(mask_embedding, self.config.ema)

    # ---------------------------------------------------- plain decoding
    @torch.no_grad()
    def _plain(self, prompt_ids, max_new_tokens: int, eos_token_id,
               pick: Callable[[torch.Tensor], int]) -> DecodeResult:
        from transformers import DynamicCache

        result = DecodeResult()
        if max_new_tokens <= 0:
            return result
        eos = _eos_set(eos_token_id)
        cache = DynamicCache(config=self.model.config)
        input_ids = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(1, -1)
        while True:
            out = self.model(input_ids=input_ids, past_key_values=cache,
                             use_cache=True, logits_to_keep=1)
            result.num_forwards += 1
            token = pick(out.logits[0, -1].float())
            _, done = _commit(result.tokens, [token], max_new_tokens, eos)
            if done:
                break
            result.num_steps += 1
            result.accepted_per_step.append(0)
            input_ids = torch.tensor([[token]])
        return result

    def greedy(self, prompt_ids, max_new_tokens: int,
               eos_token_id: int | Iterable[int] | None = None) -> DecodeResult:
        """Plain greedy decoding through the model's own forward and masks."""
        return self._plain(prompt_ids, max_new_tokens, eos_token_id,
                           lambda logits: int(logits.argmax()))

    def sample(self, prompt_ids, max_new_tokens: int, *, temperature: float = 1.0,
               seed: int = 0, generator: torch.Generator | None = None,
               eos_token_id: int | Iterable[int] | None = None) -> DecodeResult:
        """Plain sampling: one ``torch.multinomial`` draw per token from ``generator``."""
        generator = generator or torch.Generator().manual_seed(seed)
        return self._plain(
            prompt_ids, max_new_tokens, eos_token_id,
            lambda logits: int(torch.multinomial(
                _probs(logits, temperature), 1, generator=generator)))

    # ------------------------------------------------ speculative decoding
    @torch.no_grad()
    def speculative(self, prompt_ids, max_new_tokens: int, source: CandidateSource,
                    verify: Callable[[DraftTree, torch.Tensor], VerifyResult],
                    pick_first: Callable[[torch.Tensor], int], *,
                    eos_token_id: int | Iterable[int] | None = None,
                    prefill_masks: bool = False) -> DecodeResult:
        """Decode with any candidate source and verifier (see module docstring).

        ``verify(tree, node_logits)`` gets raw fp32 logits [T, V];
        ``pick_first(logits)`` picks the prefill's token.
        """
        result = DecodeResult()
        if max_new_tokens <= 0:
            return result
        eos = _eos_set(eos_token_id)
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1)
        prompt_len = prompt.numel()
        cache = self._new_cache()
        prompt_embeds = self._embed(prompt)
        mask_state = self._initial_mask_state(prompt_embeds)

        # Prefill (+ the paper's k masks after the last prompt token).
        num_masks = self.config.masks_per_node if prefill_masks else 0
        mask_rows = mask_state.mask_embedding.to(self._dtype).expand(num_masks, -1)
        embeds = torch.cat([prompt_embeds.to(self._dtype), mask_rows])
        length = prompt_len + num_masks
        hidden = self._forward(embeds, torch.arange(length),
                               torch.ones(length, length, dtype=torch.bool).tril(),
                               cache, prefix_len=0)
        result.num_forwards += 1
        root = pick_first(self._logits(hidden[prompt_len - 1]))
        mask_logits = self._logits(hidden[prompt_len:]) if num_masks else None
        self._keep_in_cache(cache, 0, torch.arange(prompt_len))
        added, done = _commit(result.tokens, [root], max_new_tokens, eos)
        mask_state.commit(self._embed(added))

        history = prompt.tolist() + result.tokens
        while not done:
            context = ProposalContext(history, root, mask_logits)
            tree = source.propose(context)
            if tree is None:  # no proposal: verify the root alone
                tree = DraftTree(chain_tree(0), torch.tensor([root]))
            if tree.root_token != root:
                raise ValueError("the source's tree must be rooted at the root token")
            layout = tree.layout
            root_position = prompt_len + len(result.tokens) - 1  # == cache length
            embeds = torch.empty(layout.block_size, prompt_embeds.shape[1],
                                 dtype=self._dtype)
            embeds[layout.node_rows] = self._embed(tree.tokens).to(self._dtype)
            embeds[layout.is_mask_row] = mask_state.mask_embedding.to(self._dtype)
            visible = torch.cat([
                torch.ones(layout.block_size, root_position, dtype=torch.bool),
                layout.attention_mask], dim=1)
            hidden = self._forward(embeds, layout.positions(root_position), visible,
                                   cache, prefix_len=root_position)
            verified = verify(tree, self._logits(hidden[layout.node_rows]))
            self._keep_in_cache(cache, root_position, verified.accepted_path)
            mask_logits = None
            if layout.num_mask_tokens and layout.has_masks[verified.last_node]:
                mask_logits = self._logits(hidden[layout.mask_rows[verified.last_node]])
            result.num_forwards += 1
            result.num_steps += 1
            result.accepted_per_step.append(verified.num_accepted)
            result.drafted_per_step.append(tree.num_nodes - 1)
            added, done = _commit(result.tokens, verified.emitted_tokens,
                                  max_new_tokens, eos)
            mask_state.commit(self._embed(added))
            history.extend(added)
            root = added[-1]
        return result

    def esp(self, prompt_ids, max_new_tokens: int,
            eos_token_id: int | Iterable[int] | None = None, *,
            prefill_masks: bool = False,
            source: CandidateSource | None = None) -> DecodeResult:
        """ESP with greedy verification (output equals ``greedy``)."""
        return self.speculative(
            prompt_ids, max_new_tokens, source or candidate_source(self.config),
            greedy_verify, lambda logits: int(logits.argmax()),
            eos_token_id=eos_token_id, prefill_masks=prefill_masks)

    def esp_sample(self, prompt_ids, max_new_tokens: int, *,
                   method: str = "sample_and_match", temperature: float = 1.0,
                   seed: int = 0, generator: torch.Generator | None = None,
                   eos_token_id: int | Iterable[int] | None = None,
                   prefill_masks: bool = False,
                   source: CandidateSource | None = None) -> DecodeResult:
        """ESP with lossless sampling.

        ``sample_and_match`` with the same seed reproduces ``sample`` token
        for token; ``chain`` (chain reduction) matches it in distribution.
        """
        if method not in SAMPLING_METHODS:
            raise ValueError(f"method must be one of {SAMPLING_METHODS}, got {method!r}")
        generator = generator or torch.Generator().manual_seed(seed)

        def pick_first(logits: torch.Tensor) -> int:
            return int(torch.multinomial(_probs(logits, temperature), 1,
                                         generator=generator))

        def verify(tree: DraftTree, node_logits: torch.Tensor) -> VerifyResult:
            node_probs = _probs(node_logits, temperature)
            if method == "chain":
                return chain_verify_sampling(tree, node_probs, generator)
            return sample_and_match(tree, node_probs, generator)

        return self.speculative(
            prompt_ids, max_new_tokens, source or candidate_source(self.config),
            verify, pick_first, eos_token_id=eos_token_id, prefill_masks=prefill_masks)

    def prompt_lookup(self, prompt_ids, max_new_tokens: int,
                      eos_token_id: int | Iterable[int] | None = None, *,
                      max_ngram: int = 3, min_ngram: int = 1,
                      num_draft_tokens: int = 10) -> DecodeResult:
        """Greedy prompt-lookup decoding (chains, no masks)."""
        source = PromptLookupSource(max_ngram, min_ngram, num_draft_tokens)
        return self.speculative(
            prompt_ids, max_new_tokens, source, greedy_verify,
            lambda logits: int(logits.argmax()), eos_token_id=eos_token_id)


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature <= 0:
        raise ValueError("sampling needs temperature > 0 (use greedy otherwise)")
    return torch.softmax(logits.float() / temperature, dim=-1)


def main(argv: Sequence[str] | None = None) -> None:
    """Compare ESP and prompt lookup with greedy decoding on one prompt.

    ``python -m vllm_esp_dev.reference --model PATH [--tree 29 | --block-complexity 30]``
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--model", required=True, help="local model folder")
    parser.add_argument("--prompt", default="Write a short story about a robot.")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--tree", type=int, nargs="+")
    parser.add_argument("--block-complexity", type=int)
    parser.add_argument("--num-mask-tokens", type=int)
    parser.add_argument("--prefill-masks", action="store_true")
    parser.add_argument("--no-chat-template", action="store_true")
    args = parser.parse_args(argv)

    options = {}
    if args.tree:
        options["tree"] = args.tree
    if args.block_complexity:
        options["block_complexity"] = args.block_complexity
    if args.num_mask_tokens:
        options["num_mask_tokens"] = args.num_mask_tokens
    config = ESPConfig.from_dict(options)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    if args.no_chat_template or tokenizer.chat_template is None:
        prompt_ids = tokenizer(args.prompt)["input_ids"]
    else:
        prompt_ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True,
            tokenize=True, return_dict=True)["input_ids"]
    decoder = ReferenceDecoder(model, config)
    eos = tokenizer.eos_token_id
    plain = decoder.greedy(prompt_ids, args.max_new_tokens, eos)
    esp = decoder.esp(prompt_ids, args.max_new_tokens, eos,
                      prefill_masks=args.prefill_masks)
    lookup = decoder.prompt_lookup(prompt_ids, args.max_new_tokens, eos)
    print(tokenizer.decode(esp.tokens))
    print(f"config: {config.to_dict()}  block size {config.block_size}")
    print(f"ESP:           tau {esp.tau:.3f} over {esp.num_steps} steps, "
          f"matches greedy: {esp.tokens == plain.tokens}")
    print(f"prompt lookup: tau {lookup.tau:.3f} over {lookup.num_steps} steps, "
          f"matches greedy: {lookup.tokens == plain.tokens}")


if __name__ == "__main__":
    main()
