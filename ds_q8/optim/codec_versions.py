"""What a saved state's codes stand for: the map and codec version of each quantization, which state format 4
writes in the ``ds_q8`` marker and every loader checks, and how the codes of state formats 2 and 3, which
name none, are read.

A stored code is an index into a map, and nothing in the byte says which map. When a map's layout changes,
the same index stands for another value: the signed "minifloat" map of commit 4c6c1cd held zero twice
(codes 127 and 128) and 1.0 at code 255; from d65edc3 on it holds one zero (127) and 1.0 at 254, so each
positive code of the old layout reads one entry too high in the new one. Both wrote state format 3.

**Format 4** names, in the marker's ``"codecs"``, every codec its saved codes use: the group's
``quantization``, or ``"format4"`` for ``optim_bits=4`` state (whose maps are its own), each with its version
and a description of its maps, e.g. ``{"minifloat": {"version": 2, "map": "..."}}``. When what a stored code
of a map means changes, that map's entry in :data:`CODEC_VERSIONS` goes up by one, its old version moves
to :data:`KNOWN` and, where the old codes can be read exactly, :data:`UPGRADES` gains the step. A codec or
version this code does not know is refused by name.

**Formats 2 and 3.** Every map but minifloat's kept one layout while they were written: version 1. For the
signed minifloat states the codes decide (:func:`decide_minifloat`). A block's largest element scales to
within a bfloat16 rounding of 1.0 (block maxima are stored rounded up), so it codes to the top entry or, by
stochastic rounding, the one below. In a block led by a positive value (no element at the top two negative
entries, codes 0 and 1) that is 255 or 254 in the two-zero layout and 254 or 253 in the one-zero one; the
one-zero layout never writes 255 in a finite block. So a code 255 proves the two-zero layout, a positive-led
block topped by 253 proves the one-zero layout, and blocks topped by 254 favour it: the two-zero layout
leaves such a block's largest one entry low with probability under 0.25 (the largest scales to at least
1 / (1 + 2**-7) of the top, 0.24 of a spacing from it), so :data:`DECIDING_BLOCKS` of them and no 255 leave a
chance under 1e-6 of misreading. Where no code is above 127 the two layouts read every code alike. Anything
else is refused before anything is changed, with what was found and how to get past it. One checkpoint is
decided as a whole (one commit wrote all of it): the loaders add the evidence of every tensor, and of every
rank where a ZeRO checkpoint is split.
"""
from __future__ import annotations

import copy
import warnings
from typing import Callable, Dict, Iterator, NamedTuple, Optional, Tuple

import torch

from .layout import StateLayout, segment_block_size
from .state_io import CODECS_KEY, STATE_DICT_MARKER, states_of_entry
from .state_keys import codes_key

#: the codec name of ``optim_bits=4`` state, whatever the group's ``quantization``
FOUR_BIT = "format4"
#: each codec's version: what its stored codes stand for. Bump one when the meaning of a stored code changes.
CODEC_VERSIONS = {"dynamic": 1, "dynamic6": 1, "linear": 1, "minifloat": 2, FOUR_BIT: 1}
#: every version this code reads, with its maps
KNOWN: Dict[Tuple[str, int], str] = {
    ("dynamic", 1): "dynamic tree maps, signed and unsigned (maps.create_dynamic_map)",
    ("dynamic6", 1): "signed: the dynamic tree over six decades (maps.DYNAMIC6_COUNTS); unsigned: the dynamic map",
    ("linear", 1): "256 evenly spaced values over [-1, 1] (signed) or [0, 1] (unsigned)",
    ("minifloat", 1): "signed: sign + E3M4 with two zeros (codes 127 and 128) and 1.0 at code 255, as commit "
                      "4c6c1cd wrote it; unsigned: E4M4",
    ("minifloat", 2): "signed: sign + E3M4 with one zero (code 127), 1.0 at code 254 and code 255 above 1.0; "
                      "unsigned: E4M4",
    (FOUR_BIT, 1): "optim_bits=4: format4.py's maps for Adam's two moments",
}
#: positive-led blocks topped by 254 that decide the one-zero layout of format-3 minifloat codes without a proof
DECIDING_BLOCKS = 10


def _two_zero_to_one_zero(codes: torch.Tensor, signed: bool) -> torch.Tensor:
    # two-zero entry c (c >= 128) is one-zero entry c - 1, +0 (128) becoming the one zero (127); the
    # negatives and -0 (127) keep their codes, and the unsigned E4M4 map did not change
    if not signed:
        return codes
    return torch.where(codes >= 128, codes - 1, codes)


#: (codec, version) -> the codes of that version as the next version's: ``f(codes, signed) -> codes``
UPGRADES: Dict[Tuple[str, int], Callable[[torch.Tensor, bool], torch.Tensor]] = {
    ("minifloat", 1): _two_zero_to_one_zero,
}


def codec_name(quantization: str, state_bits: int) -> str:
    """The codec of a tensor's quantized state: its group's ``quantization``, or :data:`FOUR_BIT`."""
    return FOUR_BIT if int(state_bits) == 4 else quantization


def marker_codecs(names) -> dict:
    """The marker's ``"codecs"`` entry for the codecs ``names``: each one's current version and maps."""
    return {n: {"version": CODEC_VERSIONS[n], "map": KNOWN[(n, CODEC_VERSIONS[n])]} for n in sorted(set(names))}


def _versions_in(entry) -> Dict[str, int]:
    """The version of each codec a format-4 marker names; refuses what it does not know, by name."""
    if not isinstance(entry, dict):
        raise ValueError(f"the '{STATE_DICT_MARKER}' marker of state format 4 needs '{CODECS_KEY}', a dict of codec "
                         f"name -> {{'version': int, 'map': str}}; found {type(entry).__name__}")
    out = {}
    for name, spec in entry.items():
        version = spec.get("version") if isinstance(spec, dict) else None
        if name not in CODEC_VERSIONS:
            raise ValueError(f"the checkpoint's codes use codec {name!r}, which this ds_q8 does not know (it reads "
                             f"{', '.join(sorted(CODEC_VERSIONS))}): load it with the ds_q8 that wrote it")
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"'{CODECS_KEY}' entry {name!r} of the marker needs an integer 'version', got {spec!r}")
        if (name, version) not in KNOWN:
            readable = sorted(v for n, v in KNOWN if n == name)
            raise ValueError(
                f"the checkpoint's {name!r} codes are of codec version {version}; this ds_q8 reads version(s) "
                f"{', '.join(map(str, readable))} of {name!r} and cannot tell what version {version}'s codes stand "
                "for. Load it with the ds_q8 that wrote it, or there export fp32 state "
                "(Optimizer.export_fp32_state_dict) and load that here (it is requantized)")
        out[name] = version
    return out


# ---------------------------------------------------------------------------- the codes of a state_dict
class Saved(NamedTuple):
    """One saved entry's quantized codes: what they are coded with and how its blocks lie."""
    pid: object
    codec: str
    signed: tuple
    layout: StateLayout


def saved_codes(state_dict: dict) -> Iterator[Saved]:
    """Every state entry of ``state_dict`` that holds codes (8 or 4 bits), with its codec."""
    mark = state_dict.get(STATE_DICT_MARKER) or {}
    layouts = mark.get("layouts") or {}
    group_of = {pid: g for g in state_dict.get("param_groups", []) for pid in g.get("params", [])}
    for pid, st in (state_dict.get("state") or {}).items():
        codes = st.get(codes_key(0)) if isinstance(st, dict) else None
        desc = layouts.get(pid, layouts.get(str(pid)))
        if not torch.is_tensor(codes) or codes.dtype != torch.uint8 or desc is None or pid not in group_of:
            continue  # fp32 state, or an entry the loader's own checks refuse
        _, signed = states_of_entry(mark, pid)
        yield Saved(pid, codec_name(group_of[pid].get("quantization"), desc.get("state_bits", 8)), tuple(signed),
                    StateLayout.from_description(desc))


class Evidence(NamedTuple):
    """What the signed minifloat codes of formats 2 and 3 say of their layout (module doc), summed over a
    checkpoint's tensors (and ranks)."""
    codes: int = 0        # codes scanned
    above_zero: int = 0   # codes 128..255, which the two layouts read differently
    top_255: int = 0      # codes 255: the two-zero layout's 1.0, never written by the one-zero layout
    blocks: int = 0       # whole blocks scanned
    led_253: int = 0      # positive-led blocks topped by 253: only the one-zero layout writes them
    led_254: int = 0      # positive-led blocks topped by 254: one-zero's 1.0, or a two-zero block rounded down

    def __add__(self, other: "Evidence") -> "Evidence":
        return Evidence(*(a + b for a, b in zip(self, other)))

    def summed(self, reduce: Optional[Callable[[torch.Tensor], None]]) -> "Evidence":
        """The evidence added over ranks, ``reduce`` an in-place all-reduce sum (None: this rank's alone)."""
        if reduce is None:
            return self
        t = torch.tensor(list(self), dtype=torch.float64)
        reduce(t)
        return Evidence(*(int(x) for x in t.tolist()))

    def said(self) -> str:
        return (f"read {self.codes} codes and {self.blocks} whole blocks: {self.above_zero} codes above 127, "
                f"{self.top_255} codes 255, {self.led_253} blocks led by a positive value topped by code 253 and "
                f"{self.led_254} by code 254")


def evidence_of(state_dict: dict) -> Evidence:
    """The :class:`Evidence` of one state_dict's signed minifloat 8-bit codes (none for format 4, whose marker
    names its codecs)."""
    total = Evidence()
    if (state_dict.get(STATE_DICT_MARKER) or {}).get("format") == 4:
        return total
    for saved in saved_codes(state_dict):
        if saved.codec != "minifloat":
            continue
        st = state_dict["state"][saved.pid]
        for i, signed in enumerate(saved.signed):
            if signed:
                total = total + _codes_evidence(st[codes_key(i)].reshape(-1), saved.layout)
    return total


def _counts(codes: torch.Tensor) -> Evidence:
    return Evidence(codes.numel(), int((codes >= 128).sum()), int((codes == 255).sum()))


def _codes_evidence(codes: torch.Tensor, layout: StateLayout) -> Evidence:
    codes = codes.cpu()
    ev = _counts(codes)
    # only whole blocks: a block that a partition edge cuts may have its largest element on another rank
    for piece in layout.pieces8:
        bs = segment_block_size(layout.block_size, layout.segments[piece.segment].param_numel)
        ev = ev + blocks_evidence(codes[piece.codes_start:piece.codes_start + piece.numel], bs)
    return ev


def blocks_evidence(codes: torch.Tensor, block_size: int) -> Evidence:
    """The block counts of :class:`Evidence` for ``codes`` that are whole blocks of ``block_size`` (the last
    one may be shorter: a parameter's end)."""
    c = codes.reshape(-1).cpu().to(torch.int16)
    pad = (-c.numel()) % block_size
    if pad:
        c = torch.cat([c, torch.full((pad,), 127, dtype=c.dtype)])  # zeros, which decide nothing
    c = c.view(-1, block_size)
    led = c.amin(dim=1) > 1  # no element at -1.0 or the entry above it: the block's largest is positive
    top = c.amax(dim=1)
    return Evidence(blocks=c.shape[0], led_253=int((led & (top == 253)).sum()), led_254=int((led & (top == 254)).sum()))


def codes_evidence(codes: torch.Tensor, block_size: int) -> Evidence:
    """The :class:`Evidence` of one whole parameter's signed codes in blocks of ``block_size``."""
    c = codes.reshape(-1).cpu()
    return _counts(c) + blocks_evidence(c, block_size)


def decide_minifloat(ev: Evidence) -> Tuple[int, str]:
    """The minifloat codec version that wrote codes with evidence ``ev`` and why; ValueError where the codes
    do not decide it (module doc)."""
    if ev.top_255 and ev.led_253:
        raise ValueError(f"{_UNDECIDED} Its codes fit neither layout ({ev.said()}): code 255 is written only by the "
                         "two-zero layout, a positive-led block topped by 253 only by the one-zero layout; the "
                         f"checkpoint is damaged or mixes the two. {_HOW}")
    if ev.top_255:
        return 1, (f"the two-zero layout of commit 4c6c1cd ({ev.top_255} codes 255, the two-zero layout's 1.0, which "
                   f"the one-zero layout never writes; {ev.said()})")
    if ev.led_253 or ev.led_254 >= DECIDING_BLOCKS:
        return 2, (f"the one-zero layout (no code 255, which the two-zero layout writes for 1.0; {ev.said()}; the "
                   "two-zero layout cannot top a positive-led block with 253, and tops one with 254 with a "
                   "probability under 0.25)")
    if not ev.above_zero:
        return 2, ("the one-zero layout, which reads them as the two-zero layout would: no code is above 127 "
                   f"({ev.said()})")
    raise ValueError(f"{_UNDECIDED} Its codes do not say which ({ev.said()}): a code 255, or a positive-led block "
                     f"topped by 253, or {DECIDING_BLOCKS} topped by 254 would decide it. Nothing was loaded. {_HOW}")


_UNDECIDED = ("ds_q8: this checkpoint (state format 3, which names no codec) keeps first moments on the signed "
              "minifloat map, which commit 4c6c1cd wrote in a two-zero layout (1.0 at code 255) and later "
              "releases in a one-zero layout (1.0 at code 254); read in the wrong one, every positive value moves "
              "by one entry.")
_HOW = ("To load it: with the ds_q8 that wrote it, export fp32 state (Optimizer.export_fp32_state_dict, or "
        "python -m ds_q8.checkpoint to-fp32 for a DeepSpeed checkpoint) and load that here; or, knowing which "
        "commit wrote it, name the layout with ds_q8.optim.codec_versions.assume_codecs(state_dict, "
        "{'minifloat': 1}) (4c6c1cd's two zeros) or {'minifloat': 2} (one zero, 047c763 and later).")


# ---------------------------------------------------------------------------- reading saved codes
def versions_of(state_dict: dict, evidence: Optional[Evidence] = None,
                reduce: Optional[Callable[[torch.Tensor], None]] = None) -> Tuple[Dict[str, int], Optional[str]]:
    """The codec version of each codec that ``state_dict``'s codes use, and, for format 2 or 3, what decided the
    minifloat layout (None when nothing needed deciding). ``evidence``: the whole checkpoint's, where it spans
    several state_dicts (ZeRO rank files); ``reduce`` adds this state_dict's over ranks (every rank calls it:
    it is called exactly when the marker and groups, alike on every rank, name minifloat state)."""
    mark = state_dict.get(STATE_DICT_MARKER) or {}
    if mark.get("format") == 4:
        return _versions_in(mark.get(CODECS_KEY)), None
    versions = {n: 1 for n in CODEC_VERSIONS}
    if not any(g.get("quantization") == "minifloat" for g in state_dict.get("param_groups", [])):
        return versions, None
    if evidence is None:
        evidence = evidence_of(state_dict).summed(reduce)
    if not evidence.codes:
        return dict(versions, minifloat=CODEC_VERSIONS["minifloat"]), None  # no signed minifloat codes to read
    versions["minifloat"], why = decide_minifloat(evidence)
    return versions, why


def current(state_dict: dict, evidence: Optional[Evidence] = None,
            reduce: Optional[Callable[[torch.Tensor], None]] = None) -> dict:
    """``state_dict`` with every code in its codec's current version and a format-4 marker that says so: the
    same dict where nothing changes, else a copy (the argument is never modified). Formats 3 and 4 only;
    anything else is returned as it is, for the loader's own handling (format 2 is requantized from fp32).
    Raises ValueError, having changed nothing, where a codec or version is unknown or the codes do not
    decide (module doc); warns when format-3 minifloat codes were decided, with the evidence."""
    mark = state_dict.get(STATE_DICT_MARKER) if isinstance(state_dict, dict) else None
    if not isinstance(mark, dict) or mark.get("format") not in (3, 4) or not isinstance(state_dict.get("state"), dict):
        return state_dict
    versions, why = versions_of(state_dict, evidence, reduce)
    used = {}
    for saved in saved_codes(state_dict):
        if saved.codec not in versions:
            raise ValueError(f"state entry {saved.pid} holds {saved.codec!r} codes, but the checkpoint's "
                             f"'{STATE_DICT_MARKER}' marker names no codec for them ({CODECS_KEY}: "
                             f"{sorted(versions)}): the state_dict is damaged")
        used[saved.pid] = saved
    stale = {n for n in {s.codec for s in used.values()} if versions[n] != CODEC_VERSIONS[n]}
    for name in stale:
        _check_upgrade(name, versions[name])
    if mark.get("format") == 4 and not stale:
        return state_dict
    new_mark = dict(mark, format=4)
    new_mark[CODECS_KEY] = marker_codecs(s.codec for s in used.values())
    out = dict(state_dict, state=dict(state_dict["state"]))
    out[STATE_DICT_MARKER] = new_mark
    for pid, saved in used.items():
        if saved.codec not in stale:
            continue
        st = dict(out["state"][pid])
        for i, signed in enumerate(saved.signed):
            st[codes_key(i)] = upgraded_codes(st[codes_key(i)], saved.codec, versions[saved.codec], signed)
        out["state"][pid] = st
    if why is not None and used:
        converted = " and converted exactly (codes 128..255 one down)" if stale else ", as this ds_q8 reads them"
        warnings.warn(f"ds_q8: this checkpoint is in state format 3, which does not name its maps; its signed "
                      f"minifloat codes were read as {why}{converted}. Saving writes format 4, which names them.",
                      RuntimeWarning, stacklevel=3)
    return out


def _check_upgrade(name: str, version: int) -> None:
    for v in range(version, CODEC_VERSIONS[name]):
        if (name, v) not in UPGRADES:
            raise ValueError(f"the checkpoint's {name!r} codes are of codec version {version}, which this ds_q8 knows "
                             f"({KNOWN[(name, version)]}) but cannot convert to version {CODEC_VERSIONS[name]}: load "
                             "it with the ds_q8 that wrote it and export fp32 state")


def upgraded_codes(codes: torch.Tensor, name: str, version: int, signed: bool) -> torch.Tensor:
    """``codes`` of codec ``name`` at ``version`` as the current version's (the same tensor where they are
    current); ValueError, naming it, for a version this code cannot read."""
    _versions_in({name: {"version": version}})
    _check_upgrade(name, version)
    for v in range(version, CODEC_VERSIONS[name]):
        codes = UPGRADES[(name, v)](codes, signed)
    return codes


def assume_codecs(state_dict: dict, versions: Dict[str, int]) -> dict:
    """A copy of a format-3 ``state_dict`` whose marker names the codec ``versions`` given (e.g. ``{"minifloat":
    1}``: written by commit 4c6c1cd), for a checkpoint whose codes do not decide its layout. Loading the copy
    converts its codes like any format-4 state of those versions; the codecs not named are version 1."""
    mark = state_dict.get(STATE_DICT_MARKER) if isinstance(state_dict, dict) else None
    if not isinstance(mark, dict) or mark.get("format") != 3:
        raise ValueError(f"assume_codecs is for state format 3, which names no codec; this state_dict's "
                         f"'{STATE_DICT_MARKER}' marker has format {(mark or {}).get('format')!r}")
    named = {n: 1 for n in CODEC_VERSIONS}
    named.update(versions)
    _versions_in({n: {"version": v} for n, v in named.items()})  # refuses unknown names and versions
    out = copy.copy(state_dict)
    out[STATE_DICT_MARKER] = dict(mark, format=4, **{CODECS_KEY: {n: {"version": v, "map": KNOWN[(n, v)]}
                                                                    for n, v in named.items()}})
    return out


__all__ = ["CODECS_KEY", "FOUR_BIT", "CODEC_VERSIONS", "KNOWN", "UPGRADES", "DECIDING_BLOCKS", "codec_name",
           "marker_codecs", "saved_codes", "Evidence", "evidence_of", "blocks_evidence", "codes_evidence",
           "decide_minifloat", "versions_of", "current", "upgraded_codes", "assume_codecs"]
