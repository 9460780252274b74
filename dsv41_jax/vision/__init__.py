"""The V4.1 vision path: image processor (pixels -> patches, span layout), ViT + aligner, prompt merge."""
