"""Benchmarks whose results go to BENCHMARKS.md: quality at equal tokens (in-process engine),
the distributed pipeline (overlap, pipeline efficiency, memory, latency), and resilience (S1
failures, S2 stragglers) on real processes."""

from ops.bench import pipeline, quality, resilience

__all__ = ["pipeline", "quality", "resilience"]
