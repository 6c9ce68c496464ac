"""Front ends: one short class per matrix optimizer over :class:`.base.MatrixOptimizer`."""
