"""Helpers the tests share: tiny tokenizers and configs, golden kernel vectors, numpy transcriptions of
libm/MKL/SLEEF routines, and a server-process launcher."""
