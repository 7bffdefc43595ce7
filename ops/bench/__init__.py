"""Benchmarks whose results go to BENCHMARKS.md: quality at equal tokens (in-process engine),
the distributed pipeline (overlap of the CLI and the library learner, pipeline efficiency,
memory, latency), learner islands over several devices, and resilience (S1 failures, S2
stragglers) on real processes."""

from ops.bench import islands, pipeline, quality, resilience

__all__ = ["islands", "pipeline", "quality", "resilience"]
