# SPDX-License-Identifier: Apache-2.0
"""`vllm serve MODEL --speculative-config '{"method": "esp"}'` end to end:
completions and chat, streaming and not, 32 concurrent requests whose greedy
outputs equal vLLM's without speculation, and the spec-decode counters at
/metrics with ESP's meaning."""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from vllm_esp_dev.runs import run_once

pytestmark = pytest.mark.vllm

NUM_CONCURRENT = 32
MAX_TOKENS = 40


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _vllm_command() -> str:
    return shutil.which("vllm") or str(Path(sys.executable).parent / "vllm")


@contextlib.contextmanager
def serve(args: list[str], log_path: Path, env: dict | None = None, timeout: float = 600):
    """Run ``vllm serve ARGS`` on a free port until /health answers; yield
    the base URL; terminate it on exit."""
    port = _free_port()
    log = log_path.open("w")
    process = subprocess.Popen(
        [_vllm_command(), "serve", *args, "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT,
        # A served engine runs as users run it: engine core and worker in
        # processes of their own (tests/conftest.py turns that off for
        # offline engines).
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1",
             "VLLM_ENABLE_V1_MULTIPROCESSING": "1", **(env or {})})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if process.poll() is not None:
                raise RuntimeError("server exited:\n" + log_path.read_text()[-5000:])
            try:
                if requests.get(base + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(2)
        else:
            raise RuntimeError("server did not start:\n" + log_path.read_text()[-5000:])
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


@contextlib.contextmanager
def esp_server(model_dir, tmp_path_factory, name, speculative_config, *extra_args,
               max_num_seqs=16):
    """``vllm serve`` of the bundled model in fp32 with ESP; yields
    ``(base URL, model)``."""
    log_path = tmp_path_factory.mktemp(name) / "server.log"
    with serve([model_dir, "--dtype", "float32", "--enforce-eager",
                "--max-model-len", "2048", "--max-num-seqs", str(max_num_seqs),
                "--seed", "0", *extra_args,
                "--speculative-config", json.dumps(speculative_config)],
               log_path) as base:
        yield base, model_dir


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    with esp_server(smollm2_dir, tmp_path_factory, "serve",
                    {"method": "esp", "tree": [4], "candidates": ["esp"]}) as running:
        yield running


def _complete(base, model, prompt_ids, stream=False):
    body = {"model": model, "prompt": prompt_ids, "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "stream": stream, "return_token_ids": True}
    response = requests.post(base + "/v1/completions", json=body, timeout=600,
                             stream=stream)
    response.raise_for_status()
    if not stream:
        return response.json()["choices"][0]
    text, token_ids = "", []
    for line in response.iter_lines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        choice = json.loads(line[6:])["choices"][0]
        text += choice.get("text", "")
        token_ids += choice.get("token_ids") or []
    return {"text": text, "token_ids": token_ids}


def _counters(base) -> dict[str, float]:
    metrics = requests.get(base + "/metrics", timeout=30).text
    values = {}
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        match = re.search(rf"^vllm:spec_decode_{name}_total\{{[^}}]*\}} ([0-9.e+]+)$",
                          metrics, re.M)
        assert match, f"vllm:spec_decode_{name}_total missing from /metrics"
        values[name] = float(match.group(1))
    return values


def _prompt_embeds(model_dir, token_ids) -> str:
    """The model's own input embeddings of ``token_ids`` (SmolLM2 does not
    scale them), as vLLM's API takes them: base64 of ``torch.save``."""
    import torch
    from safetensors import safe_open

    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as weights:
        table = weights.get_tensor("model.embed_tokens.weight")
    buffer = io.BytesIO()
    torch.save(table[torch.tensor(token_ids)].clone(), buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def _chat_ids(tokenizer, text):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True, tokenize=True,
                                         return_dict=False)


def _plain_greedy(model, prompts):
    from vllm import SamplingParams

    return run_once(model, prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                    max_num_seqs=16).token_ids


def test_prompt_embeds_refused_as_without_esp_and_server_keeps_serving(
        server, smollm2_tokenizer):
    """ESP does not open the prompt-embeds input to clients: unless the user
    enabled it, such a request gets vLLM's own 400, and the server goes on
    answering correctly."""
    base, model = server
    prompt = _chat_ids(smollm2_tokenizer, "Name three colors.")
    body = {"model": model, "prompt_embeds": _prompt_embeds(model, prompt),
            "max_tokens": 8, "temperature": 0.0}
    refused = requests.post(base + "/v1/completions", json=body, timeout=600)
    assert refused.status_code == 400, refused.text
    assert "--enable-prompt-embeds" in refused.text
    # Malformed embeddings are refused too, without harm.
    garbage = requests.post(base + "/v1/completions", timeout=600,
                            json={**body, "prompt_embeds": "bm90IGEgdGVuc29y"})
    assert garbage.status_code == 400, garbage.text
    assert _complete(base, model, prompt)["token_ids"] == _plain_greedy(model, [prompt])[0]


@pytest.fixture(scope="module")
def embeds_server(smollm2_dir, tmp_path_factory):
    """ESP (the default hybrid) with prompt embeddings enabled by the user."""
    with esp_server(smollm2_dir, tmp_path_factory, "serve-embeds", {"method": "esp"},
                    "--enable-prompt-embeds", max_num_seqs=8) as running:
        yield running


def test_user_enabled_prompt_embeds_work_with_esp(embeds_server, smollm2_tokenizer):
    """With ``--enable-prompt-embeds`` a prompt given as embeddings is served
    with ESP (its mask embedding starts from the given embeddings) and gives
    plain greedy decoding's tokens; the server keeps serving."""
    base, model = embeds_server
    prompts = [_chat_ids(smollm2_tokenizer, text) for text in
               ("Name three colors.", "Write two sentences about the sea.")]
    expected = _plain_greedy(model, prompts)
    before = _counters(base)
    for prompt, plain in zip(prompts, expected):
        body = {"model": model, "prompt_embeds": _prompt_embeds(model, prompt),
                "max_tokens": MAX_TOKENS, "temperature": 0.0, "return_token_ids": True}
        reply = requests.post(base + "/v1/completions", json=body, timeout=600)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["token_ids"] == plain
    assert _counters(base)["num_drafts"] > before["num_drafts"]
    assert _complete(base, model, prompts[0])["token_ids"] == expected[0]


def test_completions_and_chat_streaming_and_not(server, smollm2_tokenizer):
    base, model = server
    prompt = smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three colors."}],
        add_generation_prompt=True, tokenize=True, return_dict=False)
    plain = _complete(base, model, prompt)
    streamed = _complete(base, model, prompt, stream=True)
    assert plain["text"] and streamed["text"] == plain["text"]

    chat = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "messages": [{"role": "user", "content": "Name three colors."}]}
    reply = requests.post(base + "/v1/chat/completions", json=chat, timeout=600)
    reply.raise_for_status()
    content = reply.json()["choices"][0]["message"]["content"]
    # The chat endpoint renders the same template: same greedy answer.
    assert content == plain["text"]
    response = requests.post(base + "/v1/chat/completions",
                             json={**chat, "stream": True}, timeout=600, stream=True)
    pieces = []
    for line in response.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            delta = json.loads(line[6:])["choices"][0]["delta"]
            pieces.append(delta.get("content") or "")
    assert "".join(pieces) == content


def test_concurrent_requests_match_plain_vllm_and_metrics(server, questions,
                                                         smollm2_tokenizer):
    from vllm import SamplingParams

    from vllm_esp_dev.data import chat_prompt_ids

    base, model = server
    questions = (questions * 2)[:NUM_CONCURRENT]  # 26 bundled; repeats are fine
    prompts = [chat_prompt_ids(smollm2_tokenizer, q) for q in questions]
    before = _counters(base)
    with concurrent.futures.ThreadPoolExecutor(NUM_CONCURRENT) as pool:
        served = list(pool.map(lambda p: _complete(base, model, p), prompts))
    after = _counters(base)

    plain = run_once(model, prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                     max_num_seqs=16)
    mismatched = [i for i, (s, p) in enumerate(zip(served, plain.token_ids))
                  if s["token_ids"] != p]
    assert not mismatched, f"served ESP outputs differ for prompts {mismatched}"

    drafts = after["num_drafts"] - before["num_drafts"]
    drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    assert drafts > 0
    # tree [4]: every ESP step proposes 4 nodes (masks are not counted).
    assert drafted == 4 * drafts
    assert 0 <= accepted <= drafted
    # Output tokens = per request: 1 from prefill + per step (1 + accepted),
    # minus what a final step overshot max_tokens by.
    total_tokens = sum(len(s["token_ids"]) for s in served)
    assert total_tokens <= len(prompts) + drafts + accepted
