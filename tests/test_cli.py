import subprocess
import sys


def test_train_help_names_the_embedded_default():
    out = subprocess.run([sys.executable, "-m", "jaxagent", "train", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--config" in out.stdout and "--resume" in out.stdout
    top = subprocess.run([sys.executable, "-m", "jaxagent", "--help"], capture_output=True, text=True, timeout=120)
    assert "configs/default.yaml" in top.stdout


def test_unknown_command_is_an_error():
    out = subprocess.run([sys.executable, "-m", "jaxagent", "nonsense"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0
    assert "invalid choice" in out.stderr


def test_envs_lists_the_builtins_and_adapter_families():
    out = subprocess.run([sys.executable, "-m", "jaxagent", "envs"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    names = out.stdout.split()
    for name in ("frozenlake", "sokoban", "countdown", "toolmath", "intake", "gymnasium/<...>"):
        assert name in names
    assert not any(n.startswith("testing/") for n in names)
