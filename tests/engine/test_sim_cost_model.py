"""The cost model, the profile JSON and the deterministic tokens of simulated workers."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from sim_profiles import DEMO_TOKENS, synthetic_profile

from tandem.engine.sim.cost_model import (
    STEP_FEATURES,
    LinearModel,
    StepCost,
    TransferCost,
    fit_linear,
    relative_errors,
    step_features,
)
from tandem.engine.sim.profile import load_profile, profile_from_dict
from tandem.engine.sim.tokens import next_token


def test_step_features_of_a_mixed_batch() -> None:
    # A 64-token chunk after 32 computed tokens, a 1-token prompt tail, two decodes.
    rows = [(64, 32), (1, 9), (1, 100), (1, 0)]
    assert step_features(rows) == (1.0, 67.0, 4.0, 1.0, 64 * 32, 64 * 65 / 2, 10 + 101 + 1)
    assert step_features([]) == (1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


def test_a_scaled_step_cost_predicts_each_part_that_many_times() -> None:
    execute = LinearModel(STEP_FEATURES, (0.003, 2e-5, 1e-4, 4e-4, 3e-9, 1e-9, 5e-8))
    host = LinearModel(STEP_FEATURES, (1e-4, 0.0, 2e-6, 0.0, 0.0, 0.0, 0.0))
    rows = [(64, 32), (1, 9), (1, 100)]
    step = StepCost(execute, host)
    slow = step.scaled(1.25)
    assert slow.execute_seconds(rows) == pytest.approx(1.25 * step.execute_seconds(rows))
    assert slow.step_seconds(rows) == pytest.approx(1.25 * step.step_seconds(rows))
    assert slow.host.coefficients[3] == 0.0 and step.scaled(1.0) == step


def test_fit_recovers_exact_coefficients() -> None:
    truth = LinearModel(STEP_FEATURES, (0.003, 2e-5, 1e-4, 4e-4, 3e-9, 1e-9, 5e-8))
    shapes = [[(q, c)] for q in (16, 64, 256) for c in (0, 128)]
    shapes += [[(1, c)] * b for b in (1, 8, 32) for c in (32, 512)]
    shapes += [[(128, 0)] + [(1, 64)] * 4, [(32, 0), (32, 64)]]
    xs = [step_features(s) for s in shapes]
    ys = [truth.predict(x) for x in xs]
    fitted = fit_linear(STEP_FEATURES, xs, ys)
    for got, want in zip(fitted.coefficients, truth.coefficients, strict=True):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-12)
    assert max(relative_errors(fitted, xs, ys)) < 1e-9


def test_fit_never_goes_negative_and_ignores_constant_zero_features() -> None:
    # y falls with tokens: the unconstrained slope is negative, NNLS clamps it to zero.
    xs = [(1.0, t, 0.0, 0.0, 0.0, 0.0, 0.0) for t in (1.0, 2.0, 3.0)]
    fitted = fit_linear(STEP_FEATURES, xs, [0.3, 0.2, 0.1])
    assert fitted.coefficients[1] == 0.0
    assert fitted.coefficients[2:] == (0.0,) * 5
    assert fitted.coefficients[0] > 0
    with pytest.raises(ValueError, match="> 0"):
        fit_linear(STEP_FEATURES, xs, [0.1, 0.0, 0.1])


def test_transfer_cost_names_the_missing_transport() -> None:
    cost = TransferCost({"tcp": LinearModel(("transfers", "bytes"), (0.001, 1e-9))})
    assert cost.seconds("tcp", 10**6) == pytest.approx(0.002)
    with pytest.raises(ValueError, match="no KV transfer model for 'ucx'; it has tcp"):
        cost.seconds("ucx", 1)


def test_profile_round_trips_through_json(tmp_path: Path) -> None:
    profile = synthetic_profile(execute=(0.002, 1e-5, 3e-5, 0, 1e-9, 1e-9, 2e-8), num_blocks=99)
    serving = replace(profile.serving, run_queue_wait=0.0015, router_handoff_cpu=0.0012,
                      handoff_spread=(0.001, 0.002, 0.004))  # fmt: skip
    profile = replace(profile, serving=serving)
    path = tmp_path / "p.json"
    profile.save(path)
    again = load_profile(path)
    assert again == profile
    assert again.step.step_seconds([(16, 0)]) == pytest.approx(0.002 + 16e-5 + 3e-5 + 136e-9)


def _raw() -> dict:
    return synthetic_profile().to_dict()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(version=1), "version 2 document .* again with `tandem profile`"),
        (lambda d: d["model"].pop("vocab_size"), "model.vocab_size is missing"),
        (lambda d: d["engine"].update(num_blocks=0), "engine.num_blocks must be an integer >= 1"),
        (lambda d: d["engine"].update(block_size=24), "power of two"),
        (lambda d: d["step"].update(execute=[0.1, -1, 0, 0, 0, 0, 0]), r"step.execute\[1\]"),
        (lambda d: d["step"].update(host=[0.1]), "list of 7 coefficients"),
        (lambda d: d["model"].update(sim_token_ids=[257]), "must not contain an EOS"),
        (lambda d: d["model"].update(sim_token_ids=[]), "must not be empty"),
        (lambda d: d["transfer"]["models"].update(tcp="fast"), "transfer.models.tcp"),
        (lambda d: d["serving"].update(token_seconds=math.inf), "serving.token_seconds"),
        (lambda d: d["serving"].update(row_wake_share=1.5), r"serving.row_wake_share .*\[0, 1\]"),
        (lambda d: d["serving"].update(run_queue_wait=-0.001), "serving.run_queue_wait"),
        (lambda d: d["serving"].update(router_handoff_cpu=-1e-4), "serving.router_handoff_cpu"),
        (lambda d: d["serving"].update(handoff_spread=[0.001, -1]), r"serving.handoff_spread"),
        (lambda d: d["serving"].update(handoff_spread=0.001), r"serving.handoff_spread"),
    ],
)
def test_bad_profiles_are_refused_naming_the_field(mutate, message: str) -> None:  # noqa: ANN001
    raw = _raw()
    mutate(raw)
    with pytest.raises(ValueError, match=message):
        profile_from_dict(json.loads(json.dumps(raw)))


def test_a_non_json_profile_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        load_profile(path)


def test_simulated_tokens_depend_on_the_sequence_only() -> None:
    seq = [5, 6, 7, 8, 9]
    tok = next_token(seq, DEMO_TOKENS)
    assert tok in DEMO_TOKENS and tok == next_token(list(seq), DEMO_TOKENS)
    # Pinned: workers of different versions and the simulator must agree on the rule.
    assert [next_token(seq[:n], DEMO_TOKENS) for n in range(1, 6)] == [79, 98, 86, 73, 90]
    assert len({next_token([i, i + 1], DEMO_TOKENS) for i in range(200)}) > 20


def test_the_default_grid_reaches_the_longest_prompt_and_fits_the_cache() -> None:
    from tandem.engine.sim.profiler import default_grid

    g = default_grid(max_model_len=256, budget=2048, max_num_seqs=256, num_blocks=16384,
                     block_size=16)  # fmt: skip
    # Powers of two from 16, then the longest prompt the model takes (a fit extrapolates
    # poorly past its grid), each with the cached contexts that still fit.
    assert [q for q, _ in g.prefill] == [16] * 3 + [32] * 3 + [64] * 3 + [128] * 2 + [254]
    assert all(q + ctx <= 254 for q, ctx in g.prefill)
    assert max(b for b, _ in g.decode) == 128
    # A budget below the context caps the prefill chunk instead.
    assert max(q for q, _ in default_grid(4096, 512, 64, 16384, 16).prefill) == 512
