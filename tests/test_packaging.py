"""The repository's top-level kernels/ folder must not shadow PyPI's `kernels` package.

transformers (>= 5) imports Hugging Face's `kernels` package when it is installed. Run
from the repository root (`python -m pytest`, a notebook, `python -c`), the working
directory comes first on sys.path; were kernels/ a regular package there, `import
kernels` would load our folder and transformers (hence peft, hence the HF oracles) would
fail to import. kernels/ is therefore a plain folder (no __init__.py), whose
shrink_expand/ is installed as `lora_jax.kernels.shrink_expand`.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_kernels_folder_is_not_a_regular_package():
    assert (ROOT / "kernels" / "shrink_expand" / "__init__.py").exists()
    assert not (ROOT / "kernels" / "__init__.py").exists(), (
        "kernels/__init__.py makes the repository's kernels/ a regular package that "
        "shadows PyPI's `kernels` (imported by transformers) when run from the root"
    )


def test_import_kernels_from_the_root_is_not_ours():
    import lora_jax.kernels as k  # the re-exports of kernels/shrink_expand

    assert k.lora_shrink.__name__ == "lora_shrink"
    # Run from the root, as `python -m pytest` is: the working directory leads sys.path.
    code = "import importlib.util as u; s = u.find_spec('kernels'); print(s and s.origin)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    # None: no `kernels` installed, our folder is at most a namespace portion (no origin);
    # else the installed package's __init__.py, never a file of this repository.
    assert out == "None" or not out.startswith(str(ROOT)), out
