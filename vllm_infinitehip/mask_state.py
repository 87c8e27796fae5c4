"""Per-request decode mask state and the refresh schedule (INFINITEHIP.md §1.6).

The attention builder sees batches, not request ids. A running request is recognised by its block
table row: the block that held its first decoded token is written by that request alone, so
``(first block, anchor index, anchor block)`` plus an exact length check identifies it from step
to step. A request that is not in a step's batch is forgotten at that step (it finished, was
aborted or preempted); if it comes back, its mask is simply recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# refresh level of a row that does not decode sparsely this step
LEVEL_NONE = -1


def refresh_level(decode_step: int, intervals: tuple[int, ...]) -> int:
    """First stage to rerun at this decode step; ``len(intervals)`` means reuse the mask.

    Step 0 reruns everything; otherwise the first stage ``i`` with ``step % intervals[i] == 0``
    reruns from its cached input, and later stages follow.
    """
    if decode_step == 0:
        return 0
    for i, interval in enumerate(intervals):
        if decode_step % interval == 0:
            return i
    return len(intervals)


@dataclass
class DecodeState:
    """One running request's decode masks, for every layer."""

    first_block: int
    anchor_index: int
    anchor_block: int
    seq_len: int
    decode_step: int = 0
    layers: dict[str, Any] = field(default_factory=dict)


class DecodeStateStore:
    """Maps the rows of each step's batch to their :class:`DecodeState`; owned by the builder."""

    def __init__(self) -> None:
        self._states: dict[int, list[DecodeState]] = {}

    def __len__(self) -> int:
        return sum(len(v) for v in self._states.values())

    def _find(self, row: list[int], seq_len: int) -> DecodeState | None:
        for st in self._states.get(row[0], ()):
            if (
                st.anchor_index < len(row)
                and row[st.anchor_index] == st.anchor_block
                and seq_len == st.seq_len + 1
            ):
                return st
        return None

    def assign(
        self, rows: list[list[int] | None], seq_lens: list[int], block_size: int
    ) -> list[DecodeState | None]:
        """Match this step's sparse-decode rows (others are None) to states, creating new ones.

        States matched by no row are dropped. Two rows that claim one state (possible only
        when requests share every block, which then hold identical tokens) get fresh states.
        """
        matched: list[DecodeState | None] = []
        claimed: set[int] = set()
        for row, seq_len in zip(rows, seq_lens):
            if row is None:
                matched.append(None)
                continue
            st = self._find(row, seq_len)
            if st is not None and id(st) not in claimed:
                claimed.add(id(st))
                st.seq_len = seq_len
                st.decode_step += 1
            else:
                anchor = (seq_len - 1) // block_size
                st = DecodeState(row[0], anchor, row[anchor], seq_len)
            matched.append(st)
        self._states = {}
        for st in matched:
            if st is not None:
                self._states.setdefault(st.first_block, []).append(st)
        return matched
