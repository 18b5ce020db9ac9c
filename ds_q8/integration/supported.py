"""The DeepSpeed releases ds_q8's integration supports: the ones its tests run on.

ds_q8 patches private parts of DeepSpeed (``integration.patches``), which DeepSpeed changes between
releases, patch releases included. So the supported range is exactly the releases the test suite ran
on, nothing wider. ``setup.py`` reads this file by path (it imports nothing) for the ``deepspeed``
extra, and ``integration.contract`` names the same range when a DeepSpeed lacks a patched place.

To support a new release: run the suite on it, read the places ``docs/deepspeed.md`` lists under
"Review at each DeepSpeed release", and add it to ``TESTED``.
"""

#: every DeepSpeed release the test suite passed on (requirements-dev.txt pins one of them)
TESTED = ("0.19.8",)


def _numbers(version: str) -> tuple:
    out = []
    for part in version.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        out.append(int(digits) if digits else 0)
    return tuple(out + [0] * (3 - len(out)))


def _after(version: str) -> str:
    major, minor, patch = _numbers(version)
    return f"{major}.{minor}.{patch + 1}"


#: the first supported release, and the first release after the supported ones
LOWEST = min(TESTED, key=_numbers)
BELOW = _after(max(TESTED, key=_numbers))
#: the range as a PEP 440 specifier, and as the requirement setup.py declares
RANGE = f">={LOWEST},<{BELOW}"
REQUIREMENT = f"deepspeed{RANGE}"


def supports(version: str) -> bool:
    """Whether a DeepSpeed ``__version__`` lies in the supported range (local labels such as
    ``+abc123`` of a source build are ignored)."""
    return _numbers(LOWEST) <= _numbers(version) < _numbers(BELOW)
