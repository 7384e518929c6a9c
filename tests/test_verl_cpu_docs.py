"""docs/verl-cpu.md lists every CPU patch of verl, mbridge and megatron-core, and nothing else."""

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs" / "verl-cpu.md"


def test_the_docs_list_each_cpu_patch_once():
    from ablate.backends.verl.cpu.patches import CUDA_LITERAL_MODULES, PATCHES

    rows = re.findall(r"^\| `([a-z_]+)` \|", DOCS.read_text(), flags=re.M)
    assert rows == [patch.name for patch in PATCHES]
    assert f"in {len(CUDA_LITERAL_MODULES)} megatron-core modules" in DOCS.read_text()


def test_importing_the_cpu_package_imports_neither_verl_nor_ray_nor_megatron():
    import subprocess
    import sys

    code = ("import sys, ablate.backends.verl.cpu, ablate.backends.verl.launch; "
            "print(sorted(m for m in ('verl', 'ray', 'megatron') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
