"""studies/arith_maps.py: every map it names is one the simulation accepts (256 sorted entries, 1.0 and 0
among them; a signed map in ds_q8's mirrored layout with its one entry above 1.0), and a variant's name
parses into its maps and rule."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # studies/
import arith_maps  # noqa: E402


@pytest.mark.parametrize("signed,name", [(True, n) for n in arith_maps.SIGNED] + [(False, n) for n in arith_maps.UNSIGNED])
def test_every_named_map_is_one_the_simulation_takes(signed, name):
    arith_maps.check_map(arith_maps.make_map(name, signed), signed)


def test_a_variant_name_gives_its_maps_and_rule():
    spec = arith_maps.parse("q8:m=e3m4:v=e4m4:rule=code")
    assert (spec["m"], spec["v"], spec["rule"]) == ("e3m4", "e4m4", "code")
