# SPDX-License-Identifier: Apache-2.0
"""The registry of what ESP changes inside vLLM (``vllm_esp.patching``):
every change the code makes is registered and checked against the running
vLLM, logged once, and the README lists exactly the registry."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from vllm_esp import patching

ROOT = Path(__file__).resolve().parent.parent


def test_readme_lists_the_registry():
    readme = (ROOT / "README.md").read_text()
    section = re.search(r"<!-- reaches -->\n(.*?)\n<!-- /reaches -->", readme, re.S)
    assert section is not None
    assert section.group(1) == patching.reaches_markdown()


def test_every_registered_change_is_made_through_reach_and_nothing_else_is():
    sources = "\n".join(path.read_text() for path in
                        list((ROOT / "vllm_esp").rglob("*.py")) + [ROOT / "patches/engine_args.py"])
    used = set(re.findall(r'\breach\("([^"]+)"\)', sources))
    used |= set(re.findall(r'apply_patch\("([^"]+)"', sources))
    assert used == set(patching.REACHES)


def test_a_change_refuses_a_vllm_it_was_not_checked_on(monkeypatch):
    monkeypatch.setattr(patching, "installed_vllm_version", lambda: "0.40.1")
    with pytest.raises(patching.UnsupportedVLLMError,
                       match=r"CPU_ATTN.*tree attention.*0\.32\.x, 0\.33\.x.*0\.40\.1"):
        patching.reach("tree attention")


def test_each_change_is_logged_once(monkeypatch, caplog):
    monkeypatch.setattr(patching, "installed_vllm_version", lambda: "0.32.0+cpu")
    monkeypatch.setattr(patching, "_REACHED", set())
    records = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    esp_logger = logging.getLogger("vllm.esp")
    level = esp_logger.level
    esp_logger.addHandler(handler)
    esp_logger.setLevel(logging.DEBUG)
    try:
        for _ in range(3):
            patching.reach("expand kernel")
        patching.reach("runner class")
    finally:
        esp_logger.removeHandler(handler)
        esp_logger.setLevel(level)
    messages = [r.getMessage() for r in records]
    assert len(messages) == 2
    assert "expand_kernel" in messages[0] and "CPUModelRunner" in messages[1]


def test_a_patch_is_applied_once_and_calls_the_original():
    class Owner:
        def method(self):
            return "original"

    def make(original):
        def wrapper(self):
            return "wrapped " + original(self)
        return wrapper

    name = "engine args"
    saved = patching._APPLIED.pop(name, None)
    try:
        first = patching.apply_patch(name, Owner, "method", make)
        second = patching.apply_patch(name, Owner, "method", make)
        assert first is second
        assert Owner().method() == "wrapped original"
        assert first.checked_on == patching.REACHES[name].checked_on
    finally:
        patching._APPLIED.pop(name, None)
        if saved is not None:
            patching._APPLIED[name] = saved
