import re
import subprocess
import sys


def test_train_help_names_the_embedded_default():
    out = subprocess.run(
        [sys.executable, "-m", "jaxagent", "train", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "--config" in out.stdout and "--resume" in out.stdout
    assert "examples:" in out.stdout and "jaxagent train --resume" in out.stdout
    top = subprocess.run([sys.executable, "-m", "jaxagent", "--help"], capture_output=True, text=True, timeout=120)
    assert "configs/default.yaml" in top.stdout


def test_help_lists_the_commands_one_line_each():
    top = subprocess.run([sys.executable, "-m", "jaxagent", "--help"], capture_output=True, text=True, timeout=120)
    assert top.returncode == 0, top.stderr
    assert top.stdout.startswith("usage: jaxagent [-h] COMMAND ...")
    assert "``" not in top.stdout and len(top.stdout.splitlines()) < 25
    listed = dict(re.findall(r"^    (\w+) +(\S.*)$", top.stdout, flags=re.M))
    assert not re.search(r"^ {6,}\S", top.stdout, flags=re.M), "a command's line is wrapped"
    assert set(listed) == {"train", "config", "envs", "serve", "eval", "export", "plot", "view", "bench"}
    for name in listed:
        sub = subprocess.run(
            [sys.executable, "-m", "jaxagent", name, "--help"], capture_output=True, text=True, timeout=120
        )
        assert sub.returncode == 0 and sub.stdout.startswith(f"usage: jaxagent {name}"), sub.stderr
        assert f"\nexamples:\n  jaxagent {name}" in sub.stdout


def test_unknown_command_is_an_error():
    out = subprocess.run([sys.executable, "-m", "jaxagent", "nonsense"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "invalid choice" in out.stderr


def test_envs_lists_the_builtins_and_adapter_families():
    out = subprocess.run([sys.executable, "-m", "jaxagent", "envs"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    names = out.stdout.split()
    for name in ("frozenlake", "sokoban", "countdown", "toolmath", "intake", "gymnasium/<...>"):
        assert name in names
    assert not any(n.startswith("testing/") for n in names)


def test_config_lists_every_key_with_its_value_and_type():
    import dataclasses
    from pathlib import Path

    from jaxagent.train.config import TrainerConfig

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxagent",
            "config",
            "--config",
            str(root / "configs" / "default.yaml"),
            "algo.gamma=0.5",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
    )
    assert out.returncode == 0, out.stderr
    shown = {line.split(" = ")[0]: line for line in out.stdout.splitlines()}

    def leaves(cls, prefix=""):  # the dotted keys of the schema, walked independently of the CLI
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else None
            if dataclasses.is_dataclass(default):
                yield from leaves(type(default), prefix + f.name + ".")
            else:
                yield prefix + f.name

    assert set(shown) == set(leaves(TrainerConfig))
    assert shown["algo.gamma"].startswith("algo.gamma = 0.5  # float: ")
    assert shown["env.name"].startswith("env.name = frozenlake  # str")
    bad = subprocess.run(
        [sys.executable, "-m", "jaxagent", "config", "algo.nope=1"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
    )
    assert bad.returncode == 2 and "algo.nope" in bad.stderr
