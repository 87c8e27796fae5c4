"""Regions of a CUDA-graph capture that run at replay only when a device flag is set.

A decode step's pruning cascade computes nothing on 28 of every 32 steps (no row refreshes), yet
in vLLM's full decode graph its launches cost 1-3 us each per layer even when every program exits
at once. CUDA's conditional graph nodes (CUDA 12.4+) skip a captured body on the device: an IF
node runs its body graph when its handle is non-zero, and a kernel sets the handle from device
memory at replay. torch 2.11 exposes no conditional nodes, so this module builds them with the
CUDA driver API (``cuda.bindings``, a torch dependency) inside torch's stream capture, as torch's
own later ``begin_capture_to_if_node`` does:

- the capturing stream's graph and dependencies come from ``cuStreamGetCaptureInfo``; the IF node
  is added there and made the stream's only dependency;
- its body is captured from a side stream (``cuStreamBeginCaptureToGraph``): whatever the caller
  launches on the current stream inside :meth:`GraphIf.region` lands in the body;
- one small kernel per capture sets the handles of every region from the flag, so a step pays
  one launch for all layers, then one conditional node per layer. NVRTC builds it at first use;
  its ``cudaGraphSetConditional`` is a driver-resolved call (as ``vprintf`` is), so no device
  runtime is linked.

Measured on an H200 (docs/ARCHITECTURE.md, "The cascade gate"): a skipped node costs about 5 us
of the GPU's timeline, about what the three no-op launches it replaces did, so the gain is at
refresh steps and where those launches were wider (stage 0 past 512K).

Nothing inside a region may allocate: torch's caching allocator routes a capture's allocations to
its private pool by capture id, and the side stream's capture has another id. Outside a capture
(eager steps, the CPU) a region is a no-op context and the body runs as launched.

:func:`conditional_graphs_work` checks the whole mechanism once per device (a captured graph
replayed with the flag set and cleared); where it fails, regions run unconditionally.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Iterator

import torch

logger = logging.getLogger("vllm.vllm_infinitehip")

# Handles set by one launch: the kernel's parameter struct stays under CUDA's 4 KiB limit.
_MAX_HANDLES = 256
_SET_HANDLES_SRC = r"""
extern "C" __device__ void cudaGraphSetConditional(unsigned long long handle, unsigned int value);
struct Handles { unsigned long long h[MAX_HANDLES]; unsigned char inverted[MAX_HANDLES];
                 unsigned int n; };
extern "C" __global__ void set_handles(const unsigned char* flag, Handles hs) {
  // one thread: concurrent sets of a handle are undefined, and the handles are few
  unsigned int value = flag[0] != 0;
  for (unsigned int i = 0; i < hs.n; ++i) cudaGraphSetConditional(hs.h[i], value ^ hs.inverted[i]);
}
""".replace("MAX_HANDLES", str(_MAX_HANDLES))


class _Handles(ctypes.Structure):
    _fields_ = [
        ("h", ctypes.c_ulonglong * _MAX_HANDLES),
        ("inverted", ctypes.c_ubyte * _MAX_HANDLES),
        ("n", ctypes.c_uint),
    ]


def _check(result: tuple) -> tuple:
    """A ``cuda.bindings`` call's outputs, raising on an error code."""
    err, *out = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver call failed: {err!r}")
    return tuple(out)


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


_KERNELS: dict[int, object] = {}  # device index -> CUfunction


def _set_handles_kernel(device: torch.device) -> object:
    """The handle-setting kernel on ``device`` (NVRTC, loaded once; never during a capture)."""
    index = _device_index(device)
    if index in _KERNELS:
        return _KERNELS[index]
    from cuda.bindings import driver, nvrtc

    major, minor = torch.cuda.get_device_capability(index)
    (prog,) = _check(nvrtc.nvrtcCreateProgram(_SET_HANDLES_SRC.encode(), b"graph_if.cu", 0, [], []))
    opts = [f"-arch=sm_{major}{minor}".encode()]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    if int(err) != 0:
        (size,) = _check(nvrtc.nvrtcGetProgramLogSize(prog))
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(f"NVRTC: {log.decode(errors='replace')}")
    (size,) = _check(nvrtc.nvrtcGetCUBINSize(prog))
    cubin = b" " * size
    _check(nvrtc.nvrtcGetCUBIN(prog, cubin))
    with torch.cuda.device(index):
        torch.cuda.current_stream(index)  # the primary context is current on this thread
        (module,) = _check(driver.cuModuleLoadData(cubin))
        (fn,) = _check(driver.cuModuleGetFunction(module, b"set_handles"))
    _KERNELS[index] = fn
    return fn


class GraphIf:
    """``n_regions`` regions, each run at replay only when ``flag`` (a 1-element bool or uint8
    device tensor, rewritten before each replay) is non-zero, or, for the indices in
    ``inverted``, only when it is zero (an if / else pair is two regions, one inverted).

    Every region index must be opened once in each capture that opens any (the handles of a
    capture are made together at its first region, and an unused handle can fail the graph's
    instantiation); a region opened twice in one capture runs unconditionally."""

    def __init__(self, flag: torch.Tensor, n_regions: int, inverted: frozenset[int] = frozenset(),
                 ) -> None:  # fmt: skip
        if flag.numel() != 1 or flag.element_size() != 1 or not flag.is_cuda:
            raise ValueError("the flag is one byte on a CUDA device")
        self.flag = flag
        self.n_regions = n_regions
        self.inverted = inverted
        self._fn = _set_handles_kernel(flag.device)
        self._side = torch.cuda.Stream(flag.device)
        self._capture_id: int | None = None
        self._handles: list[int] = []
        self._opened: set[int] = set()

    @contextlib.contextmanager
    def region(self, index: int, pool: tuple[int, int] | None = None) -> Iterator[None]:
        """Inside a capture, what is launched on the current stream lands in region ``index``'s
        body. ``pool``: the capturing graph's memory pool, for a body that allocates (a model's
        forward): this thread's allocations go there while the body is captured, as the
        capture's own would (its allocator routes by capture id, and the body has its own)."""
        if not torch.cuda.is_current_stream_capturing():
            yield
            return
        stream = torch.cuda.current_stream(self.flag.device)
        from cuda.bindings import driver

        s = driver.CUstream(stream.cuda_stream)
        _, capture_id, graph, deps, edges, n_deps = _check(driver.cuStreamGetCaptureInfo(s))
        capture_id = int(capture_id)
        if capture_id != self._capture_id:
            self._begin_capture(s, graph, capture_id)
            _, _, graph, deps, edges, n_deps = _check(driver.cuStreamGetCaptureInfo(s))
        if index in self._opened:
            yield
            return
        self._opened.add(index)
        params = driver.CUgraphNodeParams()
        params.type = driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
        params.conditional.handle = self._handles[index]
        params.conditional.type = driver.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_IF
        params.conditional.size = 1
        (params.conditional.ctx,) = _check(driver.cuCtxGetCurrent())
        (node,) = _check(driver.cuGraphAddNode(graph, deps, edges, n_deps, params))
        body = params.conditional.phGraph_out[0]
        _check(driver.cuStreamUpdateCaptureDependencies(
            s, [node], None, 1,
            driver.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_SET_CAPTURE_DEPENDENCIES,
        ))  # fmt: skip
        side = driver.CUstream(self._side.cuda_stream)
        _check(driver.cuStreamBeginCaptureToGraph(
            side, body, None, None, 0, driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        ))  # fmt: skip
        device = _device_index(self.flag.device)
        if pool is not None:
            # the allocator keeps one route per pool: the capture's (its capture id) gives way to
            # this thread's while the body is captured, then this thread's stands in for it
            # until the capture ends and removes it (each route holds a pool reference: dropped)
            torch._C._cuda_endAllocateToPool(device, pool)
            torch._C._cuda_beginAllocateCurrentThreadToPool(device, pool)
            torch._C._cuda_releasePool(device, pool)
        try:
            with torch.cuda.stream(self._side):
                yield
        finally:
            _check(driver.cuStreamEndCapture(side))

    def _begin_capture(self, s: object, graph: object, capture_id: int) -> None:
        """This capture's handles (default 1: a region whose handle were never set runs), and
        the launch that sets them all from the flag at replay."""
        from cuda.bindings import driver

        (ctx,) = _check(driver.cuCtxGetCurrent())
        self._handles = [
            _check(driver.cuGraphConditionalHandleCreate(
                graph, ctx, 1, driver.CU_GRAPH_COND_ASSIGN_DEFAULT
            ))[0]
            for _ in range(self.n_regions)
        ]  # fmt: skip
        self._capture_id = capture_id
        self._opened = set()
        flag_ptr = ctypes.c_void_p(self.flag.data_ptr())
        for lo in range(0, self.n_regions, _MAX_HANDLES):
            chunk = self._handles[lo : lo + _MAX_HANDLES]
            hs = _Handles()
            for i, h in enumerate(chunk):
                hs.h[i] = int(h)
                hs.inverted[i] = int(lo + i in self.inverted)
            hs.n = len(chunk)
            args = (ctypes.c_void_p * 2)(ctypes.addressof(flag_ptr), ctypes.addressof(hs))
            _check(driver.cuLaunchKernel(self._fn, 1, 1, 1, 1, 1, 1, 0, s,
                                         ctypes.addressof(args), 0))  # fmt: skip


_WORKS: dict[int, str | None] = {}  # device index -> None, or why conditional regions fail


def conditional_graphs_work(device: torch.device) -> bool:
    """Whether :class:`GraphIf` works on ``device``: a graph with two regions, captured and
    replayed with the flag set, cleared and set again, must run the bodies exactly when set.
    Checked once per device, before any of vLLM's captures; logged when it fails."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    index = _device_index(device)
    if index not in _WORKS:
        problem = None
        try:
            with torch.cuda.device(index):
                flag = torch.ones(1, dtype=torch.bool, device=device)
                x = torch.zeros(2, dtype=torch.float32, device=device)
                always = torch.zeros(1, dtype=torch.float32, device=device)
                gate = GraphIf(flag, 2)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for i in range(2):
                        with gate.region(i):
                            x[i : i + 1].add_(1.0)
                        always.add_(1.0)
                for value in (1, 0, 1):
                    flag.fill_(value)
                    graph.replay()
                torch.cuda.synchronize(device)
                got = (x.tolist(), always.item())
                if got != ([2.0, 2.0], 6.0):
                    problem = f"bodies ran {got[0]} times and the rest {got[1]} (want 2 and 6)"
        except Exception as e:  # noqa: BLE001 - any failure means: run regions unconditionally
            problem = f"{type(e).__name__}: {e}"[:300]
        _WORKS[index] = problem
        if problem is not None:
            logger.warning(
                "CUDA-graph conditional nodes do not work here (%s); decode graphs launch the "
                "pruning cascade on every step", problem,
            )  # fmt: skip
    return _WORKS[index] is None
