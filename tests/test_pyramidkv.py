"""PyramidKV (backends/pyramidkv.py): its per-layer schedule."""

from __future__ import annotations



from backends.pyramidkv import pyramid_schedule


def test_pyramid_schedule_is_linear_decreasing_with_snapkvs_total():
    plan = pyramid_schedule(8, 1000, 200, 32, beta=20)
    steps = [a - b for a, b in zip(plan, plan[1:])]
    assert sum(plan) == 8 * 200 and all(s > 0 for s in steps) and max(steps) - min(steps) <= 1
    assert plan[-1] == 32 + round(168 / 20) and plan[0] == 32 + round(2 * 168 - 168 / 20)
    capped = pyramid_schedule(4, 300, 250, 32)  # the first layer cannot hold more than T
    assert capped[0] == 300 and sum(capped) == 1000
    assert pyramid_schedule(4, 300, 300, 32) == [300] * 4
    assert pyramid_schedule(4, 300, 20, 32) == [20] * 4 and pyramid_schedule(1, 300, 100, 32) == [100]
