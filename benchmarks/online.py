# SPDX-License-Identifier: Apache-2.0
"""Online workload: ``vllm serve`` on 127.0.0.1 and a bounded load client.

One server per call (the venv's ``vllm`` command, a free port, started as
a subprocess in its own process group, stopped with SIGTERM then SIGKILL);
``benchmarks.spec_bench`` calls once per method and level. For each
concurrency level ``c`` the client sends every prompt once, at most
``c`` requests in flight, to ``/v1/completions`` with the prompt as token ids
(so online prompts equal offline prompts), greedy or sampled as the pass's
``Decoding`` says (a sampled request sends ``top_p`` and its fixed
``seed``, OpenAI fields vLLM serves), streaming, with
``return_token_ids`` and ``stream_options.include_usage`` so that the final
chunk carries the per-request ``metrics.speculative_decoding`` (the server
runs with ``--per-request-spec-decode-metrics summary``).

Per request: latency (request sent -> stream finished) and TTFT (request sent
-> first chunk with a token), both client side. Per level: wall time from the
first request to the last answer, and vLLM's ``vllm:spec_decode_*_total``
counters scraped from ``/metrics`` before and after (tau online).

Methods with cross-request state (suffix decoding) get a fresh server per
concurrency level even when one call has several.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.methods import Method
from benchmarks.metrics import (
    Decoding,
    PassResult,
    Prompt,
    RequestRecord,
    counter_delta,
    parse_prometheus_counters,
    row_count_delta,
    temperature_label,
)

SERVED_NAME = "bench"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def vllm_command() -> str:
    """The ``vllm`` script beside this interpreter (the venv's), else PATH's."""
    candidate = Path(sys.executable).parent / "vllm"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("vllm")
    if not found:
        raise FileNotFoundError("no 'vllm' command beside the interpreter or on PATH")
    return found


def serve_args(model: str, method: Method, port: int, options: dict[str, Any],
               max_num_seqs: int) -> list[str]:
    """The ``vllm serve`` command line for one method."""
    args = [vllm_command(), "serve", model, "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", SERVED_NAME,
            "--dtype", options["dtype"], "--seed", str(options["seed"]),
            "--max-num-seqs", str(max_num_seqs),
            "--max-model-len", str(options["max_model_len"]),
            "--disable-uvicorn-access-log"]
    if options.get("max_num_batched_tokens"):
        args += ["--max-num-batched-tokens", str(options["max_num_batched_tokens"])]
    if options.get("enforce_eager"):
        args.append("--enforce-eager")
    if options.get("enable_prefix_caching") is False:
        args.append("--no-enable-prefix-caching")
    if method.speculative_config is not None:
        args += ["--speculative-config", json.dumps(method.speculative_config),
                 "--per-request-spec-decode-metrics", "summary"]
    return args


class Server:
    """A ``vllm serve`` subprocess; use as a context manager."""

    def __init__(self, args: list[str], port: int, log_path: Path,
                 startup_timeout: float = 900.0) -> None:
        self.args = args
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen | None = None

    def env(self) -> dict[str, str]:
        env = os.environ.copy()
        if is_esp(self.args):
            # /collective_rpc (dev mode, bound to 127.0.0.1 here) reads the
            # ESP worker's row counts; see scrape_rows.
            env["VLLM_SERVER_DEV_MODE"] = "1"
        return env

    def start(self) -> Server:
        """Start the subprocess and wait for /health; stops it on failure."""
        if self.process is not None:
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL,
                                            start_new_session=True, env=self.env())
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with code {self.process.returncode} "
                    f"during start-up; last lines of {self.log_path}:\n"
                    + self.log_tail())
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=5) as r:
                    # Healthy, and from our process (not another server that
                    # grabbed the port while ours failed to bind).
                    if r.status == 200 and self.process.poll() is None:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vllm serve not healthy after {self.startup_timeout:.0f} s; "
                           f"see {self.log_path}:\n" + self.log_tail())

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM to the server's own process group (API server, engine core,
        workers), SIGKILL after 60 s; returns once the whole group is gone so
        that its port and memory are free for the next server."""
        process, self.process = self.process, None
        if process is None:
            return
        group = process.pid  # start_new_session: the group id is the pid
        try:
            os.killpg(group, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if process.poll() is not None and not _group_alive(group):
                return
            time.sleep(0.5)
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(timeout=30)


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def scrape_counters(base_url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as response:
        return parse_prometheus_counters(response.read().decode())


def is_esp(server_args: list[str]) -> bool:
    if "--speculative-config" not in server_args:
        return False
    config = json.loads(server_args[server_args.index("--speculative-config") + 1])
    return config.get("method") == "esp"


def scrape_rows(server: Server) -> dict[str, int] | None:
    """The ESP worker's cumulative decode request-steps and rows (rank 0)."""
    if not is_esp(server.args):
        return None
    request = urllib.request.Request(
        f"{server.base_url}/collective_rpc", method="POST",
        data=json.dumps({"method": "esp_row_counts"}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())["results"][0]


# ---------------------------------------------------------------- load client
def completion_payload(prompt_ids: list[int], options: dict[str, Any]) -> dict:
    """A streaming ``/v1/completions`` request; ``options``:
    ``Decoding.request_options`` (temperature, max_tokens, ignore_eos, and
    for a sampled request top_p and seed)."""
    return {"model": SERVED_NAME, "prompt": prompt_ids, **options, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}


async def _one_request(session, url: str, prompt: Prompt,
                       decoding: Decoding) -> RequestRecord:
    payload = completion_payload(prompt.token_ids, decoding.request_options(prompt.index))
    token_ids: list[int] = []
    spec: dict | None = None
    ttft = None
    # Chunks with tokens: one per engine step unless the server merged steps
    # the client had not read yet, so a lower bound on the forwards.
    chunks_with_tokens = 0
    start = time.perf_counter()
    async with session.post(url, json=payload) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status} for prompt {prompt.index}: "
                               f"{(await response.text())[:500]}")
        buffer = b""
        async for chunk in response.content.iter_any():
            buffer += chunk
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        continue
                    message = json.loads(data)
                    if "error" in message and "choices" not in message:
                        raise RuntimeError(f"server error for prompt {prompt.index}: "
                                           f"{message['error']}")
                    for choice in message.get("choices") or []:
                        new = choice.get("token_ids") or []
                        if new and ttft is None:
                            ttft = time.perf_counter() - start
                        chunks_with_tokens += bool(new)
                        token_ids.extend(new)
                    metrics = message.get("metrics") or {}
                    if metrics.get("speculative_decoding"):
                        spec = metrics["speculative_decoding"]
    latency = time.perf_counter() - start
    record = RequestRecord.from_spec_metrics(prompt.index, prompt.category, token_ids,
                                             spec, latency_s=latency, ttft_s=ttft)
    return record.with_emitting_steps(chunks_with_tokens, exact=False)


async def run_load(base_url: str, prompts: list[Prompt], concurrency: int,
                   decoding: Decoding,
                   progress: Callable[[int], None] | None = None
                   ) -> tuple[list[RequestRecord], float]:
    """Every prompt once, at most ``concurrency`` in flight, in prompt order.
    Returns the records (prompt order) and the wall time."""
    import aiohttp

    semaphore = asyncio.Semaphore(concurrency)
    url = f"{base_url}/v1/completions"
    timeout = aiohttp.ClientTimeout(total=None, sock_read=1800)
    connector = aiohttp.TCPConnector(limit=concurrency)

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        async def bounded(prompt: Prompt) -> RequestRecord:
            async with semaphore:
                record = await _one_request(session, url, prompt, decoding)
            if progress:
                progress(1)
            return record

        start = time.perf_counter()
        records = await asyncio.gather(*(bounded(p) for p in prompts))
        seconds = time.perf_counter() - start
    return list(records), seconds


def start_server(model: str, method: Method, options: dict[str, Any],
                 max_num_seqs: int, log_path: Path, attempts: int = 3) -> Server:
    """Start a server on a free port; on a port race ("Address already in
    use": another process took the port between our probe and vLLM's bind)
    try again on a new port."""
    for attempt in range(1, attempts + 1):
        port = free_port()
        server = Server(serve_args(model, method, port, options, max_num_seqs), port,
                        log_path)
        try:
            return server.start()
        except RuntimeError:
            if attempt < attempts and "Address already in use" in server.log_tail(80):
                continue
            raise
    raise AssertionError("unreachable")


def run_online(method: Method, model: str, prompts: list[Prompt],
               concurrencies: list[int], decoding: Decoding,
               warmup_ids: list[int], options: dict[str, Any], log_dir: Path,
               progress: Callable[[int], None] | None = None) -> list[PassResult]:
    results: list[PassResult] = []
    groups = ([[c] for c in concurrencies] if method.cross_request_state
              else [list(concurrencies)])
    for group in groups:
        suffix = f"-c{group[0]}" if len(group) == 1 else ""
        if decoding.sampled:
            suffix += f"-{temperature_label(decoding.temperature)}"
        log_path = log_dir / f"serve-{method.name}{suffix}.log"
        started = time.monotonic()
        server = start_server(model, method, options, max(group), log_path)
        with server:
            warmup = [Prompt(-1, "warmup", None, warmup_ids)]
            asyncio.run(run_load(server.base_url, warmup, 1, Decoding(max_tokens=8)))
            if decoding.sampled:  # the sampled path's first calls too
                asyncio.run(run_load(server.base_url, warmup, 1,
                                     replace(decoding, max_tokens=8)))
            startup: float | None = time.monotonic() - started
            for concurrency in group:
                before = scrape_counters(server.base_url)
                rows_before = scrape_rows(server)
                records, seconds = asyncio.run(run_load(
                    server.base_url, prompts, concurrency, decoding, progress))
                after = scrape_counters(server.base_url)
                rows_after = scrape_rows(server)
                notes = []
                if method.cross_request_state:
                    notes.append("fresh server for this level (first pass over "
                                 "distinct prompts)")
                results.append(PassResult(method.name, "online", concurrency, seconds,
                                          records, counter_delta(before, after), notes,
                                          startup_seconds=startup,
                                          row_counts=row_count_delta(rows_before,
                                                                     rows_after),
                                          temperature=decoding.temperature))
                startup = None  # only the first pass on a server pays for it
    return results
