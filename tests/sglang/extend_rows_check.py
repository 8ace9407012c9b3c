"""Run in SGLang's venv (``test_extend_rows_standin.py``): the serving benchmark's extend stand-in
(``standins/sitecustomize.py``, 4.) against SGLang's own ``torch_native`` extend on random tensors.

Prints one JSON line: the largest absolute difference between the two outputs, per case."""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

os.environ["UCM_SGLANG_CPU_STANDINS"] = "1"
os.environ["UCM_SGLANG_EXTEND_ROWS"] = "1"
STANDINS = Path(__file__).resolve().parent / "standins"
sys.path.insert(0, str(STANDINS))  # its torchvision stand-in (import only), as the harness has it
runpy.run_path(str(STANDINS / "sitecustomize.py"))  # installs the stand-ins' import hook
import torch  # noqa: E402
from sglang.srt.layers.attention import torch_native_backend as native  # noqa: E402

SHIPPED = native.TorchNativeAttnBackend._run_sdpa_forward_extend.__closure__
STANDIN = native.TorchNativeAttnBackend._run_sdpa_forward_extend


def shipped_extend():  # the function the stand-in wraps, from its closure
    for cell in SHIPPED or ():
        if callable(cell.cell_contents) and cell.cell_contents.__name__ == "_run_sdpa_forward_extend":
            return cell.cell_contents
    raise SystemExit("the stand-in is not installed: no shipped extend in its closure")


def case(prefixes: list[int], extends: list[int], heads: int, kv_heads: int, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    dim, slots = 64, 4096
    k_cache = torch.randn(slots, kv_heads, dim, generator=gen)
    v_cache = torch.randn(slots, kv_heads, dim, generator=gen)
    seq_lens = torch.tensor([p + e for p, e in zip(prefixes, extends, strict=True)])
    req_to_token = torch.zeros(len(prefixes), int(seq_lens.max()), dtype=torch.int64)
    for i, n in enumerate(seq_lens.tolist()):
        req_to_token[i, :n] = torch.randperm(slots, generator=gen)[:n]
    query = torch.randn(sum(extends), heads, dim, generator=gen)
    args = (
        k_cache, v_cache, req_to_token, torch.arange(len(prefixes)), seq_lens,
        torch.tensor(prefixes), torch.tensor(extends),
    )  # fmt: skip
    kw = {"scaling": dim**-0.5, "enable_gqa": heads != kv_heads, "causal": True}
    ours = STANDIN(None, query, torch.full_like(query, float("nan")), *args, **kw)
    theirs = shipped_extend()(None, query, torch.full_like(query, float("nan")), *args, **kw)
    return float((ours - theirs).abs().max())


results = {
    "one prefix": case([640], [8], 8, 4, 1),
    "no prefix": case([0], [40], 4, 4, 2),
    "a batch": case([100, 0, 333], [5, 17, 1], 8, 2, 3),
}
print(json.dumps(results))
