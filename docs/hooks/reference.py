"""The generated reference pages of the docs site, as an MkDocs hook (``hooks:`` in mkdocs.yml).

``reference/cli.md`` is rendered from the parser `hopnet` builds (:func:`hopnet.cli.main.build_parser`)
and ``reference/options.md`` from the protocol declarations (:func:`hopnet.registry.specs`), each time
the site is built, so neither can drift from the code. ``reference/environment.md`` is written by hand
around one marker, replaced by the table of the option variables (``HOPNET_<OPTION>``).
tests/test_docs.py imports this module too.
"""

from __future__ import annotations

import argparse
import typing
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from hopnet import registry
from hopnet.bootstrap.env_options import variable_name
from hopnet.cli.main import build_parser
from hopnet.config import run_fields
from hopnet.options import OptionField, iter_unique, value_text

if TYPE_CHECKING:
    from mkdocs.config.defaults import MkDocsConfig
    from mkdocs.structure.files import Files
    from mkdocs.structure.pages import Page

CLI_PAGE = "reference/cli.md"
OPTIONS_PAGE = "reference/options.md"
ENVIRONMENT_PAGE = "reference/environment.md"
OPTION_VARIABLES_MARKER = "<!-- generated: option variables -->"

PROTOCOL_PAGES = {"hop": "hop", "notify-ack": "hop", "allreduce": "allreduce", "eager-sgd": "eager-sgd",
                  "pipe-sgd": "pipe-sgd", "ad-psgd": "ad-psgd", "partial-reduce": "partial-reduce",
                  "prague": "prague", "diloco": "diloco"}
"""The protocols/ page of each built-in protocol (linked where the page exists)."""


# ------------------------------------------------------------------ Markdown helpers
def cell(text: str) -> str:
    """``text`` as one table cell: no line breaks, and nothing outside its code spans (in backticks,
    left as they are) that Markdown or HTML would take as markup."""
    parts = " ".join(text.split()).split("`")
    for i in range(0, len(parts), 2):
        for char, escaped in (("\\", "\\\\"), ("|", "\\|"), ("<", "&lt;"), (">", "&gt;"), ("*", "\\*"),
                              ("[", "\\["), ("]", "\\]")):
            parts[i] = parts[i].replace(char, escaped)
    return "`".join(parts)


def code(text: str) -> str:
    """``text`` as a code span (a pipe in it does not split a table cell)."""
    return f"`{text}`" if text else ""


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines.extend("| " + " | ".join(row) + " |" for row in rows)
    return lines


# ------------------------------------------------------------------ the command line
def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser, str]]:
    """The subcommands of ``parser``: name, parser, and the help line `hopnet --help` shows."""
    found: list[tuple[str, argparse.ArgumentParser, str]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            found.extend((name, sub, helps.get(name, "")) for name, sub in action.choices.items())
    return found


def _flag(action: argparse.Action) -> str:
    if not action.option_strings:
        return action.metavar if isinstance(action.metavar, str) else action.dest.upper()
    if action.nargs == 0:
        return ", ".join(action.option_strings)
    if action.choices is not None and action.metavar is None:
        argument = "{" + ",".join(str(c) for c in action.choices) + "}"
    elif isinstance(action.metavar, str):
        argument = action.metavar
    else:
        argument = action.dest.upper()
    return ", ".join(f"{option} {argument}" for option in action.option_strings)


def _default(action: argparse.Action) -> str:
    """The default argparse fills in, where it says something its help does not (not for switches,
    nor for options left out of the namespace: those say their default in their help)."""
    value = action.default
    if action.nargs == 0 or value is None or value == argparse.SUPPRESS or isinstance(value, (list, tuple)):
        return ""
    if "(default:" in _help(action):
        return ""
    return code(value_text(value))


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    if "%(" in text:
        params: dict[str, Any] = {**vars(action), "prog": ""}
        text = text % params
    return text


def _parser_section(parser: argparse.ArgumentParser, command: str, level: int, summary: str) -> list[str]:
    lines = [f"{'#' * level} `{command}`", ""]
    if summary:
        lines += [summary[0].upper() + summary[1:] + ".", ""]
    lines += ["```text", parser.format_usage().strip(), "```", ""]
    if parser.description:
        lines += [cell(parser.description), ""]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions
                   if a.help != argparse.SUPPRESS and not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]
        if not actions:
            continue
        title = group.title or "arguments"
        lines += [f"{'#' * (level + 1)} {title[0].upper() + title[1:]}", ""]
        if group.description:
            lines += [cell(group.description), ""]
        lines += table(("argument", "meaning", "default"),
                       ((code(_flag(a)), cell(_help(a)), _default(a)) for a in actions))
        lines.append("")
    if parser.epilog:
        lines += ["```text", parser.epilog.strip(), "```", ""]
    for name, sub, sub_help in _subcommands(parser):
        lines += _parser_section(sub, f"{command} {name}", level + 1, sub_help)
    return lines


def cli_markdown(parser: argparse.ArgumentParser | None = None) -> str:
    """The command-line reference: every subcommand of ``parser`` (default: the `hopnet` parser with
    every subcommand built), every argument with its help and default."""
    parser = parser or build_parser()
    lines = ["# Command line", "",
             "Every `hopnet` command and flag, generated from the parser the command builds, each time this "
             "site is built. `hopnet COMMAND --help` prints the same. The protocol flags of `hopnet launch` "
             "and `hopnet simulate` are also listed by protocol, with their variables and keywords, in "
             "[Protocol options](options.md).", "",
             "```text", parser.format_usage().strip(), "```", ""]
    for name, sub, sub_help in _subcommands(parser):
        lines += _parser_section(sub, f"hopnet {name}", 2, sub_help)
    return "\n".join(lines)


# ------------------------------------------------------------------ protocol options
def type_text(kind: Any) -> str:
    """An option's type as it reads in Python (``int``, ``float | None``, ``list[str]``)."""
    if isinstance(kind, type) and not typing.get_args(kind):
        return kind.__name__
    return str(kind).replace("typing.", "").replace("NoneType", "None")


def _meaning(f: OptionField) -> str:
    text = f.info.help
    if f.info.choices:
        text += f" (one of {', '.join(f.info.choices)})"
    elif f.info.minimum is not None:
        text += f" (at least {f.info.minimum:g})"
    return text


def _option_default(f: OptionField) -> str:
    if f.info.repeated:
        return "none"
    return code(value_text(f.default)) if f.default is not None else "none"


def _option_rows(fields: Iterable[OptionField]) -> list[tuple[str, ...]]:
    return [(code(f.name), code(f.flag), code(variable_name(f.name)), code(type_text(f.kind)),
             _option_default(f), cell(_meaning(f))) for f in fields]


OPTION_HEADER = ("keyword", "flag", "variable", "type", "default", "meaning")


def options_markdown(protocol_pages: Iterable[str] = ()) -> str:
    """The protocol options reference: the settings every run takes, then each protocol's own.
    ``protocol_pages``: the pages of the site (``protocols/hop.md``...) a protocol's section links to."""
    pages = set(protocol_pages)
    lines = ["# Protocol options", "",
             "Each protocol declares its options once; this page is generated from those declarations "
             "each time the site is built. Every option can be given three ways: as a flag of "
             "`hopnet launch` (and `hopnet simulate`), as a keyword of `hopnet.init(model, ...)` "
             "(for the options not given on the command line), or as a `HOPNET_<OPTION>` variable "
             "for workers started by torchrun or srun (a switch takes `1`/`0`, a repeatable option "
             "comma-separated items, an optional one `none`). A protocol refuses another protocol's "
             "options in one line naming both. See [Environment variables](environment.md) for the "
             "other variables.", "",
             "## Every protocol", "",
             "The run-wide settings, taken by every protocol.", ""]
    lines += table(OPTION_HEADER, _option_rows(run_fields()))
    lines.append("")
    for spec in registry.specs():
        lines += [f"## `{spec.name}`", "", cell(spec.summary[0].upper() + spec.summary[1:]).rstrip(".") + ".", ""]
        page = f"protocols/{PROTOCOL_PAGES.get(spec.name, spec.name)}.md"
        if page in pages:
            lines += [f"How it works and when to use it: [{spec.name}](../{page}).", ""]
        fields = spec.option_fields()
        if fields:
            lines += table(OPTION_HEADER, _option_rows(fields))
        else:
            lines.append("It takes no options of its own.")
        lines.append("")
    return "\n".join(lines)


def option_variables() -> list[tuple[str, OptionField, list[str]]]:
    """Each option's variable once: the variable, its declaration, and the protocols that take it
    (none for a run-wide setting)."""
    run_names = {f.name for f in run_fields()}
    every = [*run_fields(), *registry.protocol_option_fields()]
    return [(variable_name(f.name), f, [] if f.name in run_names else registry.owners(f.name))
            for f in iter_unique(every)]


def option_variables_markdown() -> str:
    rows = [(code(variable), code(f.flag), code(f.name), ", ".join(owners) if owners else "every protocol",
             cell(f.info.help)) for variable, f, owners in option_variables()]
    return "\n".join(table(("variable", "flag", "keyword", "protocols", "meaning"), rows))


def environment_markdown(page_text: str) -> str:
    """The environment page: the hand-written ``page_text`` with the option variables' table at its marker."""
    if OPTION_VARIABLES_MARKER not in page_text:
        raise ValueError(f"{ENVIRONMENT_PAGE} lacks the marker {OPTION_VARIABLES_MARKER!r}")
    return page_text.replace(OPTION_VARIABLES_MARKER, option_variables_markdown())


# ------------------------------------------------------------------ MkDocs events
def on_files(files: Files, config: MkDocsConfig) -> Files:
    from mkdocs.structure.files import File

    protocol_pages = [f.src_uri for f in files if f.src_uri.startswith("protocols/")]
    for uri, content in ((CLI_PAGE, cli_markdown()), (OPTIONS_PAGE, options_markdown(protocol_pages))):
        files.append(File.generated(config, uri, content=content))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    if page.file.src_uri == ENVIRONMENT_PAGE:
        return environment_markdown(markdown)
    return markdown
