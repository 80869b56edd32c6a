"""The evaluation engine: scope -> plan -> correctness, timing, profiling -> verdict."""
