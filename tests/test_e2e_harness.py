"""The end-to-end benchmark's GPU-idle attribution (``benchmarks/e2e.py``), on a hand-made trace:
the GPU runs need it to say which host call keeps a host-bound decode step long."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import e2e  # noqa: E402  (benchmarks/e2e.py)


def test_idle_gaps_are_charged_to_the_host_call_that_ended_them():
    # two steps: kernels overlap inside a step (one busy stretch), then the GPU waits for the
    # next step's graph launch; a 2 us hole inside step 2 is under the threshold
    kernels = [
        ("gemm", 0.0, 40.0), ("attn", 30.0, 50.0),  # step 1: busy 0-50
        ("gemm", 80.0, 120.0), ("norm", 122.0, 130.0),  # step 2: 30 us gap, then a 2 us hole
        ("gemm", 200.0, 240.0),  # 70 us gap before it
    ]
    launches = [
        ("cudaGraphLaunch", 1.0, 5.0, "model_runner.py(10): execute"),
        ("cudaEventSynchronize", 20.0, 55.0, "async_utils.py(50): get_output"),  # idle at 50
        ("cudaLaunchKernel", 60.0, 62.0, "backend.py(5): build"),  # ends the first gap
        ("cudaGraphLaunch", 75.0, 79.0, "model_runner.py(10): execute"),  # ends it, later
        ("cudaMemcpyAsync", 150.0, 151.0, "sampler.py(3): sample"),
        ("cudaGraphLaunch", 190.0, 199.0, "model_runner.py(10): execute"),  # ends the second
        ("cudaLaunchKernel", 205.0, 206.0, "backend.py(5): build"),  # after the gap: not it
    ]
    got = e2e.idle_gaps(kernels, launches, steps=2)
    assert got["idle_us_per_step"] == (30.0 + 70.0) / 2
    assert got["gaps_per_step"] == 1.0
    assert got["by_host_call"] == [
        ["model_runner.py(10): execute > cudaGraphLaunch", 50.0, 1.0],
    ]
    # the first gap began inside the synchronize; the second while the host ran Python
    assert got["by_call_in_flight"] == [
        ["(host busy)", 35.0, 0.5],
        ["async_utils.py(50): get_output > cudaEventSynchronize", 15.0, 0.5],
    ]


def test_idle_gaps_of_a_busy_gpu_and_of_a_gap_before_any_host_call():
    assert e2e.idle_gaps([("k", 0.0, 10.0), ("k", 10.0, 20.0)], [], steps=1) == {
        "idle_us_per_step": 0.0, "gaps_per_step": 0.0, "by_host_call": [],
        "by_call_in_flight": [],
    }  # fmt: skip
    got = e2e.idle_gaps([("k", 0.0, 10.0), ("k", 50.0, 60.0)], [("cuX", 70.0, 71.0, "c")], 1)
    assert got["by_host_call"] == [["(no host call)", 40.0, 1.0]]
    assert got["by_call_in_flight"] == [["(host busy)", 40.0, 1.0]]
