"""Per-matrix and per-element optimizer math, free of communication."""
