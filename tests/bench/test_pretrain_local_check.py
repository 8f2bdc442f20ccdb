"""bench/gpu/pretrain_local_check.py's verdict (its run itself is run_all.sh's step 4; on CPU it takes
half a minute, so the dry-run test leaves it to its deadline)."""

import pytest


def _records(precisions_last, moved=True):
    sizes = {"1.linear_qkv": 3, "1.linear_fc1": 8, "1.linear_proj": 1, "1.linear_fc2": 4}
    step = lambda p: {"linears": {k: {"precision": p[i], "numel": n, "moved": moved, "main_grad": True}  # noqa: E731
                                  for i, (k, n) in enumerate(sizes.items())}}
    return [step(["fp8"] * 4), step(["fp8"] * 4), step(precisions_last)]


LINES = ["[snip] this GPU lacks fused kernels ...", "[snip] step 3: plan abc  FP4 56.2% of linear FLOPs"]


def test_a_good_run(pretrain_local_check, monkeypatch):
    monkeypatch.setattr(pretrain_local_check, "_lacks_kernels", lambda: True)
    verdict = pretrain_local_check.judge(_records(["fp8", "fp4", "fp8", "fp4"]), LINES, 0, cuda=True)
    assert verdict == {"flags_line": 1, "replanned": 1, "trained": "3/3", "fp4_share": 0.75, "ok": 1}


@pytest.mark.parametrize("case", ["exit", "no_replan", "not_moved", "under_budget", "no_flags_line"])
def test_what_fails_it(pretrain_local_check, monkeypatch, case):
    monkeypatch.setattr(pretrain_local_check, "_lacks_kernels", lambda: True)
    records, lines, rc = _records(["fp8", "fp4", "fp8", "fp4"]), list(LINES), 0
    if case == "exit":
        rc = 1
    elif case == "no_replan":
        lines = lines[:1]
    elif case == "not_moved":
        records = _records(["fp8", "fp4", "fp8", "fp4"], moved=False)
    elif case == "under_budget":
        records = _records(["fp4", "fp8", "fp8", "fp8"])  # 3 of 16 weights
    else:
        lines = lines[1:]
    assert pretrain_local_check.judge(records, lines, rc, cuda=True)["ok"] == 0
    if case == "no_flags_line":  # on CPU, or on a GPU with TE and apex, there is no line to print
        assert pretrain_local_check.judge(records, lines, rc, cuda=False)["ok"] == 1
