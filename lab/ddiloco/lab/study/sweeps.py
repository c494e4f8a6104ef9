"""The quality study's sweeps: named lists of cases, each written as ``MODE[:key=value...]``.

The study is staged: the fair baseline and the tuning first (``dp-lr``, ``tune``), then the
ablations and the bandwidth frontier around the default, then the trends (tokens, model size,
learners) at the settings the first stages chose. Every case runs at the default budget (3
learners x 600 steps x 16 x 128 tokens) unless it says otherwise. ``docs/quality.md`` shows what
each sweep found and the command behind each table.

The first stages ran around the defaults of their time: an inner warm-up of 30 steps and no
outer momentum warm-up (``STAGE1``). What they found (60 steps, 8 outer steps) became the
defaults, so their cases name those two settings, which keeps them the cases that were run.
Every stage here ran before the later defaults too (inner lr 3e-3 for every mode, merges applied
at tau, hand-overs stepped with the momentum, train files laid out contiguously): ``BEFORE``
names them in each of these cases (``then``). What they do not name is the measurement: a sweep
run again evaluates on today's set (the whole held-out split). ``shipped`` is the modes as
``ddiloco run`` ships them.
"""

from __future__ import annotations

BEFORE: dict[str, dict[str, str]] = {
    "decoupled": {"inner_lr": "3e-3", "apply_at": "tau", "hand_over_momentum": "on", "data_order": "contiguous"},
    "diloco": {"inner_lr": "3e-3", "hand_over_momentum": "on", "data_order": "contiguous"},
    "dp": {"inner_lr": "3e-3", "data_order": "contiguous"},
}
"""The defaults every stage below ran around, besides ``STAGE1``'s, per mode."""


def then(spec: str) -> str:
    """``spec`` at the defaults its stage ran around (``BEFORE``); its own settings win."""
    mode, *opts = spec.split(":")
    given = dict(opt.split("=", 1) for opt in opts)
    return ":".join([mode, *(f"{k}={v}" for k, v in {**BEFORE[mode], **given}.items())])

STAGE1 = "warmup_steps=30:momentum_warmup=0"
"""The defaults the first stages were run around."""
DP1 = "warmup_steps=30"
"""dp's warm-up in the first stages (dp has no outer momentum)."""

DP_LRS = ("1.5e-3", "3e-3", "4.5e-3", "6e-3", "9e-3", "1.2e-2")

_STAGES: dict[str, tuple[str, ...]] = {
    # the data-parallel reference's own learning rate, for its 3x larger batch
    "dp-lr": tuple(f"dp:{DP1}:inner_lr={lr}" for lr in DP_LRS),
    # the defaults of each mode, and what a deployment's data sharding (num_shards 8) changes
    "defaults": (f"decoupled:{STAGE1}", f"decoupled:{STAGE1}:shards=8", f"diloco:{STAGE1}",
                 f"diloco:{STAGE1}:outer_momentum=0.9", f"decoupled:{STAGE1}:outer_momentum=0.9"),
    # decoupled's tuning, one setting at a time around the default (as many cases as dp-lr's
    # and more: the baseline must not be the only side that was tuned)
    "tune": (*(f"decoupled:{STAGE1}:inner_lr={lr}" for lr in ("2e-3", "4.5e-3", "6e-3", "9e-3")),
             *(f"decoupled:{STAGE1}:outer_lr={lr}" for lr in ("0.5", "1.0", "1.3")),
             *(f"decoupled:{STAGE1}:outer_momentum={mu}" for mu in ("0", "0.3", "0.7")),
             f"decoupled:{STAGE1}:outer_schedule=cosine", "decoupled:warmup_steps=30:momentum_warmup=8",
             "decoupled:warmup_steps=60:momentum_warmup=0"),
    # what each mechanism contributes, one at a time against the default
    "ablations": tuple(f"decoupled:{STAGE1}:{change}" for change in (
        "merge=mean", "apply=overwrite", "apply=mix", "codec=fp32", "global_codec=fp32", "error_feedback=off",
        "overlap=0", "overlap=6", "late=1", "fragments=6", "fragments=1:overlap=0", "token_weights=off")),
    # quality against bytes: the sync period H against the contributions' codec
    "frontier": tuple(f"decoupled:{STAGE1}:sync_every={h}:fragments={h}:overlap={min(2, h - 1)}:codec={codec}"
                      for h in (6, 12, 24, 48) for codec in ("bf16_zstd", "int4_block", "int2_block")),
    # --- the second stage, at what the first one chose (dp's inner lr 6e-3; the warm-ups, today's
    # defaults) ---
    # the spread over seeds of the references, the old default and today's
    "seeds": tuple(f"{spec}:seed={seed}" for seed in (1, 2)
                   for spec in (f"dp:{DP1}:inner_lr=6e-3", f"decoupled:{STAGE1}", "decoupled")),
    # the first stage's gains together, and the tuning knob dp gets as well
    "combos": (f"decoupled:{STAGE1}:overlap=1", "decoupled", "decoupled:apply=overwrite", "decoupled:overlap=1",
               "decoupled:outer_momentum=0.7", f"decoupled:{STAGE1}:inner_lr=4.5e-3:outer_lr=0.5",
               "dp:inner_lr=6e-3", "dp:inner_lr=6e-3:seed=1", "dp:inner_lr=6e-3:seed=2",
               # dp's best lr gained 2.8% from the longer warm-up: decoupled's lr and both warm-ups again
               "decoupled:inner_lr=4.5e-3", "decoupled:warmup_steps=120", "dp:inner_lr=6e-3:warmup_steps=120",
               "dp:inner_lr=9e-3"),
    # the gap against the budget: 3x and 9x the tokens (dp's lr swept again at 3x), and against
    # the fleet: one learner (DiLoCo with M = 1 against dp on the same batch of 16)
    "tokens": (f"dp:{DP1}:steps=1800:inner_lr=6e-3", f"decoupled:{STAGE1}:steps=1800", f"diloco:{STAGE1}:steps=1800",
               "decoupled:steps=1800", "dp:steps=1800:inner_lr=4.5e-3", "dp:steps=1800",
               "dp:steps=5400:inner_lr=4.5e-3", "dp:steps=5400:inner_lr=6e-3", "decoupled:steps=5400"),
    "one-learner": ("dp:learners=1", "dp:learners=1:inner_lr=6e-3", "decoupled:learners=1", "diloco:learners=1"),
    # a model 5.5x larger (4.9M parameters)
    "size": (f"dp:{DP1}:model=m5:inner_lr=6e-3", f"decoupled:{STAGE1}:model=m5", "dp:model=m5", "decoupled:model=m5",
             "dp:model=m5:inner_lr=1.5e-3", "diloco:model=m5"),
    # fleets of 2, 4 and 8 learners (each at 600 steps: the tokens grow with M)
    "learners": tuple(f"{mode}:learners={m}" for m in (2, 4, 8) for mode in ("dp:inner_lr=6e-3", "dp", "decoupled")),
    # the mixture-of-experts model
    "moe": (f"dp:{DP1}:model=moe:inner_lr=6e-3", f"decoupled:{STAGE1}:model=moe", "dp:model=moe:inner_lr=6e-3",
            "decoupled:model=moe"),
}

SWEEPS: dict[str, tuple[str, ...]] = {
    **{name: tuple(then(spec) for spec in specs) for name, specs in _STAGES.items()},
    # the modes as `ddiloco run` ships them (dp at its tuned lr and warm-up), three seeds
    "shipped": tuple(f"{mode}:seed={seed}" if seed else mode for seed in (0, 1, 2)
                     for mode in ("dp", "decoupled", "diloco")),
}


def expand(name: str) -> tuple[str, ...]:
    if name not in SWEEPS:
        raise ValueError(f"unknown sweep {name!r}; known: {', '.join(SWEEPS)}")
    return SWEEPS[name]
