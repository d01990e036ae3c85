"""One CUDA-event timer for the GPU benchmark tools (bench_hybrid_layers.py, bench_cp_layout.py)."""

from __future__ import annotations

import statistics


def median_ms(fn, warmup: int = 3, repeat: int = 10, queue_full: bool = False) -> float:
    """Median milliseconds of ``fn()`` over ``repeat`` timed calls after ``warmup`` untimed ones.

    ``queue_full``: the GPU first sleeps (~50 ms) while the host enqueues the call, so launch and
    host overhead are hidden and the number is the device's own time; otherwise the call is timed
    as it runs eagerly (host overhead included where the GPU waits for it)."""
    import torch  # noqa: PLC0415

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if queue_full:
            torch.cuda._sleep(100_000_000)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
