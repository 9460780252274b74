"""Golden checking: reading the oracle folder, comparing, the kernel vectors."""
