"""QAT fine-tuning of V4.1 with optax and orbax (docs/REFERENCE.md §7).

Modules, in data-flow order:
  data          text / JSONL / chat files -> packed rows with loss masks (+ Engram ids)
  params        flat parameter dicts; the served storage format of every parameter
  qat_modules   the training model: served architecture on fp32 masters, QAT at every GEMM
  weight_quant  masters <-> served formats; the straight-through QAT view of the weights
  lora          optional low-rank adapters (merged before the weight fake-quant)
  forward       the training forward over packed rows (document-aware, replay-aware, indexer KL)
  losses        cross-entropy, sequence balance, router-bias sign rule
  optim         AdamW / Muon, warmup + cosine, clipping, per-group learning rates
  step          the pure jitted train step and its state
  mesh          meshes and shardings (uses the project's `sharding` rules when present)
  checkpoint    orbax CheckpointManager: async, keep N, exact resume, restore onto any mesh
  loop          a run: prepare (fresh / restored), train with progress and metrics
  export        trained masters -> served FP8/FP4 checkpoint folder, and back
  throughput    tokens/s and the MFU estimate
  demo          `dsv41 demo` (samples its exported model through the serving engine,
                `dsv41_jax.serving.generate`)
"""
