"""MkDocs hook: the reference pages generated from the code at build time, so they
cannot drift from it.

- ``reference/config.md``: the marker ``<!-- jaxagent:config-keys -->`` becomes one table
  a config section, every key `jaxagent config` prints (`jaxagent.dataclass_yaml.config_keys` of
  the default `TrainerConfig`) with its type, default and documentation.
- ``reference/cli.md``: ``<!-- jaxagent:cli -->`` becomes ``jaxagent --help`` and each
  command's ``--help`` (`jaxagent.cli.build_parser`).
"""

from __future__ import annotations

import argparse
import dataclasses
import html
import inspect
import os
import re

CONFIG_MARKER = "<!-- jaxagent:config-keys -->"
CLI_MARKER = "<!-- jaxagent:cli -->"


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ").strip()


def _code(text: str) -> str:
    """Inline code inside a table cell: HTML, so that a `|` in it (a type union) is
    neither a column break nor shown escaped."""
    return "<code>" + html.escape(text.replace("\n", " ").strip()).replace("|", "&#124;") + "</code>"


def _type(text: str) -> str:
    """A type as the reader needs it: `OptimizerConfig | None`, not its module path."""
    return re.sub(r"\b(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*)", r"\1", text)


def _summary(cls) -> str:
    """The first paragraph of a config section's docstring."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    return doc.split("\n\n")[0].replace("\n", " ").strip()


def config_markdown() -> str:
    from jaxagent.dataclass_yaml import config_keys
    from jaxagent.train.config import TrainerConfig

    config = TrainerConfig()
    keys = config_keys(config)
    sections = [f.name for f in dataclasses.fields(config) if dataclasses.is_dataclass(getattr(config, f.name))]
    top = [k for k in keys if "." not in k.key]
    out = [f"{len(keys)} keys in {len(sections)} sections and {len(top)} top-level keys.", ""]

    def table(rows) -> None:
        out.extend(["| key | type | default | what it does |", "|---|---|---|---|"])
        for k in rows:
            out.append(f"| {_code(k.key)} | {_code(_type(k.type))} | {_code(k.value)} | {_cell(k.text or k.doc)} |")
        out.append("")

    out += ["## Top level", "", _summary(TrainerConfig), ""]
    table(top)
    for name in sections:
        section = getattr(config, name)
        out += [f"## `{name}`", "", f"`{type(section).__name__}`: {_summary(type(section))}", ""]
        table([k for k in keys if k.key.startswith(name + ".")])
    return "\n".join(out)


def cli_markdown() -> str:
    from jaxagent.cli import build_parser

    os.environ.setdefault("COLUMNS", "100")  # argparse wraps help to the terminal's width
    parser = build_parser()
    out = ["## `jaxagent`", "", "```text", parser.format_help().rstrip(), "```", ""]
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in subs.choices.items():
        out += [f"## `jaxagent {name}`", "", "```text", command.format_help().rstrip(), "```", ""]
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if CONFIG_MARKER in markdown:
        markdown = markdown.replace(CONFIG_MARKER, config_markdown())
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_markdown())
    return markdown
