#!/usr/bin/env bash
# Re-run the checks of patches/README.md: dry-run, apply, py_compile and smoke-test every patch on a scratch
# copy of the installed verl 0.9.1 (the installed copy is never touched). Light: three short python runs.
#   usage: patches/check.sh [python]   (default: .venv/bin/python of this repo)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${1:-$HERE/../.venv/bin/python}
VERL_SRC=$("$PY" -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("verl").origin))')
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cp -r "$VERL_SRC" "$WORK/verl"
find "$WORK/verl" -name __pycache__ -prune -exec rm -rf {} +
cd "$WORK"
for p in "$HERE"/000*.patch; do
  echo "== $(basename "$p")"
  patch -p1 --dry-run < "$p"
  patch -p1 --quiet < "$p"
done
"$PY" -m py_compile verl/trainer/ppo/core_algos.py verl/trainer/ppo/ray_trainer.py verl/trainer/ppo/v1/trainer_base.py \
  verl/utils/distributed.py verl/plugin/platform/__init__.py verl/plugin/platform/platform_cpu.py \
  verl/plugin/platform/platform_manager.py verl/workers/engine/fsdp/transformer_impl.py verl/utils/fsdp_utils.py
echo "py_compile: ok"
filter() { grep -v "UserWarning\|warnings.warn\|^\s*$" || true; }

cat > smoke_0001.py <<'PY'
"""Smoke check for patches/0001 against the patched scratch copy of verl (legacy and V1 paths)."""
import numpy as np
import torch

import verl
from verl import DataProto
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.core_algos import get_adv_estimator_batch_fields, register_adv_est
from verl.trainer.ppo.ray_trainer import compute_advantage

print("verl from", verl.__file__)
FIELDS = ("token_importance", "oar_reasoning_mask")
seen = []


def est(token_level_rewards, response_mask, index=None, config=None, token_importance=None,
        oar_reasoning_mask=None, **kwargs):
    seen.append(sorted(k for k in ("token_importance", "oar_reasoning_mask", "other") if
                       (k == "token_importance" and token_importance is not None)
                       or (k == "oar_reasoning_mask" and oar_reasoning_mask is not None) or k in kwargs))
    adv = torch.ones_like(token_level_rewards) if token_importance is None else token_importance.clone()
    if oar_reasoning_mask is not None:
        adv = torch.where(oar_reasoning_mask.bool(), adv, torch.ones_like(adv))
    adv = adv * response_mask
    return adv, adv


register_adv_est("smoke_est", batch_fields=FIELDS)(est)
register_adv_est("smoke_est", batch_fields=FIELDS)(est)  # same fn, same fields: no-op
assert get_adv_estimator_batch_fields("smoke_est") == FIELDS
assert get_adv_estimator_batch_fields("rloo") == () and get_adv_estimator_batch_fields("nope") == ()
for bad in (lambda: register_adv_est("smoke_est")(est), lambda: register_adv_est("smoke_est", FIELDS)(lambda **k: 0)):
    try:
        bad()
        raise AssertionError("expected ValueError")
    except ValueError as e:
        print("ValueError as expected:", str(e)[:90])
register_adv_est("smoke_single", batch_fields="token_importance")(est)
assert get_adv_estimator_batch_fields("smoke_single") == ("token_importance",)

# ---- legacy path: ray_trainer.compute_advantage --------------------------------------------------------------
B, T = 4, 5
mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.float32)
imp = torch.arange(B * T, dtype=torch.float32).reshape(B, T) / 10
reason = torch.zeros(B, T, dtype=torch.bool)
reason[:, :2] = True


def proto(with_reason=True):
    batch = {"token_level_rewards": torch.zeros(B, T), "response_mask": mask.clone(), "token_importance": imp.clone(),
             "other": torch.ones(B, T)}
    if with_reason:
        batch["oar_reasoning_mask"] = reason.clone()
    return DataProto.from_dict(tensors=batch, non_tensors={"uid": np.array(["a", "a", "b", "b"], dtype=object)})


expected = torch.where(reason, imp, torch.ones_like(imp)) * mask
out = compute_advantage(proto(), adv_estimator="smoke_est", config={})
assert torch.equal(out.batch["advantages"], expected), out.batch["advantages"]
print("legacy: estimator got", seen[-1], "-> advantages match token_importance on the reasoning mask")
out = compute_advantage(proto(with_reason=False), adv_estimator="smoke_est", config={})
assert seen[-1] == ["token_importance"] and torch.equal(out.batch["advantages"], imp * mask)
print("legacy: declared field absent from the batch -> not passed:", seen[-1])
from omegaconf import OmegaConf  # noqa: E402

out = compute_advantage(proto(), adv_estimator="rloo", config=OmegaConf.create({}))
print("legacy: undeclared estimator rloo still runs, advantages", tuple(out.batch["advantages"].shape))

# ---- V1 path: PPOTrainer._compute_advantage (TransferQueue stubbed, it only filters fields) ----------------------
from tensordict import NonTensorStack, TensorDict  # noqa: E402

import verl.trainer.ppo.v1.trainer_base as tb  # noqa: E402


def nested(x, lens):
    return torch.nested.as_nested_tensor([x[i, :n] for i, n in enumerate(lens)], layout=torch.jagged)


lens = mask.sum(-1).long().tolist()
store = {"uid": None, "response_mask": nested(mask, lens), "rm_scores": nested(torch.zeros(B, T), lens),
         "token_importance": nested(imp, lens), "oar_reasoning_mask": nested(reason, lens),
         "unrelated": nested(torch.ones(B, T), lens)}
requested, written = {}, {}


def kv_batch_get(keys, partition_id, select_fields):
    requested["fields"] = list(select_fields)
    td = TensorDict({k: v for k, v in store.items() if k in select_fields and v is not None}, batch_size=[B])
    td["uid"] = NonTensorStack(*["a", "a", "b", "b"])
    return td


def kv_batch_put(keys, partition_id, fields):
    written.update(fields.items())
    return meta


class Meta:
    keys = [f"k{i}_0_0" for i in range(B)]
    partition_id = "train"

    def __len__(self):
        return B


meta = Meta()
tb.tq.kv_batch_get, tb.tq.kv_batch_put = kv_batch_get, kv_batch_put
from verl.trainer.ppo.v1 import PPOTrainerSync  # noqa: E402

trainer = PPOTrainerSync.__new__(PPOTrainerSync)  # _compute_advantage is PPOTrainer's own
trainer.config = OmegaConf.create({
    "algorithm": {"adv_estimator": "smoke_est", "use_kl_in_reward": False, "gamma": 1.0, "lam": 1.0,
                  "norm_adv_by_std_in_grpo": True, "rollout_correction": None},
    "actor_rollout_ref": {"rollout": {"n": 2}}})
trainer._compute_advantage(meta, metrics={})
assert requested["fields"][-2:] == list(FIELDS) and "unrelated" not in requested["fields"], requested
adv = written["advantages"].to_padded_tensor(0.0)
assert torch.equal(adv, expected[:, : adv.shape[1]]), adv
print("V1: select_fields =", requested["fields"])
print("V1: estimator got", seen[-1], "-> advantages written back match")
print("SMOKE 0001 OK")
PY
cat > smoke_0002_0003.py <<'PY'
"""Smoke check for patches/0002 and 0003 (run with VERL_PLATFORM=cpu against the patched scratch copy)."""
import os

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

import verl
from verl.plugin.platform import get_platform
from verl.utils.device import auto_set_device, get_device_id, get_device_name, get_nccl_backend, get_torch_device
from verl.utils.distributed import get_default_process_group_backend, initialize_global_process_group_ray

print("verl from", verl.__file__)
p = get_platform()
print("platform:", type(p).__name__, "device:", get_device_name(), "id:", repr(get_device_id()),
      "backend:", get_nccl_backend(), "ray resource:", p.ray_resource_name(), "ipc:", p.is_ipc_supported())
assert type(p).__name__ == "PlatformCPU" and get_device_name() == "cpu" and get_device_id() == "cpu"
x = torch.ones(2).to(get_device_id())
dev = get_torch_device()
dev.set_device(0); dev.synchronize(); dev.empty_cache(); dev.ipc_collect()
with dev.stream(dev.current_stream()):
    pass
print("device module: mem_get_info", tuple(round(v / 2**30, 1) for v in dev.mem_get_info()), "GiB;",
      "max_memory_allocated", dev.max_memory_allocated(), "; count", dev.device_count(), "; tensor on", x.device)
cfg = OmegaConf.create({"trainer": {"device": "cpu"}})
auto_set_device(cfg)
assert cfg.trainer.device == "cpu"
print("auto_set_device keeps trainer.device =", cfg.trainer.device)

# 0002
backend = get_default_process_group_backend()
assert backend == "cpu:gloo", backend
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1")
initialize_global_process_group_ray(timeout_second=60)
t = torch.tensor([3.0])
dist.all_reduce(t)
print("0002: backend", repr(backend), "-> init_process_group ok, all_reduce", t.item(), "backend", dist.get_backend())
dist.destroy_process_group()

# 0003: engine registry
from verl.workers.engine.base import EngineRegistry  # noqa: E402

for mt in ("language_model", "value_model"):
    for be in ("fsdp", "fsdp2"):
        print(f"0003: EngineRegistry[{mt}, {be}] on cpu ->", EngineRegistry.get_engine_cls(mt, be).__name__)
print("SMOKE 0002/0003 OK")
PY
echo "== smoke 0001 (legacy + V1 compute_advantage)"
VERL_USE_EXTERNAL_PLUGINS=none PYTHONPATH="$WORK" "$PY" smoke_0001.py 2>&1 | filter
echo "== smoke 0002/0003 (VERL_PLATFORM=cpu)"
VERL_PLATFORM=cpu VERL_USE_EXTERNAL_PLUGINS=none PYTHONPATH="$WORK" "$PY" smoke_0002_0003.py 2>&1 | filter

cat > smoke_0004.py <<'PY'
"""Smoke check for patches/0004: a saved FSDP2 state on the CPU does not follow later updates."""
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from verl.utils.fsdp_utils import fsdp2_sharded_load_from_cpu, fsdp2_sharded_save_to_cpu

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29534", RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
model = torch.nn.Sequential(torch.nn.Linear(4, 4))
fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
state, spec = fsdp2_sharded_save_to_cpu(model)
before = model[0].weight.full_tensor().clone()
with torch.no_grad():
    model[0].weight.add_(1.0)  # an optimizer step
fsdp2_sharded_load_from_cpu(model, state, spec)
assert torch.equal(model[0].weight.full_tensor(), before), "restored the updated weights: the save aliased them"
print("0004: the saved state survives an update and restores pi_old")
dist.destroy_process_group()
print("SMOKE 0004 OK")
PY
echo "== smoke 0004 (FSDP2 save on CPU)"
VERL_USE_EXTERNAL_PLUGINS=none PYTHONPATH="$WORK" "$PY" smoke_0004.py 2>&1 | filter

cat > smoke_0005.py <<'PY'
"""Smoke check for patches/0005: registered micro-batch contexts wrap forward_step, in order, until removed."""
import contextlib
import inspect

from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

assert "self.micro_batch_context(micro_batch, forward_only)" in inspect.getsource(FSDPEngine.forward_backward_batch)
engine = object.__new__(FSDPEngine)  # the contexts need no initialised engine
seen = []


def factory(name):
    @contextlib.contextmanager
    def enter(micro_batch, forward_only):
        seen.append((name, "in", micro_batch, forward_only))
        yield
        seen.append((name, "out", micro_batch, forward_only))
    return enter


remove_a = engine.register_micro_batch_context(factory("a"))
remove_b = engine.register_micro_batch_context(factory("b"))
with engine.micro_batch_context("mb0", True):
    seen.append(("step",))
assert [s[:2] for s in seen] == [("a", "in"), ("b", "in"), ("step",), ("b", "out"), ("a", "out")], seen
remove_a()
remove_b()
seen.clear()
with engine.micro_batch_context("mb1", False):
    pass
assert not seen  # nothing registered: an empty ExitStack
print("SMOKE 0005 OK")
PY
echo "== smoke 0005 (micro-batch contexts)"
VERL_USE_EXTERNAL_PLUGINS=none PYTHONPATH="$WORK" "$PY" smoke_0005.py 2>&1 | filter
