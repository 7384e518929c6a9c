"""One line for a broken command line or ``--config-dir``: what and where, never Hydra's traceback.

Hydra prints 80 to 100 lines of traceback when a YAML file of a ``--config-dir`` does not parse,
or when an interpolation in it names a key or an environment variable that does not exist. Both
are a user's typo in a file, so both are reported as ``<file>: <problem>``:

- YAML: the files of the ``--config-dir`` that the command line selects (``sweeps=mine``,
  ``--config-name``) are parsed before Hydra starts: Hydra reads them deep inside its composition,
  where the error cannot be caught. A broken file that no command selects is left alone.
- Interpolations resolve when the sweeper plans its cells; the error names the config key, and
  the file of the ``--config-dir`` that sets that key to an interpolation, where one does.
- Overrides are parsed before Hydra starts: one that Hydra's grammar cannot read (an unquoted
  non-ASCII letter, a stray bracket) and a config-group choice too long to be a file name are
  named in one line, with the quoting that fixes the first; so is an argument that is not text
  in the locale's encoding (a non-ASCII value with Python's UTF-8 mode off in a C locale).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import yaml

#: Hydra's flags that take the next argument as their value (``-sc install=bash`` is not an override).
FLAGS_WITH_VALUES = {"-c", "--cfg", "-p", "--package", "-cp", "--config-path", "-cn", "--config-name", "-cd",
                     "--config-dir", "--experimental-rerun", "-sc", "--shell-completion"}
#: The longest config-group choice: ``<choice>.yaml`` must fit in a file name (255 bytes).
MAX_CHOICE_BYTES = 250


def command_line_overrides(argv: Sequence[str]) -> list[str]:
    """The arguments of a Hydra command line that are overrides (``key=value``, ``~key``)."""
    overrides = []
    for index, arg in enumerate(argv):
        follows_flag = index > 0 and argv[index - 1] in FLAGS_WITH_VALUES
        if not arg.startswith("-") and not follows_flag:
            overrides.append(arg)
    return overrides


def undecodable_argument(argv: Sequence[str]) -> str | None:
    """``<argument>: ...`` for the first argument that is not text in this locale's encoding, or None.

    Python keeps such bytes as surrogates (PEP 383): a path made of them would open, but the
    config files, the run store and W&B write text, and would fail midway on them.
    """
    for arg in argv:
        if any("\udc80" <= char <= "\udcff" for char in arg):
            shown = os.fsencode(arg).decode("ascii", "backslashreplace")
            return (f"{shown}: bytes that are not text in this locale's encoding ({sys.getfilesystemencoding()}); "
                    "run ablate with a UTF-8 locale (LC_ALL=C.UTF-8) or Python's UTF-8 mode (PYTHONUTF8=1)")
    return None


def override_problem(argv: Sequence[str]) -> str | None:
    """``<override>: ...`` for the first override Hydra would refuse to read, or None."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    for text in command_line_overrides(argv):
        try:
            (override,) = parser.parse_overrides([text])
        except OverrideParseException as error:
            reason = str(error.message).splitlines()[0].split(":")[0]
            key, _, value = text.partition("=")
            fix = f" (quote the value: {key}='{value}')" if value and not value.startswith(("'", '"')) else ""
            return f"{text}: Hydra cannot read this override ({reason}){fix}"
        value = override.value()
        if "." not in override.key_or_group and isinstance(value, str) and len(value.encode()) > MAX_CHOICE_BYTES:
            return (f"{override.key_or_group}={value[:40]}... ({len(value.encode())} bytes): expected a name of at "
                    f"most {MAX_CHOICE_BYTES} bytes (it names a config file)")
    return None


def config_dir(argv: Sequence[str]) -> Path | None:
    """The ``--config-dir`` (or ``-cd``) of a Hydra command line, or ``None``."""
    for index, arg in enumerate(argv):
        if arg in ("--config-dir", "-cd") and index + 1 < len(argv):
            return Path(argv[index + 1])
        if arg.startswith("--config-dir="):
            return Path(arg.split("=", 1)[1])
    return None


def selected_files(directory: Path, argv: Sequence[str]) -> list[Path]:
    """The YAML files of ``directory`` that ``argv`` selects: ``group=a,b`` and ``--config-name``."""
    names: list[str] = []
    for index, arg in enumerate(argv):
        if arg in ("--config-name", "-cn") and index + 1 < len(argv):
            names.append(argv[index + 1])
        elif arg.startswith("--config-name="):
            names.append(arg.split("=", 1)[1])
        elif not arg.startswith("-") and "=" in arg:
            group, _, value = arg.lstrip("+~").partition("=")
            if re.fullmatch(r"[\w/-]+", group):
                names += [f"{group}/{choice.strip()}" for choice in value.split(",") if choice.strip()]
    return [path for name in names for path in (directory / f"{name}.yaml", directory / f"{name}.yml") if path.is_file()]


def yaml_problem(directory: Path, argv: Sequence[str]) -> str | None:
    """``<file>: not valid YAML (...)`` for the first selected file of ``directory`` that does not parse."""
    for path in selected_files(directory, argv):
        try:
            yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(error, "problem", None) or " ".join(str(error).split())
            return f"{path}: not valid YAML{at}: {problem}"
        except (OSError, UnicodeDecodeError) as error:
            return f"{path}: cannot be read ({error})"
    return None


def interpolation_problem(error: Any, directories: Sequence[Path]) -> str:
    """One line for an OmegaConf interpolation error: the key, what failed and, when known, the file."""
    key = getattr(error, "full_key", None) or "?"
    # OmegaConf appends "full_key: ... object_type=..." to its message; the key is shown apart.
    message = " ".join(str(getattr(error, "msg", error)).split()).split(" full_key: ")[0]
    files = _files_setting(str(key).rsplit(".", 1)[-1], directories)
    where = f"{files[0]}: " if len(files) == 1 else ""
    return f"{where}{key}: {message} (an interpolation that cannot be resolved)"


def exit_with_interpolation_problem(error: Any, config: Any) -> NoReturn:
    """End the command with :func:`interpolation_problem`'s line (exit 2), searching the config
    files of the command (``hydra.runtime.config_sources``) for the setting."""
    directories = [Path(source.path) for source in config.hydra.runtime.config_sources if source.schema == "file"]
    print(f"ablate: {interpolation_problem(error, directories)}", file=sys.stderr, flush=True)
    raise SystemExit(2) from None


def _files_setting(leaf: str, directories: Sequence[Path]) -> list[Path]:
    """YAML files under ``directories`` with a line ``<leaf>: ...${...}``."""
    pattern = re.compile(rf"^\s*{re.escape(leaf)}\s*:.*\$\{{", re.MULTILINE)
    return [path for directory in directories if directory.is_dir()
            for path in sorted(directory.rglob("*.y*ml")) if pattern.search(path.read_text(errors="replace"))]
