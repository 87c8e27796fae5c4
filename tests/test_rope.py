"""kernels/rope.py: rotation algebra, agreement with vLLM, angle precision, §2 position rules."""

from __future__ import annotations

import math
from collections.abc import Iterator
from fractions import Fraction

import pytest
import torch

from vllm_infinitehip.kernels import rope as R

# 2*pi to 50 digits: the exact reference must not inherit float64's rounding of pi.
TWO_PI_EXACT = 2 * Fraction("3.14159265358979323846264338327950288419716939937510")

LLAMA3_PARAMS = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def exact_angle(pos: int, inv_freq: float) -> float:
    """``pos * inv_freq mod 2*pi`` in exact rational arithmetic, rounded once to float."""
    a = Fraction(pos) * Fraction(inv_freq)
    return float(a - math.floor(a / TWO_PI_EXACT) * TWO_PI_EXACT)


def wrapped(diff: torch.Tensor) -> torch.Tensor:
    """Angle differences folded into [-pi, pi)."""
    return torch.remainder(diff + math.pi, 2 * math.pi) - math.pi


def reconstructed_angles(pos: list[int], table: R.RopeTable) -> torch.Tensor:
    """The angles ``rotate`` really applies, read back from rotated unit vectors (float64)."""
    half = table.rotary_dim // 2
    n = len(pos)
    # One head per frequency i, holding the unit vector of the pair's first coordinate.
    x = torch.zeros(n, half, table.rotary_dim)
    first = torch.arange(half) if table.is_neox else 2 * torch.arange(half)
    second = first + half if table.is_neox else first + 1
    x[:, torch.arange(half), first] = 1.0
    y = R.rotate(x, torch.tensor(pos), table).double()
    cos = y[:, torch.arange(half), first]
    sin = y[:, torch.arange(half), second]
    return torch.atan2(sin, cos)  # [n, half]


def pair_norms(x: torch.Tensor, is_neox: bool) -> torch.Tensor:
    d = x.shape[-1]
    a, b = (x[..., : d // 2], x[..., d // 2 :]) if is_neox else (x[..., 0::2], x[..., 1::2])
    return torch.hypot(a, b)


# --------------------------------------------------------------------------- algebra
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotation_composes_and_preserves_norms(is_neox: bool) -> None:
    table = R.RopeTable(R.RopeTable.default(64, 1e5).inv_freq, is_neox)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 4, 64, generator=g)
    a = torch.tensor([0, 1, -1, 7, 4_000_000, -4_000_000, 3_999_989, -123_457, 2_500_000,
                      -3_000_001, 17, 4_000_000])
    b = torch.tensor([5, -1, 1, -7, -4_000_000, 4_000_000, 11, 4_000_000, -2_500_001,
                      -999_999, -4_000_000, 3_999_999])
    two_step = R.rotate(R.rotate(x, a, table), b, table)
    one_step = R.rotate(x, a + b, table)
    torch.testing.assert_close(two_step, one_step, atol=2e-6, rtol=1e-5)
    # a + b == 0 rows: a round trip through millions of positions returns x.
    back = (a + b == 0).nonzero().squeeze(1)
    torch.testing.assert_close(two_step[back], x[back], atol=2e-6, rtol=1e-5)
    assert torch.equal(R.rotate(x, 0, table), x)
    assert torch.equal(R.rotate(x, torch.zeros(12, dtype=torch.long), table), x)
    torch.testing.assert_close(pair_norms(one_step, is_neox), pair_norms(x, is_neox),
                               atol=1e-6, rtol=1e-6)


def test_rotate_shapes_dtypes_and_partial_rotary() -> None:
    table = R.RopeTable.default(32, 1e4)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 3, 32, generator=g)  # [B, N, H, D]
    pos = torch.tensor([0, 3, 1000, 70_000, 9])
    per_token = R.rotate(x, pos, table)  # [N] broadcasts over B and H
    for h in range(3):
        torch.testing.assert_close(per_token[1, :, h], R.rotate(x[1, :, h:h + 1], pos, table)[:, 0])
    per_head = R.rotate(x[0], pos[:, None] + torch.arange(3), table)  # [N, H]
    torch.testing.assert_close(per_head[:, 2], R.rotate(x[0, :, 2:3], pos + 2, table)[:, 0])
    xb = x.bfloat16()
    yb = R.rotate(xb, pos, table)
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), R.rotate(xb.float(), pos, table), atol=2e-2, rtol=1e-2)
    with pytest.raises(TypeError):
        R.rotate(x, pos.float(), table)
    # Partial rotary: the table covers 16 of 32 dims; the rest passes through.
    half_table = R.RopeTable(R.RopeTable.default(16, 1e4).inv_freq, True)
    y = R.rotate(x, pos, half_table)
    assert torch.equal(y[..., 16:], x[..., 16:])
    torch.testing.assert_close(y[..., :16], R.rotate(x[..., :16].contiguous(), pos, half_table))


# --------------------------------------------------------------------------- angle precision
def test_angle_precision_at_millions_of_tokens() -> None:
    table = R.RopeTable.default(64, 5e5)
    pos = [0, 1, 8191, 131_071, 1_000_000, 1_048_577, 3_000_001, 4_999_999, 8_000_000]
    got = reconstructed_angles(pos, table)
    inv = table.inv_freq.tolist()
    exact = torch.tensor([[exact_angle(p, f) for f in inv] for p in pos], dtype=torch.float64)
    err = wrapped(got - exact).abs()
    assert float(err.max()) <= 1e-5, float(err.max())
    assert float(wrapped(R.rope_angles(torch.tensor(pos), table) - exact).abs().max()) <= 1e-8

    # The same check catches the naive float32 angle: at 1e6 it is off by more than 1e-2 rad.
    inv32 = table.inv_freq.float()
    naive = (torch.tensor(1_000_000, dtype=torch.float32) * inv32).double()
    naive_err = wrapped(naive - exact[pos.index(1_000_000)]).abs()
    assert float(naive_err.max()) > 1e-2, float(naive_err.max())


# --------------------------------------------------------------------------- vs vLLM
@pytest.fixture(scope="module")
def vllm_config():
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig

    return VllmConfig()


@pytest.fixture
def vllm_ctx(vllm_config) -> Iterator[None]:
    """A current vLLM config for CustomOps, and get_rope's cache restored afterwards."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers import rotary_embedding as vr

    saved = dict(vr._ROPE_DICT)
    with set_current_vllm_config(vllm_config):
        yield
    vr._ROPE_DICT.clear()
    vr._ROPE_DICT.update(saved)


def vllm_rotate(rope, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    out, _ = rope.forward_native(pos, x.clone(), None)
    return out


VLLM_CASES = {
    "llama-theta1e5-neox": ({"rope_theta": 1e5, "rope_type": "default"}, True, 8192),
    "llama-theta1e5-gptj": ({"rope_theta": 1e5, "rope_type": "default"}, False, 8192),
    "llama3-scaled": (LLAMA3_PARAMS, True, 16384),
    "partial-rotary": ({"rope_theta": 1e4, "rope_type": "default",
                        "partial_rotary_factor": 0.5}, True, 4096),
}


@pytest.mark.parametrize("case", list(VLLM_CASES))
def test_matches_vllm_rotary_embedding(vllm_ctx: None, case: str) -> None:
    from vllm.model_executor.layers.rotary_embedding import get_rope

    params, neox, max_pos = VLLM_CASES[case]
    head = 64
    rope = get_rope(head, max_position=max_pos, is_neox_style=neox, rope_parameters=params,
                    dtype=torch.float32)
    table = R.RopeTable.from_vllm(head, params, max_pos, is_neox_style=neox,
                                  dtype=torch.float32)
    assert table.is_neox == neox and table.rotary_dim == rope.rotary_dim

    g = torch.Generator().manual_seed(2)
    n = 256
    x = torch.randn(n, 2, head, generator=g)
    pos = torch.cat([torch.arange(8), torch.randint(0, max_pos, (n - 9,), generator=g),
                     torch.tensor([max_pos - 1])])
    # vLLM's cache holds float32 angles: error up to ~pos * 2**-24 rad, times the pair's norm.
    norms = pair_norms(x[..., : table.rotary_dim], neox).amax(-1, keepdim=True)

    def tol(p: torch.Tensor) -> torch.Tensor:
        return 1e-5 + norms * (p.double() * 2.0**-23).view(-1, 1, 1).float()

    ours = R.rotate(x, pos, table)
    theirs = vllm_rotate(rope, x, pos)
    assert bool(((ours - theirs).abs() <= tol(pos)).all())

    # A key vLLM cached at t is moved to t' by rotate(k, t' - t).
    t2 = torch.randint(0, max_pos, (n,), generator=g)
    moved = R.rotate(theirs, t2 - pos, table)
    assert bool(((moved - vllm_rotate(rope, x, t2)).abs() <= tol(pos) + tol(t2)).all())
    # A wrong delta (off by one position) must fail that tolerance.
    assert not bool(((R.rotate(theirs, t2 - pos + 1, table) - vllm_rotate(rope, x, t2)).abs()
                     <= tol(pos) + tol(t2)).all())


def test_from_vllm_tables(vllm_ctx: None) -> None:
    from transformers import LlamaConfig, Qwen2Config

    default = R.RopeTable.from_vllm(64, {"rope_theta": 1e5, "rope_type": "default"}, 8192,
                                    dtype=torch.float32)
    # Bit-identical: both evaluate vLLM's float32 formula.
    assert torch.equal(default.inv_freq, R.RopeTable.default(64, 1e5).inv_freq)

    llama3 = R.RopeTable.from_vllm(64, LLAMA3_PARAMS, 16384, dtype=torch.float32)
    plain = R.RopeTable.default(64, 5e5)
    wavelen = 2 * math.pi / plain.inv_freq
    short = wavelen < 8192 / 4.0  # llama3 keeps these frequencies
    long = wavelen > 8192 / 1.0  # and divides these by the factor
    assert short.any() and long.any()
    assert torch.equal(llama3.inv_freq[short], plain.inv_freq[short])
    torch.testing.assert_close(llama3.inv_freq[long], plain.inv_freq[long] / 8, rtol=1e-6,
                               atol=0)

    # HF configs, read as vLLM's Llama and Qwen2 read them.
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_theta=1e5,
                      max_position_embeddings=8192)
    assert torch.equal(R.RopeTable.from_vllm(64, cfg, dtype=torch.float32).inv_freq,
                       default.inv_freq)
    qcfg = Qwen2Config(hidden_size=256, num_attention_heads=4, rope_theta=1e6,
                       max_position_embeddings=4096)
    qtable = R.RopeTable.from_vllm(64, qcfg, dtype=torch.float32)
    assert qtable.is_neox and torch.equal(qtable.inv_freq, R.RopeTable.default(64, 1e6).inv_freq)

    with pytest.raises(NotImplementedError):  # linear scaling is not pos * inv_freq
        R.RopeTable.from_vllm(64, {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}, 4096,
                              dtype=torch.float32)


def test_from_vllm_without_current_config_leaves_get_rope_cache_alone() -> None:
    pytest.importorskip("vllm")
    from vllm.config import get_current_vllm_config_or_none
    from vllm.model_executor.layers import rotary_embedding as vr

    assert get_current_vllm_config_or_none() is None
    before = dict(vr._ROPE_DICT)
    table = R.RopeTable.from_vllm(64, {"rope_theta": 2e4, "rope_type": "default"}, 1024,
                                  dtype=torch.float32)
    assert torch.equal(table.inv_freq, R.RopeTable.default(64, 2e4).inv_freq)
    assert dict(vr._ROPE_DICT) == before


# --------------------------------------------------------------------------- §2 position rules
def test_chunk_indexed_positions() -> None:
    # C = 6 candidate chunks, sw' = 10: keys at ordinals 0..5; query at min(p, 6 + 10 = 16).
    key_pos, q_pos = R.chunk_indexed_positions(6, torch.tensor([4, 16, 17, 500_000]), 10)
    assert key_pos.tolist() == [0, 1, 2, 3, 4, 5]
    assert q_pos.tolist() == [4, 16, 16, 16]
    assert key_pos.dtype == q_pos.dtype == torch.int64
    # Defaults: C = 128 chunks, sw' = 1024 - 256 = 768: query at 896, the last chunk (127) is
    # 896 - 127 = 769 = sw' + 1 before it.
    key_pos, q_pos = R.chunk_indexed_positions(128, torch.tensor(3_000_000), 768)
    assert int(q_pos) == 896 and int(q_pos - key_pos[-1]) == 769


def test_relative_positions() -> None:
    # sw' = 768: query at 769, left probe at 0 (distance 769), right probe at 1 (distance 768).
    q, left, right = R.relative_positions(768)
    assert (int(q), int(left), int(right)) == (769, 0, 1)
    assert q.dtype == left.dtype == right.dtype == torch.int64
    q, left, right = R.relative_positions(torch.tensor([768, 1024]))
    assert q.tolist() == [769, 1025] and left.tolist() == [0, 0] and right.tolist() == [1, 1]


def test_streaming_positions() -> None:
    # n_sink = 4, n_stream = 8, K_sel = 6, p_min = 40:
    # first = 40 - 8 - 4 - 6 + 1 = 23, so j = 0..9 -> 23..32; the last (32 = 40 - 8) sits just
    # left of the window (32, 40].
    pos = R.streaming_positions(4, 8, 6, torch.tensor(40))
    assert pos.tolist() == [23, 24, 25, 26, 27, 28, 29, 30, 31, 32]
    # Short context: n_sink = 4, n_stream = 8, K_sel = 8, p_min = 12:
    # first = 12 - 8 - 4 - 8 + 1 = -7 -> max(0, j - 7) for j = 0..11.
    pos = R.streaming_positions(4, 8, 8, torch.tensor(12))
    assert pos.tolist() == [0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4]
    # Per query block, K_sel = [6, 8], p_min = [40, 12]: 4 + 8 = 12 slots. Row 0 continues its
    # formula past its 10 real slots (23..34; the caller masks j >= 10).
    pos = R.streaming_positions(4, 8, torch.tensor([6, 8]), torch.tensor([40, 12]))
    assert pos.tolist() == [list(range(23, 35)), [0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4]]
    assert pos.dtype == torch.int64
    # A static slot count (CUDA graphs): p_min = 1_000_000, n_sink = 2, n_stream = 4,
    # K_sel = 3, 6 slots: first = 1_000_000 - 4 - 2 - 3 + 1 = 999_992.
    pos = R.streaming_positions(2, 4, 3, torch.tensor([1_000_000]), num_slots=6)
    assert pos.tolist() == [[999_992, 999_993, 999_994, 999_995, 999_996, 999_997]]
