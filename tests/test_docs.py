"""The documentation against the code: README's settings reference is the models' own rendering, its TOML example
is a valid config whose values marked as defaults are the defaults, and every `warmgate` argument has help text."""

from __future__ import annotations

import argparse
import re
import tomllib
from pathlib import Path
from typing import Any

from app.cli import build_parser
from app.config import Settings, load_settings
from app.settings_reference import BEGIN, END, block_in, render

README = Path(__file__).resolve().parent.parent / "README.md"
HIDDEN_COMMANDS = ("relay", "fork-server", "supervisor")  # started by `warmgate serve`, not by people: not in the help


def test_the_readme_settings_reference_is_rendered_from_the_models() -> None:
    text = README.read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1
    assert block_in(text) == render(), (
        "README.md's settings reference differs from the models (app/config.py, common/settings.py): "
        "run `python -m app.settings_reference --write README.md`"
    )


def test_the_readme_toml_example_is_valid_and_its_defaults_are_the_defaults(tmp_path: Path) -> None:
    text = README.read_text()
    example = re.search(r"```toml\n(.*?)```", text, re.S)
    assert example is not None, "README.md has no TOML example"
    config = tmp_path / "warmgate.toml"
    config.write_text(example.group(1))
    load_settings(config)  # every key known, every value valid
    defaults = Settings().model_dump()
    section: dict[str, Any] = defaults
    marked = 0
    for line in example.group(1).splitlines():
        if line.startswith("["):
            section = defaults[line.split("]")[0].strip("[")]
            continue
        if "=" not in line:
            continue
        setting, _, rest = line.partition("=")
        value, _, comment = rest.partition("#")
        assert "the default" in comment or "an example" in comment, f"not marked as the default or an example: {line}"
        if "the default" in comment:
            marked += 1
            shown = tomllib.loads(f"x = {value.strip()}")["x"]
            assert shown == section[setting.strip()], f"{line}: the default is {section[setting.strip()]!r}"
    assert marked > 0


def _commands(parser: argparse.ArgumentParser, prefix: str = "warmgate") -> list[tuple[str, argparse.ArgumentParser]]:
    """Every (sub)command's parser under ``parser``, hidden ones left out."""
    found = [(prefix, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helped = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                if name in HIDDEN_COMMANDS:
                    continue
                assert helped.get(name), f"`{prefix} {name}` has no help text"
                found += _commands(sub, f"{prefix} {name}")
    return found


def test_every_command_line_argument_has_help_text() -> None:
    commands = _commands(build_parser())
    assert {"warmgate serve", "warmgate status", "warmgate model demo"} <= {name for name, _ in commands}
    missing = [
        f"{name} {'/'.join(action.option_strings) or action.dest}"
        for name, parser in commands
        for action in parser._actions
        if not isinstance(action, argparse._SubParsersAction | argparse._HelpAction)
        and (not action.help or action.help == argparse.SUPPRESS)
    ]
    assert not missing, f"arguments without help text: {missing}"


def test_the_top_level_help_lists_the_commands_people_run_and_nothing_else() -> None:
    shown = build_parser().format_help()
    listed = set(re.findall(r"^    (\S+)", shown.split("positional arguments:")[1].split("options:")[0], re.MULTILINE))
    assert "SUPPRESS" not in shown
    assert not listed & set(HIDDEN_COMMANDS), listed
    assert {"serve", "status", "restart", "stop"} <= listed, listed
