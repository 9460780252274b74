"""Helpers shared by the kernel folders: bit-level number-format decoders and backend selection."""
