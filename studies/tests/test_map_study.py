"""studies/map_study.py's signed maps from entries per binade: the library's dynamic maps are among them."""
import sys
from pathlib import Path

import pytest
import torch

from ds_q8 import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # studies/
import map_study  # noqa: E402


def test_map_study_builds_the_library_maps():
    assert torch.equal(map_study.signed_map([64, 32, 16, 8, 4, 2, 1]), F.create_dynamic_map(True))
    assert torch.equal(map_study.signed_map(list(F.DYNAMIC6_COUNTS)), F.create_dynamic6_map())
    with pytest.raises(ValueError, match="127 positive entries"):
        map_study.signed_map([64, 32])
