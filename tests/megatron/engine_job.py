"""One Megatron layout, every attribution case: run under torchrun with the .venv-mcore interpreter.

    <venv-mcore>/bin/python -m torch.distributed.run --nproc_per_node N engine_job.py SPEC.json

SPEC (written by test_megatron_attribution.py): model_dir, inputs (a .pt file with the padded prompts/responses,
reasoning and answer masks and OAR-G seeds, built by the test with the core functions), tp, pp, sp, dtype
("float32" | "bfloat16"), remove_padding (the engine's training layout), dp_rows (rows of each data-parallel rank),
recompute ("none" | "full": activation checkpointing of every layer), cases [{name, oar: {...OARConfig values...}}],
out_dir.

Each rank writes out_dir/rank{R}.pt: {"cases": {name: importance (B_local, L) | None}, "src": is-collecting-rank,
"dp_rank", "rows", "seconds": {name: s}, "checks": {...}}. The test compares with the core reference.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("VERL_PLATFORM", "cpu")
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "core"))  # oar_helpers

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import cpu_shims  # noqa: E402  (test-only)
from oar_helpers import fidelity_of  # noqa: E402  (test-only)

import oar_verl.quickstart.platform  # noqa: E402,F401  (verl "cpu" platform, gloo)

cpu_shims.install()


RECOMPUTE = {"full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}}


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)

    from megatron.core import parallel_state as mpu
    from verl.trainer.config import CheckpointConfig
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig, TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker

    from oar_verl.core.methods.attribution import pass_limits, probe_kinds, run_attribution
    from oar_verl.core.config import OARConfig
    from oar_verl.core.batch.layout import build_attribution_batch, with_segments
    from oar_verl.integration import megatron as ma
    from oar_verl.integration.megatron import engine as mengine
    from oar_verl.integration.megatron.backend import MegatronBackend, embedding_module
    from verl.utils.megatron_utils import unwrap_model

    tp, pp, sp = spec["tp"], spec["pp"], bool(spec.get("sp", False))
    rmpad = bool(spec.get("remove_padding", False))
    mc = HFModelConfig(path=spec["model_dir"], use_remove_padding=rmpad)
    ec = McoreEngineConfig(dtype="bfloat16", tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                           sequence_parallel=sp, use_mbridge=True, vanilla_mbridge=True, forward_only=False,
                           use_dynamic_bsz=False, micro_batch_size_per_gpu=1, infer_micro_batch_size_per_gpu=1,
                           use_distributed_optimizer=bool(spec.get("distopt", False)), use_remove_padding=rmpad,
                           override_transformer_config={"use_cpu_initialization": True, "sequence_parallel": sp,
                                                        **RECOMPUTE.get(spec.get("recompute", "none"), {})})
    if spec["dtype"] == "float32":
        cpu_shims.float32_engine_config(ec)
    # verl's TrainingWorker (the actor worker's engine holder, whose infer_batch is compute_log_prob's), without Ray
    trainer = TrainingWorker(TrainingWorkerConfig(
        model_type="language_model", model_config=mc, engine_config=ec,
        optimizer_config=McoreOptimizerConfig(lr=1e-5, total_training_steps=10), checkpoint_config=CheckpointConfig()))
    engine = trainer.engine
    engine.initialize()
    assert bool(engine.tf_config.sequence_parallel) == sp, "sequence_parallel was changed by the engine"
    assert engine.tf_config.recompute_granularity == RECOMPUTE.get(spec.get("recompute"), {}).get(
        "recompute_granularity")

    inputs = torch.load(spec["inputs"])
    dp_rank = mpu.get_data_parallel_rank()
    rows = torch.tensor(spec["dp_rows"][dp_rank])
    sel = {k: v[rows] for k, v in inputs.items()}

    params = [p for m in engine.module for p in m.parameters()]
    flags = [p.requires_grad for p in params]

    def log_probs():  # the engine's own compute_log_prob path (padded layout), to check the policy is unchanged
        ids = [torch.cat([p[pm.bool()], r[rm.bool()]]) for p, pm, r, rm in
               zip(sel["prompts"], sel["prompt_mask"], sel["responses"], sel["response_mask"])]
        nj = lambda xs: torch.nested.as_nested_tensor(xs, layout=torch.jagged)  # noqa: E731
        td = tu.get_tensordict({"input_ids": nj(ids), "position_ids": nj([torch.arange(len(x)) for x in ids]),
                                "loss_mask": nj([torch.ones(len(x)) for x in ids])})
        tu.assign_non_tensor(td, use_dynamic_bsz=False, micro_batch_size_per_gpu=2, temperature=1.0,
                             use_fused_kernels=False, calculate_entropy=False)
        with mengine.padded_layout(engine), engine.eval_mode():
            out = engine.infer_batch(td)
        lp = out.get("model_output", {}).get("log_probs") if out else None
        return None if lp is None else [t.clone() for t in lp.unbind()]

    # the grad buffers hold a marker while attribution runs: it must survive unchanged (nothing accumulated into or
    # reduced over them)
    grads = [p.main_grad for p in params if getattr(p, "main_grad", None) is not None]
    for i, g in enumerate(grads):
        g.fill_(0.25 + i)
    lp_before = log_probs()

    # record the embedding output layout on the first stage: [s/tp, b, h] chunks under sequence parallelism
    shapes = []
    emb = embedding_module(engine)
    rec = emb.register_forward_hook(lambda m, a, k, o: shapes.append((o.shape[0], k["input_ids"].shape[1])),
                                    with_kwargs=True) if emb is not None else None

    results, seconds = {}, {}
    for case in spec["cases"]:
        restore = fuse_norms(engine) if case.get("fuse_norms") else None
        cfg = OARConfig.from_mapping(case["oar"])
        kinds = probe_kinds(cfg, 0, len(rows))
        batch = with_segments(build_attribution_batch(sel["prompts"], sel["prompt_mask"], sel["responses"],
                                                      sel["response_mask"], sel["reasoning"], sel["answer"], kinds),
                              sel["segments"])
        t0 = time.perf_counter()
        mask_id = int(spec["mask_token_id"])
        with engine.eval_mode():
            res = run_attribution(MegatronBackend(engine, pass_limits(cfg)), batch, cfg,
                                  mask_token_id=mask_id, seeds=sel["seeds"])
        seconds[case["name"]] = time.perf_counter() - t0
        results[case["name"]] = res.importance if engine.is_mp_src_rank_with_outputs() else None
        if restore is not None:
            restore()

    if rec is not None:
        rec.remove()
    bypass_error = None
    if spec.get("check_bypass"):  # an MLP whose forward never calls its linears (as a fused implementation would)
        mlp = unwrap_model(engine.module[0]).decoder.layers[0].mlp
        mlp.forward = lambda hidden, *a, **k: (torch.zeros_like(hidden), None)
        try:
            with engine.eval_mode():
                run_attribution(MegatronBackend(engine, pass_limits(cfg)), batch,
                                OARConfig.from_mapping({"mode": "conservative"}), mask_token_id=mask_id)
        except RuntimeError as e:
            bypass_error = str(e)
        finally:
            del mlp.forward
    # the in-step fidelity metric of a fixed ranking through the engine's backend (ranks aligned by fillers)
    fcfg = OARConfig(probe="as_mean")
    fbatch = build_attribution_batch(sel["prompts"], sel["prompt_mask"], sel["responses"], sel["response_mask"],
                                     sel["reasoning"], sel["answer"], probe_kinds(fcfg, 0, len(rows)))
    with engine.eval_mode():
        fid = fidelity_of(MegatronBackend(engine, pass_limits(fcfg)), fbatch, int(spec["mask_token_id"]))
    fid = fid if engine.is_mp_src_rank_with_outputs() else None
    shared = shared_pass(engine, sel, rows, int(spec["mask_token_id"]))
    shared["worker"], shared["worker_fidelity"] = worker_pass(trainer, sel)
    shared["recompute"] = spec.get("recompute", "none")
    lp_after = log_probs()
    checks = {
        "embedding_chunked": None if emb is None else any(o != i for o, i in shapes),
        "param_grads_none": all(p.grad is None for p in params),
        "requires_grad_restored": [p.requires_grad for p in params] == flags,
        "grad_buffers_unchanged": all(bool((g == 0.25 + i).all()) for i, g in enumerate(grads)),
        "n_grad_buffers": len(grads),
        "optimizer_state_empty": _optimizer_state_empty(engine.optimizer),
        "log_probs_unchanged": (lp_before is None and lp_after is None) or
                               all(torch.equal(a, b) for a, b in zip(lp_before, lp_after)),
        "has_log_probs": lp_before is not None,
        "bypass_error": bypass_error,
    }
    for g in grads:
        g.zero_()
    # unsupported layouts are refused with a message naming them
    try:
        object.__setattr__(engine.engine_config, "context_parallel_size", 2)
        MegatronBackend(engine, pass_limits(cfg))
        checks["cp_error"] = None
    except ma.MegatronLayoutError as e:
        checks["cp_error"] = str(e)
    finally:
        object.__setattr__(engine.engine_config, "context_parallel_size", 1)

    out = Path(spec["out_dir"]) / f"rank{rank}.pt"
    torch.save({"cases": results, "fidelity": fid, "shared": shared, "src": engine.is_mp_src_rank_with_outputs(),
                "dp_rank": dp_rank, "rows": rows, "seconds": seconds, "checks": checks,
                "tp_rank": mpu.get_tensor_model_parallel_rank(), "pp_rank": mpu.get_pipeline_model_parallel_rank()},
               out)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: done", flush=True)


class FusedNormLinear(torch.nn.Module):
    """TEST-ONLY: an RMSNorm and the column-parallel linear after it as one module, with the attributes of
    TransformerEngine's ``TELayerNormColumnParallelLinear`` that OAR's rules read (``layer_norm_weight``, ``eps``,
    ``normalization``, ``bias``): how the TransformerEngine spec GPU runs use lays out a layer's norms, which CPU
    megatron-core (local spec) cannot build. The same maths as the local modules it wraps."""

    def __init__(self, norm, linear):
        super().__init__()
        object.__setattr__(self, "norm", norm)  # not a submodule: TransformerEngine's fused module has none
        self.linear, self.layer_norm_weight, self.eps, self.normalization = linear, norm.weight, norm.eps, "RMSNorm"

    @property
    def bias(self):
        return self.linear.bias

    def forward(self, x):
        return self.linear(self.norm(x))


def fuse_norms(engine):
    """Fuse every layer's input and pre-MLP norms into the next linear (:class:`FusedNormLinear`, the
    TransformerEngine layout); returns the function that restores the local layout."""
    from megatron.core.transformer.identity_op import IdentityOp
    from verl.utils.megatron_utils import unwrap_model

    undo = []
    for layer in unwrap_model(engine.module[0]).decoder.layers:
        for norm_name, owner, linear_name in (("input_layernorm", layer.self_attention, "linear_qkv"),
                                               ("pre_mlp_layernorm", layer.mlp, "linear_fc1")):
            norm, linear = getattr(layer, norm_name), getattr(owner, linear_name)
            setattr(owner, linear_name, FusedNormLinear(norm, linear))
            setattr(layer, norm_name, IdentityOp())
            undo.append(lambda layer=layer, owner=owner, n=norm_name, norm=norm, ln=linear_name, linear=linear: (
                setattr(layer, n, norm), setattr(owner, ln, linear)))

    def restore():
        for step in undo:
            step()

    return restore


def log_prob_batch(ids: list, *, micro_batch_size: int, temperature: float = 1.0, entropy: bool = False,
                   rows: bool = False):
    """verl's ``compute_log_prob`` inputs for token-id rows (nested, unpadded), as its actor worker hands them to the
    engine; with ``rows`` each row's index too (what OAR's worker adds for the shared pass)."""
    from verl.utils import tensordict_utils as tu

    from oar_verl.integration.fields import ROW_FIELD

    nj = lambda xs: torch.nested.as_nested_tensor(xs, layout=torch.jagged)  # noqa: E731
    td = tu.get_tensordict({"input_ids": nj(ids), "position_ids": nj([torch.arange(len(x)) for x in ids]),
                            "loss_mask": nj([torch.ones(len(x)) for x in ids])})
    tu.assign_non_tensor(td, use_dynamic_bsz=False, micro_batch_size_per_gpu=micro_batch_size,
                         temperature=temperature, use_fused_kernels=False, calculate_entropy=entropy)
    if rows:
        td[ROW_FIELD] = torch.arange(len(ids))
    return td


SHARED = [  # fisher with one loss column (Megatron's schedule runs one backward per micro-batch), each probe kind
    {"mode": "fisher", "probe": "as_mean", "mask": "mean"},
    {"mode": "fisher", "probe": "as_joint", "mask": "pad"},
    {"mode": "fisher", "probe": "lt_logits", "mask": "zero"},
    {"mode": "conservative", "probe": "as_mean"},  # the pass under the propagation rules: log-probs unchanged
]


def shared_pass(engine, sel, rows, mask_id: int) -> dict:
    """verl's old-log-prob call (the engine's own training layout, entropies, a rollout temperature of 0.7) with
    fisher or conservative read from it: the log-probs and entropies against the plain call's, the scores against the
    backend's own passes of the method (on the collecting rank)."""
    from oar_verl.core.batch.layout import build_attribution_batch
    from oar_verl.core.config import OARConfig
    from oar_verl.core.methods.attribution import pass_limits, probe_kinds, run_attribution
    from oar_verl.integration.backends import ENGINE_BACKENDS
    from oar_verl.integration.megatron.backend import MegatronBackend

    ids = [torch.cat([p[pm.bool()], r[rm.bool()]]) for p, pm, r, rm in
           zip(sel["prompts"], sel["prompt_mask"], sel["responses"], sel["response_mask"])]

    def call(attributed=False):
        td = log_prob_batch(ids, micro_batch_size=2, temperature=0.7, entropy=True, rows=attributed)
        with engine.eval_mode():
            out = engine.infer_batch(td)
        got = (out or {}).get("model_output", {})
        return {k: [t.clone() for t in got[k].unbind()] for k in ("log_probs", "entropy") if k in got}

    plain = call()
    out = {"log_probs_equal": [], "entropy_equal": [], "rel": [], "choices": [], "has_outputs": bool(plain)}
    for oar in SHARED:
        cfg = OARConfig.from_mapping(oar)
        batch = build_attribution_batch(sel["prompts"], sel["prompt_mask"], sel["responses"], sel["response_mask"],
                                        sel["reasoning"], sel["answer"], probe_kinds(cfg, 0, len(rows)))
        prepared = SimpleNamespace(batch=batch, mask_token_id=mask_id, seeds=sel["seeds"])  # what the worker prepares
        with ENGINE_BACKENDS.get("megatron").shared_pass(engine, cfg, prepared, None, engine.engine_config.
                                                         use_remove_padding) as made:
            got = call(attributed=True)
        (attribution,) = made
        scores = attribution.result()
        with engine.eval_mode():
            own = run_attribution(MegatronBackend(engine, pass_limits(cfg)), batch, cfg, mask_token_id=mask_id,
                                  seeds=sel["seeds"]).importance
        m = batch.reasoning_mask
        assert bool((own[m] != 0).all()), "vacuous comparison: the own passes scored zeros"
        out["log_probs_equal"].append(all(torch.equal(a, b) for a, b in zip(plain.get("log_probs", []),
                                                                             got.get("log_probs", []))))
        out["entropy_equal"].append(all(torch.equal(a, b) for a, b in zip(plain.get("entropy", []),
                                                                           got.get("entropy", []))))
        out["rel"].append(float((scores - own).abs().max() / own.abs().max()))
        out["choices"].append(attribution.choices)
    return out


def worker_pass(trainer, sel) -> tuple[dict, dict]:
    """OAR's worker RPC body (``OARActorRolloutRefWorker.compute_log_prob`` over verl's ``TrainingWorker``, no Ray)
    with fisher read from the pass: log-probs and entropies against verl's own call's, the importance against the
    worker's own ``compute_token_importance`` (fisher's own passes), and marked as read from the pass (collecting
    rank). The call, with entropies as verl's trainers ask for them, also measures the step's fidelity
    (``fidelity_every=1``), whose entropy control reads the pass's entropies: returned too, this rank's measurements
    per micro-batch size (every rank's: verl hands the pass's outputs to one rank of the model-parallel group only,
    and the others must measure the same, or the group's collectives part)."""
    from unittest import mock

    from verl.utils import tensordict_utils as tu

    from oar_verl.core.config import OARConfig
    from oar_verl.core.fidelity.step import due
    from oar_verl.core.pipeline import RowAttribution
    from oar_verl.integration.fields import CONFIG_KEY, SHARED_KEY, STEP_KEY
    from oar_verl.integration.worker import OARActorRolloutRefWorker

    prompts = [p[pm.bool()] for p, pm in zip(sel["prompts"], sel["prompt_mask"])]
    # each response ends in a final answer, where the worker finds its span (its own rows: no masks handed over; a row
    # without one has no reasoning tokens to attribute or measure)
    answer = torch.tensor(trainer.model_config.tokenizer.encode(" The answer is 7.", add_special_tokens=False))
    responses = [torch.cat([r[rm.bool()], answer]) for r, rm in zip(sel["responses"], sel["response_mask"])]
    nj = lambda xs: torch.nested.as_nested_tensor(xs, layout=torch.jagged)  # noqa: E731
    cfg = OARConfig(mode="fisher", probe="as_mean", mask="mean").to_dict()  # as the trainer step sends it
    measured = OARConfig.from_mapping({**cfg, "fidelity_every": 1}).to_dict()  # the pass of a fidelity step

    def data(shared: bool, micro_batch_size: int):
        td = log_prob_batch([torch.cat([p, r]) for p, r in zip(prompts, responses)],
                            micro_batch_size=micro_batch_size, temperature=0.7, entropy=True)
        td["prompts"], td["responses"] = nj(prompts), nj(responses)
        tu.assign_non_tensor(td, **{CONFIG_KEY: cfg, STEP_KEY: 3})
        if shared:
            tu.assign_non_tensor(td, **{SHARED_KEY: {CONFIG_KEY: measured, STEP_KEY: 3}})
        return td

    records: dict[int, list] = {}
    measure = RowAttribution.fidelity

    def recording(mbs):
        def fidelity(att, c, step, **kw):
            got = measure(att, c, step, **kw)
            if due(c, step):
                records.setdefault(mbs, []).append({"entropies": kw.get("entropies") is not None,
                                                    **{k: v.clone() for k, v in got.items()}})
            return got
        return mock.patch.object(RowAttribution, "fidelity", fidelity)

    worker = object.__new__(OARActorRolloutRefWorker)  # the RPC bodies need only the actor (verl's TrainingWorker)
    worker.actor, worker.enable_routing_replay = trainer, False  # (verl's worker sets the flag from its config)
    own = worker.compute_token_importance(data(False, 1))
    out = {}
    # the update's micro-batch is 1 row: a pass of 1-row micro-batches shares; of 2-row ones only under the engine's
    # full recompute (its backward would keep more activations than the update), else the fallback after the pass
    for mbs in (1, 2):
        plain = trainer.infer_batch(data(False, mbs))
        with recording(mbs):
            got = worker.compute_log_prob(data(True, mbs))
        if plain is None:  # not a collecting rank
            out[mbs] = {"collecting": False}
            continue
        a, b = got["token_importance"].values(), own["token_importance"].values()
        out[mbs] = {"collecting": True, "shared": float(got["oar_shared"].min()), "nonzero": int((b != 0).sum()),
                    "log_probs_diff": float((plain["log_probs"].values() - got["log_probs"].values()).abs().max()),
                    "entropy_diff": float((plain["entropy"].values() - got["entropy"].values()).abs().max()),
                    "rel": float((a - b).abs().max() / b.abs().max())}
    return out, records


def _optimizer_state_empty(optimizer) -> bool:
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    for opt in inner:
        torch_opt = getattr(opt, "optimizer", opt)
        if len(getattr(torch_opt, "state", {})) != 0:
            return False
    return True


if __name__ == "__main__":
    main(sys.argv[1])
