# SPDX-License-Identifier: Apache-2.0
"""The demo's quiet mode (``examples/demo.py`` without ``--verbose``): what
vLLM's engine processes, C++ libraries and Python's warnings write stays
off the terminal, while the demo's own output and progress bars reach it;
when the run fails, what was held back is printed with the traceback.
Each case runs in a fresh interpreter (the mode redirects file descriptors
1 and 2)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.py"

PRELUDE = f"""
import importlib.util, os, subprocess, sys, warnings
spec = importlib.util.spec_from_file_location("demo", {str(DEMO)!r})
demo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(demo)

def engine_process(code):
    # Like vLLM's engine core and worker: a child writing to the inherited
    # stdout and stderr.
    subprocess.run([sys.executable, "-c", code], check=True)
"""


def run(body: str) -> subprocess.CompletedProcess:
    script = PRELUDE + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], capture_output=True,
                          text=True, timeout=120)


def test_quiet_mode_keeps_warnings_off_the_terminal():
    done = run("""
        with demo.quiet_output():
            print("model: tiny")
            engine_process("import sys; print('WARNING [cpu_worker.py:114] libtcmalloc is not found'); "
                           "print('Loading safetensors checkpoint shards: 100%', file=sys.stderr)")
            os.write(2, b"[W1205 utils.cpp:68] Warning: NUMA binding\\n")
            warnings.warn("`torch.distributed.reduce_op` is deprecated", FutureWarning)
            print("progress bar", file=sys.stderr)
            print("outputs identical: 8/8")
        print("after")
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "model: tiny\noutputs identical: 8/8\nafter\n"
    assert done.stderr == "progress bar\n"


def test_quiet_mode_prints_what_it_held_back_when_the_run_fails():
    done = run("""
        with demo.quiet_output():
            print("model: tiny")
            engine_process("import sys; print('WARNING an engine notice'); "
                           "print('Traceback: EngineCore failed: out of memory', file=sys.stderr)")
            raise RuntimeError("Engine core initialization failed")
    """)
    assert done.returncode == 1
    assert done.stdout == "model: tiny\n"
    # The engine's error and the demo's own traceback, in full.
    assert "The run failed" in done.stderr
    assert "Traceback: EngineCore failed: out of memory" in done.stderr
    assert "WARNING an engine notice" in done.stderr
    assert "RuntimeError: Engine core initialization failed" in done.stderr


def test_quiet_vllm_logging_silences_vllms_import_and_start_up_warnings():
    done = run("""
        demo.quiet_vllm_logging()
        import logging
        from vllm import SamplingParams  # warns about Triton on import otherwise
        from vllm.logger import init_logger
        init_logger("vllm.config").warning("Enforce eager set")
        init_logger("vllm.engine").error("an engine error")
    """)
    assert done.returncode == 0, done.stderr
    output = done.stdout + done.stderr
    assert "Triton" not in output and "Enforce eager" not in output
    assert "an engine error" in output
