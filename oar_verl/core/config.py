"""The one typed OAR configuration (``algorithm.oar.*``); a leaf module: it imports nothing of the package.

Construction checks every value's type and range, raising :class:`OARConfigError` naming the full key
(``algorithm.oar.<key>``) and the allowed range. The names a registry resolves (``mode``, ``perturbation``, ``mask``,
``probe``, ``answer_patterns``, ``segment_split``) and the combinations that depend on their entries' facts are checked
by :func:`oar_verl.core.checks.startup.check_config`, which every entry point runs before any work. The keys' meanings:
docs/config.md (generated from the field metadata below).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

AUTO_PROBE = "auto"  # the probe schedule: LT-Logits during warm-up, AS-Mean after (:meth:`OARConfig.probe_for_step`)
TARGETS = ("response", "reference")
APPLY_TO = ("all", "negative", "positive")
AUTO_MODE = "auto"  # `mode=auto`: the driver chooses a registered mode per band (oar_verl.core.auto, docs/auto.md)
AUTO_FALLBACKS = ("grpo", "best")
RECOMPUTE = ("auto", "always", "never")
ATTENTION_RULES = ("values", "uniform")  # how `conservative` propagates through attention (core/backends/rules.py)
# how the gate reads signed scores (`signed_scores`): the names of core/reshaping/gating.py's SIGNED_SCORES, whose
# import fails if the two differ (this module is a leaf: it cannot import the scalings)
SIGNED_SCORE_NAMES = ("clamp", "signed", "magnitude", "rank")
SIGNED_SCORES_DEFAULT = "magnitude"  # chosen by measurement: research/docs/evidence.md §10
AUTO_MAX_CANDIDATES = 8  # the integrations' per-row fields hold this many candidates

# Presets only fill the keys the user did not set.  `paper`: the values the paper's summaries report; `official_code`:
# the values of the official OAR-main.py (τ = 0.25, β = 1.0).
PRESETS: dict[str, dict[str, Any]] = {
    "paper": {"tau": 0.4, "beta": 2.0},
    "official_code": {"tau": 0.25, "beta": 1.0},
}

DEFAULT_PREFIX = "algorithm.oar"


class OARConfigError(ValueError):
    """An invalid OAR configuration value; the message names the key and the allowed range."""


# The groups of `algorithm.oar.*`, in the order docs/config.md and the trainer YAML list them.
GROUPS = ("method", "gating", "probe", "OAR-G noise", "OAR-P cost", "budgets", "dumps", "fidelity", "auto")


def _key(default: Any, group: str, help: str) -> Any:  # noqa: A002  (TRL's name for the same metadata)
    """A configuration key: its default plus the help text and group that docs/config.md and the YAML comments are
    generated from (``python -m devtools.config_doc``)."""
    if group not in GROUPS:
        raise ValueError(f"unknown config group {group!r}; one of {GROUPS}")
    return field(default=default, metadata={"group": group, "help": help})


@dataclass(frozen=True)
class OARConfig:
    """OAR settings (``algorithm.oar.*`` in the trainer config).

    Each key's meaning, default and allowed values are in its field's ``metadata["help"]``; the rendered reference is
    ``docs/config.md`` (generated, and checked by a test). ``prefix`` is not a key: it is the dotted path errors name.
    """

    mode: str = _key("conservative", "method",
                     "`conservative` (the default, chosen by measurement, docs/method.md §15: gradient x input of "
                     "the answer's log-probability with relevance conserved through attention, norms and the gated "
                     "MLP; one clean input-gradient pass; every engine; docs/method.md §13), "
                     "`gradient` (OAR-G, the paper's: gradient x input under embedding noise), `perturbation` (OAR-P: "
                     "one-token masking, the probe's change per masked token), `fisher` (OAR-P's masking KL to second "
                     "order from clean-point gradients: about OAR-G's cost; docs/method.md §11) or `path` (integrated "
                     "gradients of the shift along the mask path, every reasoning token moved together: OAR-G's "
                     "cost with `path_points` draws; docs/method.md §12); `auto`: the run chooses among "
                     "`auto_candidates` on its own rows (docs/auto.md).")
    attention_rule: str = _key("values", "method",
                               "`conservative`: how relevance crosses attention: `values` (the attention "
                               "probabilities held constant, the values carry it; exactly conserved) or `uniform` "
                               "(AttnLRP's: the softmax by gradient x input and each of attention's two products split "
                               "in half between its factors, so relevance also flows through what a token attends "
                               "to; conserved up to the softmax's share). Same cost; docs/method.md §13.")
    preset: str = _key("paper", "method",
                       "`paper` (tau = 0.4, beta = 2.0, the paper's summaries) or `official_code` (tau = 0.25, "
                       "beta = 1.0, the official OAR-main.py); an explicit `tau` / `beta` wins over the preset.")
    tau: float | None = _key(None, "gating",
                             "Gating quantile level in [0, 1): about this fraction of each sequence's tokens is "
                             "suppressed. null = the preset's value.")
    beta: float | None = _key(None, "gating",
                              "Boost strength, >= 0: boosted raw weights lie in [1, 1 + beta]. null = the preset's "
                              "value.")
    floor: float = _key(0.1, "gating", "Lowest raw weight of a suppressed token, in (0, 1].")
    signed_scores: str = _key(SIGNED_SCORES_DEFAULT, "gating",
                              "How the gate reads signed scores (the default mode's relevance is signed: "
                              "negative = the token argues against the stated answer): `magnitude` (|score|: "
                              "evidence for or against alike; chosen by measurement, research/docs/evidence.md "
                              "§10), `clamp` (negatives count as 0, the gate before it), `signed` "
                              "(counter-evidence ranks lowest), `rank` (ranks of the signed scores). Scores "
                              "that are never negative (KL, fisher, OAR-G) read the same under `magnitude` and "
                              "`clamp`.")
    probe: str = _key("auto", "probe",
                      "Outcome probe: `auto` (LT-Logits for the first `probe_warmup_steps` steps, AS-Mean after) | "
                      "`lt_logits` | `as_mean` | `as_joint`.")
    probe_warmup_steps: int = _key(10, "probe",
                                   "With `probe=auto`, LT-Logits for the first this-many global steps, AS-Mean after; "
                                   ">= 0.")
    target: str = _key("response", "probe",
                       "`response` (the response's own answer span) or `reference` (teacher-force `conclude_text` "
                       "plus the ground-truth answer after the reasoning).")
    conclude_text: str = _key("Therefore, the final answer is \\boxed{", "probe",
                              "Text placed between the reasoning and the ground-truth answer with "
                              "`target=reference`.")
    answer_patterns: tuple[str, ...] = _key(("boxed", "gsm8k", "answer_is"), "probe",
                                            "Answer-span patterns tried in order: built-in names (`boxed`: the last "
                                            "balanced `\\boxed{...}`; `gsm8k`: `#### N`; `answer_is`: \"The answer "
                                            "is N\") or regexes with a named group `(?P<answer>...)`.")
    noise_std: float = _key(1e-3, "OAR-G noise",
                            "OAR-G: std (absolute) of the Gaussian noise on reasoning-token embeddings, > 0. Ignored "
                            "by OAR-P.")
    noise_std_low_precision: float | None = _key(5e-2, "OAR-G noise",
                                                 "OAR-G: σ where the embedding output is bf16 or fp16 (an FSDP or "
                                                 "Megatron actor's compute dtype), > 0; `noise_std`'s σ = 1e-3 moves "
                                                 "the logits by less than bf16 resolves, so its shift is rounding "
                                                 "(bf16 vs fp32 Spearman 0.54 on SmolLM2's rows, 0.95 at 5e-2, the "
                                                 "same credit: docs/method.md §4); null = `noise_std` in every dtype.")
    seed: int = _key(0, "OAR-G noise",
                     "OAR-G: base seed of the noise, >= 0; per-sequence generators derive from (seed, step, a "
                     "fingerprint of the sequence's tokens), so the noise does not depend on batching or data "
                     "parallelism. Also seeds the signs of `fisher_sketches`. Ignored by OAR-P.")
    noise_samples: int = _key(1, "OAR-G noise",
                              "OAR-G: noise draws per sequence, >= 1; the score is the mean of the single-draw "
                              "scores (draw 0 uses the sequence's own seed, so 1 is the single-draw method). Costs K "
                              "student passes per sequence, run in the same passes where the token budget allows "
                              "(each draw counts as a sequence for the budget and for `micro_batch_size`). Ignored by "
                              "OAR-P. Measured cost: research/docs/evidence.md.")
    fisher_outcomes: int = _key(1, "method",
                                "`fisher`: the most likely outcomes of each row's probe kept exactly in the Fisher "
                                "sum, >= 1 (0 only with `fisher_sketches` >= 1: the pure sketch); one backward per "
                                "outcome and sequence (Megatron: a forward+backward per outcome). With "
                                "`fisher_sketches` = 0 the sum stops there, a lower bound of the full Fisher form; 1 "
                                "keeps only the top outcome: first-order attribution patching of its log-probability "
                                "(docs/method.md §11). Measured fidelity and cost: research/docs/faithfulness.md.")
    fisher_sketches: int = _key(0, "method",
                                "`fisher`: Rademacher sketches of the outcomes beyond the top `fisher_outcomes`, >= "
                                "0. 0 = the truncated sum (biased low); S >= 1 = an unbiased estimate of the full "
                                "vocabulary's Fisher form for any `fisher_outcomes` (the top K exact, the rest "
                                "sketched; relative standard deviation of a token's tail term <= sqrt(2/S)), signs "
                                "seeded by `seed`. Cost: one forward and K + S backwards per sequence (Megatron: K + S "
                                "forward+backwards; AS-Joint rows: one) (docs/method.md §11).")
    path_points: int = _key(2, "method",
                            "`path`: points M on the path from the clean embeddings to the mask embedding (midpoints "
                            "(m - 1/2)/M), in [1, 8]; the score is the M-point Riemann sum of the integrated "
                            "gradient, whose sum over tokens tends to the shift of removing them all as M grows. "
                            "Cost: one teacher forward and M forward+backwards per sequence, as OAR-G with "
                            "`noise_samples` = M (docs/method.md §12).")
    mask: str = _key("mean", "method",
                     "What replaces a masked token (OAR-P's copies; `fisher`'s and `path`'s embedding move): "
                     "`mean` (the input-embedding output set to the mean of the embedding table's rows), `zero` (set "
                     "to the zero vector), `resample` (a token drawn, seeded, from the same row's own reasoning "
                     "tokens: the policy's empirical marginal, not the model's conditional; not with `fisher` or "
                     "`path`), `pad` (the tokenizer's pad token) or `token` (`mask_token_id`). `pad` / `token` are "
                     "refused at start-up when the token is an EOS, is written by the chat template or is another "
                     "special token (docs/method.md §3). Ignored by OAR-G.")
    mask_token_id: int | None = _key(None, "method",
                                     "The replacement token id with `mask=token`, >= 0 (a plain token; refused at "
                                     "start-up if it is an EOS, end-of-turn or other special token); must be null "
                                     "with any other `mask`.")
    max_token_len_per_gpu: int | None = _key(None, "budgets",
                                             "Token budget of one attribution pass (rows x columns it holds), >= 1; "
                                             "null = the actor's own (`log_prob_max_token_len_per_gpu` for OAR-P / "
                                             "`ppo_max_token_len_per_gpu` for OAR-G with `use_dynamic_bsz`, else the "
                                             "micro-batch size x the longest sequence).")
    shared_forward: bool = _key(True, "budgets",
                                "`fisher` and `conservative` read their scores from verl's old-log-prob forward "
                                "(one forward for both, backwards only from the probe; docs/method.md §14) where the "
                                "engine allows it (FSDP, with or without Ulysses; Megatron for methods with one "
                                "backward per row: `fisher` at its default `fisher_outcomes`, `conservative`; not "
                                "with fused kernels; elsewhere right after the pass, in the same call), in the V1 and "
                                "legacy trainers and "
                                "OpenRLHF's experience maker; `gradient` (OAR-G) reads its clean teachers from that "
                                "forward on FSDP (its noisy passes follow in the same call, on the rows the step "
                                "reads); under `mode=auto` on the steps that do not calibrate, "
                                "when every band runs one such method; never with `target=reference` (its rows end in "
                                "the ground truth, which that forward does not hold); with false, their own passes.")
    recompute: str = _key("auto", "budgets",
                          "Gradient checkpointing of attribution's backwards: `auto` (keep the activations of as many "
                          "decoder layers as fit under verl's update's peak, the old-log-prob pass's logits counted "
                          "when read from it, and the free memory, recompute the "
                          "rest; one setting for every pass under Ulysses and in OpenRLHF: the actor's own; logged as "
                          "`oar/recomputed_share`), `always` or `never`. Megatron: its engine's own settings (`auto` "
                          "only).")
    chunk_size: int | None = _key(None, "budgets",
                                  "Optional cap on OAR-P's masked copies per pass, >= 1; null = the token budget "
                                  "alone.")
    prefix_cache: bool = _key(True, "OAR-P cost",
                              "OAR-P reuses each sequence's clean key/value cache for the unchanged prefix of its "
                              "masked copies (same numbers, less compute; needs a model that supports "
                              "`past_key_values`).")
    mask_span: int = _key(1, "OAR-P cost",
                          "OAR-P masks this many consecutive reasoning tokens per copy, >= 1; 1 is the exact method, "
                          "k > 1 a k-times cheaper approximation (`perturbation=exact` only).")
    perturbation: str = _key("exact", "OAR-P cost",
                             "OAR-P policy for long reasoning (docs/method.md): `exact` (one copy per token), "
                             "`segment` (one copy per reasoning segment, its score spread over its tokens), "
                             "`hierarchical` (segments first, exact OAR-P inside the top segments) or `auto` (exact up "
                             "to `exact_max_tokens` reasoning tokens, hierarchical above).")
    segment_split: str = _key("sentence", "OAR-P cost",
                              "Where reasoning segments end: `line` (line breaks), `sentence` (line breaks and "
                              "`. ! ? 。` before whitespace) or a regex (a segment ends where a match ends).")
    segment_min_tokens: int = _key(8, "OAR-P cost", "Shorter segments merge into the next one; >= 1.")
    segment_max_tokens: int = _key(64, "OAR-P cost",
                                   "Longer segments are cut into near-equal parts; >= `segment_min_tokens`.")
    refine_share: float = _key(0.1, "OAR-P cost",
                               "`hierarchical`: share of a row's reasoning tokens refined at token level (top "
                               "segments first), in (0, 1]; 1 refines every segment, i.e. exact OAR-P.")
    exact_max_tokens: int = _key(512, "OAR-P cost",
                                 "`auto`: rows with at most this many reasoning tokens run exact OAR-P; >= 0.")
    micro_batch_size: int | None = _key(None, "budgets",
                                        "Optional cap on the sequences of one OAR-G round or clean probe pass, >= 1; "
                                        "null = the token budget alone.")
    apply_to: str = _key("all", "method",
                         "Reshape `all` sequences, or only those with `negative` / `positive` advantage.")
    base_estimator: str = _key("grpo", "method",
                               "Registered verl outcome estimator that gives the sequence advantage (`grpo`, "
                               "`rloo`, `reinforce_plus_plus`, ...; not `oar`).")
    skip_zero_advantage: bool = _key(True, "method",
                                     "Attribute only sequences with a non-zero base advantage (the others keep "
                                     "weight 1).")
    dump_every: int = _key(0, "dumps",
                           "Every this-many steps, dump attributed rollouts (tokens, importance, weights) as JSONL "
                           "for token heatmaps (`python -m oar_verl.viz.heatmap`); a due step that reshaped no row "
                           "passes its dump to the next step that does (within a launch); 0 = never.")
    dump_dir: str | None = _key(None, "dumps",
                                "Where the dumps go; null = `oar_dumps` in the run's output folder (verl: "
                                "`trainer.default_local_dir`; TRL: `output_dir`).")
    dump_groups: int = _key(2, "dumps", "Prompt groups (all their rollouts) per dump; >= 1.")
    fidelity_every: int = _key(0, "fidelity",
                               "Every this-many steps, measure the fidelity of that step's attribution with the "
                               "deletion metric (docs/fidelity.md, \"Logged while training\"; `oar/fidelity/*`); 0 = "
                               "never, >= 0. Cost per measured row: one clean forward and 35 of the row with tokens masked "
                               "((1 + 4 random rankings) x (5 fractions + 1), plus 5 for the position control; 5 "
                               "more for the entropy control where the old-log-prob pass gave entropies), "
                               "independent of its length, packed under the attribution's token budget.")
    fidelity_rows: int = _key(4, "fidelity",
                              "Rows measured per data-parallel rank on a measured step: the first this-many attributed "
                              "rows with reasoning tokens; >= 1.")
    auto_candidates: tuple[str, ...] = _key(("conservative", "fisher"), "auto",
                                            "`mode=auto`: the registered modes scored on the run's own rows "
                                            "(docs/auto.md); the cheapest one whose gain over the random, position "
                                            "and entropy controls has a lower bound > 0 is chosen. `perturbation` is opt-in: at "
                                            "4k tokens one exact OAR-P row costs hundreds of training rows.")
    auto_default: str = _key("conservative", "auto",
                             "`mode=auto`: the mode rows attribute with before the first decision; a registered mode.")
    auto_rows: int = _key(32, "auto", "`mode=auto`: rows (all ranks) a check needs per band before it decides; >= 1.")
    auto_prompts: int = _key(8, "auto",
                             "`mode=auto`: distinct prompts among a check's rows (the bootstrap's clusters); >= 1.")
    auto_every: int = _key(20, "auto",
                           "`mode=auto`: steps from one check's decision to the next re-check on fresh rows; >= 1. "
                           "20 keeps calibration + re-checks under 5 % of a 200-step run's compute (docs/auto.md §5).")
    auto_max_cost: float = _key(2.0, "auto",
                                "`mode=auto`: the most a candidate may cost, in training forward+backward units "
                                "(its seconds per token over the actor update's); > 0.")
    auto_fallback: str = _key("grpo", "auto",
                              "`mode=auto` when no affordable candidate beats the controls: `grpo` (those rows keep "
                              "the plain GRPO advantage) or `best` (the candidate with the highest lower bound).")
    prefix: str = field(default=DEFAULT_PREFIX, compare=False, repr=False)

    def __post_init__(self) -> None:
        p = self.prefix
        _name(p, "mode", self.mode)
        _choice(p, "preset", self.preset, tuple(PRESETS))
        preset = PRESETS[self.preset]
        # resolve the preset into concrete values (frozen dataclass: object.__setattr__ is the documented escape hatch)
        for k in ("tau", "beta"):
            if getattr(self, k) is None:
                object.__setattr__(self, k, preset[k])
        _number(p, "tau", self.tau, lo=0.0, hi=1.0, hi_open=True)
        _number(p, "beta", self.beta, lo=0.0)
        _number(p, "floor", self.floor, lo=0.0, hi=1.0, lo_open=True)
        _choice(p, "signed_scores", self.signed_scores, SIGNED_SCORE_NAMES)
        _name(p, "probe", self.probe)
        _integer(p, "probe_warmup_steps", self.probe_warmup_steps, lo=0)
        _choice(p, "target", self.target, TARGETS)
        if not isinstance(self.conclude_text, str):
            raise OARConfigError(f"{p}.conclude_text must be a string, got {self.conclude_text!r}")
        object.__setattr__(self, "answer_patterns", _patterns(p, self.answer_patterns))
        _number(p, "noise_std", self.noise_std, lo=0.0, lo_open=True)
        if self.noise_std_low_precision is not None:
            _number(p, "noise_std_low_precision", self.noise_std_low_precision, lo=0.0, lo_open=True)
        _integer(p, "seed", self.seed, lo=0)
        _integer(p, "noise_samples", self.noise_samples, lo=1)
        _integer(p, "fisher_sketches", self.fisher_sketches, lo=0)
        _integer(p, "path_points", self.path_points, lo=1, hi=8)
        _integer(p, "fisher_outcomes", self.fisher_outcomes, lo=0)
        if self.fisher_outcomes == 0 and self.fisher_sketches == 0:
            raise OARConfigError(f"{p}.fisher_outcomes=0 needs {p}.fisher_sketches >= 1 (the pure sketch); with "
                                 f"{p}.fisher_sketches=0 set {p}.fisher_outcomes >= 1")
        _name(p, "mask", self.mask)
        if self.mask_token_id is not None:
            _integer(p, "mask_token_id", self.mask_token_id, lo=0)
        for key in ("max_token_len_per_gpu", "chunk_size"):
            if getattr(self, key) is not None:
                _integer(p, key, getattr(self, key), lo=1)
        for key in ("prefix_cache", "shared_forward"):
            if not isinstance(getattr(self, key), bool):
                raise OARConfigError(f"{p}.{key} must be true or false, got {getattr(self, key)!r}")
        _choice(p, "recompute", self.recompute, RECOMPUTE)
        _choice(p, "attention_rule", self.attention_rule, ATTENTION_RULES)
        _integer(p, "mask_span", self.mask_span, lo=1)
        _name(p, "perturbation", self.perturbation)
        if not isinstance(self.segment_split, str) or not self.segment_split:
            raise OARConfigError(f"{p}.segment_split must be line, sentence or a regex, got {self.segment_split!r}")
        _integer(p, "segment_min_tokens", self.segment_min_tokens, lo=1)
        _integer(p, "segment_max_tokens", self.segment_max_tokens, lo=self.segment_min_tokens)
        _number(p, "refine_share", self.refine_share, lo=0.0, hi=1.0, lo_open=True)
        _integer(p, "exact_max_tokens", self.exact_max_tokens, lo=0)
        if self.micro_batch_size is not None:
            _integer(p, "micro_batch_size", self.micro_batch_size, lo=1)
        _choice(p, "apply_to", self.apply_to, APPLY_TO)
        if not isinstance(self.base_estimator, str) or not self.base_estimator:
            raise OARConfigError(f"{p}.base_estimator must be a registered estimator name, got {self.base_estimator!r}")
        if self.base_estimator == "oar":
            raise OARConfigError(f"{p}.base_estimator cannot be 'oar' itself; use an outcome estimator such as 'grpo'")
        if not isinstance(self.skip_zero_advantage, bool):
            raise OARConfigError(f"{p}.skip_zero_advantage must be true or false, got {self.skip_zero_advantage!r}")
        _integer(p, "dump_every", self.dump_every, lo=0)
        if self.dump_dir is not None and not isinstance(self.dump_dir, str):
            raise OARConfigError(f"{p}.dump_dir must be a path string or null, got {self.dump_dir!r}")
        _integer(p, "dump_groups", self.dump_groups, lo=1)
        _integer(p, "fidelity_every", self.fidelity_every, lo=0)
        _integer(p, "fidelity_rows", self.fidelity_rows, lo=1)
        object.__setattr__(self, "auto_candidates", _names(p, "auto_candidates", self.auto_candidates))
        _name(p, "auto_default", self.auto_default)
        for key in ("auto_rows", "auto_prompts", "auto_every"):
            _integer(p, key, getattr(self, key), lo=1)
        _number(p, "auto_max_cost", self.auto_max_cost, lo=0.0, lo_open=True)
        _choice(p, "auto_fallback", self.auto_fallback, AUTO_FALLBACKS)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None, prefix: str = DEFAULT_PREFIX) -> OARConfig:
        """Build from a dict / OmegaConf DictConfig; unknown keys are an error (a typo must not be ignored)."""
        values = _to_plain(values) if values is not None else {}
        if not isinstance(values, Mapping):
            raise OARConfigError(f"{prefix} must be a mapping of OAR settings, got {type(values).__name__}")
        known = {f.name for f in fields(cls) if f.name != "prefix"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise OARConfigError(f"unknown key(s) {', '.join(prefix + '.' + k for k in unknown)}; "
                                 f"allowed: {', '.join(sorted(known))}")
        kwargs = dict(values)
        if isinstance(kwargs.get("auto_candidates"), (list, str)):
            ac = kwargs["auto_candidates"]
            kwargs["auto_candidates"] = (ac,) if isinstance(ac, str) else tuple(ac)
        if "answer_patterns" in kwargs and kwargs["answer_patterns"] is not None:
            ap = kwargs["answer_patterns"]
            kwargs["answer_patterns"] = (ap,) if isinstance(ap, str) else tuple(ap)
        return cls(**kwargs, prefix=prefix)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("prefix")
        d["answer_patterns"] = list(self.answer_patterns)
        d["auto_candidates"] = list(self.auto_candidates)
        return d

    def probe_for_step(self, global_step: int) -> str:
        """The probe used at a training step: ``auto`` resolves to LT-Logits during warm-up, AS-Mean after."""
        if self.probe != AUTO_PROBE:
            return self.probe
        return "lt_logits" if global_step < self.probe_warmup_steps else "as_mean"


def _to_plain(values: Any) -> Any:
    try:  # OmegaConf is a verl dependency, but the core must not need it
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(values, (DictConfig, ListConfig)):
            return OmegaConf.to_container(values, resolve=True)
        if isinstance(values, Mapping):  # a plain dict holding OmegaConf values ({**cfg.oar, "mode": ...})
            return {k: _to_plain(v) for k, v in values.items()}
    except ImportError:  # pragma: no cover
        pass
    return values


def _choice(prefix: str, key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise OARConfigError(f"{prefix}.{key}={value!r} is not allowed; choose one of: {', '.join(allowed)}")


def _number(prefix: str, key: str, value: Any, lo: float | None = None, hi: float | None = None,
            lo_open: bool = False, hi_open: bool = False) -> None:
    lo_s = "" if lo is None else f"{lo} {'<' if lo_open else '<='} "
    hi_s = "" if hi is None else f" {'<' if hi_open else '<='} {hi}"
    rng = f"{lo_s}{key}{hi_s}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise OARConfigError(f"{prefix}.{key}={value!r} must be a finite number with {rng}")
    bad = (lo is not None and (value <= lo if lo_open else value < lo)) or \
          (hi is not None and (value >= hi if hi_open else value > hi))
    if bad:
        raise OARConfigError(f"{prefix}.{key}={value!r} is out of range: must satisfy {rng}")


def _integer(prefix: str, key: str, value: Any, lo: int, hi: int | None = None) -> None:
    allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
    if isinstance(value, bool) or not isinstance(value, int):
        raise OARConfigError(f"{prefix}.{key}={value!r} must be an integer {allowed}")
    if value < lo or (hi is not None and value > hi):
        raise OARConfigError(f"{prefix}.{key}={value!r} is out of range: must be an integer {allowed}")


def _name(prefix: str, key: str, value: Any) -> None:
    """A name-valued key is a non-empty string (which names are allowed: its registry, at
    :func:`~oar_verl.core.checks.startup.check_config`)."""
    if not isinstance(value, str) or not value:
        raise OARConfigError(f"{prefix}.{key}={value!r} must be a name (a non-empty string)")


def _names(prefix: str, key: str, names: Any) -> tuple[str, ...]:
    """A non-empty tuple of distinct names (which names: at :func:`~oar_verl.core.checks.startup.check_config`)."""
    if isinstance(names, str):
        names = (names,)
    if not isinstance(names, (tuple, list)) or not names or not all(isinstance(n, str) and n for n in names):
        raise OARConfigError(f"{prefix}.{key}={names!r} must be a non-empty list of registered mode names")
    if len(set(names)) != len(names):
        raise OARConfigError(f"{prefix}.{key}={list(names)!r} names a mode twice")
    if len(names) > AUTO_MAX_CANDIDATES:
        raise OARConfigError(f"{prefix}.{key} names {len(names)} modes; at most {AUTO_MAX_CANDIDATES}")
    return tuple(names)


def _patterns(prefix: str, patterns: Any) -> tuple[str, ...]:
    """The answer patterns as a non-empty tuple of strings (each one's name or regex: at
    :func:`~oar_verl.core.checks.startup.check_config`)."""
    if isinstance(patterns, str):
        patterns = (patterns,)
    if not isinstance(patterns, (tuple, list)) or not patterns:
        raise OARConfigError(f"{prefix}.answer_patterns must be a non-empty list of pattern names or regexes with a "
                             "named group 'answer'")
    for pat in patterns:
        if not isinstance(pat, str):
            raise OARConfigError(f"{prefix}.answer_patterns entry {pat!r} must be a string")
    return tuple(patterns)
