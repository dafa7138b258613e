"""``hal diff`` finds a planted divergence at the right op, and reports none where there is none."""

from __future__ import annotations

import json

import pytest
import torch

from hal.cli import main
from hal.diff import DiffSpec, first_divergence, run_diff
from hal.errors import HalError
from hal.model import OpTrace

SMALL = dict(num_requests=3, prompt_len=(3, 8), max_new_tokens=5)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("scenario", ["train-vs-rollout", "rollout-vs-rollout", "train-vs-train"])
def test_no_divergence_on_the_contract_backend(scenario):
    report = run_diff(DiffSpec(scenario=scenario, backend="reference", arch="qwen3", dtype="bfloat16", **SMALL))
    c = report.comparison
    assert c.divergence is None and c.token_divergence is None and not report.diverged
    assert report.logprobs.num_tokens == SMALL["max_new_tokens"] and report.logprobs.identical
    # every op of every layer was compared, at every position both sides computed
    assert c.compared > 20 * len(c.positions) and len(c.positions) >= report.sequence_len - 1


@pytest.mark.parametrize("scenario, norm", [
    ("train-vs-rollout", "model.layers.1.post_attention_layernorm"),
    ("rollout-vs-rollout", "model.layers.0.self_attn.k_norm"),
    ("train-vs-train", "model.norm"),
])
def test_planted_rmsnorm_eps_is_found_at_its_op(scenario, norm):
    spec = DiffSpec(scenario=scenario, backend="reference", arch="qwen3", dtype="float32",
                    eps_b={norm: 1e-2}, request=1, **SMALL)
    report = run_diff(spec)
    d = report.comparison.divergence
    assert d is not None and d.op == norm
    # the first position this op is computed at on both sides: 0, or the first logits row for the final norm
    assert d.position == (report.prompt_len - 1 if norm == "model.norm" else 0)
    assert d.differing > 0 and d.max_abs_diff > 0
    assert d.layer == (None if norm == "model.norm" else int(norm.split(".")[2]))
    text = report.format()
    assert f"FIRST DIVERGENCE: op {norm}" in text and "--eps-b" in text and spec.command() in text
    assert not report.logprobs.identical


def test_one_traced_position():
    spec = DiffSpec(backend="reference", eps_b={"model.layers.1.mlp.*": 1.0}, **SMALL)
    with pytest.raises(HalError, match="no RMSNorm"):
        run_diff(spec)
    spec = DiffSpec(backend="reference", eps_b={"model.layers.1.*_layernorm": 1e-2}, position=5, **SMALL)
    d = run_diff(spec).comparison.divergence
    assert (d.op, d.position) == ("model.layers.1.input_layernorm", 5)
    assert "--position 5" in spec.command()


def test_planted_divergence_from_the_command_line(capsys):
    argv = ["diff", "--backend", "reference", "--arch", "llama", "--num-requests", "2", "--prompt-len", "3-6",
            "--max-new-tokens", "4", "--eps-b", "model.layers.0.input_layernorm=1e-2", "--json"]
    assert main(argv) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["divergence"]["op"] == "model.layers.0.input_layernorm"
    assert report["divergence"]["layer"] == 0 and report["divergence"]["position"] == 0
    # the repro command reproduces the report
    repro = report["command"].split()[1:]
    assert main(repro) == 1 and "FIRST DIVERGENCE: op model.layers.0.input_layernorm" in capsys.readouterr().out
    assert main(["diff", "--backend", "reference", "--num-requests", "2", "--prompt-len", "3-6",
                 "--max-new-tokens", "3"]) == 0


def test_stock_backend_on_one_side_is_caught():
    report = run_diff(DiffSpec(backend="reference", backend_b="torch", **SMALL))
    assert report.comparison.divergence is not None
    assert not report.logprobs.identical


def test_first_divergence_orders_ops_before_positions():
    a, b = OpTrace("a"), OpTrace("b")
    x = torch.zeros(2, 4)
    for trace in (a, b):
        with trace.watch([0, 1], [0, 1], call="call"):
            trace.record_tokens(torch.tensor([5, 6]))
            trace.record("first", x)
            trace.record("second", x if trace is a else x + torch.tensor([[0.0] * 4, [1.0] * 4]))
    b.entries[("first", 1)].value = torch.ones(4)    # op "first" differs at the later position
    d = first_divergence(a, b).divergence
    assert (d.op, d.position, d.differing) == ("first", 1, 4)
    b.tokens[1] = 9                                  # a different input token stops the comparison there
    c = first_divergence(a, b)
    assert c.token_divergence == 1 and c.divergence is None


def test_bad_specs_are_refused():
    with pytest.raises(HalError, match="scenario"):
        DiffSpec(scenario="nope")
    with pytest.raises(HalError, match="--request 5"):
        DiffSpec(request=5)
    with pytest.raises(HalError, match="no RMSNorm of the model matches"):
        run_diff(DiffSpec(backend="reference", eps_b={"model.layers.9.nothing": 1e-3}, **SMALL))


def test_a_diff_that_compared_nothing_is_an_error(capsys):
    from hal.diff import NothingComparedError

    with pytest.raises(NothingComparedError, match=r"compared nothing.*--position 500 is outside"):
        run_diff(DiffSpec(backend="reference", position=500, **SMALL))
    argv = ["diff", "--backend", "reference", "--num-requests", "2", "--prompt-len", "3-6", "--max-new-tokens", "3",
            "--position", "500"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("hal: error: hal diff compared nothing") and len(err.strip().splitlines()) == 1
