"""What the Ray worker-group jobs of this folder share (``detach_worker_job.py``, ``worker_group_job.py``).

verl's trainer config and the actor's worker group as verl's trainers spawn it (:mod:`devtools.verl_group`, shared
with the GPU check's ``verl-worker`` part), the jobs' prompts and their tokens, the copies a job saves, and the OAR
worker that keeps every rank's in-step fidelity (:class:`FidelityRecordingWorker`; Ray resolves it here in every
worker process, whose ``PYTHONPATH`` the test puts this folder on).

A job runs as a script (this folder first on ``sys.path``) in the process its test started with the CPU platform's
environment (``cpu_env()``), which must be set before verl is first imported: here, on importing this module.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from devtools.verl_group import actor_group, trainer_config  # noqa: F401  (the jobs' group, as verl builds it)
from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register

from oar_verl.core.fidelity.step import due
from oar_verl.core.pipeline import RowAttribution
from oar_verl.integration.worker import OARActorRolloutRefWorker

PROMPTS = ["What is 3 plus 4?", "What is 12 plus 30?", "Add 5 and 9.", "What is 7 plus 8?"]


def tokenized(model_dir: str, responses: Sequence[str], prompts: Sequence[str] = PROMPTS):
    """The model's tokenizer, each prompt's ids under its chat template (generation prompt added) and each response's
    ids with EOS last (lists of ints)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"] for p in prompts]
    response_ids = [tok.encode(r, add_special_tokens=False) + [tok.eos_token_id] for r in responses]
    return tok, prompt_ids, response_ids


def saved(value: torch.Tensor):
    """A copy to save: a nested tensor as the list of its rows, another tensor cloned."""
    return [t.clone() for t in value.unbind()] if getattr(value, "is_nested", False) else value.clone()


_ACTOR_MESH = make_nd_compute_dataproto_dispatch_fn(mesh_name="actor")


class FidelityRecordingWorker(OARActorRolloutRefWorker):
    """TEST-ONLY: the OAR worker that keeps, on every rank, each in-step fidelity it measured in ``compute_log_prob``
    and ``compute_token_importance`` (verl collects outputs from one rank of a model-parallel group only; the ranks
    must have measured the same), read back with :meth:`fidelity_records`."""

    def _recorded(self, call: str, fn, data):
        from unittest import mock

        records = self.__dict__.setdefault("_fidelity_records", [])
        measure = RowAttribution.fidelity

        def fidelity(att, cfg, step, **kw):
            got = measure(att, cfg, step, **kw)
            if due(cfg, step):  # a step that measured (else all NaN)
                records.append({"call": call, "entropies": kw.get("entropies") is not None,
                                **{k: v.clone() for k, v in got.items()}})
            return got

        with mock.patch.object(RowAttribution, "fidelity", fidelity):
            return fn(data)

    @register(dispatch_mode=_ACTOR_MESH)
    def compute_log_prob(self, data):
        return self._recorded("compute_log_prob", super().compute_log_prob, data)

    @register(dispatch_mode=_ACTOR_MESH)
    def compute_token_importance(self, data):
        return self._recorded("compute_token_importance", super().compute_token_importance, data)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fidelity_records(self) -> list[dict]:
        """This rank's records, oldest first (each: the call, whether the entropy control had entropies, and the
        measurement's per-row fields)."""
        return self.__dict__.get("_fidelity_records", [])
