"""One if / else per decode step, instead of one gate per layer, in vLLM's full decode graphs.

A decode step refreshes no mask on 28 of every 32 steps (the default schedule), yet a captured
graph holds every layer's pruning cascade. Gating each layer's cascade with a conditional node
(:mod:`kernels.graph_if`) costs about 5 us of the GPU's timeline per skipped node, 32 per step of
a Llama-3-8B: 160 us of a 5.4 ms step at 512K. Here the whole forward is captured twice, as the
two bodies of an if / else on the builder's refresh flag (``DecodeSlots.refreshing``, set on the
device before the replay):

- the *refresh* body is the forward with every layer's cascade (launched ungated, each stage's
  top-k in a launch of its own, the faster way when the launches run only at refresh);
- the *reuse* body is the forward without any, only the block-sparse attention of the stored
  masks;

so a reuse step pays one skipped conditional node, not 32, and a refresh step runs the cascade
without per-layer nodes (H200, 512K: 185.5 -> 190.5 tok/s). The backend asks :func:`current`
which body it is being captured into.

Where: vLLM 0.26's V2 model runner (the default on CUDA for Llama-style models) captures a full
graph by calling a ``forward_fn`` inside ``torch.cuda.graph``
(``vllm.v1.worker.gpu.cudagraph_utils.CudaGraphManager.capture``), and that forward writes its
hidden states into the manager's persistent buffer, so either body leaves the output where the
runner reads it. :func:`install` wraps that ``forward_fn``; nothing else of vLLM changes. Under
the V1 runner, with a TP group (its collectives stay out of conditional bodies), with more than
one infinitehip KV-cache group per engine, or where conditional nodes fail, nothing is branched
and the per-layer gate stays.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch

REFRESH = "refresh"
REUSE = "reuse"
_PATCHED_MARK = "_infinitehip_step_branches"

_branch: str | None = None
# device index -> (the engine's VllmConfig, weakly: through it vLLM reaches every attention layer
# and its KV cache, which a deleted engine must hand back; the step gates its builders offered)
_offers: dict[int, tuple[weakref.ref, list[object]]] = {}


def current() -> str | None:
    """The body being captured now (:data:`REFRESH` or :data:`REUSE`), or None: not branched."""
    return _branch


@contextlib.contextmanager
def branch(name: str) -> Iterator[None]:
    """Run the enclosed forward as body ``name`` (what :func:`current` returns meanwhile)."""
    global _branch
    previous, _branch = _branch, name
    try:
        yield
    finally:
        _branch = previous


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def offer(gate: object, device: torch.device, owner: object) -> None:
    """A builder's step gate: a ``graph_if.GraphIf`` of two regions on its refresh flag, the
    second inverted. Branching needs exactly one per engine (``owner``, its ``VllmConfig``):
    an engine with two infinitehip KV-cache groups has two flags and keeps per-layer gates. A
    new engine in the same process replaces the last one's offers."""
    index = _index(device)
    entry = _offers.get(index)
    if entry is None or entry[0]() is not owner:
        _offers[index] = (weakref.ref(owner), [gate])
    else:
        entry[1].append(gate)
    install()


def step_gate(device: torch.device) -> object | None:
    """The gate to branch on for ``device``, or None when there is not exactly one."""
    entry = _offers.get(_index(device))
    if entry is None or len(entry[1]) != 1:
        return None
    return entry[1][0]


def capture_branched(forward: Callable[[], object], pool: tuple[int, int] | None,
                     device: torch.device) -> bool:  # fmt: skip
    """Inside a capture, ``forward`` twice: as the refresh body (flag set), then as the reuse
    body (flag clear), allocating from ``pool`` (the graph's). False, and nothing run, when
    there is no gate to branch on."""
    gate = step_gate(device)
    if gate is None:
        return False
    # imported here: this module stays free of vLLM (and so of Triton) at import, which the
    # interpreted kernel tests need
    from vllm.logger import init_logger

    init_logger(f"vllm.{__name__}").info_once(
        "infinitehip: decode graphs branch once per step on the refresh flag"
    )
    with gate.region(0, pool), branch(REFRESH):
        forward()
    with gate.region(1, pool), branch(REUSE):
        forward()
    return True


def install() -> None:
    """Wrap the V2 model runner's full-graph captures (idempotent; see the module docstring)."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu import cudagraph_utils

    manager = cudagraph_utils.CudaGraphManager
    original = manager.capture
    if getattr(original, _PATCHED_MARK, False):
        return

    def capture(self, create_forward_fn, *args, **kwargs):
        def create(desc, warmup):
            forward_fn = create_forward_fn(desc, warmup)

            def forward_or_branches(cg_mode):
                # cg_mode NONE inside a capture: the body of a FULL graph (PIECEWISE captures
                # and the eager warm-up run as they are)
                if cg_mode == CUDAGraphMode.NONE and torch.cuda.is_current_stream_capturing():
                    device = torch.device("cuda", torch.cuda.current_device())
                    if capture_branched(lambda: forward_fn(cg_mode), self.pool, device):
                        return None
                return forward_fn(cg_mode)

            return forward_or_branches

        return original(self, create, *args, **kwargs)

    setattr(capture, _PATCHED_MARK, True)
    manager.capture = capture
