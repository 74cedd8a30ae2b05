import json
import math

from workbench.core.fmt import bytes2human
from workbench.telemetry.na import NA, NaType, is_na, jsonable


def test_na_prints_na_and_behaves_like_nan():
    assert str(NA) == "N/A" and repr(NA) == "NA"
    assert f"{NA:>8.1f}" == "     N/A" and f"{NA:.0f}" == "N/A" and f"{NA:<5}|" == "N/A  |"
    assert math.isnan(NA + 1) and math.isnan(NA * 0) and not (NA > 0) and not (NA <= 0) and NA != NA
    assert NaType() is NA and is_na(NA) and is_na(None) and is_na(math.nan) and not is_na(0.0)
    assert bytes2human(NA) == "N/A"


def test_jsonable_replaces_nan_with_null():
    obj = {"a": NA, "b": [1.0, math.nan, {"c": NA}], "d": "x"}
    assert json.loads(json.dumps(jsonable(obj), allow_nan=False)) == {
        "a": None,
        "b": [1.0, None, {"c": None}],
        "d": "x",
    }
