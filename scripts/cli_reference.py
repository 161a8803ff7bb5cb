#!/usr/bin/env python3
"""Writes docs/reference/cli.md: every ``psframe`` command and flag group of ``psframe.flags``, from their parsers.

Usage: python scripts/cli_reference.py [--check]

The page is made from the parsers themselves (``psframe.cli.build_parser`` and
the ``add_*_flags`` functions scripts call), so it cannot go stale:
tests/unit/test_docs.py fails when docs/reference/cli.md differs from what this
script writes. With ``--check`` the script only compares, and exits 1 on a
difference.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "reference" / "cli.md"

HEADER = """# Command line

Every `psframe` command, and the flags `psframe.flags` gives a training script.
Written by `scripts/cli_reference.py` from the parsers themselves (a test fails
when this page differs), so what you read here is what `--help` says.
"""

# The flag groups of psframe.flags a script adds to its own parser, in the order a script adds them.
FLAG_GROUPS = (
    ("add_cluster_flags", "The cluster and this process's task"),
    ("add_security_flags", "Security: an auth token and TLS"),
    ("add_liveness_flags", "Liveness: how fast a lost peer is noticed"),
    ("add_sync_flags", "Synchronous training"),
)


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    if "%(" in text:
        text = text % {**vars(action), "prog": ""}
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        text += f" (one of: {', '.join(str(c) for c in action.choices)})"
    return text


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "off" if action.default is False else "on"
    if action.default is None or action.default == argparse.SUPPRESS:
        return ""
    return f"`{action.default}`"


def flags_table(parser: argparse.ArgumentParser) -> str:
    """A Markdown table of ``parser``'s flags and arguments (without ``--help``)."""
    rows = ["| flag | default | what it does |", "|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        names = ", ".join(f"`{name}`" for name in action.option_strings) or f"`{action.dest}` (positional)"
        rows.append(f"| {names} | {_cell(_default(action))} | {_cell(_help(action))} |")
    return "\n".join(rows)


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(parser.prog, width=100)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


def render() -> str:
    """The page: each command's usage and flags, then each flag group of ``psframe.flags``."""
    sys.path.insert(0, str(ROOT))
    from psframe import cli, flags

    parser = cli.build_parser()
    parts = [HEADER, "## psframe", "", parser.description or "", ""]
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {choice.dest: choice.help for choice in commands._choices_actions}
    for name, command in commands.choices.items():
        summary = (helps.get(name) or "").strip()
        parts += [f"### psframe {name}", "", summary[:1].upper() + summary[1:] + ".", ""]
        if command.description:
            parts += [command.description, ""]
        parts += ["```", _usage(command), "```", "", flags_table(command), ""]
    parts += ["## Flags for training scripts (`psframe.flags`)", ""]
    parts += [
        "A script adds these groups to its own `argparse` parser and reads them back as objects "
        "(`cluster_from_flags`, `security_from_flags`, `liveness_from_flags`, `sync_from_flags`); "
        "the examples do.",
        "",
    ]
    for function, title in FLAG_GROUPS:
        group = argparse.ArgumentParser(prog="script.py", add_help=False)
        getattr(flags, function)(group)
        parts += [f"### {title}", "", f"`psframe.flags.{function}(parser)`:", "", flags_table(group), ""]
    return "\n".join(parts).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="compare with docs/reference/cli.md; exit 1 on a difference"
    )
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != page:
            print(f"{OUTPUT.relative_to(ROOT)} is stale: run python scripts/cli_reference.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(page)
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
