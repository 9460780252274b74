"""Engram n-gram memory on the host: the token map and the exact int64 hashing."""
