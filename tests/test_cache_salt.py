# SPDX-License-Identifier: Apache-2.0
"""A request's ``cache_salt`` reaches the proposer (no engine): the ESP
scheduler records it in the request's sampling params, where the worker's
proposer reads it to pick the request's pool of earlier answers
(``core.hybrid.AnswerPools``; the engine test is in test_vllm_esp.py)."""

from __future__ import annotations

from types import SimpleNamespace

from vllm import SamplingParams

from vllm_esp.proposer import CACHE_SALT_ARG, request_cache_salt
from vllm_esp.scheduler import record_cache_salt


def request(params, cache_salt=None):
    return SimpleNamespace(sampling_params=params, cache_salt=cache_salt)


def test_the_scheduler_records_the_salt_where_the_proposer_reads_it():
    shared = {"user": 1}
    params = SamplingParams(extra_args=shared)
    salted = request(params, "tenant-a")
    record_cache_salt(salted, salted.cache_salt)
    assert request_cache_salt(salted) == "tenant-a"
    assert params.extra_args == {"user": 1, CACHE_SALT_ARG: "tenant-a"}
    # The caller's dict is left alone (a shallow clone shares it).
    assert shared == {"user": 1}
    # No salt: nothing recorded, nothing copied.
    plain = request(SamplingParams())
    record_cache_salt(plain, None)
    assert request_cache_salt(plain) is None and plain.sampling_params.extra_args is None
    # Pooling requests have no sampling params.
    record_cache_salt(request(None), "tenant-a")
    assert request_cache_salt(request(None)) is None


def test_a_client_cannot_name_another_tenants_pool():
    spoofed = request(SamplingParams(extra_args={CACHE_SALT_ARG: "tenant-b"}))
    record_cache_salt(spoofed, None)
    assert request_cache_salt(spoofed) is None
    assert spoofed.sampling_params.extra_args is None
    other = request(SamplingParams(extra_args={CACHE_SALT_ARG: "tenant-b", "x": 2}))
    record_cache_salt(other, "tenant-a")
    assert request_cache_salt(other) == "tenant-a"
    assert other.sampling_params.extra_args == {"x": 2, CACHE_SALT_ARG: "tenant-a"}
