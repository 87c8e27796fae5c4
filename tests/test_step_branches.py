"""The decode graph's one branch per step (``vllm_infinitehip/step_branches.py``): which forward is
captured into which body, which engines branch at all, and, on a GPU, an if / else pair of
conditional bodies that allocate from the graph's pool (``kernels/graph_if.py``)."""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch

from vllm_infinitehip import step_branches

HAS_CUDA = torch.cuda.is_available()


class RecordingGate:
    """The two-region gate's interface (``region(index, pool)``), recording what runs where."""

    def __init__(self) -> None:
        self.log: list[tuple] = []

    @contextlib.contextmanager
    def region(self, index, pool):
        self.log.append(("open", index, pool))
        try:
            yield
        finally:
            self.log.append(("close", index))


class Engine:
    """Stands for an engine's VllmConfig: what owns a set of offers (weakly referenced)."""


@pytest.fixture
def clean_offers():
    saved = dict(step_branches._offers)
    step_branches._offers.clear()
    yield
    step_branches._offers.clear()
    step_branches._offers.update(saved)


def test_the_forward_is_captured_as_the_refresh_body_then_the_reuse_body(clean_offers):
    device = torch.device("cuda", 0)
    gate = RecordingGate()
    step_branches._offers[0] = (weakref.ref(Engine()), [gate])
    seen = []

    def forward():
        seen.append(step_branches.current())
        gate.log.append(("forward", step_branches.current()))

    assert step_branches.current() is None
    assert step_branches.capture_branched(forward, (0, 7), device)
    assert seen == [step_branches.REFRESH, step_branches.REUSE]
    assert gate.log == [
        ("open", 0, (0, 7)), ("forward", "refresh"), ("close", 0),
        ("open", 1, (0, 7)), ("forward", "reuse"), ("close", 1),
    ]  # fmt: skip
    assert step_branches.current() is None


def test_a_failing_body_leaves_no_branch_behind(clean_offers):
    step_branches._offers[0] = (weakref.ref(Engine()), [RecordingGate()])

    def forward():
        raise RuntimeError("capture failed")

    with pytest.raises(RuntimeError):
        step_branches.capture_branched(forward, None, torch.device("cuda", 0))
    assert step_branches.current() is None


def test_only_an_engine_with_one_step_gate_branches(clean_offers):
    device = torch.device("cuda", 0)
    ran = []
    assert not step_branches.capture_branched(lambda: ran.append(1), None, device)  # no offer
    engine_a, engine_b = Engine(), Engine()  # two VllmConfigs
    first, second = RecordingGate(), RecordingGate()
    step_branches.offer(first, device, engine_a)
    assert step_branches.step_gate(device) is first
    # a second infinitehip KV-cache group of the same engine: two flags, no branching
    step_branches.offer(second, device, engine_a)
    assert step_branches.step_gate(device) is None
    assert not step_branches.capture_branched(lambda: ran.append(1), None, device)
    assert ran == []
    # a new engine in the same process replaces the last one's offers
    step_branches.offer(second, device, engine_b)
    assert step_branches.step_gate(device) is second
    assert step_branches.step_gate(torch.device("cuda", 1)) is None


def test_the_offers_do_not_keep_a_deleted_engine_alive(clean_offers):
    # through its VllmConfig vLLM reaches every attention layer and its KV cache: an engine
    # deleted in-process (a benchmark running several in turn) must hand its memory back
    device = torch.device("cuda", 0)
    engine, gate = Engine(), RecordingGate()
    step_branches.offer(gate, device, engine)
    assert step_branches.step_gate(device) is gate
    gone = weakref.ref(engine)
    del engine
    gc.collect()
    assert gone() is None
    # a later engine, even one at the same address, starts its own offers
    later = Engine()
    step_branches.offer(RecordingGate(), device, later)
    step_branches.offer(RecordingGate(), device, later)
    assert step_branches.step_gate(device) is None  # two gates of one engine: no branching


def test_install_wraps_the_v2_runners_capture_once(clean_offers):
    from vllm.v1.worker.gpu import cudagraph_utils

    step_branches.install()
    wrapped = cudagraph_utils.CudaGraphManager.capture
    assert getattr(wrapped, step_branches._PATCHED_MARK)
    step_branches.install()
    assert cudagraph_utils.CudaGraphManager.capture is wrapped


@pytest.mark.skipif(not HAS_CUDA, reason="conditional graph nodes need a GPU; the CPU tests above "
                    "check which forward goes into which body")  # fmt: skip
def test_an_if_else_pair_of_allocating_bodies_runs_one_body_per_replay():
    from vllm_infinitehip.kernels.graph_if import GraphIf, conditional_graphs_work

    device = torch.device("cuda")
    assert conditional_graphs_work(device)
    flag = torch.ones(1, dtype=torch.bool, device=device)
    x = torch.arange(8, dtype=torch.float32, device=device)
    out = torch.zeros(8, device=device)
    runs = torch.zeros(2, device=device)
    gate = GraphIf(flag, 2, frozenset({1}))

    def body(i):
        # temporaries: the body allocates from the graph's pool while it is captured
        y = x * (2.0 if i == 0 else -1.0)
        out.copy_(y + 1.0)
        runs[i : i + 1].add_(1.0)

    graph = torch.cuda.CUDAGraph()
    pool = torch.cuda.graph_pool_handle()
    with torch.cuda.graph(graph, pool):
        for i in range(2):
            with gate.region(i, pool):
                body(i)
        after = out * 10.0  # allocated by the capture itself after both bodies
    for value in (1, 0, 0, 1):
        flag.fill_(value)
        graph.replay()
        torch.cuda.synchronize()
        want = x * (2.0 if value else -1.0) + 1.0
        assert torch.equal(out, want)
        assert torch.equal(after, want * 10.0)
    assert runs.tolist() == [2.0, 2.0]
