"""Output every locale can print: the commands' lines never fail for a character.

With Python's UTF-8 mode off in a locale that is not UTF-8 (``LC_ALL=C PYTHONUTF8=0``), the
console streams encode ASCII only, and a message that names a non-ASCII value (a path, a tag)
would end the command in a ``UnicodeEncodeError`` instead of the message. The commands call
:func:`printable_output` first: a character the console cannot encode is written as its escape
(``\\xe9``), as Python already does on stderr.
"""

from __future__ import annotations

import sys


def printable_output() -> None:
    """Let stdout and stderr write what their encoding lacks as backslash escapes."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)  # a replaced stream (a test's capture) may lack it
        if reconfigure is not None:
            reconfigure(errors="backslashreplace")
