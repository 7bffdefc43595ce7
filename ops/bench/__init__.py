"""Benchmarks whose results go to BENCHMARKS.md: quality at equal tokens (in-process engine),
the distributed pipeline (overlap of the CLI and the library learner, pipeline efficiency,
memory, latency, the largest model end to end: `large`), learner islands over several
devices, the learner's inner step against the machine (and in every setting users run it:
`step_matrix`), resilience (S1 failures, S2
stragglers) on real processes, the cross-site scenario in the lab (network namespaces behind
shaped links), and the prepared check for an accelerator host (`accelerator`)."""

from ops.bench import (
                       accelerator,
                       islands,
                       lab,
                       large,
                       overlap,
                       pipeline,
                       quality,
                       resilience,
                       roles,
                       step,
                       step_matrix,
)

__all__ = ["accelerator", "islands", "lab", "large", "overlap", "pipeline", "quality", "resilience",
           "roles", "step", "step_matrix"]
