"""Timing shared by the PyTorch peers: the method of our Rust benchmarks (CUDA events around
batches of calls, warm-up batches dropped, median per call)."""
import statistics
import time

import torch


def median_ms(step, device, batch, reps, warmup=2):
    """Median milliseconds per call of `step()` over `reps - warmup` batches of `batch` calls."""
    times = []
    with torch.no_grad():
        for rep in range(reps):
            if device == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
            t0 = time.perf_counter()
            for _ in range(batch):
                step()
            if device == "cuda":
                b.record()
                b.synchronize()
                ms = a.elapsed_time(b)
            else:
                ms = (time.perf_counter() - t0) * 1e3
            if rep >= warmup:
                times.append(ms / batch)
    return statistics.median(times)
