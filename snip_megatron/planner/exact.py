"""Exact fallback: a dynamic programme over the budget, one multiple-choice knapsack per group.

Used when CBC is missing, fails or times out, and as the reference the ILP is checked against.
FLOP-derived weights are multiples of a common unit (their greatest common divisor), so the budget
is counted exactly in those units whenever that takes at most `max_states` states (true for real
model shapes: the 70B layout needs ~4,000). Otherwise tiny groups are enumerated, and larger ones
use a conservatively discretised budget (weights rounded down, so the answer still meets the
budget; its status is "feasible", not "optimal").
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np

from snip_megatron.planner.problem import Knapsack

# Groups with at most this many combinations are enumerated outright when the DP cannot be exact.
ENUMERATE_LIMIT = 1 << 15


def solve_exact(ks: Knapsack, max_states: int) -> tuple[list[int], str]:
    """Choice indices (one per free layer) and status "optimal" or "feasible"."""
    picks = [0] * len(ks.free)
    status = "optimal"
    for g, need in enumerate(ks.need):
        members = [j for j, gj in enumerate(ks.group) if gj == g]
        costs = [ks.cost[j] for j in members]
        weights = [ks.weight[j] for j in members]
        sub, sub_status = solve_group(costs, weights, need, max_states)
        for j, i in zip(members, sub):
            picks[j] = i
        if sub_status != "optimal":
            status = sub_status
    return picks, status


def solve_group(costs, weights, need: float, max_states: int) -> tuple[list[int], str]:
    """min sum costs[j][x_j] s.t. sum weights[j][x_j] >= need; weights >= 0, known feasible."""
    if not costs:
        return [], "optimal"
    if need <= 0:  # budget already met: every layer takes its cheapest choice
        return [int(np.argmin(c)) for c in costs], "optimal"
    units = _integer_units(weights, need, max_states)
    if units is not None:
        w_int, states = units
        picks = _dp(costs, w_int, states)
        if picks is not None:
            return picks, "optimal"
    if math.prod(len(c) for c in costs) <= ENUMERATE_LIMIT:
        return _enumerate(costs, weights, need), "optimal"
    # Discretised budget: rounding weights down keeps every DP-feasible answer truly feasible.
    unit = need / max_states
    w_int = [[min(max_states, int(math.floor(w / unit))) for w in row] for row in weights]
    picks = _dp(costs, w_int, max_states)
    if picks is None:  # rounding lost too much: the heaviest choice everywhere is feasible
        picks = [int(np.argmax(w)) for w in weights]
    return picks, "feasible"


def integer_units(weights, need: float, max_units: int):
    """(weights as integers in units of their greatest common divisor, ceil(need) in those units),
    or None when the budget needs more than max_units units. `weights` is a flat list."""
    nonzero = [Fraction(w) for w in weights if w > 0]
    if not nonzero:
        return None
    denom = math.lcm(*(w.denominator for w in nonzero))
    common = math.gcd(*(int(w * denom) for w in nonzero))
    unit = Fraction(common, denom)
    units = math.ceil(Fraction(need) / unit)
    if units > max_units:
        return None
    return [int(Fraction(w) / unit) for w in weights], units


def _integer_units(weights, need: float, max_states: int):
    """Per-layer integer weights (capped at the budget) and the budget, for the exact DP."""
    flat = integer_units([w for row in weights for w in row], need, max_states)
    if flat is None:
        return None
    ints, states = flat
    it = iter(ints)
    return [[min(states, next(it)) for _ in row] for row in weights], states


def _dp(costs, w_int, states: int):
    """Min-cost choices whose integer weights sum (capped at `states`) to `states`; None if none."""
    size = states + 1
    best = np.full(size, np.inf)
    best[0] = 0.0
    choice = np.zeros((len(costs), size), dtype=np.uint8)
    cap_from = []  # per layer and choice: the state that reaches the capped top state most cheaply
    for j, (row_c, row_w) in enumerate(zip(costs, w_int)):
        new = np.full(size, np.inf)
        froms = []
        for i, (c, w) in enumerate(zip(row_c, row_w)):
            cand = np.full(size, np.inf)
            if w == 0:
                cand[:] = best + c
                froms.append(states)
            else:
                if w < states:
                    cand[w:states] = best[:states - w] + c
                lo = max(0, states - w)
                k = int(np.argmin(best[lo:])) + lo
                cand[states] = best[k] + c
                froms.append(k)
            better = cand < new
            new[better] = cand[better]
            choice[j, better] = i
        cap_from.append(froms)
        best = new
    if not np.isfinite(best[states]):
        return None
    picks = [0] * len(costs)
    r = states
    for j in range(len(costs) - 1, -1, -1):
        i = int(choice[j, r])
        picks[j] = i
        r = cap_from[j][i] if r == states else r - w_int[j][i]
    return picks


def _enumerate(costs, weights, need: float) -> list[int]:
    best, best_picks = math.inf, None
    for picks in itertools.product(*(range(len(c)) for c in costs)):
        if sum(w[i] for w, i in zip(weights, picks)) >= need:
            total = sum(c[i] for c, i in zip(costs, picks))
            if total < best:
                best, best_picks = total, list(picks)
    return best_picks
