"""Errors a user can act on: printed as one line, without a traceback."""

from __future__ import annotations

import dataclasses
import errno
import re
from pathlib import Path

from hydra.errors import OverrideParseException
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException


class DptError(Exception):
    """A problem with the user's input or environment, reported as a single line."""


class ConfigError(DptError):
    """A config value is out of range or inconsistent; the message names the key."""


class Abort(BaseException):
    """Carries a DptError past Hydra's own handling, to be printed as one line by `dpt.launch.cli`.

    Hydra turns an `Exception` raised by a callback into a warning and runs the job anyway, and
    prefixes a failed job's error with a line of its own; a `BaseException` passes through both.
    """

    def __init__(self, error: DptError) -> None:
        super().__init__(str(error))
        self.error = error


# A full disk, or a full quota: the same to the user.
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in DISK_FULL


def could_not_write(fallback: Path | str, error: OSError) -> str:
    """`could not write <file>: no space left on device`. A failed write or close names no file
    (the error carries none): then the folder it was writing into."""
    path = error.filename or fallback
    reason = "no space left on device" if is_disk_full(error) else error.strerror or str(error)
    return f"could not write {path}: {reason}"


def first_line(error: BaseException) -> str:
    """An error's first line (its type where it says nothing): torch's, numpy's and Hydra's
    messages run on for lines."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


_PICKLED_GLOBAL = re.compile(r"Unsupported global: GLOBAL (\S+)")
_UNPICKLER = re.compile(
    r"WeightsUnpickler error:\s*(.+?)\s*(?:\n\n|Check the documentation|$)", re.S
)


def torch_load_reason(error: BaseException) -> str:
    """Why `torch.load(weights_only=True)` could not read a file, in one line: what was wrong
    with it, without torch's advice to load it with weights_only=False (which runs any code a
    damaged or hostile file holds)."""
    text = str(error)
    pickled = _PICKLED_GLOBAL.search(text)
    if pickled:  # readable, but holding an object to import: code that would run
        return f"it pickles {pickled.group(1)}, not only tensors"
    found = _UNPICKLER.search(text)
    if found:
        detail = " ".join(found.group(1).split())
    elif "Weights only load failed" in text:
        detail = "objects other than tensors"
    else:
        detail = f"{type(error).__name__}: {first_line(error)}"
    return f"damaged, or not written by torch.save ({detail})"


def one_line(error: BaseException) -> str:
    """Hydra and OmegaConf messages span many lines; keep what names the key and the problem."""
    cause = error.__cause__
    if isinstance(error, OverrideParseException):
        return _override_line(error)
    if isinstance(error, OmegaConfBaseException):
        return _omegaconf_line(error)
    if isinstance(cause, OmegaConfBaseException):
        return _omegaconf_line(cause) + _append_hint(str(error), cause)
    text = _unwrap_loader_error(str(error))
    ambiguous = _AMBIGUOUS.search(text)
    if ambiguous:
        return _ambiguous_line(ambiguous.group(1))
    options = re.search(
        r"Could not find '([^']+)'\s+Available options in '([^']+)':(.*?)"
        r"(Config search path|$)",
        text,
        re.S,
    )
    if options:
        choices = ", ".join(options.group(3).split())
        return (
            f"no config '{options.group(1)}'; available options in '{options.group(2)}': {choices}"
        )
    listed = re.search(r"Could not load '([\w-]+)/([^']+)'", text)
    if listed:  # an option of a group chosen as a list (logger=[tensorboard,comet])
        group, name = listed.groups()
        return f"no config '{group}/{name}'; available options in '{group}': {_options(group)}"
    lines = [ln.strip() for ln in text.splitlines()]
    kept = [ln for ln in lines if ln and not ln.startswith(("See https://", "Config search path"))]
    return " ".join(kept).split(" provider=")[0]


def some_of(names: list[str], shown: int) -> str:
    """`a, b, c and 4 more`: the first `shown` names, so that a line stays one line."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def clipped(text: str, limit: int = 300) -> str:
    """`text` within `limit` characters, cut after a whole sentence (or at a space): never
    inside a word or a link."""
    if len(text) <= limit:
        return text
    head = text[:limit]
    sentence = max(head.rfind(". "), head.rfind("; "))
    end = sentence + 1 if sentence > limit // 2 else head.rfind(" ")
    return head[: end if end > 0 else limit].rstrip() + " ..."


def _options(group: str) -> str:
    """The options dpt ships for a config group (its YAML files under dpt/conf/<group>)."""
    from importlib.resources import files

    folder = files("dpt.conf") / group
    names = [p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml")]
    return ", ".join(sorted(names))


OVERRIDE_SYNTAX = (
    "Hydra's override syntax: key=value, key=[1,2], key='a string' (quote a value holding "
    "spaces, brackets or commas, and the whole override for the shell)"
)
_LEXER = "LexerNoViableAltException: "


_AMBIGUOUS = re.compile(r"Ambiguous value for argument '([^']*)'")


def _ambiguous_line(override: str) -> str:
    """`key=a,b` outside a sweep: Hydra cannot tell a list, a sweep and a text with a comma."""
    key, value = override.split("=", 1)
    return (
        f"{override}: a comma makes {key}'s value a sweep (with -m); a list is in brackets, "
        f"{key}=[{value}]; to mean the text, quote it for Hydra and the whole override for the "
        f"shell: \"{key}='{value}'\""
    )


def _override_line(error: OverrideParseException) -> str:
    """An override Hydra's grammar cannot read, named with its key and what is wrong in it."""
    override = error.override
    key = override.split("=", 1)[0] if "=" in override else override
    lines = str(error.message).splitlines()
    if lines[0].startswith(_LEXER) and len(lines) > 1:  # the second line's caret marks the spot
        at = len(lines[1]) - len(_LEXER) - 1
        reason = f"unexpected character {override[at : at + 1]!r} at position {at + 1}"
    else:  # "Error parsing override '...'" comes before the reason, where there is one
        reason = next(
            (
                ln.strip()
                for ln in lines
                if ln.strip() and not ln.startswith(("Error parsing", "See "))
            ),
            "not a valid override",
        )
    return f"{override}: cannot read the value of {key} ({reason}); {OVERRIDE_SYNTAX}"


_LOADER_WORKER = re.compile(r"^Caught \w+ in DataLoader worker process (\d+)\.")


def loader_worker_error(text: str) -> tuple[int, str] | None:
    """A DataLoader worker's exception, re-raised in its rank as "Caught X in DataLoader worker
    process N. Original Traceback ...": (N, the traceback's last line, "module.X: message")."""
    found = _LOADER_WORKER.match(text.strip())
    if found is None or "Original Traceback" not in text:
        return None
    return int(found.group(1)), text.strip().splitlines()[-1].strip()


def _unwrap_loader_error(text: str) -> str:
    """The original message of a loader worker's exception, after "module.X: "."""
    found = loader_worker_error(text)
    if found is None:
        return text
    return re.sub(r"^(\w+\.)*[A-Z]\w*: ", "", found[1])  # a class: ValueError, SourceUnreachable


def _omegaconf_line(error: OmegaConfBaseException) -> str:
    key = getattr(error, "full_key", None) or "config"
    message = str(getattr(error, "msg", None) or error).splitlines()[0].strip()
    if isinstance(error, ConfigAttributeError | ConfigKeyError) and "not in" in message:
        object_type = getattr(error, "object_type", None)
        allowed = _fields(object_type)
        hint = f"; allowed keys: {', '.join(allowed)}" if allowed else ""
        if not _is_schema(object_type):  # a config of yours: Hydra's `+` adds the key
            return f"{key}: unknown key{hint}"
        if not allowed:
            hint = "; this option takes no keys"
        return f"{key}: unknown key{hint}{options_with(key)}"
    if "does not support deletion" in message:  # `~model.hidden_dims`: a built-in's schema key
        group = key.split(".", 1)[0]
        return (
            f"{key}: a key of the built-in {group} option cannot be deleted; for your own "
            f"{group}, give it a config file of its own (--config-dir DIR with "
            f"DIR/{group}/<name>.yaml; docs/guides/own-model-and-data.md)"
        )
    return f"{key}: {message}"


_APPEND = re.compile(r"To append to your config use (\+\S+)")


def _append_hint(text: str, cause: OmegaConfBaseException) -> str:
    """A key that a config of yours lacks (no schema lists its keys: `dataset.shuffle` on your
    data set's YAML): Hydra's way to add it, `+dataset.shuffle=false`. A schema's option
    refuses an added key all the same: no such hint there."""
    found = _APPEND.search(text)
    if found is None or _is_schema(getattr(cause, "object_type", None)):
        return ""
    return f"; add it with {found.group(1)}"


def _is_schema(object_type: object) -> bool:
    return isinstance(object_type, type) and dataclasses.is_dataclass(object_type)


def _fields(object_type: object) -> list[str]:
    if _is_schema(object_type):
        assert isinstance(object_type, type)
        return [f.name for f in dataclasses.fields(object_type) if not f.name.startswith("_")]
    return []


def options_with(key: str) -> str:
    """`; strategy=ddp, strategy=fsdp take it`: the group's options whose schema has the key
    (`strategy.tensor_parallel` under strategy=single); "" where none or not a group's key."""
    from hydra.core.config_store import ConfigStore

    group, _, name = key.partition(".")
    if not name or "." in name:
        return ""
    options = ConfigStore.instance().repo.get("schema", {}).get(group, {})
    # keys(): a key whose schema value is MISSING is not `in` its DictConfig
    having = sorted(f"{group}={option.removesuffix('.yaml')}" for option, stored in options.items()
                    if name in getattr(stored, "node", {}).keys())  # noqa: SIM118  # fmt: skip
    if not having:
        return ""
    return f"; {', '.join(having)} take{'s' if len(having) == 1 else ''} it"
