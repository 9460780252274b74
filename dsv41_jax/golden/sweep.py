"""Config sweep against the golden oracle (issue 28, item 4): small golden-format folders for
configurations the shared golden set does not cover.

    python -m dsv41_jax.golden.sweep OUT_DIR --oracle ../shared/oracle --python $ORACLE/venv/bin/python \
        [--only NAME ...]

For each entry of CONFIGS this writes OUT_DIR/<name>/ in the golden format (golden/README.md):
`config.json` (`model_args` = the reference's ModelArgs), `weights.safetensors` (reference
state-dict names, FP8/E8M0/FP4 as raw bytes with `logical_dtypes`; random values from
`checkpoint.synthetic`, seeded), `cases.json`, and one tensor file per case computed by the oracle
(`harness.py run`, DeepSeek's reference with the oracle's CPU kernels; it needs the oracle installed,
docs/NUMERICS.md "Rebuilding the oracle"). `MADE_BY.txt` records the command. Check a folder with
`dsv41 golden-check OUT_DIR --only <name>` (tests/test_golden_sweep.py).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import shlex
import subprocess
import sys

import numpy as np

# the shared golden set's main_fp8 arguments that every sweep config starts from (then shrunk)
BASE = dict(
    max_batch_size=1, max_seq_len=128, temperature=1.0, dtype="fp8", expert_dtype="fp4", vocab_size=128, dim=32,
    moe_inter_dim=32, n_layers=4, n_mtp_layers=0, n_heads=4, n_routed_experts=4, n_shared_experts=1,
    n_activated_experts=2, score_func="sqrtsoftplus", gate_temp=1.0, norm_topk_prob=True, route_scale=1.5,
    swiglu_limit=10.0, q_lora_rank=32, head_dim=64, rope_head_dim=32, norm_eps=1e-20, o_groups=2, o_lora_rank=32,
    window_size=16, compress_ratios=[0, 2, 1, 0], kv_source_layers=[1, 2], index_source_layers=[1, 2],
    compress_rope_theta=160000.0, original_seq_len=64, rope_theta=10000.0, rope_factor=16.0, beta_fast=32,
    beta_slow=1, index_n_heads=4, index_head_dim=64, index_topk=8, candidate_source_layer=-1,
    candidate_topk_blocks=0, candidate_block_size=0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    engram_layer_ids=[], engram_num_embeddings=[], engram_max_ngram_size=1, engram_vocab_size=0, engram_n_heads=0,
    engram_head_dim=0, engram_pad_id=2, engram_compressed_vocab_size=0, vision_n_layers=0, dspark_block_size=0,
    dspark_noise_token_id=0, dspark_target_layer_ids=[], dspark_n_routed_experts=0, dspark_n_activated_experts=0,
)

# name -> (overrides of BASE, weight seed, token seed, cases); a case is ("prefill", L) or ("decode", P, S)
CONFIGS = {
    # rope_head_dim 64 (SLEEF powf on the frequency vector body), other head dim, thetas and YaRN
    "rope64_theta": (dict(head_dim=96, rope_head_dim=64, rope_theta=50000.0, compress_rope_theta=80000.0,
                          original_seq_len=32, rope_factor=8.0, beta_fast=16, beta_slow=2, window_size=8,
                          index_topk=4), 101, 201, [("prefill", 40), ("decode", 24, 8)]),
    # ratio 4 and a candidate pool, another window, gate/route parameters
    "ratio4_pool": (dict(n_layers=5, compress_ratios=[0, 4, 4, 1, 0], kv_source_layers=[1, 3],
                         index_source_layers=[1, 2, 3], candidate_source_layer=3, candidate_topk_blocks=3,
                         candidate_block_size=4, window_size=12, gate_temp=0.8, route_scale=2.5, swiglu_limit=7.0,
                         index_topk=6), 102, 202, [("prefill", 48), ("decode", 30, 8)]),
    # smaller head dims, more heads and groups, softmax gate
    "heads8_softmax": (dict(n_heads=8, head_dim=32, rope_head_dim=16, o_groups=4, o_lora_rank=32,
                            score_func="softmax", rope_theta=20000.0, index_n_heads=2, index_head_dim=32,
                            n_routed_experts=8, n_activated_experts=3), 103, 203,
                       [("prefill", 36), ("decode", 20, 6)]),
}


def model_args(name: str) -> dict:
    over = CONFIGS[name][0]
    return {**BASE, **over}


def write_weights(path: pathlib.Path, args: dict, seed: int) -> tuple[str, dict]:
    """Random weights in the reference's names and checkpoint dtypes; returns (sha256, tensors meta)."""
    import ml_dtypes
    from safetensors.numpy import save_file

    from dsv41_jax.checkpoint.synthetic import model_from_params, random_params
    from dsv41_jax.checkpoint.weights import to_reference_state_dict
    from dsv41_jax.config import ModelConfig

    cfg = ModelConfig.from_dict(args)
    sd = to_reference_state_dict(model_from_params(cfg, random_params(cfg, seed)))
    store, logical = {}, {}
    for k, v in sorted(sd.items()):
        v = np.asarray(v)
        kind = _logical(k, v, args)
        if kind is not None:
            logical[k] = kind
            v = v.view(np.uint8)
        elif v.dtype == np.float32 and np.array_equal(v.astype(ml_dtypes.bfloat16).astype(np.float32), v):
            v = v.astype(ml_dtypes.bfloat16)  # bf16-valued (wo_a, index wk, ...): half the bytes, loaded exactly
        store[k] = np.ascontiguousarray(v)
    save_file(store, str(path), metadata={"logical_dtypes": json.dumps(logical)})
    names = {"float32": "F32", "bfloat16": "BF16"}
    meta = {k: {"dtype": logical.get(k, names.get(str(v.dtype), str(v.dtype))), "shape": list(v.shape)}
            for k, v in store.items()}
    return hashlib.sha256(path.read_bytes()).hexdigest(), meta


def _logical(name: str, v: np.ndarray, args: dict) -> str | None:
    """The reference dtype of a raw-byte tensor (golden/README.md "Weights"), None for plain floats."""
    dt = str(v.dtype)
    if "float8_e4m3" in dt:
        return "F8_E4M3FN"
    if "e8m0" in dt or (dt == "uint8" and name.endswith("scale")):
        return "F8_E8M0FNU"
    if dt == "uint8" or "float4" in dt:
        return "F4_E2M1FN_X2"
    return None


def write_folder(out: pathlib.Path, name: str, oracle: pathlib.Path, python: str) -> None:
    over, wseed, tseed, cases = CONFIGS[name]
    args = model_args(name)
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    sha, meta = write_weights(d / "weights.safetensors", args, wseed)
    (d / "weights.safetensors").chmod(0o644)
    tokens = np.random.default_rng(tseed).integers(0, args["vocab_size"], 128).tolist()
    (d / "config.json").write_text(json.dumps({"name": name, "model_args": args, "weight_seed": wseed,
                                               "tensors": meta, "weights_sha256": sha, "trace_layers": []}, indent=1))
    entries = []
    for c in cases:
        if c[0] == "prefill":
            L = c[1]
            entries.append({"name": f"prefill_L{L}", "file": f"prefill_L{L}.safetensors", "kind": "prefill",
                            "token_seed": tseed, "tokens": tokens[:L], "schedule": [{"start_pos": 0, "n_tokens": L}]})
        else:
            P, S = c[1], c[2]
            entries.append({"name": f"decode_P{P}_S{S}", "file": f"decode_P{P}_S{S}.safetensors", "kind": "decode",
                            "token_seed": tseed, "tokens": tokens[:P + S],
                            "schedule": [{"start_pos": 0, "n_tokens": P}] + [{"start_pos": i, "n_tokens": 1}
                                                                              for i in range(P, P + S)]})
    (d / "cases.json").write_text(json.dumps({"config": name, "weights_file": "weights.safetensors",
                                              "weights_sha256": sha, "cases": entries}, indent=1))
    for e in entries:
        cmd = [python, str(oracle / "harness.py"), "run", str(d.resolve()), e["name"], str((d / e["file"]).resolve())]
        subprocess.run(cmd, check=True, cwd=str(oracle), stdout=subprocess.DEVNULL)
        (d / e["file"]).chmod(0o644)
    (d / "MADE_BY.txt").write_text("python -m dsv41_jax.golden.sweep " + " ".join(shlex.quote(a) for a in sys.argv[1:])
                                   + f"\n(config {name}; oracle: torch 2.14.1 reference, docs/NUMERICS.md)\n")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--oracle", required=True, help="the oracle folder (harness.py)")
    ap.add_argument("--python", required=True, help="the oracle venv's python (torch 2.14.1)")
    ap.add_argument("--only", action="append", choices=sorted(CONFIGS))
    a = ap.parse_args(argv)
    for name in a.only or sorted(CONFIGS):
        write_folder(pathlib.Path(a.out), name, pathlib.Path(a.oracle).resolve(), a.python)
        print(f"wrote {a.out}/{name}", flush=True)


if __name__ == "__main__":
    main()
