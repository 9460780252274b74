"""One training step as a pure jitted function: state in, state and metrics out.

State (a dict of flat dicts, so orbax, optax and sharding rules see plain string keys):
  step    int32 scalar (also seeds the step's sampling, so a resumed run repeats it exactly);
  master  fp32 master weights without the router biases (frozen under LoRA);
  bias    the MoE router biases, updated by the sign rule after the optimizer, never by it;
  lora    adapters ({} without LoRA); the optimizer trains these instead of the masters;
  opt     the optax state of whichever of master / lora is trained.

What is trained: the backbone's masters (or its LoRA adapters); with `TrainConfig.dspark` only the
DSpark drafter's (mtp.*, `dsv41_jax.train.dspark`). The other part is frozen: it is not an optimizer
parameter, so it leaves every step bitwise unchanged (no gradient, no weight decay), and so do its
router biases.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dsv41_jax.config import ModelConfig
from dsv41_jax.runtime import COMPILER_OPTIONS
from dsv41_jax.train import losses
from dsv41_jax.train.dspark import DSparkLoss, drafter_loss, is_drafter_key
from dsv41_jax.train.forward import ForwardOptions, train_forward
from dsv41_jax.train.lora import apply_lora, init_lora
from dsv41_jax.train.mesh import layer_layout, stored_layout
from dsv41_jax.train.optim import OptimConfig, make_optimizer, schedule
from dsv41_jax.train.params import key_path, merge_model
from dsv41_jax.train.qat_modules import ONE_SHOT_COMPILE
from dsv41_jax.train.weight_quant import qat_view

# nnx filter for the router bias: selection-only, so it is balanced by a rule, not a gradient
ROUTER_BIAS = nnx.All(nnx.PathContains("gate"), nnx.PathContains("bias"))
_is_router_bias = nnx.filterlib.to_predicate(ROUTER_BIAS)


@dataclass(frozen=True)
class TrainConfig:
    """What a run optimises and how (static: part of the compiled step)."""

    seq_len: int = 128
    batch_size: int = 8
    steps: int = 300
    seed: int = 0
    qat: bool = True  # fake-quantize FP8/FP4 weights in the forward (activations/KV always are)
    lora_rank: int = 0
    lora_alpha: float = 0.0  # 0: alpha = rank (scale 1)
    balance_weight: float = 1e-4
    bias_rate: float = 1e-3
    indexer_kl_weight: float = 1.0
    kl_positions: int = 8
    replay_prob: float = 0.0
    optim: OptimConfig = field(default_factory=OptimConfig)
    exact_mhc: bool = False  # served SLEEF exp in mHC (bitwise serving parity, slower compile)
    fast_compile: bool = False  # XLA without backend optimisation: ~2x faster compile, slower steps
    impl: str = "xla"  # "pallas": the attention and indexer kernels in the forward (ForwardOptions.impl)
    dspark: DSparkLoss | None = None  # train only the DSpark drafter, with this objective

    @property
    def lora_scale(self) -> float:
        return (self.lora_alpha or self.lora_rank) / max(self.lora_rank, 1)


def split_bias(flat: dict) -> tuple[dict, dict]:
    """(everything else, router biases) of a flat master dict."""
    bias = {k: v for k, v in flat.items() if _is_router_bias(key_path(k), v)}
    return {k: v for k, v in flat.items() if k not in bias}, bias


def trained_keys(master: dict, tcfg: TrainConfig) -> list[str]:
    """The master keys the optimizer updates (router biases excluded): the drafter's under
    tcfg.dspark, else the backbone's (the drafter gets no gradient from the backbone's loss; weight
    decay alone would shrink it)."""
    drafter = tcfg.dspark is not None
    return [k for k in master if is_drafter_key(k) == drafter]


def init_state(master: dict, tcfg: TrainConfig) -> dict:
    """A step-0 state from fp32 masters (fresh or imported from a checkpoint)."""
    rest, bias = split_bias(master)
    if tcfg.dspark is not None:
        if tcfg.lora_rank:
            raise ValueError("--dspark trains the drafter's own weights; it does not combine with --lora")
        if not any(is_drafter_key(k) for k in rest):
            raise ValueError("--dspark: this model has no DSpark drafter (no mtp.* parameters; n_mtp_layers=0); "
                             "use a config or checkpoint with one")
    lora = init_lora(rest, tcfg.lora_rank, tcfg.seed) if tcfg.lora_rank else {}
    trainable = lora if tcfg.lora_rank else {k: rest[k] for k in trained_keys(rest, tcfg)}
    tx = make_optimizer(tcfg.optim, trainable)
    return {"step": jnp.zeros((), jnp.int32), "master": rest, "bias": bias, "lora": lora, "opt": tx.init(trainable)}


def full_master(state: dict, tcfg: TrainConfig) -> dict:
    """Masters with biases and merged adapters: what export and evaluation use."""
    return apply_lora({**state["master"], **state["bias"]}, state["lora"], tcfg.lora_scale)


def _layer_of(bias_key: str) -> int:
    """The backbone layer (layers.{l}.*) or drafter stage (mtp.{k}.*) of a router bias."""
    return key_path(bias_key)[1]


def drafter_step_fn(graphdef, formats, cfg: ModelConfig, tcfg: TrainConfig, mesh=None):
    """The drafter's step: the frozen backbone's forward gives taps and target logits (no gradient),
    then only the mtp.* masters take the DSpark objective's gradient; the drafter's router biases
    follow the sign rule with the drafter's expert loads."""
    obj = tcfg.dspark

    def step(state, batch):
        rng = jax.random.fold_in(jax.random.key(tcfg.seed), state["step"])
        keys = trained_keys(state["master"], tcfg)
        trainable = {k: state["master"][k] for k in keys}
        frozen = {k: v for k, v in state["master"].items() if k not in trainable}
        frozen_view = stored_layout(mesh, qat_view({**frozen, **state["bias"]}, formats, fake_quant_weights=tcfg.qat))
        view = lambda tr: stored_layout(mesh, qat_view(tr, formats, fake_quant_weights=tcfg.qat))  # noqa: E731
        backbone = merge_model(graphdef, {**frozen_view, **view(trainable)})
        target_logits, aux = train_forward(backbone, batch, ForwardOptions(), taps=True, layout=layer_layout(mesh))
        taps, target_logits = jax.lax.stop_gradient((aux["main_hidden"], target_logits))
        tx = make_optimizer(tcfg.optim, trainable)

        def f(tr):
            model = merge_model(graphdef, {**frozen_view, **view(tr)})
            return drafter_loss(model, batch, taps, target_logits, rng, obj)

        (_, (metrics, loads)), grads = jax.value_and_grad(f, has_aux=True)(trainable)
        updates, opt = tx.update(grads, state["opt"], trainable)
        trainable = optax.apply_updates(trainable, updates)
        bias = {k: (losses.bias_update(b, loads[_layer_of(k)], tcfg.bias_rate) if is_drafter_key(k) else b)
                for k, b in state["bias"].items()}
        new = dict(state, step=state["step"] + 1, bias=bias, opt=opt, master={**state["master"], **trainable})
        metrics = dict(metrics, grad_norm=optax.tree.norm(grads), lr=schedule(tcfg.optim)(state["step"]))
        return new, metrics

    return step


def _sample(rng, tcfg: TrainConfig, B: int, T: int):
    """Per-step random choices: KL query positions and replay tail starts."""
    k1, k2, k3 = jax.random.split(rng, 3)
    kl_pos = jax.random.randint(k1, (B, max(tcfg.kl_positions, 1)), 0, T).astype(jnp.int32)
    replay = None
    if tcfg.replay_prob > 0:
        s = jax.random.randint(k2, (B,), 0, T)
        replay = jnp.where(jax.random.bernoulli(k3, tcfg.replay_prob, (B,)), s, 0).astype(jnp.int32)
    return kl_pos, replay


def loss_and_aux(graphdef, formats, cfg: ModelConfig, tcfg: TrainConfig, master: dict, batch: dict, rng,
                 fwd_opts: ForwardOptions | None = None, mesh=None):
    """Total loss and (metrics, expert loads) for fp32 masters (differentiable in `master`); on
    `mesh`, each layer's weights are multiplied whole over its FSDP axes (`train.mesh.layer_layout`)."""
    view = stored_layout(mesh, qat_view(master, formats, fake_quant_weights=tcfg.qat))
    model = merge_model(graphdef, view)
    B, T = batch["tokens"].shape
    kl_pos, replay = _sample(rng, tcfg, B, T)
    opts = fwd_opts or ForwardOptions(kl_positions=tcfg.kl_positions if tcfg.indexer_kl_weight > 0 else 0,
                                      impl=tcfg.impl)
    logits, aux = train_forward(model, batch, opts, replay_start=replay, kl_pos=kl_pos, layout=layer_layout(mesh))
    ce, n_tokens = losses.cross_entropy(logits, batch["targets"], batch["loss_mask"])
    valid = batch["valid"]
    bal = jnp.mean(jnp.stack([losses.sequence_balance(aux["gate_scores"][l], aux["experts"][l], valid)
                              for l in sorted(aux["experts"])]))
    loads = {l: losses.expert_load(aux["experts"][l], valid, cfg.n_routed_experts) for l in aux["experts"]}
    kl_terms = {l: s / jnp.maximum(c, 1.0) for l, (s, c) in aux["indexer_kl"].items()}
    kl = jnp.mean(jnp.stack(list(kl_terms.values()))) if kl_terms else jnp.float32(0.0)
    total = ce + tcfg.balance_weight * bal + tcfg.indexer_kl_weight * kl
    metrics = {"loss": total, "ce": ce, "balance": bal, "indexer_kl": kl, "tokens": n_tokens,
               "load_imbalance": jnp.mean(jnp.stack([losses.load_imbalance(v) for v in loads.values()]))}
    metrics.update({f"indexer_kl/{l}": v for l, v in kl_terms.items()})
    return total, (metrics, loads)


def train_step_fn(graphdef, formats, cfg: ModelConfig, tcfg: TrainConfig, mesh=None):
    """The pure step (state, batch) -> (state, metrics); jit it (see `make_train_step`). mesh: the
    one the state is laid out on (its weights are gathered for the forward's products there)."""
    if tcfg.dspark is not None:
        return drafter_step_fn(graphdef, formats, cfg, tcfg, mesh)
    trainable_params = (lambda s: s["lora"]) if tcfg.lora_rank else (
        lambda s: {k: s["master"][k] for k in trained_keys(s["master"], tcfg)})

    def step(state, batch):
        rng = jax.random.fold_in(jax.random.key(tcfg.seed), state["step"])
        trainable = trainable_params(state)
        tx = make_optimizer(tcfg.optim, trainable)

        def f(tr):
            if tcfg.lora_rank:
                master = apply_lora({**state["master"], **state["bias"]}, tr, tcfg.lora_scale)
            else:
                master = {**state["master"], **tr, **state["bias"]}
            return loss_and_aux(graphdef, formats, cfg, tcfg, master, batch, rng, mesh=mesh)

        (_, (metrics, loads)), grads = jax.value_and_grad(f, has_aux=True)(trainable)
        updates, opt = tx.update(grads, state["opt"], trainable)
        trainable = optax.apply_updates(trainable, updates)
        bias = {k: (b if is_drafter_key(k) else losses.bias_update(b, loads[_layer_of(k)], tcfg.bias_rate))
                for k, b in state["bias"].items()}
        new = dict(state, step=state["step"] + 1, bias=bias, opt=opt)
        if tcfg.lora_rank:
            new["lora"] = trainable
        else:
            new["master"] = {**state["master"], **trainable}
        metrics = dict(metrics, grad_norm=optax.tree.norm(grads), lr=schedule(tcfg.optim)(state["step"]))
        return new, metrics

    return step


_STEP_CACHE: dict = {}


def make_train_step(graphdef, formats, cfg: ModelConfig, tcfg: TrainConfig, *, state_shardings=None,
                    batch_sharding=None, donate: bool = True):
    """The jitted step; with shardings it runs SPMD over their mesh.

    Steps are cached per (model, formats, configs, layout): a run that is prepared again (e.g.
    resumed in the same process) reuses the compiled program instead of compiling it anew.
    """
    layout = None if state_shardings is None else (tuple(jax.tree_util.tree_flatten_with_path(state_shardings)[0]),
                                                   batch_sharding)
    key = (graphdef, tuple(sorted(formats.items())), cfg, tcfg, layout, donate)
    if key not in _STEP_CACHE:
        kw, mesh = {}, None
        if state_shardings is not None:
            mesh = jax.tree.leaves(state_shardings)[0].mesh
            kw["in_shardings"] = (state_shardings, batch_sharding)
            kw["out_shardings"] = (state_shardings, None)
        options = dict(COMPILER_OPTIONS, **(ONE_SHOT_COMPILE if tcfg.fast_compile else {}))
        _STEP_CACHE[key] = jax.jit(train_step_fn(graphdef, formats, cfg, tcfg, mesh), compiler_options=options,
                                   donate_argnums=(0,) if donate else (), **kw)
    return _STEP_CACHE[key]
