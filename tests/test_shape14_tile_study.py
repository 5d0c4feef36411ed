"""scripts/shape14_tile_study.py (issue 19, shape 14) on a tiny causal shape on the CPU: every variant is
computed and counted against the reference tile, the timings and the whole-shape estimate are written, and a
tile outside the sequence is a one-line refusal. (Which skips are bitwise is the H200's question.)"""

from __future__ import annotations

import json

from tests.conftest import load_script

TINY = ["--device", "cpu", "--dtype", "float32", "--seq-len", "200", "--d-model", "32", "--heads", "2",
        "--ffn-dim", "32", "--tile", "48", "--key-block", "32", "--repeats", "1"]


def test_every_variant_is_counted_against_the_reference_tile(tmp_path):
    study = load_script("shape14_tile_study")
    out = tmp_path / "s14.json"
    assert study.main([*TINY, "--tiles", "0,100,190", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [t["t0"] for t in report["tiles"]] == [0, 100, 190]
    last = report["tiles"][-1]
    assert (last["t1"], last["visible_keys"]) == (200, 200)  # the last tile is cut at the sequence's end
    assert report["tiles"][1]["visible_keys"] == 160  # rows 100..147 see keys < 148, rounded up to 32s
    for tile in report["tiles"]:
        assert set(tile["variants"]) == {"qk-visible", "pv-visible", "softmax-visible", "qk+pv-visible",
                                         "all-visible"}
        assert all(isinstance(v["out"], int) and v["out"] >= 0 for v in tile["variants"].values())
        assert tile["variants"]["pv-visible"]["dropped_probs_nonzero"] == 0  # beyond kv every key is masked
        assert set(tile["reference_ms"]) == set(study.STEPS) == set(tile["all-visible_ms"])
        assert tile["reference_total_ms"] > 0 and tile["all-visible_total_ms"] > 0
    assert report["estimate_s"]["reference_attention"] >= 0 and report["weights"].startswith("seeded")


def test_a_tile_outside_the_sequence_is_refused_in_one_line(tmp_path, capsys):
    study = load_script("shape14_tile_study")
    assert study.main([*TINY, "--tiles", "0,500", "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "[0, 200)" in err[0]
    assert not (tmp_path / "x.json").exists()
