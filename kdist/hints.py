"""How a message names a setting: a command's flag, or the library's keyword.

Messages are written once, naming each setting by its command-line flag
(`--checkpoint-dir`, `--no-resume`). The commands print them as they are:
each runs its work within `command_line()`. A library call gets them in
its own terms: the public functions (`train_and_evaluate`,
`evaluate_checkpoint`, `connect`, ...) are wrapped by `library_terms`, which
rewrites the flags in the kdist errors they raise and in the lines they log
into the keywords a script sets (`checkpoint_dir`, `resume=False`). The
rewrite happens where the call returns, so an error raised on another thread
or in a torch replica process reads the same. A line printed directly (the
join's watchdog) is named at once with `name`.

Importing this module imports no framework.
"""

import contextlib
import contextvars
import functools
import inspect
import re
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from kdist import config
from kdist.errors import KdistError

_ON_COMMAND_LINE = contextvars.ContextVar("kdist_on_command_line", default=False)

# Flags whose keyword is not their name with underscores, besides the switches
# (`_switches`): the join's timeout is an argument of `kdist.connect`; the
# model a file's function builds is `model_fn`'s.
_KEYWORDS = {"--connect-timeout": "kdist.connect's timeout", "--model": "model_fn"}
# A flag, with the number that follows it, if any ("--replicas 4" -> "replicas=4"). Not
# part of a longer word: "XLA_FLAGS=--xla_force_host_platform_device_count" stays.
_FLAG = re.compile(r"(?<![\w/.=-])--([a-z][a-z0-9-]*)(?![\w-])(?: (-?\d[\d.]*)(?![\w/.-]))?")

F = TypeVar("F", bound=Callable[..., Any])


@contextlib.contextmanager
def command_line() -> Iterator[None]:
    """Within the block, messages keep their flags: a command prints them."""
    token = _ON_COMMAND_LINE.set(True)
    try:
        yield
    finally:
        _ON_COMMAND_LINE.reset(token)


def on_command_line() -> bool:
    """Whether messages keep their flags here (within `command_line()`)."""
    return _ON_COMMAND_LINE.get()


@functools.cache
def _switches() -> dict[str, str]:
    """The flags that set a boolean `TrainConfig` field, as `field=value`."""
    return {config.flag_name(f): f"{f.name}={not f.default}"
            for f in config.flag_fields() if isinstance(f.default, bool)}


def keyword(flag: str) -> str:
    """The library's name for `flag`: "--no-resume" -> "resume=False",
    "--checkpoint-dir" -> "checkpoint_dir"."""
    return _KEYWORDS.get(flag) or _switches().get(flag) or flag[2:].replace("-", "_")


def in_library_terms(text: str) -> str:
    """`text` with each flag replaced by its keyword, and a number after it as its value."""
    def replace(match: re.Match) -> str:
        name = keyword("--" + match.group(1))
        return name if match.group(2) is None else f"{name}={match.group(2)}"

    return _FLAG.sub(replace, text)


def name(flag: str) -> str:
    """`flag` on the command line, else its keyword: for a line printed at once."""
    return flag if on_command_line() else keyword(flag)


def library_terms(fn: F) -> F:
    """Wraps public function `fn`: outside `command_line()`, the kdist errors it
    raises and the lines it passes to its `log` argument name keywords, not flags."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if on_command_line():
            return fn(*args, **kwargs)
        if "log" in signature.parameters:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            log = bound.arguments["log"]
            bound.arguments["log"] = lambda line: log(in_library_terms(line))
            args, kwargs = bound.args, bound.kwargs
        try:
            return fn(*args, **kwargs)
        except KdistError as error:
            error.args = (in_library_terms(str(error)), *error.args[1:])
            raise

    return wrapper  # type: ignore[return-value]
