"""Query blocks of several requests' prefill chunks, so one launch prunes or attends them all.

A prefill chunk's queries are cut into blocks of ``block_size_q`` from its first query
(INFINITEHIP.md §1.1), and every block is pruned and attended on its own. To run the chunks of a
step's requests in one launch, each block records where it comes from: its request's
block-table row, the index of its first query in the step's query tensor, how many queries it
holds, the first one's position, its request's length, and where its part of the chunk ends
(the keys the part's attention may read).

A chunk may be split into parts that prune differently (the body, and the tail that uses the
tail window). Each part is padded to a whole number of blocks of the coarsest stage, so that a
coarse block's finer blocks (:meth:`QueryBlocks.refine`) are the next ones and no block holds
queries of two parts. A padding block holds no query: its key limit is 0, so it selects
nothing and attends nothing.

The builder plans these once per step (host ints, one small copy to the device); the layers run
them with no host work.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch


def shared_once(shared: dict | None, key: tuple, make):
    """``make()``, made once per ``key`` in ``shared``: the dict one layer's calls over a step's
    query blocks keep what they can reuse in (the body and tail parts of a chunk read the same
    requests). ``None``: nothing is shared, ``make()`` runs every time."""
    if shared is None:
        return make()
    if key not in shared:
        shared[key] = make()
    return shared[key]


@dataclass(frozen=True)
class RequestPart:
    """Queries ``[q_lo, q_hi)`` of the step's query tensor, at positions from ``first_pos``, of
    the request whose block-table row is ``row`` and whose length is ``seq_len``."""

    row: int
    q_lo: int
    q_hi: int
    first_pos: int
    seq_len: int

    @property
    def slice_end(self) -> int:
        """One past the part's last position: the keys its attention may read end here."""
        return self.first_pos + self.q_hi - self.q_lo


@dataclass(frozen=True)
class QueryBlocks:
    """Query blocks of ``block_size_q`` queries; every tensor is ``[num_blocks]`` int64.

    Block ``b`` holds queries ``start[b] + i`` for ``i < count[b]``, at positions
    ``first_pos[b] + i`` (consecutive), of the request at block-table row ``row[b]`` with
    ``seq_len[b]`` keys; the block's part ends at position ``slice_end[b] - 1``.
    ``max_seq_len`` (host) sizes the first stage's candidates. ``parts`` (host, may be empty) and
    ``part_blocks`` (the first block of each part, then the block count) say where each part's
    blocks are, for the reference path, which runs part by part."""

    block_size_q: int
    row: torch.Tensor
    start: torch.Tensor
    count: torch.Tensor
    first_pos: torch.Tensor
    seq_len: torch.Tensor
    slice_end: torch.Tensor
    max_seq_len: int
    parts: tuple[RequestPart, ...] = ()
    part_blocks: tuple[int, ...] = ()
    # derived layouts, made once: every layer of a step asks for the same ones
    _derived: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_blocks(self) -> int:
        return self.row.shape[0]

    @classmethod
    def plan(cls, parts: list[RequestPart], block_size_q: int, device: torch.device) -> QueryBlocks:
        """Blocks of ``parts`` (host ints), each padded to whole blocks: one copy to ``device``."""
        cols: list[list[int]] = [[], [], [], [], [], []]
        part_blocks = [0]
        for p in parts:
            n = p.q_hi - p.q_lo
            for lo in range(0, n, block_size_q):
                for col, v in zip(cols, (p.row, p.q_lo + lo, min(block_size_q, n - lo),
                                         p.first_pos + lo, p.seq_len, p.slice_end)):  # fmt: skip
                    col.append(v)
            part_blocks.append(len(cols[0]))
        table = torch.tensor(cols, dtype=torch.int64).view(6, -1).to(device, non_blocking=True)
        return cls(block_size_q, *table.unbind(0),
                   max_seq_len=max((p.seq_len for p in parts), default=0), parts=tuple(parts),
                   part_blocks=tuple(part_blocks))  # fmt: skip

    @classmethod
    def single(
        cls, num_queries: int, first_pos: int | torch.Tensor, seq_len: int, block_size_q: int,
        device: torch.device, slice_end: int | None = None,
    ) -> QueryBlocks:  # fmt: skip
        """One request's ``num_queries`` consecutive queries from ``first_pos`` (an int, or a
        0-dim device tensor: nothing syncs), block-table row 0."""
        offs = torch.arange(0, num_queries, block_size_q, device=device)
        first = offs + (first_pos if isinstance(first_pos, int) else first_pos.long())
        end = seq_len if slice_end is None else slice_end
        return cls(block_size_q, torch.zeros_like(offs), offs,
                   (num_queries - offs).clamp(max=block_size_q), first,
                   torch.full_like(offs, seq_len), torch.full_like(offs, end),
                   max_seq_len=seq_len)  # fmt: skip

    def row_lengths(self, num_rows: int, capacity: int) -> dict[int, int]:
        """Block-table row -> the longest request length its parts reach. Without the parts
        (host ints), each of ``num_rows`` rows up to the blocks' longest request, or up to
        ``capacity`` where that is unknown (a decode refresh resuming)."""
        if not self.parts:
            return dict.fromkeys(range(num_rows), self.max_seq_len or capacity)
        lengths: dict[int, int] = {}
        for part in self.parts:
            lengths[part.row] = max(lengths.get(part.row, 0), part.seq_len)
        return lengths

    def refine(self, block_size_q: int) -> QueryBlocks:
        """The same queries in blocks of ``block_size_q`` (a divisor of this one): block ``b``
        becomes blocks ``b * f .. b * f + f - 1`` (``f`` the ratio), empty ones included."""
        if block_size_q == self.block_size_q:
            return self
        if self.block_size_q % block_size_q:
            raise ValueError(f"block_size_q={block_size_q} must divide {self.block_size_q}")
        if block_size_q not in self._derived:
            self._derived[block_size_q] = self._refined(block_size_q)
        return self._derived[block_size_q]

    def _refined(self, block_size_q: int) -> QueryBlocks:
        f = self.block_size_q // block_size_q
        offs = torch.arange(f, device=self.row.device) * block_size_q

        def each(t: torch.Tensor) -> torch.Tensor:
            return t.repeat_interleave(f)

        count = (self.count.view(-1, 1) - offs).clamp(0, block_size_q).view(-1)
        return QueryBlocks(
            block_size_q, each(self.row), (self.start.view(-1, 1) + offs).view(-1), count,
            (self.first_pos.view(-1, 1) + offs).view(-1), each(self.seq_len),
            each(self.slice_end), self.max_seq_len, self.parts,
            tuple(b * f for b in self.part_blocks),
        )  # fmt: skip

    def key_limit(self) -> torch.Tensor:
        """Keys every query of a block may see (its first position + 1); 0 for a padding block."""
        return torch.where(self.count > 0, self.first_pos + 1, 0)

    def query_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``[num_blocks, block_size_q]``: which rows hold a query, and every row's position."""
        if "rows" not in self._derived:
            i = torch.arange(self.block_size_q, device=self.row.device)
            self._derived["rows"] = (i < self.count.view(-1, 1), self.first_pos.view(-1, 1) + i)
        return self._derived["rows"]

    def padded_queries(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q`` ``[Nq, H, D]`` as ``[num_blocks, block_size_q, H, D]`` float32 (absent rows
        zero), with :meth:`query_rows`."""
        present, positions = self.query_rows()
        index = torch.where(present, self.start.view(-1, 1) + positions - positions[:, :1], 0)
        rows = q.float().index_select(0, index.view(-1)).view(*index.shape, *q.shape[1:])
        rows = torch.where(present.view(*present.shape, 1, 1), rows, 0.0)
        return rows, present, positions


def pool_block_queries(rows: torch.Tensor, present: torch.Tensor, stride: int) -> torch.Tensor:
    """:func:`reference.pool_queries` over padded blocks: ``[num_blocks, H, bq // stride, D]``,
    each row the mean of ``stride`` consecutive present queries, NaN where a group holds none."""
    nb, bq, h, d = rows.shape
    groups = bq // stride
    total = rows.view(nb, groups, stride, h, d).sum(2)
    count = present.float().view(nb, groups, stride).sum(2)
    return (total / count[:, :, None, None]).permute(0, 2, 1, 3).contiguous()


@dataclass(frozen=True)
class DenseRows:
    """A step's prefill chunks that run dense (short contexts), as one varlen FlashAttention
    call: ``cu_seqlens_q`` / ``seqused_k`` (int32) and each chunk's block-table ``rows``
    (int64) on the device; ``token_index`` gathers the chunks' queries out of the step's when
    they are not one range (``q_range``)."""

    parts: tuple[RequestPart, ...]
    cu_seqlens_q: torch.Tensor
    seqused_k: torch.Tensor
    rows: torch.Tensor
    token_index: torch.Tensor | None
    q_range: tuple[int, int]
    max_q: int
    max_k: int

    @classmethod
    def plan(cls, parts: list[RequestPart], device: torch.device) -> DenseRows:
        lens = [p.q_hi - p.q_lo for p in parts]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        one_range = all(a.q_hi == b.q_lo for a, b in itertools.pairwise(parts))
        index = None
        if not one_range:
            index = torch.cat([torch.arange(p.q_lo, p.q_hi) for p in parts]).to(device)
        i32 = torch.tensor([cu, [p.slice_end for p in parts] + [0]], dtype=torch.int32)
        i32 = i32.to(device, non_blocking=True)
        rows = torch.tensor([p.row for p in parts], dtype=torch.int64).to(device)
        return cls(tuple(parts), i32[0], i32[1, :-1], rows, index,
                   (parts[0].q_lo, parts[-1].q_hi), max(lens), max(p.slice_end for p in parts))  # fmt: skip


# Keys per program of the landmark kernel (kernels/triton_landmark.py).
LANDMARK_TILE = 32


@dataclass(frozen=True)
class LandmarkTiles:
    """A step's prefill chunks as the tiles of keys their queries add landmark scores to: each
    chunk's keys from ``window`` before its first query to its last, ``LANDMARK_TILE`` at a
    time. ``tiles [n, 5]`` int32 on the device: block-table row, first key, index of the
    chunk's first query in the step's queries, that query's position, the chunk's query count.
    Planned once per step (host ints, one copy); every layer runs one launch over them."""

    tiles: torch.Tensor
    chunks: tuple[RequestPart, ...]

    @classmethod
    def plan(cls, chunks: tuple[RequestPart, ...], window: int,
             device: torch.device) -> LandmarkTiles:  # fmt: skip
        rows = []
        for p in chunks:
            n = p.q_hi - p.q_lo
            for t0 in range(max(0, p.first_pos - window), p.first_pos + n, LANDMARK_TILE):
                rows.append((p.row, t0, p.q_lo, p.first_pos, n))
        tiles = torch.tensor(rows, dtype=torch.int32).view(-1, 5)
        return cls(tiles.to(device, non_blocking=True), tuple(chunks))

    @classmethod
    def single(cls, num_queries: int, first_pos: int, window: int,
               device: torch.device) -> LandmarkTiles:  # fmt: skip
        """One request's chunk of ``num_queries`` queries from ``first_pos``, block-table row
        0, its queries the first of the step's."""
        chunk = RequestPart(0, 0, num_queries, first_pos, first_pos + num_queries)
        return cls.plan((chunk,), window, device)
