# SPDX-License-Identifier: Apache-2.0
"""Measure the acceptance rates behind the hybrid tree's scores.

    ./run python -m benchmarks.calibrate_hybrid [--per-category 4] [--max-tokens 128]

Prints, on the model's greedy Spec-Bench answers (reference decoder, fp32):

* prompt lookup: the chance that the lookup chain's next token is right
  when its occurrence shares ``m`` tokens of context with the history's end
  (``LOOKUP_ACCEPT`` in vllm_esp/core/hybrid.py), and how it depends on
  whether the other occurrences sharing that context agree (the ``f_d``
  factor);
* ESP: the chance that a level-1 candidate is the next token, against its
  mask probability (``ESP_WEIGHT``: mask probabilities overstate it).

These only rank candidates; whatever they are, verification keeps the output
identical to the target's.
"""

from __future__ import annotations

import argparse
import collections
import sys

import numpy as np


def lookup_rates(samples, max_context: int = 16):
    """Per context length ``m`` (the tokens the lookup chain's occurrence
    shares with the history's end, plus the chain tokens already right):
    how often the chain's next token was right. ``m = max_context`` means
    at least that."""
    from vllm_esp.core.hybrid import lookup_occurrences

    tries, hits = collections.Counter(), collections.Counter()
    first_tries, first_hits = collections.Counter(), collections.Counter()
    for prompt, output in samples:
        for t in range(1, len(output)):
            history = np.asarray(prompt + output[:t])
            truth = output[t:]
            starts, contexts = lookup_occurrences(history, max_context=max_context)
            if not starts.size:
                continue
            chain = history[int(starts[0]):int(starts[0]) + 16]
            peers = starts[contexts >= contexts[0]]
            nexts = history[np.minimum(peers, len(history) - 1)]
            agree = float(np.mean(nexts == chain[0]))
            bucket = (int(contexts[0]), "all agree" if agree == 1 else
                      ">= half agree" if agree >= 0.5 else "< half agree")
            first_tries[bucket] += 1
            first_hits[bucket] += int(chain[0] == truth[0])
            for depth in range(min(len(chain), len(truth))):
                match_length = min(int(contexts[0]) + depth, max_context)
                tries[match_length] += 1
                if chain[depth] != truth[depth]:
                    break
                hits[match_length] += 1
    return tries, hits, first_tries, first_hits


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dataset", default=None)
    parser.add_argument("--per-category", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--esp-per-category", type=int, default=1)
    args = parser.parse_args(argv)

    # Before the slow imports: a missing Spec-Bench fails at once.
    from vllm_esp_dev.data import load_questions_or_exit, select_questions

    questions = load_questions_or_exit(args.dataset or "spec-bench")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_esp.config import ESPConfig
    from vllm_esp_dev.data import chat_prompt_ids
    from vllm_esp_dev.models import MODELS, model_path
    from vllm_esp_dev.reference import ReferenceDecoder
    from vllm_esp_dev.sources import ESPMaskSource

    torch.set_num_threads(2)
    path = str(model_path(args.model)) if args.model in MODELS else args.model
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eos = tokenizer.eos_token_id

    samples = []
    for question in select_questions(questions, args.per_category):
        prompt = chat_prompt_ids(tokenizer, question)
        with torch.inference_mode():
            output = model.generate(torch.tensor([prompt]), max_new_tokens=args.max_tokens,
                                    do_sample=False)
        samples.append((prompt, output[0, len(prompt):].tolist()))
    tries, hits, first_tries, first_hits = lookup_rates(samples)
    print(f"prompt lookup, {len(samples)} greedy answers: P(next lookup token "
          "right | context length m) (m = 16 means >= 16)")
    for m in sorted(tries):
        print(f"  m={m}: {hits[m] / tries[m]:.3f}  (n={tries[m]})")
    print("  first token, by context length and agreement of its peers:")
    for bucket in sorted(first_tries):
        print(f"    m={bucket[0]}, {bucket[1]}: "
              f"{first_hits[bucket] / first_tries[bucket]:.3f} (n={first_tries[bucket]})")

    # ESP: record each level-1 candidate's mask probability and whether it
    # turned out to be the next token.
    config = ESPConfig.from_dict({"block_complexity": 30})
    records: list[tuple[float, int]] = []

    class RecordingSource(ESPMaskSource):
        previous = None

        def propose(self, context):
            history = [int(t) for t in context.token_ids]
            if self.previous is not None:
                position, candidates = self.previous
                truth = history[position] if len(history) > position else None
                records.extend((p, int(c == truth)) for c, p in candidates)
            tree = super().propose(context)
            self.previous = None
            if context.mask_logits is not None:
                probs = torch.softmax(context.mask_logits[0].float(), dim=-1)
                level1 = [i for i, p in enumerate(tree.tree_spec.parents) if p == 0]
                self.previous = (len(history), [(int(tree.tokens[i]),
                                                 float(probs[tree.tokens[i]]))
                                                for i in level1])
            return tree

    decoder = ReferenceDecoder(model, config)
    for question in select_questions(questions, args.esp_per_category):
        decoder.esp(chat_prompt_ids(tokenizer, question), 64, eos_token_id=eos,
                    source=RecordingSource(config))
    table = np.asarray(records)
    print(f"\nESP level-1 candidates (block complexity 30): {len(table)}; "
          "P(candidate is the next token | mask probability p)")
    for low, high in [(0, .02), (.02, .05), (.05, .1), (.1, .2), (.2, .4), (.4, .7), (.7, 1.01)]:
        chosen = (table[:, 0] >= low) & (table[:, 0] < high)
        if chosen.any():
            print(f"  p in [{low}, {high}): mean p {table[chosen, 0].mean():.3f}, "
                  f"right {table[chosen, 1].mean():.3f} (n={int(chosen.sum())})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
