# SPDX-License-Identifier: Apache-2.0
"""Imported by Python at start-up when tests/ray_shim is on PYTHONPATH (the
Ray tests put it there): installs the test-only CPU Ray shim in every process
they start. See esp_ray_shim.py."""

import esp_ray_shim

esp_ray_shim.install()
