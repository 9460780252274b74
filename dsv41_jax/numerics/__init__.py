"""Number formats and exact float32 numerics: the leaf package (kernels may import it)."""
