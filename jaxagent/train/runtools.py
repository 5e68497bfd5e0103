"""Run tooling: a training run's directory read back, its checkpoint restored, its policy exported.

`run_config(run_dir)` reads `<run_dir>/config.yaml` (the config the run was trained
with, `run_dir` set to where the run is now); `restore_run(config, step)` builds the run
and restores a checkpoint (the newest readable, or `step`), reading the run directory
only; `export_run(run_dir, out_dir)` is `jaxagent export`: the policy as a Hugging Face
directory (`checkpoint.export_policy`), with a note when `transformers.AutoTokenizer`
would split text differently from the run (`autotokenizer_agrees`). `jaxagent eval`
(`jaxagent.train.evaluate.evaluate_run`) restores a run with these.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def run_config(run_dir: str | Path, overrides=()):
    """A run directory's `config.yaml` (with `run_dir` set to where the run is now). A
    damaged file (`rundir.read_config`) is a `RunFileError`, and a value the config cannot
    hold a `ConfigError`, each naming the file; a bad override is a `ConfigError` of its own."""
    from jaxagent.dataclass_yaml import ConfigError, load_config
    from jaxagent.train.config import TrainerConfig
    from jaxagent.train.rundir import read_config

    run_dir = Path(run_dir)
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a training run directory: {config_path} is missing")
    read_config(config_path)
    try:
        load_config(TrainerConfig, config_path, [f"run_dir={run_dir}"], saved=True)  # the file alone
    except ConfigError as err:
        raise ConfigError(f"{config_path}: {err}") from None
    return load_config(TrainerConfig, config_path, [f"run_dir={run_dir}", *overrides], saved=True)


def restore_run(config, step: int | None = None, log=print):
    """`(run, state, progress)`: the run of `config` built and its checkpoint (the newest
    readable, or `step`) restored, reading the run directory only."""
    from jaxagent.train import build
    from jaxagent.train.rundir import RunDir, check_tokenizer_files

    rundir = RunDir(config.run_dir, primary=False)  # reads only
    if config.model.tokenizer == "bpe":  # the run's own, read back from its directory
        check_tokenizer_files(rundir.tokenizer_dir)
    run = build.build_run(config, resume=True, log=log)
    with rundir.checkpoints(config.keep_checkpoints) as ckpt:
        state, progress, _ = rundir.restore(ckpt, run.state, config, step, log=log)
    return run, state, progress


def export_run(
    run_dir: str | Path, out_dir: str | Path, *, step: int | None = None, overwrite: bool = False, log=print
) -> Path:
    """`jaxagent export`: a run's policy (checkpoint `step`, default the newest) as a
    Hugging Face directory that transformers loads: config, safetensors (LoRA merged),
    the run's tokenizer and chat template, and a generation config whose EOS ends a turn."""
    from jaxagent.train.rundir.checkpoint import export_policy

    config = run_config(run_dir)
    run, state, progress = restore_run(config, step, log=log)
    path = export_policy(state, out_dir, tokenizer=run.tokenizer, overwrite=overwrite)
    log(f"exported {Path(run_dir) / 'checkpoints' / str(progress.iteration)} to {path}")
    if run.tokenizer is not None and not autotokenizer_agrees(path, run.tokenizer):
        log(
            f"note: transformers.AutoTokenizer loads {path} as a {state.model_config.model_type} tokenizer "
            "class that replaces this tokenizer's pre-tokenizer, and splits text differently from the run; "
            f"load it as jaxagent.models.load_tokenizer({str(path)!r}) or "
            f"transformers.PreTrainedTokenizerFast.from_pretrained({str(path)!r}), which read tokenizer.json as "
            "trained (jaxagent train model.path= does)"
        )
    return path


#: text that crosses word, line and role boundaries, for `autotokenizer_agrees`
_PROBE = [
    {"role": "system", "content": "You are a careful assistant.\nAnswer briefly."},
    {"role": "user", "content": "Hello! I've been sleeping badly since March 3rd, 2024 (about 5 hours)."},
    {"role": "assistant", "content": "Thanks for telling me. What do you do when you can't sleep?"},
]


def autotokenizer_agrees(path, tokenizer) -> bool:
    """Whether `transformers.AutoTokenizer` on an exported directory gives the run's token
    ids for a probe conversation (its chat template and its text)."""
    import transformers

    auto = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    text = tokenizer.apply_chat_template(_PROBE, tokenize=False)
    return auto.encode(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False)


def load_policy(source: str, step: int | None = None, log=print) -> tuple[Any, Any, Any, str]:
    """`(params, model_config, tokenizer, model_id)` of a run directory (its checkpoint
    `step`, default the newest), a Hugging Face directory, a `.gguf` file or a packaged
    model name."""
    path = Path(source)
    if (path / "config.yaml").is_file():
        run, state, progress = restore_run(run_config(path), step, log=log)
        params = run.placement.sampler_params(state)
        return params, run.model_config, run.tokenizer, f"{path.name}@{progress.iteration}"
    if step is not None:
        raise ValueError(f"--step is for a run directory; {source} is not one (it has no config.yaml)")
    from jaxagent.models import load_pretrained, load_tokenizer

    model = load_pretrained(source)
    return model.params, model.config, load_tokenizer(source), path.name or str(source)
