"""Owners for work units: longest-processing-time greedy, then moves and swaps toward the lower bound.

Input: per unit a cost (FLOPs), per rank a pinned load (work fixed there already), per unit the elements each rank
already holds, and optionally per unit the bytes of state its owner keeps. A rank's load is its pinned load plus
the cost of the units it owns.

1. Greedy (longest processing time): units by decreasing cost, ties by name; each goes to the rank with the least
   load so far; ties: the rank holding most of the unit, then the lowest rank.
2. Refinement (local search) on the busiest rank b, of load L_b:

   - move: a unit of cost c from b to the least loaded rank r where it fits, when L_r + c < L_b;
   - swap: a unit of cost a on b for a unit of cost d on another rank r, δ = a − d, when 0 < δ and L_r + δ < L_b.

   Both changed ranks end below L_b, so each accepted step makes the load vector, sorted in decreasing order,
   lexicographically smaller (the max first, then how many ranks share it, and so on): the search cannot cycle.
   Of the improving moves the one leaving the pair most balanced is taken; swaps are tried only when no move
   improves, with the least loaded rank that has an improving one, the most balanced of them. The search stops
   when the busiest rank has no improving step or is at ``lower_bound`` rounded up (loads are integers, so that
   is optimal), or after ``MAX_STEPS_PER_UNIT`` steps per unit (a bound on run time, not reached in practice).

Memory, a second constraint: with ``memory`` given, no rank may own more than
``memory_cap = max(MEMORY_SLACK · sum(memory) / world_size, max(memory))`` bytes, with ``MEMORY_SLACK = 1.25``:
25% above a perfect split of the memory, and never below the largest unit, which has to fit somewhere. The greedy
skips ranks the unit would take over the cap (when none fits, the unit goes to the rank owning the least memory,
ties by load then rank), and no refinement step takes a rank's memory up over the cap.

Deterministic: units are handled in the order (decreasing cost, name), so a permutation of the input gives the
same owner to each name; no randomness, and nothing depends on the order of a dict beyond its insertion order.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right, insort

MEMORY_SLACK = 1.25
MAX_STEPS_PER_UNIT = 4


def lower_bound(costs: list[int], pinned_load: list[int], world_size: int) -> float:
    """A lower bound on the busiest rank's load: the largest of the costliest unit, the mean load (units and
    pinned load spread over all ``world_size`` ranks), the largest pinned load, and, with more units than
    ranks, the sum of the W-th and (W+1)-th costliest units (two of the W+1 costliest share a rank)."""
    mean = (sum(costs) + sum(pinned_load)) / world_size
    pair = 0
    if len(costs) > world_size:
        top = sorted(costs, reverse=True)
        pair = top[world_size - 1] + top[world_size]
    return float(max(max(costs, default=0), mean, max(pinned_load, default=0), pair))


def simple_lower_bound(costs: list[int], pinned_load: list[int], world_size: int) -> float:
    """max(costliest unit, mean load, largest pinned load): the bound without the pair term."""
    mean = (sum(costs) + sum(pinned_load)) / world_size
    return float(max(max(costs, default=0), mean, max(pinned_load, default=0)))


def memory_cap(memory: list[int], world_size: int) -> float:
    """Most bytes one rank may own: ``MEMORY_SLACK`` times a perfect split, at least the largest unit."""
    return float(max(MEMORY_SLACK * sum(memory) / world_size, max(memory, default=0)))


def greedy_owners(
    costs: list[int],
    names: list[str],
    world_size: int,
    pinned_load: list[int],
    preferred: list[dict[int, int]],
    memory: list[int] | None = None,
) -> list[int]:
    """Owner rank per unit by the longest-processing-time greedy alone (step 1 of the module docstring)."""
    return _Balance(costs, names, world_size, pinned_load, preferred, memory).owners_by_input()


def assign_owners(
    costs: list[int],
    names: list[str],
    world_size: int,
    pinned_load: list[int],
    preferred: list[dict[int, int]],
    memory: list[int] | None = None,
) -> list[int]:
    """Owner rank per unit: the greedy, refined by moves and swaps off the busiest rank (module docstring)."""
    balance = _Balance(costs, names, world_size, pinned_load, preferred, memory)
    balance.refine()
    return balance.owners_by_input()


def _check(
    costs: list[int],
    names: list[str],
    world_size: int,
    pinned_load: list[int],
    preferred: list[dict[int, int]],
    memory: list[int] | None,
) -> None:
    """Raise ValueError on inconsistent input."""
    n = len(costs)
    if world_size < 1:
        raise ValueError(f"world_size must be ≥ 1, got {world_size}")
    if len(names) != n or len(preferred) != n or (memory is not None and len(memory) != n):
        raise ValueError("costs, names, preferred (and memory) need one entry per unit")
    if len(set(names)) != n:
        raise ValueError("unit names must be unique")
    if len(pinned_load) != world_size:
        raise ValueError(f"pinned_load has {len(pinned_load)} entries for {world_size} ranks")
    if any(c < 0 for c in costs) or (memory is not None and any(m < 0 for m in memory)):
        raise ValueError("costs and memory must be ≥ 0")
    for held in preferred:
        if any(not 0 <= r < world_size for r in held):
            raise ValueError(f"preferred names a rank outside 0..{world_size - 1}: {sorted(held)}")


class _Balance:
    """Loads, owned memory and owners; units are numbered in greedy order (decreasing cost, then name)."""

    def __init__(
        self,
        costs: list[int],
        names: list[str],
        world_size: int,
        pinned_load: list[int],
        preferred: list[dict[int, int]],
        memory: list[int] | None,
    ) -> None:
        _check(costs, names, world_size, pinned_load, preferred, memory)
        self.order = sorted(range(len(costs)), key=lambda i: (-costs[i], names[i]))
        self.world = world_size
        self.cost = [costs[i] for i in self.order]
        self.held = [preferred[i] for i in self.order]
        self.mem = [0] * len(costs) if memory is None else [memory[i] for i in self.order]
        self.cap = float("inf") if memory is None else memory_cap(memory, world_size)
        self.load = list(pinned_load)
        # lower_bound rounded up, in integers: loads are integers, so a busiest rank at it is optimal
        self.floor = max(max(costs, default=0), -(-(sum(costs) + sum(pinned_load)) // world_size), max(pinned_load))
        self.used = [0] * world_size
        self.owner = self._greedy()
        # per rank its units and their costs, in increasing (cost, unit); ranks in increasing (load, rank)
        pairs: list[list[tuple[int, int]]] = [[] for _ in range(world_size)]
        for k, r in enumerate(self.owner):
            pairs[r].append((self.cost[k], k))
        for p in pairs:
            p.sort()
        self.costs_on = [[c for c, _ in p] for p in pairs]
        self.units_on = [[k for _, k in p] for p in pairs]
        self.by_load = sorted((load, r) for r, load in enumerate(self.load))

    def owners_by_input(self) -> list[int]:
        """Owner per unit in the caller's order."""
        out = [0] * len(self.order)
        for k, i in enumerate(self.order):
            out[i] = self.owner[k]
        return out

    def _fits(self, rank: int, extra: int) -> bool:
        """Whether ``rank`` stays within the memory cap after its owned bytes change by ``extra``."""
        return extra <= 0 or self.used[rank] + extra <= self.cap

    def _greedy(self) -> list[int]:
        """Place the units in order by the greedy rule; a heap of (load, rank) with stale entries skipped."""
        load = self.load
        heap = [(pinned, r) for r, pinned in enumerate(load)]
        heapq.heapify(heap)
        owner = []
        for k, cost in enumerate(self.cost):
            held, mem = self.held[k], self.mem[k]
            popped: list[tuple[int, int]] = []
            top: tuple[int, int] | None = None
            while heap:
                entry = heapq.heappop(heap)
                if entry[0] != load[entry[1]]:  # stale: that rank's load has grown since
                    continue
                popped.append(entry)
                if self._fits(entry[1], mem):
                    top = entry
                    break
            if top is None:
                best = min(range(self.world), key=lambda r: (self.used[r], load[r], r))
            else:  # the lowest rank of least load that fits, or one of the same load holding more of the unit
                tied = [r for r in held if load[r] == top[0] and self._fits(r, mem)]
                best = min([top[1], *tied], key=lambda r: (-held.get(r, 0), r))
            for entry in popped:
                heapq.heappush(heap, entry)
            if cost:
                load[best] += cost
                heapq.heappush(heap, (load[best], best))
            self.used[best] += mem
            owner.append(best)
        return owner

    def refine(self) -> None:
        """Moves, else swaps, off the busiest rank while one makes the sorted load vector smaller."""
        for _ in range(MAX_STEPS_PER_UNIT * len(self.cost)):
            top, busiest = self.by_load[-1]
            if top <= self.floor:
                return
            step = self._best_move(busiest) or self._best_swap(busiest)
            if step is None:
                return
            for k, rank in step:
                self._reassign(k, rank)

    def _best_move(self, b: int) -> list[tuple[int, int]] | None:
        """The improving move of a unit off ``b`` leaving the pair most balanced, as [(unit, new rank)].

        Each unit of b is tried on the least loaded rank where it fits (the lowest rank at equal load); the units
        are compared by the pair's new max, then by how much of the unit that rank holds, then greedy order.
        """
        top = self.load[b]
        best: tuple[int, int, int] | None = None
        target = 0
        for c, k in zip(self.costs_on[b], self.units_on[b]):
            if c == 0:
                continue
            for load, r in self.by_load:
                if load + c >= top:
                    break  # no improving rank for this unit (b itself is last, with load + c ≥ top)
                if self._fits(r, self.mem[k]):
                    key = (max(top - c, load + c), -self.held[k].get(r, 0), k)
                    if best is None or key < best:
                        best, target = key, r
                    break
        return None if best is None else [(best[2], target)]

    def _best_swap(self, b: int) -> list[tuple[int, int]] | None:
        """An improving swap between ``b`` and another rank, as two reassignments.

        The partner rank is the least loaded one that has an improving swap; of its swaps, the one leaving the
        pair most balanced (ties: the first found, units of b in increasing cost). For a unit of cost a on b the
        best partner unit has cost d nearest a − (L_b − L_r)/2; the units of r are walked outward from there
        (nearer first, the smaller cost first at equal distance) to the first that keeps both ranks within the
        memory cap. Arithmetic is in doubled integers (2·d against 2a − gap).
        """
        top, mem, fits = self.load[b], self.mem, self._fits
        mine = list(zip(self.costs_on[b], self.units_on[b]))
        best: tuple[int, int, int] | None = None  # (twice the pair's new max, unit of b, unit of r)
        partner_rank = 0
        for load, r in self.by_load:
            if best is not None or load + 1 >= top:
                break  # found on a less loaded rank, or no integer δ in (0, L_b − L_r) from here on
            gap, costs, units = top - load, self.costs_on[r], self.units_on[r]
            count = len(costs)
            for a_cost, a in mine:
                aim = 2 * a_cost - gap
                right = bisect_left(costs, -(-aim // 2))
                left = right - 1
                if (right == count or costs[right] >= a_cost) and (left < 0 or costs[left] <= a_cost - gap):
                    continue  # no cost in (a − gap, a) on r
                while True:
                    dist_left = aim - 2 * costs[left] if left >= 0 else gap
                    dist_right = 2 * costs[right] - aim if right < count else gap
                    dist = min(dist_left, dist_right)
                    if dist >= gap or (best is not None and top + load + dist >= best[0]):
                        break  # δ would leave (0, gap), or the pair would end no more balanced than the best
                    if dist_left <= dist_right:
                        d = units[left]
                        left -= 1
                    else:
                        d = units[right]
                        right += 1
                    shift = mem[a] - mem[d]
                    if fits(r, shift) and fits(b, -shift):
                        best, partner_rank = (top + load + dist, a, d), r
                        break
        return None if best is None else [(best[1], partner_rank), (best[2], b)]

    def _reassign(self, k: int, rank: int) -> None:
        """Give unit ``k`` to ``rank``, keeping loads, memory and the sorted structures current."""
        old, c = self.owner[k], self.cost[k]
        costs, units = self.costs_on[old], self.units_on[old]
        i = _slot(costs, units, c, k)
        del costs[i], units[i]
        costs, units = self.costs_on[rank], self.units_on[rank]
        i = _slot(costs, units, c, k)
        costs.insert(i, c)
        units.insert(i, k)
        for r, delta in ((old, -c), (rank, c)):
            del self.by_load[bisect_left(self.by_load, (self.load[r], r))]
            self.load[r] += delta
            insort(self.by_load, (self.load[r], r))
        self.used[old] -= self.mem[k]
        self.used[rank] += self.mem[k]
        self.owner[k] = rank


def _slot(costs: list[int], units: list[int], cost: int, unit: int) -> int:
    """Index of (cost, unit) in a rank's parallel lists sorted by (cost, unit)."""
    lo = bisect_left(costs, cost)
    return bisect_left(units, unit, lo, bisect_right(costs, cost, lo))
