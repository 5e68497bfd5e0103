"""Imports point inward: `jaxagent.algos` imports nothing else of the package, and
`jaxagent.parallel` (meshes, rules, hosts) knows nothing of training."""

import json
import subprocess
import sys

import pytest


def loaded_after_import(module: str) -> list[str]:
    code = (
        f"import sys, json; import {module}; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('jaxagent', 'envs'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "module, allowed",
    [
        ("jaxagent.algos", ("jaxagent", "jaxagent.algos")),
        ("jaxagent.parallel", ("jaxagent", "jaxagent.algos", "jaxagent.models", "jaxagent.parallel")),
        ("jaxagent.models", ("jaxagent", "jaxagent.models")),
    ],
)
def test_a_layer_imports_only_the_layers_below_it(module, allowed):
    loaded = loaded_after_import(module)
    assert module in loaded
    # "jaxagent" allows the package itself, not its subpackages (else every module would pass)
    outside = [m for m in loaded if not any(m == a or (a != "jaxagent" and m.startswith(a + ".")) for a in allowed)]
    assert outside == [], f"importing {module} loaded {outside}"


def test_the_failure_kinds_load_nothing_else():
    """`jaxagent.failures` (the worker pools' failure kinds) is imported by `envs` and by
    the gateway's `program` at module level: it loads nothing but itself and the package."""
    assert loaded_after_import("jaxagent.failures") == ["jaxagent", "jaxagent.failures"]


def test_tokenizers_and_their_training_stay_in_the_models_layer():
    """Building the in-memory ChatML tokenizer and training a BPE one
    (`jaxagent.models.byte_tokenizer`, `jaxagent.models.tokenizer_training`) load nothing
    above `jaxagent.models`, also with the imports they make when they run."""
    code = (
        "import sys, json; from jaxagent.models import byte_chat_tokenizer, train_bpe_tokenizer; "
        "byte_chat_tokenizer(); train_bpe_tokenizer(['a b c', 'b c d'] * 4, 300); "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('jaxagent', 'envs'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert [m for m in loaded if m != "jaxagent" and not m.startswith("jaxagent.models")] == []


def test_the_rollout_knows_neither_the_envs_nor_the_trainer():
    """The agent loop drives any pool through its interface (an env's hooks reach it in
    the step's info, e.g. `envs.Env.cut_outcome`): `jaxagent.rollout` imports no `envs`."""
    loaded = loaded_after_import("jaxagent.rollout")
    assert "jaxagent.rollout.agent_loop" in loaded
    outside = [m for m in loaded if m.split(".")[0] == "envs" or m.startswith("jaxagent.train")]
    assert outside == [], f"importing jaxagent.rollout loaded {outside}"


def test_the_gateway_knows_neither_the_envs_nor_the_trainer():
    """The gateway serves a sampler and hands the trainer episodes: the trainer imports it
    (`jaxagent.train.build`), never the other way round, and it plays no env."""
    mods = "jaxagent.gateway.loop, jaxagent.gateway.serve, jaxagent.gateway.server, jaxagent.gateway.demonstrations"
    loaded = loaded_after_import(mods)
    outside = [m for m in loaded if m.split(".")[0] == "envs" or m.startswith("jaxagent.train")]
    assert "jaxagent.gateway.loop" in loaded and outside == [], f"importing the gateway loaded {outside}"
