"""Fixtures of the chart tests. Tests that render the chart carry `chart.needs_helm`: without
helm they skip and say how to get it."""

from __future__ import annotations

import pytest

from tests.k8s.chart import KUBERAY_SCHEMAS


@pytest.fixture(scope="session")
def kuberay_schemas_present() -> None:
    if not KUBERAY_SCHEMAS.is_dir():
        pytest.skip(f"{KUBERAY_SCHEMAS} is absent (the KubeRay CRD schemas live in ../shared, "
                    "next to the repository): custom resources not validated")
