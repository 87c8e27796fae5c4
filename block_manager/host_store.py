"""The host tier's memory: vLLM's KV blocks in pinned host memory, seen by the GPU through UVA.

vLLM allocates each KV buffer as an int8 ``torch.zeros`` on the device and then reshapes and binds
it. With offload on, :class:`HostKVStore` hands out the same int8 buffers backed by host memory
instead, so every step of vLLM after the allocation (reshape, ``bind_kv_cache``, block zeroing,
block copies) runs unchanged on a device tensor whose bytes live on the host.

Why ``mmap`` + ``cudaHostRegister`` (as vLLM's own ``kv_offload.cpu.gpu_worker.pin_mmap_region``
does) and not ``torch.empty(..., pin_memory=True)``: PyTorch's pinned allocator rounds each block
up to a power of two, so 80 GiB of KV would pin 128 GiB. An anonymous mapping costs its size
rounded to a page, and is zero-filled by the kernel (the ``torch.zeros`` contract for free).
The device view is vLLM's ``get_accelerator_view_from_cpu_tensor``.

The store keeps every mapping it handed out alive: the device views do not own the memory.
:meth:`HostKVStore.close` (the worker's shutdown) unregisters and unmaps them.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import torch


def mapped_bytes(nbytes: int) -> int:
    """What an allocation of ``nbytes`` costs: its size rounded up to whole pages."""
    if nbytes <= 0:
        raise ValueError(f"a host KV buffer needs a positive size, got {nbytes}")
    page = mmap.PAGESIZE
    return -(-nbytes // page) * page


@dataclass
class _Region:
    """One anonymous mapping and the host tensor over it (which pins the mapping open)."""

    mapping: mmap.mmap
    host: torch.Tensor
    registered: bool


class HostKVStore:
    """Hands out zeroed int8 KV buffers in host memory, as tensors on ``device``.

    On a CUDA device the mapping is page-locked with ``cudaHostRegister`` and returned as its
    UVA device view; on the CPU (the PyTorch reference path) the host tensor itself is returned:
    it is ordinary memory there, nothing to register.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._regions: list[_Region] = []

    @property
    def mapped_bytes(self) -> int:
        """Host bytes this store holds (page-rounded), across all buffers."""
        return sum(len(r.mapping) for r in self._regions)

    def zeros(self, nbytes: int) -> torch.Tensor:
        """A zeroed int8 tensor of ``nbytes`` elements on ``self.device``, backed by host memory."""
        mapping = mmap.mmap(-1, mapped_bytes(nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        host = torch.frombuffer(mapping, dtype=torch.int8)
        region = _Region(mapping, host, registered=False)
        self._regions.append(region)
        if self.device.type == "cpu":
            return host[:nbytes]
        if self.device.type != "cuda":
            raise RuntimeError(
                f"host KV buffers are viewable from CUDA or the CPU, not {self.device}"
            )
        self._register(region)
        from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor

        with torch.cuda.device(self.device):
            return get_accelerator_view_from_cpu_tensor(host[:nbytes])

    def _register(self, region: _Region) -> None:
        result = torch.cuda.cudart().cudaHostRegister(
            region.host.data_ptr(), len(region.mapping), 0
        )
        if int(getattr(result, "value", result)) != 0:
            raise RuntimeError(
                f"cudaHostRegister of {len(region.mapping) / (1 << 30):.2f} GiB of host KV failed "
                f"(CUDA error {result}); the host tier needs page-locked memory: lower "
                f"`infinitehip.offload.host_gib` or raise the locked-memory limit (ulimit -l)"
            )
        region.registered = True
        # vLLM's view op copies an unpinned tensor into a fresh pinned buffer instead of viewing
        # it; the KV would then not be this memory.
        if not region.host.is_pinned():
            raise RuntimeError("registered host KV memory does not report as pinned to PyTorch")

    def close(self) -> None:
        """Unregister and unmap every buffer. Only once nothing reads the views any more."""
        regions, self._regions = self._regions, []
        for region in regions:
            if region.registered:
                torch.cuda.cudart().cudaHostUnregister(region.host.data_ptr())
            region.host = None  # type: ignore[assignment]
            try:
                region.mapping.close()
            except BufferError:
                pass  # a view still exports the buffer; the mapping goes with the last one
