"""The backend's two execution paths on a real model's Q/K/V, call by call, inside vLLM.

The kernels are tested against the PyTorch reference on synthetic inputs. This checks the same
contract where it matters: every prune and attend call the backend makes while serving a real
prompt runs both paths on the same inputs, and :class:`CompareOps` records, per layer and call,

- ``mask_agreement``: the share of the reference's selected blocks that the Triton path selected;
- ``max_abs_diff``: the largest |Triton - reference| of the attention output, both attending with
  the reference's mask (so the block-sparse kernel alone is compared), and ``ref_max_abs``.

The run continues on the reference's results, so one wrong call cannot hide later ones. Decode
rows run on the reference alone here: their masks live in per-slot buffers that both paths would
write (tests/test_triton_decode.py compares the batched decode kernels with the reference). The
passkey harness uses it with ``--ops compare`` (in-process engine only, which it sets).
"""

from __future__ import annotations

import torch

from vllm_infinitehip.kernels import reference as ref
from vllm_infinitehip.kernels.ops import ReferenceOps, TritonOps


class CompareOps(ReferenceOps):
    """Reference results, with the Triton path's prefill disagreement recorded in ``rows``."""

    layer: int = -1  # set by the backend's forward (see :func:`install`)

    def __init__(self) -> None:
        self.triton = TritonOps()
        self.rows: list[dict] = []

    def prune(self, params, req, q, positions, scale):
        want = super().prune(params, req, q, positions, scale)
        got = self.triton.prune(params, req, q, positions, scale)
        self._row("prune", q, params, mask_agreement=_mask_agreement(got, want))
        return want

    def attend(self, params, req, q, positions, scale, prune, slice_end):
        want, pairs = super().attend(params, req, q, positions, scale, prune, slice_end)
        got, _ = self.triton.attend(params, req, q, positions, scale, prune, slice_end)
        diff = (got.float() - want.float()).abs()
        self._row("attend", q, params, max_abs_diff=float(diff.max()),
                  ref_max_abs=float(want.float().abs().max()))  # fmt: skip
        return want, pairs

    def _row(self, call: str, q: torch.Tensor, params: ref.PruneParams, **values) -> None:
        kind = "decode" if q.shape[0] == 1 else "prefill"
        self.rows.append({"layer": CompareOps.layer, "call": call, "kind": kind,
                          "queries": q.shape[0], "window": params.window_tokens, **values})


def _mask_agreement(got: ref.PruneResult, want: ref.PruneResult) -> float:
    hits = total = extra = 0
    for row in range(want.block_starts.shape[0]):
        w = want.block_starts[row][want.block_valid[row]]
        g = got.block_starts[row].to(w.device)[got.block_valid[row].to(w.device)]
        hits += int(torch.isin(w, g).sum())
        total += w.numel()
        extra += g.numel()
    if total == 0:  # nothing to select (a window covering everything): agree if both say so
        return 1.0 if extra == 0 else 0.0
    return hits / total


def install(kind: str) -> CompareOps | None:
    """Make the backend use ``kind`` ("reference" or "compare") on every device; "kernels"
    leaves its own choice. Returns the CompareOps whose rows fill up, for "compare"."""
    if kind == "kernels":
        return None
    from vllm_infinitehip import backend

    ops = CompareOps() if kind == "compare" else ReferenceOps()
    backend.ops_for = lambda device, precision=None: ops
    forward = backend.InfiniteHiPImpl.forward
    if kind == "compare" and not getattr(forward, "_sets_layer", False):
        from vllm.model_executor.models.utils import extract_layer_index

        def forward_setting_layer(self, layer, *args, **kwargs):
            CompareOps.layer = extract_layer_index(layer.layer_name)
            return forward(self, layer, *args, **kwargs)

        forward_setting_layer._sets_layer = True
        backend.InfiniteHiPImpl.forward = forward_setting_layer
    return ops if kind == "compare" else None
