"""Write docs/configuration.md from `specpd`'s own argument parser: every flag of `specpd serve`,
`specpd generate` and `specpd train-draft`, by group, with its choices and help text as `--help` prints them.

    python docs/gen_configuration.py           # rewrite docs/configuration.md
    python docs/gen_configuration.py --check   # exit 1 when the page is not what the parser says (a test runs it)
"""
from __future__ import annotations

import argparse
import os
import sys

DOCS = os.path.dirname(os.path.abspath(__file__))
PAGE = os.path.join(DOCS, "configuration.md")
INTRO = """# Configuration

Every flag of the `specpd` command, generated from its argument parser by `python docs/gen_configuration.py`
(a test fails when this page and the parser disagree). Defaults are chosen from the machine where the help
says so (threads, dtype, the tree shape): `/server_info` and the start-up log show what a server chose, and an
explicit flag always wins. How the flags fit together: [speculative-decoding.md](speculative-decoding.md),
[disaggregation.md](disaggregation.md), [prefix-caching.md](prefix-caching.md),
[structured-outputs.md](structured-outputs.md), [draft-training.md](draft-training.md).
"""


def _flag(action: argparse.Action) -> str:
    names = ", ".join(f"`{s}`" for s in action.option_strings)
    if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        return names
    if action.choices:
        return f"{names} {{{', '.join(str(c) for c in action.choices)}}}"
    return f"{names} {action.metavar or action.dest.upper()}"


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    text = parser._get_formatter()._expand_help(action) if action.help else ""
    if action.required:
        text = f"required. {text}"
    elif "default" not in text and action.default not in (None, False, argparse.SUPPRESS) \
            and not isinstance(action, argparse.BooleanOptionalAction):
        text = f"{text} (default: {action.default})".strip()
    return " ".join(text.split()).replace("|", "\\|")


def _groups(parser: argparse.ArgumentParser) -> list[tuple[str, list[argparse.Action]]]:
    out = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.help != argparse.SUPPRESS
                   and "-h" not in a.option_strings]
        if actions:
            out.append((group.title, actions))
    return out


def _subcommands() -> argparse._SubParsersAction:
    """`specpd`'s subcommands (serve, generate, train-draft) as its parser holds them."""
    from specpd.server.cli import build_parser
    return next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))


def render() -> str:
    sub = _subcommands()
    helps = {c.dest: c.help for c in sub._choices_actions}
    lines = [INTRO]
    for name, command in sub.choices.items():
        lines += [f"## specpd {name}", "", f"{helps.get(name, '')[:1].upper()}{helps.get(name, '')[1:]}.", ""]
        for title, actions in _groups(command):
            if title == "engine" and name != "serve":
                lines += ["and every flag of `specpd serve`'s engine group above.", ""]
                continue
            lines += [f"### {'general' if title == 'options' else title}", "", "| flag | what it does |", "|---|---|"]
            lines += [f"| {_flag(a)} | {_help(command, a)} |" for a in actions]
            lines.append("")
    return "\n".join(lines)


def flags() -> set[str]:
    """Every option string any `specpd` subcommand takes."""
    return {s for command in _subcommands().choices.values() for a in command._actions for s in a.option_strings}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    page = render()
    if args.check:
        with open(PAGE) as f:
            if f.read() != page:
                print("docs/configuration.md is stale: run python docs/gen_configuration.py", file=sys.stderr)
                return 1
        return 0
    with open(PAGE, "w") as f:
        f.write(page)
    print(f"wrote {os.path.relpath(PAGE)} ({page.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
