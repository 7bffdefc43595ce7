"""Benchmarks whose results go to BENCHMARKS.md: quality at equal tokens (in-process engine),
the distributed pipeline (overlap of the CLI and the library learner, pipeline efficiency,
memory, latency), learner islands over several devices, the learner's inner step against the
machine, resilience (S1 failures, S2 stragglers) on real processes, and the cross-site
scenario in the lab (network namespaces behind shaped links)."""

from ops.bench import islands, lab, pipeline, quality, resilience, step

__all__ = ["islands", "lab", "pipeline", "quality", "resilience", "step"]
