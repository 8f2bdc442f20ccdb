"""bench/gpu/te_check.py refuses to start without a GPU and the real Transformer Engine (it cannot
run here), and checks the same recipe flags as the CPU checks over the TE double."""

import ast
import subprocess
import sys

from tests.distributed import ROOT


def test_refuses_without_a_gpu_and_checks_the_cpu_flags():
    proc = subprocess.run([sys.executable, "bench/gpu/te_check.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    assert "needs a CUDA GPU and Transformer Engine; this machine has no GPU" in proc.stderr
    sys.path.insert(0, str(ROOT / "bench" / "gpu"))
    try:
        import te_check
    finally:
        sys.path.pop(0)
    tree = ast.parse((ROOT / "tests" / "te" / "megatron_checks.py").read_text())
    cpu_flags = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                     and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["RECIPE_FLAGS"])
    assert te_check.RECIPE_FLAGS == cpu_flags
