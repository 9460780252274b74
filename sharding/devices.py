"""The accelerators `dsv41 plan --device` knows, and their memory (no JAX import: the CLI parser reads it)."""

# HBM per chip (per GPU), as the vendors state it (GB), used as GiB (the conservative reading).
# Sources: Cloud TPU docs, "TPU v5e" (16 GB HBM2 per chip), "TPU v5p" (95 GB), "TPU v6e" (32 GB),
# "TPU7x" (192 GB); NVIDIA H100 SXM (80 GB), H200 (141 GB); HGX B200 (180 GB HBM3e per GPU as
# shipped; 192 GB is the full stack capacity, nvidia-smi reports about 179 GiB).
HBM_GIB = {"v5e": 16, "v5p": 95, "v6e": 32, "v7x": 192, "H100": 80, "H200": 141, "B200": 180}
