"""RoPE re-rotation inside Triton kernels: cos/sin of integer deltas from two small tables.

The kernels move a cached, already rotated key to another position. They rotate it by
``delta = new - true`` (:mod:`kernels.rope` explains why that is exact). The deltas reach
millions. ``delta * inv_freq`` formed in float32 is then off by about 0.1 rad at 1e6, so no kernel
forms an angle. Each delta is split as ``delta = hi * S + lo`` with ``0 <= lo < S``. Two tables
hold ``cos/sin(hi * S * inv_freq)`` (table A, one row per ``hi``) and ``cos/sin(lo * inv_freq)``
(table B, ``S`` rows). The kernel combines one row of each with the angle-addition formula.
Both tables are computed in float64 by :func:`rope.rope_cos_sin` and rounded once to float32.
Each entry is therefore within 2**-24 of the truth, and the combined cos/sin within about 3e-7,
at every delta the tables cover, however large.

``S`` is fixed (:data:`LO_BITS`), so a table that grows changes no ``constexpr`` and causes no
recompilation. Tables depend only on the frequencies, not on the pairing layout. The kernels
take the layout (NeoX or GPT-J, partial rotary) as ``constexpr`` and work it out per dimension
(:func:`rope_pair_layout`).

Every Triton piece here has a PyTorch reference beside it: :func:`delta_cos_sin_reference`
and :func:`rotate_by_delta_reference`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .rope import RopeTable, apply_rotation, rope_cos_sin

LO_BITS = 11
"""``S = 2**LO_BITS``: 2048 rows of table B. Table A then has ``2 * max|delta| / 2048 + 1`` rows,
i.e. about 2 MiB for D = 128 at 4M. The two tables are of similar size near the largest
contexts, so their sum, and the cache footprint of the gathers, stays near its minimum."""

_S = 1 << LO_BITS


@dataclass(frozen=True)
class DeltaTables:
    """Table A (``hi``) and table B (``lo``) of one RoPE frequency set on one device.

    ``hi`` is ``[n_hi, 2, rotary_dim // 2]`` float32. Row ``r`` holds cos (``[:, 0]``) and sin
    (``[:, 1]``) of ``(r * S - bias) * inv_freq``. ``lo`` is ``[S, 2, rotary_dim // 2]`` and holds
    cos/sin of ``lo * inv_freq``. ``delta + bias`` is non-negative for
    ``|delta| <= max_abs_delta``, so a kernel splits it with a shift and a mask. Deltas beyond
    that bound are clamped into table A (wrong angles, but never an out-of-bounds read).
    """

    hi: torch.Tensor
    lo: torch.Tensor
    bias: int
    max_abs_delta: int

    @property
    def n_hi(self) -> int:
        return self.hi.shape[0]

    @property
    def half(self) -> int:
        return self.hi.shape[2]


def build_delta_tables(
    table: RopeTable, max_abs_delta: int, device: torch.device | str
) -> DeltaTables:
    """Tables covering every ``|delta| <= max_abs_delta``, computed in float64 (uncached)."""
    if max_abs_delta < 0:
        raise ValueError(f"max_abs_delta={max_abs_delta} must be >= 0")
    cpu = table.to("cpu")
    rows = -(-max_abs_delta // _S)  # R: hi runs over [-R, R]
    hi_delta = (torch.arange(2 * rows + 1, dtype=torch.int64) - rows) * _S
    lo_delta = torch.arange(_S, dtype=torch.int64)

    def pack(delta: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_cos_sin(delta, cpu, torch.float32)  # float64 angles, one rounding
        return torch.stack([cos, sin], dim=1).contiguous().to(device)

    return DeltaTables(pack(hi_delta), pack(lo_delta), rows * _S, rows * _S)


def _lru_put(cache: OrderedDict, key, value, size: int) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > size:
        cache.popitem(last=False)


# The frequencies' values identify a table. vLLM builds one RopeTable per attention layer, and
# they all hold equal frequencies, so all the layers share one set of tables. The values of a
# frequency tensor are read once and memoised by the tensor's identity. The entry holds the
# tensor, so its id cannot be reused while it is cached.
_FREQ_KEYS: OrderedDict[int, tuple[torch.Tensor, bytes]] = OrderedDict()


def _freq_key(inv_freq: torch.Tensor) -> bytes:
    hit = _FREQ_KEYS.get(id(inv_freq))
    if hit is not None and hit[0] is inv_freq:
        return hit[1]
    key = inv_freq.detach().to("cpu", torch.float64).numpy().tobytes()
    _lru_put(_FREQ_KEYS, id(inv_freq), (inv_freq, key), 256)
    return key


# Tables only grow, to powers of two, so a context that grows token by token rebuilds them
# O(log) times.
_TABLES: OrderedDict[tuple[bytes, str], DeltaTables] = OrderedDict()


def delta_tables(table: RopeTable, max_abs_delta: int, device: torch.device | str) -> DeltaTables:
    """The cached :class:`DeltaTables` of ``table`` on ``device``, covering ``max_abs_delta``.

    Built on first use, or when a larger bound is asked for: a host-side float64 computation
    and one copy to ``device``. Build it before a CUDA graph is captured. A later call with a
    bound no larger than the cached one returns the cached tables and does no device work. The
    same holds for any table with equal frequencies.
    """
    dev = torch.device(device)
    key = (_freq_key(table.inv_freq), str(dev))
    hit = _TABLES.get(key)
    if hit is not None and hit.max_abs_delta >= max_abs_delta:
        _TABLES.move_to_end(key)
        return hit
    bound = max(_S, triton.next_power_of_2(max(1, max_abs_delta)))
    tables = build_delta_tables(table, bound, dev)
    _lru_put(_TABLES, key, tables, 16)
    return tables


_ON_DEVICE: OrderedDict[tuple[bytes, bool, str], RopeTable] = OrderedDict()


def rope_table_on(table: RopeTable, device: torch.device | str) -> RopeTable:
    """``table.to(device)``, cached, so host-side query rotation copies no frequencies per call."""
    dev = torch.device(device)
    if table.inv_freq.device == dev:
        return table
    key = (_freq_key(table.inv_freq), table.is_neox, str(dev))
    hit = _ON_DEVICE.get(key)
    if hit is None:
        hit = table.to(dev)
        _lru_put(_ON_DEVICE, key, hit, 16)
    return hit


def check_layout(table: RopeTable, head_dim: int) -> None:
    """Raise unless the kernels can rotate heads of ``head_dim`` with ``table``."""
    if table.rotary_dim > head_dim:
        raise ValueError(f"rotary_dim {table.rotary_dim} exceeds the head size {head_dim}")


# --------------------------------------------------------------------------- PyTorch reference
def delta_cos_sin_reference(
    delta: torch.Tensor, tables: DeltaTables
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[*delta.shape, rotary_dim // 2]`` float32, computed as the kernels do."""
    u = delta.to(torch.int64) + tables.bias
    hi = torch.clamp(u >> LO_BITS, 0, tables.n_hi - 1)
    a = tables.hi[hi]
    b = tables.lo[u & (_S - 1)]
    ca, sa, cb, sb = a[..., 0, :], a[..., 1, :], b[..., 0, :], b[..., 1, :]
    return ca * cb - sa * sb, sa * cb + ca * sb


def rotate_by_delta_reference(
    x: torch.Tensor, delta: torch.Tensor, table: RopeTable, tables: DeltaTables
) -> torch.Tensor:
    """``x [..., D]`` rotated by ``delta [...]`` (one per row), as the kernels rotate keys."""
    cos, sin = delta_cos_sin_reference(delta, tables)
    return apply_rotation(x, cos, sin, table)


# --------------------------------------------------------------------------- Triton pieces
@triton.jit
def rope_pair_layout(offs_d, ROT_DIM: tl.constexpr, IS_NEOX: tl.constexpr):
    """Per dimension: its pair partner, its frequency, the sign of sin in its row, and whether
    it rotates at all.

    A rotated row is ``x * cos + x[partner] * sign * sin``. NeoX pairs ``(i, i + ROT_DIM/2)``,
    GPT-J pairs ``(2i, 2i + 1)``. Dimensions past ``ROT_DIM`` are their own partner and keep
    ``cos = 1, sin = 0`` (from :func:`delta_cos_sin`), so they pass through unchanged.
    """
    rot = offs_d < ROT_DIM
    if IS_NEOX:
        first = offs_d < ROT_DIM // 2
        partner = tl.where(first, offs_d + ROT_DIM // 2, offs_d - ROT_DIM // 2)
        freq = tl.where(first, offs_d, offs_d - ROT_DIM // 2)
    else:
        first = (offs_d % 2) == 0
        partner = tl.where(first, offs_d + 1, offs_d - 1)
        freq = offs_d // 2
    partner = tl.where(rot, partner, offs_d)
    freq = tl.where(rot, freq, 0)
    sign = tl.where(first, -1.0, 1.0)
    return partner, freq, sign, rot


@triton.jit
def delta_cos_sin(
    delta,
    row_ok,
    freq,
    rot,
    hi_ptr,
    lo_ptr,
    bias,
    n_hi,
    HALF: tl.constexpr,
    LO_BITS: tl.constexpr,
):
    """cos and sin ``[rows, dims]`` of ``delta[rows] * inv_freq[freq[dims]]``.

    No angle is formed: the two table rows are combined with the angle-addition formula.
    Where ``~row_ok`` or ``~rot`` the result is cos = 1, sin = 0, so the rotation is an exact
    identity, as it is for ``delta = 0``. Table A and table B rows of delta 0 hold exactly 1 and 0.
    """
    u = delta.to(tl.int64) + bias  # >= 0 within the tables' bound
    hi = tl.minimum(tl.maximum(u >> LO_BITS, 0), n_hi - 1)
    lo = u & ((1 << LO_BITS) - 1)
    m = row_ok[:, None] & rot[None, :]
    a = hi_ptr + hi[:, None] * (2 * HALF) + freq[None, :]
    b = lo_ptr + lo[:, None] * (2 * HALF) + freq[None, :]
    ca = tl.load(a, mask=m, other=1.0)
    sa = tl.load(a + HALF, mask=m, other=0.0)
    cb = tl.load(b, mask=m, other=1.0)
    sb = tl.load(b + HALF, mask=m, other=0.0)
    return ca * cb - sa * sb, sa * cb + ca * sb


@triton.jit
def pair_dims(offs_f, ROT_DIM: tl.constexpr, IS_NEOX: tl.constexpr):
    """The dimensions of the first and second element of each rotation pair ``offs_f``."""
    if IS_NEOX:
        first = offs_f
        second = offs_f + ROT_DIM // 2
    else:
        first = 2 * offs_f
        second = 2 * offs_f + 1
    return first, second


@triton.jit
def load_split(
    rows,
    ok,
    stride_d,
    head_dim,
    scale,
    FP8: tl.constexpr,
    ROT_DIM: tl.constexpr,
    IS_NEOX: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Rows at ``rows`` ``[N]`` split by the rotation: the first element of every pair
    ``[N, BLOCK_F]``, the second ``[N, BLOCK_F]``, and the dimensions past ``ROT_DIM``
    ``[N, BLOCK_P]`` (``BLOCK_P == 0``: none; the third value is then a placeholder). Zeros
    where ``~ok``. ``FP8``: e4m3 values, dequantized as ``float32(x) * scale``.

    Kernels that rotate work on the halves: a rotation is then two products per pair, its
    cos/sin are loaded once per pair rather than once per dimension, and no row is loaded a
    second time for its pair partners."""
    offs_f = tl.arange(0, BLOCK_F)
    first, second = pair_dims(offs_f, ROT_DIM, IS_NEOX)
    m = ok[:, None] & (offs_f < ROT_DIM // 2)[None, :]
    xa = tl.load(rows[:, None] + first[None, :] * stride_d, mask=m, other=0.0)
    xb = tl.load(rows[:, None] + second[None, :] * stride_d, mask=m, other=0.0)
    if FP8:
        xa = xa.to(tl.float32) * scale
        xb = xb.to(tl.float32) * scale
    if BLOCK_P > 0:
        offs_p = ROT_DIM + tl.arange(0, BLOCK_P)
        xp = tl.load(rows[:, None] + offs_p[None, :] * stride_d,
                     mask=ok[:, None] & (offs_p < head_dim)[None, :], other=0.0)  # fmt: skip
        if FP8:
            xp = xp.to(tl.float32) * scale
    else:
        xp = xa
    return xa, xb, xp


@triton.jit
def rotate_split(
    xa,
    xb,
    delta,
    ok,
    hi_ptr,
    lo_ptr,
    bias,
    n_hi,
    ROT_DIM: tl.constexpr,
    LO_BITS: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    """Pair halves (:func:`load_split`) turned by ``delta`` per row (float32); rows where
    ``~ok`` are left as they are. The same products as :func:`rotate_pairs`."""
    offs_f = tl.arange(0, BLOCK_F)
    cos, sin = delta_cos_sin(delta, ok, offs_f, offs_f < ROT_DIM // 2, hi_ptr, lo_ptr, bias,
                             n_hi, ROT_DIM // 2, LO_BITS)  # fmt: skip
    xa = xa.to(tl.float32)
    xb = xb.to(tl.float32)
    return xa * cos - xb * sin, xb * cos + xa * sin


def split_blocks(rotary_dim: int, head_dim: int) -> tuple[int, int]:
    """``(BLOCK_F, BLOCK_P)`` of :func:`load_split`: the pairs and the dimensions past the
    rotary ones, each padded to a power of two of at least 16 (``tl.dot``'s minimum); 0 when
    every dimension rotates."""
    block_f = max(16, triton.next_power_of_2(max(1, rotary_dim // 2)))
    rest = head_dim - rotary_dim
    return block_f, max(16, triton.next_power_of_2(rest)) if rest > 0 else 0


@triton.jit
def rotate_pairs(x, x_partner, cos, sin, sign):
    """``x`` rotated (float32): each row by its own angles, pairs as :func:`rope_pair_layout`."""
    return x.to(tl.float32) * cos + x_partner.to(tl.float32) * (sign[None, :] * sin)
