"""Where CuTe DSL writes the artifacts the compile tests keep.

test_cute_compile.py and test_research_kernels.py set `CUTE_DSL_KEEP=ptx` to read each kernel's
PTX; CuTe DSL then also writes it as a file to `CUTE_DSL_DUMP_DIR`, by default the directory
pytest runs in. Set here, at collection and before any compile, for every test of the session.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

if "CUTE_DSL_DUMP_DIR" not in os.environ:
    os.environ["CUTE_DSL_DUMP_DIR"] = tempfile.mkdtemp(prefix="agentab-cute-dsl-dump-")
    atexit.register(shutil.rmtree, os.environ["CUTE_DSL_DUMP_DIR"], ignore_errors=True)
