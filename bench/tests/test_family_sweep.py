"""bench/family_sweep.py --resume (no GPU): a family too large for one device call is swept over several;
the second call keeps the first one's rows and runs only the cells they lack, on the same kind of GPU."""

from __future__ import annotations

import json
import os
import sys

import pytest

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)
import family_sweep  # noqa: E402  (bench/ is a folder of scripts, not a package)


def _planned():
    cells = family_sweep.gemm_cells() + family_sweep.decode_cells() + family_sweep.prefill_cells()
    return cells, {c["op"]: sorted(c) for c in cells}


def test_a_measured_cell_keeps_its_key_and_cells_differ(tmp_path, monkeypatch):
    cells, fields = _planned()
    keys = [family_sweep._cell_key(c, fields) for c in cells]
    assert len(set(keys)) == len(cells)                      # no two planned cells collide
    measured = dict(cells[0], ours_ms=0.01, cublas_ms=0.01, ratio=1.0)
    assert family_sweep._cell_key(measured, fields) == keys[0]  # what a run adds is not part of the key


def test_resume_keeps_rows_of_the_same_gpu_only_and_reruns_errors(tmp_path, monkeypatch):
    cells, fields = _planned()
    rows = [dict(cells[0], ratio=1.0), dict(cells[1], error="OutOfMemoryError: ...")]
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(dict(device="NVIDIA H200", rows=rows)))
    monkeypatch.setattr(family_sweep.torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    kept = family_sweep._resumed_rows(str(path), fields)
    assert [family_sweep._cell_key(r, fields) for r in kept] == [family_sweep._cell_key(cells[0], fields)]
    monkeypatch.setattr(family_sweep.torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    with pytest.raises(SystemExit, match="do not make one distribution"):
        family_sweep._resumed_rows(str(path), fields)
