"""The serving benchmark's extend stand-in computes what SGLang's ``torch_native`` extend computes.

``benchmarks/sglang_serving.py`` swaps ``torch_native``'s extend attention (a query as long as the
whole sequence) for one that computes only the new tokens' rows (``standins/sitecustomize.py``, 4.),
so that a cached prefix's time to first token is not the prefix's attention again. The swap is only
fair if the outputs are the same: both are run on random tensors, in SGLang's venv, for a request
with a cached prefix, one without, and a batch mixing both with grouped-query heads.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.sglang.conftest import require_sglang

CHECK = Path(__file__).resolve().parent / "extend_rows_check.py"


def test_extend_rows_standin_matches_sglangs_extend() -> None:
    python = require_sglang()
    done = subprocess.run([str(python), str(CHECK)], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    differences = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(differences) == {"one prefix", "no prefix", "a batch"}
    for case, largest in differences.items():
        assert largest < 1e-5, f"{case}: the stand-in differs from SGLang's extend by {largest}"
