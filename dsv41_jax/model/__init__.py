"""The V4.1 backbone: the Transformer module, its cache and its forward."""
