"""Tables on stdout that keep every name whole where nobody reads them at a terminal.

Without a terminal rich lays everything out in 80 columns (or $COLUMNS): a table wider
than that loses its last columns and squeezes names to `opti…`, and a name cut short in
a CI log or a file cannot be searched for or pasted into a configuration. So outside a
terminal a table is printed as wide as its content needs; at a terminal it fits the
terminal, as before.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console, RenderableType
from rich.measure import Measurement

# The widest a table is laid out outside a terminal: past it a long name column folds
# onto more lines (never cut), rather than making lines no log viewer shows whole.
MAX_PIPE_WIDTH = 1000


def at_terminal(console: Console) -> bool:
    """Whether the console writes to a terminal (FORCE_COLOR, as CI sets it, is no
    terminal: its width is still a guess)."""
    isatty = getattr(console.file, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed file
        return False


def print_whole(renderable: RenderableType, **console_options: Any) -> None:
    """Print to stdout at the terminal's width, or elsewhere at the natural width of
    `renderable` when it is wider than the console's."""
    console = Console(**console_options)
    if not at_terminal(console):
        options = console.options.update_width(MAX_PIPE_WIDTH)
        natural = Measurement.get(console, options, renderable).maximum
        if natural > console.width:
            console = Console(**{**console_options, "width": natural})
    console.print(renderable)
