"""Error types for bad user input, printed as a single paragraph by every CLI.

`shared/` speaks the domain, not the command line: it raises `ChoiceError` carrying the bad value and the
allowed choices under a domain name ("sampler", "attention", ...). Each stage's `__main__` knows which
flag sets that name and turns the error into flag advice with `advise`.
"""
import contextlib
import difflib
import errno
import re
import shutil
import sys
import textwrap
from pathlib import Path
from typing import Iterator, NoReturn


class UserError(Exception):
    """A problem the user can fix; the message says what went wrong and how to fix it."""


class ChoiceError(UserError):
    """A value outside a known vocabulary: carries the domain name, the bad value and the allowed choices."""

    def __init__(self, setting: str, value, choices, detail: str = ""):
        self.setting, self.value, self.choices, self.detail = setting, value, list(choices), detail
        self.allowed = ", ".join(str(c) for c in self.choices)
        super().__init__(f"unknown {setting} {value!r}{f' ({detail})' if detail else ''}{self._guess()}; choose one "
                         f"of: {self.allowed}.")

    def advise(self, flag: str) -> UserError:
        """The same error phrased for the flag that set the value."""
        extra = f" ({self.detail})" if self.detail else ""
        return UserError(f"{flag} {self.value!r} is not a valid {self.setting}{extra}{self._guess()}; pass {flag} with "
                         f"one of: {self.allowed}.")

    def _guess(self) -> str:
        """The suggestion for a choice equal but for case (else the closest spelling): " (did you mean 'X'?)"."""
        names = [str(c) for c in self.choices]
        same = [c for c in names if c.lower() == str(self.value).lower()]
        close = same or difflib.get_close_matches(str(self.value), names, n=1, cutoff=0.8)
        return f" (did you mean {close[0]!r}?)" if close else ""


class SettingError(UserError):
    """A text naming settings as `{setting}` fields: str() reads "use cfg scale 1", `advise` "use --cfg-scale 1"."""

    _FIELD = re.compile(r"\{([a-z][a-z -]*)\}")

    def __init__(self, template: str):
        self.template = template
        super().__init__(self.phrase({}))

    def phrase(self, flags: dict) -> str:
        """The text with each {setting} replaced by flags[setting], or by the setting where no flag is known."""
        return self._FIELD.sub(lambda m: flags.get(m.group(1), m.group(1)), self.template)


def advise(error: UserError, flags: dict) -> UserError:
    """Turn a domain ChoiceError or SettingError into flag advice for the settings this stage has flags for."""
    if isinstance(error, ChoiceError) and error.setting in flags:
        return error.advise(flags[error.setting])
    if isinstance(error, SettingError):
        return UserError(error.phrase(flags))
    return error


def exit_with(error: UserError, prog: str, flags: dict | None = None) -> NoReturn:
    """Print a UserError as one wrapped paragraph on stderr and exit with status 2."""
    text = " ".join(str(advise(error, flags or {})).split())
    # Never break inside a word: a path or command cut at a hyphen would not survive copy and paste.
    print(textwrap.fill(f"{prog}: error: {text}", width=100, break_on_hyphens=False, break_long_words=False),
          file=sys.stderr)
    sys.exit(2)


# ---- A full disk ----

def _bytes(n: int) -> str:
    """1536 -> '1.5 KiB'."""
    size = float(n)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1024


def _free_bytes(path) -> int | None:
    """Free bytes on the filesystem holding `path` (or its nearest existing parent); None if unknown."""
    path = Path(path)
    for folder in (path, *path.parents):
        with contextlib.suppress(OSError):
            return shutil.disk_usage(folder).free
    return None


class DiskFullError(UserError):
    """A write failed because the disk (or the quota) is full; already-finished files are intact."""

    def __init__(self, path=None, written: int | None = None):
        self.path, self.written = path, written
        free = _free_bytes(path) if path is not None else None
        where = f"the disk holding {path}" if path is not None else "the disk"
        facts = ", ".join(x for x in (f"{_bytes(free)} free" if free is not None else "",
                                      f"the write stopped after {_bytes(written)}" if written else "") if x)
        super().__init__(f"no space left on {where}{f' ({facts})' if facts else ''}. Files finished before it are "
                         f"intact; the unfinished one is redone on the rerun. Free some space (or move the output "
                         f"folder to a bigger disk) and rerun the same command: it continues from the last finished "
                         f"file.")


def disk_full(err: BaseException, path=None, written: int | None = None) -> DiskFullError | None:
    """A DiskFullError for a write error caused by a full disk or quota, else None."""
    # OSError carries errno ENOSPC/EDQUOT (disk full; over quota); safetensors' Rust errors say "os error 28";
    # torch.save's C++ writer says neither ("unexpected pos ..."), so with a `path` an error is also blamed on space
    # under 1 MiB free there (a block and metadata slack).
    if isinstance(err, DiskFullError):
        return err
    if (isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)) \
            or any(t in str(err) for t in ("No space left on device", "os error 28", "Disk quot")):
        return DiskFullError(path if path is not None else getattr(err, "filename", None), written)
    if path is not None and (free := _free_bytes(path)) is not None and free < 1 << 20:
        return DiskFullError(path, written)
    return None


@contextlib.contextmanager
def cli_errors(prog: str, flags: dict | None = None) -> Iterator[None]:
    """Turn UserErrors and full-disk write errors raised inside into one paragraph and exit status 2."""
    try:
        yield
    except UserError as err:
        exit_with(err, prog, flags)
    except Exception as err:  # noqa: BLE001 - anything else is re-raised untouched
        if (full := disk_full(err)) is None:
            raise
        exit_with(full, prog, flags)
