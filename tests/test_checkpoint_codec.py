"""Saved codes and their codec versions (``ds_q8/optim/codec_versions.py``), on checkpoint files written by the old
code (tests/data/old_state, with the script that wrote them):

* 047c763 (one-zero minifloat layout) and 4c6c1cd (two-zero layout) both wrote state format 3, which names no
  map: each file loads into today's optimizer decoded as the old code decoded it, the layout decided from
  the codes and said in a warning; 4c6c1cd's codes converted exactly; training goes on;
* dynamic6 codes of format 3 load unchanged;
* a file whose codes do not decide the layout is refused with the documented error, nothing changed, and
  loads once the layout is named;
* format 4 names its codecs and round-trips codes bit for bit; an unknown codec or version is refused by name;
* the offline tools (export_fp32_state_dict, to-fp32 and to-universal of a DeepSpeed checkpoint) decode
  and stamp the same; a DeepSpeed engine resumes the old ZeRO-2 checkpoints (slow).
"""
import copy
import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import ds_q8
from ds_q8 import functional as F
from ds_q8.integration import universal
from ds_q8.optim import codec_versions as CV
from ds_q8.optim.state_keys import absmax_key, codes_key

DATA = Path(__file__).resolve().parent / "data" / "old_state"
SCRIPTS = Path(__file__).resolve().parent / "ds_scripts"
NEW, OLD = "047c763", "4c6c1cd"  # one-zero and two-zero minifloat layouts
MINIFLOAT_CASES = ("adamw", "lion", "ademamix")
DS_OPTIM = "ds/step4/zero_pp_rank_0_mp_rank_00_optim_states.pt"
# one-zero file, two-zero file: what the loader's warning says it read
LAYOUT_SAID = {NEW: "read as the one-zero layout", OLD: "read as the two-zero layout of commit 4c6c1cd"}


def _files(commit: str, case: str):
    sd = torch.load(DATA / commit / f"{case}.optim.pt", map_location="cpu", weights_only=True)
    ref = torch.load(DATA / commit / f"{case}.ref.pt", map_location="cpu", weights_only=True)
    return sd, ref


def _optimizer(ref: dict):
    params = [nn.Parameter(t.clone()) for t in ref["params"]]
    return params, getattr(ds_q8, ref["optimizer"])(params, **ref["options"])


def _old_map(commit: str, signed: bool) -> torch.Tensor:
    """The map the old code decoded with: float64 magnitudes over the largest, rounded once to float32, the
    signed map mirrored with one zero (047c763) or two (4c6c1cd)."""
    mags = F.minifloat_magnitudes(*F.MINIFLOAT_BITS[signed])
    if not signed:
        return mags.to(torch.float32)
    if commit == NEW:
        return F.mirrored_map(mags)
    return (torch.cat([-mags.flip(0), mags]) + 0.0).to(torch.float32)


def _entry_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in float32 spacings at |b|."""
    spacing = torch.nextafter(b.abs(), torch.tensor(float("inf"))) - b.abs()
    return (a - b).abs() / spacing


def _check_decoded(opt, params, decoded_ref, exact: bool = False) -> None:
    """Today's decoded state against the old code's: each value is a map entry times the block's bfloat16
    maximum, rounded once; today's entries are within one float32 ulp of the old ones (maps.py computes
    them from their bits), so a value is within one ulp of the entry relative to itself plus the
    product's rounding (2**-22 relative); zeros stay zeros."""
    for p, want in zip(params, decoded_ref):
        got = opt.dequantized_state(p)
        assert sorted(got) == sorted(want)
        for name, w in want.items():
            if exact:
                assert torch.equal(got[name], w), name
                continue
            torch.testing.assert_close(got[name], w, rtol=2.0 ** -22, atol=0.0, msg=name)
            assert torch.equal(got[name] == 0, w == 0), name


def _continues(opt, params) -> None:
    before = [p.detach().clone() for p in params]
    steps = [int(opt.state[p]["step"]) for p in params]
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    assert all(torch.isfinite(p).all() and not torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert [int(opt.state[p]["step"]) for p in params] == [s + 2 for s in steps]
    for p in params:
        assert all(torch.isfinite(v).all() for v in opt.dequantized_state(p).values())


# ---------------------------------------------------------------------------- the files themselves
@pytest.mark.parametrize("commit", [NEW, OLD])
@pytest.mark.parametrize("case", MINIFLOAT_CASES)
def test_the_files_are_what_the_old_maps_decode(commit, case):
    """The reference values are each file's codes looked up in that commit's map, times the block maxima:
    what the tests below compare against is the old code's decoding, and the layouts are as described."""
    sd, ref = _files(commit, case)
    mark = sd["ds_q8"]
    assert mark["format"] == 3 and "codecs" not in mark
    assert ref["commit"].startswith(commit)
    for pid, st in sd["state"].items():
        if codes_key(0) not in st:
            continue  # a tensor under min_8bit_size keeps fp32 state
        for i, (name, signed) in enumerate(zip(mark["state_names"], mark["state_signed"])):
            values = F.dequantize_flat(st[codes_key(i)].reshape(-1), st[absmax_key(i)], _old_map(commit, signed), 64)
            assert torch.equal(values, ref["decoded"][pid][name].reshape(-1)), (pid, name)


# ---------------------------------------------------------------------------- format 3 loads
@pytest.mark.parametrize("commit", [NEW, OLD])
@pytest.mark.parametrize("case", MINIFLOAT_CASES)
def test_format3_minifloat_loads_as_the_old_code_decoded_it(commit, case):
    sd, ref = _files(commit, case)
    saved = copy.deepcopy(sd)
    params, opt = _optimizer(ref)
    with pytest.warns(RuntimeWarning, match=LAYOUT_SAID[commit]):
        opt.load_state_dict(sd)
    _check_decoded(opt, params, ref["decoded"])
    mark = sd["ds_q8"]
    for pid, p in enumerate(params):
        st, old = opt.state[p], saved["state"][pid]
        if codes_key(0) not in old:
            continue
        for i, signed in enumerate(mark["state_signed"]):
            old_codes = old[codes_key(i)].reshape(-1).long()
            codes = st[codes_key(i)].reshape(-1).long()
            if commit == NEW or not signed:
                assert torch.equal(codes, old_codes)  # the codes are kept
            else:  # two-zero codes moved exactly one down above 127: the same entry of today's map
                assert torch.equal(codes, torch.where(old_codes >= 128, old_codes - 1, old_codes))
            # either way: the nearest entry of today's map to the old entry, within one ulp of it
            old_entry = _old_map(commit, signed)[old_codes]
            today = F.state_map("minifloat", signed, "cpu")
            nearest = (today[None, :] - old_entry[:, None]).abs().argmin(dim=1)
            assert torch.equal(codes, nearest)
            assert float(_entry_ulps(today[codes], old_entry).max()) <= 1.0
    for a, b in zip(sd["state"].values(), saved["state"].values()):  # the argument is left as it was
        assert all(torch.equal(a[k], b[k]) for k in b if torch.is_tensor(b[k]))
    _continues(opt, params)


def test_the_warning_gives_the_evidence():
    sd, ref = _files(OLD, "adamw")
    _, opt = _optimizer(ref)
    with pytest.warns(RuntimeWarning) as caught:
        opt.load_state_dict(sd)
    said = " ".join(str(w.message) for w in caught)
    ev = CV.evidence_of(sd)
    assert ev.top_255 > 0 and ev.led_253 == 0
    assert f"{ev.top_255} codes 255" in said and f"read {ev.codes} codes and {ev.blocks} whole blocks" in said
    assert "converted exactly" in said and "format 4" in said


def test_format3_dynamic6_loads_unchanged():
    sd, ref = _files(OLD, "adamw_dynamic6")
    params, opt = _optimizer(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # nothing to decide, nothing to say
        opt.load_state_dict(copy.deepcopy(sd))
    _check_decoded(opt, params, ref["decoded"], exact=True)
    for pid, p in enumerate(params):
        for key, v in sd["state"][pid].items():
            if torch.is_tensor(v) and v.dtype == torch.uint8:
                assert torch.equal(opt.state[p][key].reshape(-1), v.reshape(-1))
    _continues(opt, params)


@pytest.mark.parametrize("commit", [NEW, OLD])
def test_export_fp32_decodes_as_the_old_code(commit):
    sd, ref = _files(commit, "ademamix")
    with pytest.warns(RuntimeWarning, match=LAYOUT_SAID[commit]):
        out = ds_q8.AdEMAMix8bitBlock.export_fp32_state_dict(sd)
    for pid, want in enumerate(ref["decoded"]):
        for name, w in want.items():
            torch.testing.assert_close(out["state"][pid][name], w, rtol=2.0 ** -22, atol=0.0)


# ---------------------------------------------------------------------------- refused, and named
def _undecidable(commit):
    sd, ref = _files(commit, "undecidable")
    ev = CV.evidence_of(sd)
    assert ev.above_zero > 0 and ev.top_255 == 0 and ev.led_253 == ev.led_254 == 0  # what the file was made for
    return sd, ref


@pytest.mark.parametrize("commit", [NEW, OLD])
def test_undecidable_codes_are_refused_and_nothing_changes(commit):
    sd, ref = _undecidable(commit)
    saved = copy.deepcopy(sd)
    params, opt = _optimizer(ref)
    params[0].grad = torch.ones_like(params[0])
    opt.step()
    state_before = {k: v.clone() for k, v in opt.state[params[0]].items()}
    groups_before = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    with pytest.raises(ValueError) as e:
        opt.load_state_dict(sd)
    msg = str(e.value)
    assert "state format 3" in msg and "two-zero layout" in msg and "one-zero layout" in msg
    assert "do not say which" in msg and f"{int(sd['state'][0]['state1'].ge(128).sum())} codes above 127" in msg
    assert "Nothing was loaded" in msg and "export_fp32_state_dict" in msg and "assume_codecs" in msg
    assert opt.state[params[0]].keys() == state_before.keys()
    assert all(torch.equal(opt.state[params[0]][k], v) for k, v in state_before.items())
    assert {k: v for k, v in opt.param_groups[0].items() if k != "params"} == groups_before
    for k, v in saved["state"][0].items():
        assert torch.equal(sd["state"][0][k], v) if torch.is_tensor(v) else sd["state"][0][k] == v
    with pytest.raises(ValueError, match="do not say which"):
        ds_q8.AdamW8bitBlock.export_fp32_state_dict(sd)


@pytest.mark.parametrize("commit", [NEW, OLD])
def test_undecidable_codes_load_once_the_layout_is_named(commit):
    sd, ref = _undecidable(commit)
    named = CV.assume_codecs(sd, {"minifloat": 2 if commit == NEW else 1})
    assert sd["ds_q8"]["format"] == 3  # a copy
    params, opt = _optimizer(ref)
    opt.load_state_dict(named)
    _check_decoded(opt, params, ref["decoded"])
    wrong = CV.assume_codecs(sd, {"minifloat": 1 if commit == NEW else 2})
    params, opt = _optimizer(ref)
    opt.load_state_dict(wrong)  # what the checkpoint cannot say: here the positive values move one entry
    assert not torch.equal(opt.dequantized_state(params[0])["exp_avg"], ref["decoded"][0]["exp_avg"])
    with pytest.raises(ValueError, match="version 7"):
        CV.assume_codecs(sd, {"minifloat": 7})


def test_codes_that_fit_neither_layout_are_refused():
    sd, ref = _files(NEW, "adamw")
    assert CV.evidence_of(sd).led_253 > 0
    st = sd["state"][0]
    st["state1"] = st["state1"].clone()
    st["state1"].view(-1)[0] = 255  # a two-zero 1.0 in a checkpoint with a block only the one-zero layout writes
    _, opt = _optimizer(ref)
    with pytest.raises(ValueError, match="fit neither layout"):
        opt.load_state_dict(sd)


# ---------------------------------------------------------------------------- format 4
def _trained(commit=NEW, case="ademamix"):
    sd, ref = _files(commit, case)
    params, opt = _optimizer(ref)
    with pytest.warns(RuntimeWarning):
        opt.load_state_dict(sd)
    return params, opt, ref


def test_format4_names_its_codecs_and_round_trips_codes_bit_for_bit(tmp_path):
    params, opt, ref = _trained()
    sd = opt.state_dict()
    mark = sd["ds_q8"]
    assert mark["format"] == 4 == ds_q8.optim.state_io.STATE_FORMAT
    assert mark["codecs"] == {"minifloat": {"version": 2, "map": CV.KNOWN[("minifloat", 2)]}}
    torch.save(sd, tmp_path / "sd.pt")
    again = torch.load(tmp_path / "sd.pt", weights_only=True)
    params2, opt2 = _optimizer(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # format 4: nothing to decide
        opt2.load_state_dict(again)
    for p, q in zip(params, params2):
        assert opt.state[p].keys() == opt2.state[q].keys()
        assert all(torch.equal(opt.state[p][k], opt2.state[q][k]) for k in opt.state[p])
        assert all(opt.state[p][k].dtype == opt2.state[q][k].dtype for k in opt.state[p])


def test_format4_of_several_codecs():
    p8, p4 = nn.Parameter(torch.randn(300)), nn.Parameter(torch.randn(200))
    opt = ds_q8.AdamW8bitBlock([{"params": [p8], "quantization": "dynamic6"}, {"params": [p4], "optim_bits": 4}],
                               min_8bit_size=16)
    for p in (p8, p4):
        p.grad = torch.randn_like(p)
    opt.step()
    assert set(opt.state_dict()["ds_q8"]["codecs"]) == {"dynamic6", "format4"}


@pytest.mark.parametrize("edit, error", [
    (lambda c: c["minifloat"].update(version=3), "'minifloat' codes are of codec version 3; this ds_q8 reads version"),
    (lambda c: c.update(minifloat9=c.pop("minifloat")), "codec 'minifloat9', which this ds_q8 does not know"),
    (lambda c: c.pop("minifloat"), "names no codec for them"),
    (lambda c: c["minifloat"].update(version="2"), "needs an integer 'version'"),
])
def test_unknown_codecs_and_versions_are_refused_by_name(edit, error):
    params, opt, ref = _trained()
    sd = opt.state_dict()
    edit(sd["ds_q8"]["codecs"])
    before = {k: v.clone() for k, v in opt.state[params[0]].items()}
    with pytest.raises(ValueError, match=error):
        opt.load_state_dict(sd)
    assert all(torch.equal(opt.state[params[0]][k], v) for k, v in before.items())


def test_format4_converts_an_older_version_it_names():
    sd, ref = _files(OLD, "adamw")
    named = CV.assume_codecs(sd, {"minifloat": 1})
    assert named["ds_q8"]["codecs"]["minifloat"]["version"] == 1
    params, opt = _optimizer(ref)
    opt.load_state_dict(named)
    _check_decoded(opt, params, ref["decoded"])
    assert opt.state_dict()["ds_q8"]["codecs"]["minifloat"]["version"] == 2


def test_the_evidence_adds_over_ranks():
    """A ZeRO checkpoint decides over every rank's share: the loader sums the evidence through the layouts'
    comm (here one that doubles it, as two ranks with the same share would)."""
    sd, _ = _files(NEW, "adamw")
    ev = CV.evidence_of(sd)
    assert ev.summed(lambda t: t.mul_(2)) == ev + ev
    versions, why = CV.versions_of(sd, reduce=lambda t: t.mul_(2))
    assert versions["minifloat"] == 2 and f"{2 * ev.codes} codes" in why


# ---------------------------------------------------------------------------- DeepSpeed checkpoints, offline
def _ds_reference(commit):
    return torch.load(DATA / commit / "ds" / "ds.ref.pt", map_location="cpu", weights_only=True)


@pytest.mark.parametrize("commit", [NEW, OLD])
def test_to_fp32_of_an_old_deepspeed_checkpoint(commit, tmp_path):
    out = tmp_path / "fp32"
    with pytest.warns(RuntimeWarning, match=LAYOUT_SAID[commit]):
        universal.to_fp32_checkpoint(str(DATA / commit / "ds" / "step4"), str(out))
    rank = torch.load(out / Path(DS_OPTIM).name, map_location="cpu", weights_only=False)
    inner = rank["optimizer_state_dict"]["base_optimizer_state"]
    assert inner["ds_q8"]["format"] == 4
    ref = _ds_reference(commit)
    for pid, want in enumerate(ref["decoded"]):
        for name, w in want.items():
            torch.testing.assert_close(inner["state"][pid][name], w, rtol=2.0 ** -22, atol=0.0)


@pytest.mark.parametrize("commit", [NEW, OLD])
def test_to_universal_stamps_current_codes(commit, tmp_path):
    """The parameter files of the universal route carry codes in the current codec version and say so;
    a file that names no codec (converted before format 4) is decided over the folder, and an unknown
    version is refused by name."""
    codes = {}
    with pytest.warns(RuntimeWarning, match=LAYOUT_SAID[commit]):
        universal.to_fp32_checkpoint(str(DATA / commit / "ds" / "step4"), str(tmp_path / "fp32"), codes)
    assert set(codes) == {"0.weight", "0.bias", "2.weight", "2.bias"}  # the model's parameters, whole
    assert not codes.pop("2.bias").eight_bit  # under min_8bit_size: fp32 values, no codec
    folder = tmp_path / "uni"
    (folder / universal.CODES_FOLDER).mkdir(parents=True)
    for name, entry in codes.items():
        payload = entry.payload()
        assert payload[universal.CODEC_KEY] == {"name": "minifloat", "version": 2}
        torch.save(payload, folder / universal.CODES_FOLDER / f"{name}.pt")
    # today's optimizer over the parameters, each its own segment, reads them back
    params = {name: nn.Parameter(torch.zeros(e.numel)) for name, e in codes.items()}
    opt = ds_q8.AdamW8bitBlock(list(params.values()), min_8bit_size=16)
    group = opt.param_groups[0]
    segs = [ds_q8.optim.layout.StateLayout.for_parameter(p, True, 64, name=n).segments[0] for n, p in params.items()]
    got = universal._saved_state(str(folder), segs, group, opt, {})
    assert [g[universal.CODEC_KEY]["version"] for g in got] == [2] * len(got)
    current = [torch.cat([g["codes"][0] for g in got])]

    # the same files as a universal checkpoint converted before format 4 wrote them: no codec, the layout's codes
    for name, entry in codes.items():
        payload = entry.payload()
        del payload[universal.CODEC_KEY]
        if commit == OLD:  # back to the two-zero layout: 1.0 at 255 (the one zero stands for the +0 of 128)
            c = payload["codes"][0]
            payload["codes"][0] = torch.where(c >= 127, c + 1, c).to(torch.uint8)
        torch.save(payload, folder / universal.CODES_FOLDER / f"{name}.pt")
    with pytest.warns(RuntimeWarning, match="were read as " + LAYOUT_SAID[commit].replace("read as ", "")):
        got = universal._saved_state(str(folder), segs, group, opt, {})
    assert torch.equal(torch.cat([g["codes"][0] for g in got]), current[0])

    entry = next(iter(codes.values())).payload()
    entry[universal.CODEC_KEY]["version"] = 5
    torch.save(entry, folder / universal.CODES_FOLDER / f"{next(iter(codes))}.pt")
    with pytest.raises(ValueError, match="'minifloat' codes are of codec version 5"):
        universal._saved_state(str(folder), segs, group, opt, {})


# ---------------------------------------------------------------------------- DeepSpeed checkpoints, resumed
@pytest.mark.slow
def test_a_deepspeed_engine_resumes_the_old_zero2_checkpoints(tmp_path):
    from helpers.ds_launch import env, free_port

    e = dict(env(), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    work = tmp_path / "data"
    shutil.copytree(DATA, work / "data" / "old_state")  # DeepSpeed may write beside a checkpoint it loads
    script = work / "ds_scripts" / "old_state_resume.py"
    script.parent.mkdir()
    shutil.copy(SCRIPTS / "old_state_resume.py", script)
    proc = subprocess.run([sys.executable, str(script), NEW, OLD], env=e, capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(line[-1][len("RESULT "):])
    for commit in (NEW, OLD):
        r = out[commit]
        assert r["worst_rel"] <= 2.0 ** -22, r
        assert r["steps"] == [6] and all(x == x for x in r["losses"]) and r["losses"][1] < r["losses"][0]
        assert len(r["warnings"]) == 1 and LAYOUT_SAID[commit] in r["warnings"][0]
