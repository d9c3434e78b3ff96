"""Memory sizes: parsing what a user types ('24GiB', '22.5GB') and printing bytes (train.plan, train.bench)."""
from shared.runtime.errors import UserError

KiB, MiB, GiB = 2**10, 2**20, 2**30
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": KiB, "m": 10**6, "mb": 10**6, "mib": MiB,
          "g": 10**9, "gb": 10**9, "gib": GiB, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(text: str) -> int:
    """'24GiB', '22.5GB', '1536MiB', '0' -> bytes; UserError naming the accepted forms."""
    s = str(text).strip().lower().replace(" ", "")
    number = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = None
    if value is None or value < 0 or unit not in _UNITS:
        raise UserError(f"cannot read the memory size {text!r}; write a number with a unit, e.g. 24GiB, "
                        "22.5GB, 1536MiB (GiB/MiB are powers of 2, GB/MB powers of 10).")
    return int(value * _UNITS[unit])


def format_size(nbytes: float) -> str:
    """Bytes as a short human string in binary units (GiB/MiB/KiB)."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"
