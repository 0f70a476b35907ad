"""Who holds GPU memory at the peak of a step: replay the CUDA caching allocator's trace.

``with PeakTrace() as pt: step()`` records every allocation (with its Python stack) during the
step; :meth:`PeakTrace.report` replays the trace, finds the moment the live bytes peaked and
groups the blocks alive then by the innermost frame of our own code (``mistill/`` or
``benchmarks/``), else of transformers, else the innermost frame of all. Blocks allocated before
the trace started (weights, optimizer state) are counted once as ``baseline``.
"""

from __future__ import annotations

from collections import defaultdict

import torch


def _site(frames: list[dict]) -> str:
    for marker in ("/mistill/", "/benchmarks/", "/transformers/"):
        for f in frames:
            if marker in f.get("filename", ""):
                return f"{f['filename'].split(marker)[-1]}:{f['line']} {f['name']}"
    if frames:
        f = frames[0]
        return f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}"
    return "?"


class PeakTrace:
    def __init__(self, max_entries: int = 2_000_000) -> None:
        self.max_entries = max_entries
        self.snapshot: dict | None = None
        self.baseline = 0

    def __enter__(self) -> PeakTrace:
        torch.cuda.synchronize()
        self.baseline = torch.cuda.memory_allocated()
        # the backward runs on the calling thread, so its allocations get Python stacks too
        self._single = torch.autograd.set_multithreading_enabled(False)
        self._single.__enter__()
        torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                                 max_entries=self.max_entries)
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.synchronize()
        self.snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        self._single.__exit__(None, None, None)

    def report(self, top: int = 25) -> dict:
        """``{peak_gib, baseline_gib, at_peak: [(site, gib, n_blocks)], events}``."""
        dev = torch.cuda.current_device()
        trace = self.snapshot["device_traces"][dev]
        freeing = "free_completed" if any(e["action"] == "free_completed" for e in trace) else "free_requested"
        live: dict[int, int] = {}
        cur = best = 0
        best_i = -1
        for i, e in enumerate(trace):
            if e["action"] == "alloc":
                live[e["addr"]] = e["size"]
                cur += e["size"]
            elif e["action"] == freeing and e["addr"] in live:
                cur -= live.pop(e["addr"])
            if cur > best:
                best, best_i = cur, i
        alive: dict[int, dict] = {}
        for e in trace[:best_i + 1]:
            if e["action"] == "alloc":
                alive[e["addr"]] = e
            elif e["action"] == freeing:
                alive.pop(e["addr"], None)
        groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for e in alive.values():
            g = groups[_site(e.get("frames", []))]
            g[0] += e["size"]
            g[1] += 1
        ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
        return {"peak_gib": (self.baseline + best) / 2 ** 30, "baseline_gib": self.baseline / 2 ** 30,
                "events": len(trace),
                "at_peak": [(site, size / 2 ** 30, n) for site, (size, n) in ranked]}
