"""Property-based checks: invariants of the metrics hold on random valid runs."""

from __future__ import annotations

import itertools
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlscope.catalog import default_catalog
from rlscope.engine import compute
from rlscope.reader import open_run
from rlscope.writer import RunWriter

RATES = default_catalog().share_metrics()  # every metric declared a share in [0, 1]


@st.composite
def runs(draw: st.DrawFn) -> dict:
    seed = draw(st.integers(0, 2**32 - 1))
    steps = draw(st.integers(1, 6))
    group_sizes = draw(st.lists(st.integers(1, 9), min_size=1, max_size=6))
    binary = draw(st.booleans())
    return {"seed": seed, "steps": steps, "group_sizes": group_sizes, "binary": binary}


def _write(spec: dict, root: Path) -> Path:
    rng = np.random.default_rng(spec["seed"])
    rows: dict[str, list] = {
        k: [] for k in ("rollout_id", "step", "prompt_id", "reward", "response_len", "n_tool_calls")
    }
    rid = 0
    for step in range(spec["steps"]):
        for g, size in enumerate(spec["group_sizes"]):
            for _ in range(size):
                rows["rollout_id"].append(rid)
                rows["step"].append(step)
                rows["prompt_id"].append(f"p{g}")
                reward = float(rng.integers(0, 2)) if spec["binary"] else float(rng.normal())
                rows["reward"].append(reward)
                rows["response_len"].append(int(rng.integers(1, 50)))
                rows["n_tool_calls"].append(int(rng.integers(0, 4)))
                rid += 1
    n_tokens = 200
    tokens = {
        "rollout_id": rng.integers(0, rid, n_tokens),
        "step": rng.integers(0, spec["steps"], n_tokens),
        "pos": np.arange(n_tokens, dtype=np.int32),
        "logprob": -rng.gamma(1.0, 1.0, n_tokens).astype(np.float32),
        "old_logprob": -rng.gamma(1.0, 1.0, n_tokens).astype(np.float32),
        "ref_logprob": -rng.gamma(1.0, 1.0, n_tokens).astype(np.float32),
        "entropy": rng.gamma(0.5, 1.0, n_tokens).astype(np.float32),
        "advantage": rng.normal(size=n_tokens).astype(np.float32),
    }
    with RunWriter(root, algorithm="GRPO", max_response_len=40, max_tool_calls=3) as writer:
        writer.log_rollouts(rows)
        writer.log_tokens(tokens)
    return root


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(runs())
def test_invariants_hold_on_random_runs(spec: dict) -> None:
    root = Path(tempfile.mkdtemp())
    try:
        results = compute(open_run(_write(spec, root / "run"))).results
    finally:
        shutil.rmtree(root)
    for metric_id in RATES:
        if metric_id in results:
            values = [v for v in results[metric_id].values if v is not None]
            assert all(-1e-12 <= v <= 1 + 1e-12 for v in values), metric_id
    assert all(v >= 0 for v in results["stability.kl"].values if v is not None), "k3 >= 0"
    corr = results.get("behavior.len_correct_corr")
    if corr is not None:
        assert all(-1 - 1e-9 <= v <= 1 + 1e-9 for v in corr.values if v is not None)
    if "signal.pass_at_k" in results:
        components = results["signal.pass_at_k"].extra["components"]
        ordered = [components[k] for k in sorted(components, key=lambda k: int(k.split("@")[1]))]
        assert all(a <= b + 1e-12 for a, b in itertools.pairwise(ordered)), ordered
        gap = results["signal.pass_gap"]
        assert all(v >= -1e-12 for v in gap.values if v is not None)
    zero = results.get("signal.zero_std_frac")
    if zero is not None and spec["binary"]:
        # With 0/1 rewards (correct = reward > 0), a zero-σ group is all correct or all wrong.
        easy, hard = results["signal.all_correct_frac"], results["signal.all_wrong_frac"]
        assert zero.steps == easy.steps == hard.steps
        for z, e, h in zip(zero.values, easy.values, hard.values, strict=True):
            assert z == pytest.approx(e + h)
