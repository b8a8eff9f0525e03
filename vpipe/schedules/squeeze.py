"""Squeezing a building block's start-up and drain (the controllable-memory paper's idea, our
own implementation): a block repeats one microbatch's pattern every period, so the first and
last microbatches leave slots empty that the steady state fills. Working in the block's unit
slots, each action of those phases moves to the earliest free slot of its rank after its
inputs, unless that raises the rank's memory above the block's own peak:

1. W's are put in the free slots (each free slot takes the oldest weight gradient owed), then
   the start-up and the drain are squeezed, W's included;
2. the W's are taken out again and the drain squeezed once more (F's and I's only, memory
   counted with the W's greedily in the free slots);
3. the W's go back into the free slots, each slot taking the second chunk's oldest W first.

:func:`squeeze` returns both each rank's F/I order (for :func:`vpipe.schedules.fill.fill` to
place W's under the real costs) and the complete programs of step 3.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from vpipe.ir import Action
from vpipe.schedules._common import F, I, W
from vpipe.schedules.blocks import Block

__all__ = ["squeeze"]

_F, _I, _W = 0, 1, 2
Slots = dict[tuple[int, int, int], int]  # (kind, stage, mb) -> slot


def squeeze(
    block: Block, placement: Mapping[int, int], microbatches: int
) -> tuple[list[list[Action]], list[list[Action]]]:
    """(F/I orders, complete programs) of ``block`` squeezed (see the module docstring)."""
    n = len(placement)
    ranks = max(placement.values()) + 1
    f0, i0 = block.slots()
    slot: Slots = {}
    for s in range(n):
        for m in range(microbatches):
            slot[_F, s, m] = f0[s] + m * block.period
            slot[_I, s, m] = i0[s] + m * block.period
    ctx = _Ctx(placement, ranks, n, microbatches)
    with_w = ctx.put_w(slot, split=False)
    ctx.compact(with_w, startup=True)
    fi = {k: t for k, t in with_w.items() if k[0] != _W}
    ctx.compact(fi, startup=False)
    orders = ctx.orders(fi)
    full = ctx.put_w(fi, split=True)
    return orders, ctx.programs(full)


class _Ctx:
    def __init__(self, placement: Mapping[int, int], ranks: int, n: int, mbs: int) -> None:
        self.place, self.ranks, self.n, self.mbs = placement, ranks, n, mbs
        self.mine: list[list[tuple[int, int, int]]] = []  # set by compact

    def rank_of(self, key: tuple[int, int, int]) -> int:
        return self.place[key[1]]

    def put_w(self, slot: Slots, split: bool) -> Slots:
        """``slot`` plus every rank's W's in its free slots (see the module docstring)."""
        out = dict(slot)
        for r in range(self.ranks):
            acts = sorted((t, k) for k, t in slot.items() if self.rank_of(k) == r)
            owed: list[deque[tuple[int, int]]] = [deque(), deque()]
            t = 0  # the next slot to fill
            for at, (kind, s, m) in [*acts, (None, (None, None, None))]:
                while (at is None or t < at) and (owed[0] or owed[1]):
                    ws, wm = (owed[0] if owed[0] else owed[1]).popleft()
                    out[_W, ws, wm] = t
                    t += 1
                if at is None:
                    break
                t = max(t, at + 1)
                if kind == _I:
                    owed[1 if split and self._first_chunk(s, r) else 0].append((s, m))
        return out

    def _first_chunk(self, stage: int, rank: int) -> bool:
        """Whether ``stage`` is the first of its rank's stages (``rank`` unused when -1)."""
        r = self.place[stage]
        return stage == min(s for s, x in self.place.items() if x == r)

    def compact(self, slot: Slots, startup: bool) -> None:
        """Squeeze the drain (and the start-up when ``startup``) of ``slot`` in place."""
        has_w = any(k[0] == _W for k in slot)
        self.mine = [[] for _ in range(self.ranks)]  # each rank's keys, for peak
        for key in slot:
            self.mine[self.rank_of(key)].append(key)
        cap = max(self.peak(slot, r, has_w) for r in range(self.ranks))
        taken = [set() for _ in range(self.ranks)]
        phase = 0
        for key in sorted(slot, key=lambda k: (slot[k], self.rank_of(k), k[0])):
            kind, s, m = key
            if phase == 0 and kind == _I and s == 0:
                phase = 1
            elif phase == 1 and kind == _F and m == self.mbs - 1 and self._first_chunk(s, -1):
                phase = 2
            elif phase == 2 or (phase == 0 and startup):
                self.move(slot, key, taken, cap, has_w)
            taken[self.rank_of(key)].add(slot[key])

    def move(self, slot: Slots, key, taken: list[set[int]], cap: int, has_w: bool) -> None:
        t, r = slot[key], self.rank_of(key)
        for cand in range(self.ready(slot, key), t):
            if cand in taken[r]:
                continue
            slot[key] = cand
            if self.peak(slot, r, has_w) <= cap:
                return
        slot[key] = t

    def ready(self, slot: Slots, key: tuple[int, int, int]) -> int:
        """The first slot ``key`` may take: after its input (a W after its I) and its
        predecessor of the same kind and stage."""
        kind, s, m = key
        deps = [-1]
        if kind == _W:
            deps.append(slot[_I, s, m])
        if kind == _F and s > 0:
            deps.append(slot[_F, s - 1, m])
        if kind == _I:
            deps.append(slot[_F, s, m] if s == self.n - 1 else slot[_I, s + 1, m])
        if m:
            deps.append(slot[kind, s, m - 1])
        return max(deps) + 1

    def peak(self, slot: Slots, rank: int, has_w: bool) -> int:
        """Most stage-activations ``rank`` holds in slot order; without W's, each runs in the
        first free slot after its I."""
        events = sorted((slot[k], k[0]) for k in self.mine[rank])
        live = peak = owed = 0
        last = -1
        for t, kind in events:
            if not has_w:
                gap = t - last - 1
                freed = min(gap, owed)
                live, owed = live - freed, owed - freed
            if kind == _F:
                live += 1
            elif kind == _W:
                live -= 1
            elif not has_w:
                owed += 1
            peak = max(peak, live)
            last = t
        return peak

    def orders(self, slot: Slots) -> list[list[Action]]:
        rows: list[list[tuple[int, int, int, int]]] = [[] for _ in range(self.ranks)]
        for (kind, s, m), t in slot.items():
            rows[self.place[s]].append((t, kind, s, m))
        return [[F(s, m) if k == _F else I(s, m) for _, k, s, m in sorted(row)] for row in rows]

    def programs(self, slot: Slots) -> list[list[Action]]:
        make = {_F: F, _I: I, _W: W}
        rows: list[list[tuple[int, int, int, int]]] = [[] for _ in range(self.ranks)]
        for (kind, s, m), t in slot.items():
            rows[self.place[s]].append((t, kind, s, m))
        return [[make[k](s, m) for _, k, s, m in sorted(row)] for row in rows]
