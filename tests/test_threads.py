"""kiln.threads.ordered_map: results in input order, and never more than a window of the input in flight."""

from __future__ import annotations

import threading
import time

from kiln.threads import ordered_map


def test_results_come_back_in_input_order_whatever_finishes_first():
    def slow_for_small(x: int) -> int:
        time.sleep(0.001 * (20 - x))
        return x * x

    assert list(ordered_map(slow_for_small, range(20), workers=4)) == [x * x for x in range(20)]


def test_the_input_is_read_a_window_ahead_not_all_at_once():
    taken, lock = [], threading.Lock()

    def items():
        for i in range(1000):
            with lock:
                taken.append(i)
            yield i

    results = ordered_map(lambda x: x, items(), workers=2, depth=4)
    assert [next(results) for _ in range(3)] == [0, 1, 2]
    assert len(taken) <= 3 + 4  # what was handed back, and the window


def test_one_worker_runs_in_the_caller():
    seen = list(ordered_map(lambda _: threading.current_thread(), range(3), workers=1))
    assert seen == [threading.current_thread()] * 3
