# SPDX-License-Identifier: Apache-2.0
"""Offline batch inference with ESP speculative decoding.

    ./run python examples/offline_batch.py [MODEL]

MODEL defaults to the bundled SmolLM2-135M-Instruct. ESP needs no draft
model: one option turns it on.
"""

import os
import sys

# vLLM's CPU backend otherwise reserves most of RAM for the KV cache.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def main() -> None:
    from vllm import LLM, SamplingParams

    from vllm_esp_dev.models import model_path

    model = sys.argv[1] if len(sys.argv) > 1 else str(model_path("smollm2-135m"))
    llm = LLM(
        model=model,
        max_model_len=2048,
        # k = 1 mask token per node, level-1 width 4: a 10-token block.
        speculative_config={"method": "esp", "tree": [4]},
        disable_log_stats=False,
    )
    conversations = [
        [{"role": "user", "content": "Explain speculative decoding in two sentences."}],
        [{"role": "user", "content": "Write a haiku about the sea."}],
        [{"role": "user", "content": "List the first five prime numbers."}],
    ]
    outputs = llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=96))
    for output in outputs:
        print("-" * 60)
        print(output.outputs[0].text)
    counters = {m.name: m.value for m in llm.get_metrics()
                if m.name.startswith("vllm:spec_decode_num")}
    drafts = counters.get("vllm:spec_decode_num_drafts", 0)
    if drafts:
        accepted = counters["vllm:spec_decode_num_accepted_tokens"]
        print(f"\nESP: {drafts} verification steps, mean tokens per step "
              f"(tau) = {1 + accepted / drafts:.3f}")


# The guard is required: vLLM starts its engine core in a spawned process,
# which re-imports this file.
if __name__ == "__main__":
    main()
