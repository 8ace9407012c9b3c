"""Build the optional compiled helper (``ucm_protocol._native``); everything else is in pyproject.toml.

``optional=True``: on a machine without a C compiler or Python headers the package still installs,
without the helper, and the local data plane stays off (clients use gRPC, as they always could).
Debian/Ubuntu: ``apt-get install gcc python3-dev`` gives it. ``make run`` and the container image
build it; ``python -c "import ucm_protocol._native"`` tells whether it is there.
"""

import sysconfig
from pathlib import Path

from setuptools import Extension, setup


def _xxhash_header() -> list[tuple[str, str | None]]:
    """XXH3 without the GIL where the xxHash header is there (Debian: libxxhash-dev; header-only use,
    nothing to link and nothing needed at run time); without it the helper has no ``xxh3_64``."""
    dirs = [sysconfig.get_config_var("INCLUDEDIR") or "/usr/include", "/usr/include", "/usr/local/include"]
    return [("UCM_HAVE_XXHASH", "1")] if any((Path(d) / "xxhash.h").is_file() for d in dirs) else []


setup(
    ext_modules=[
        Extension(
            "ucm_protocol._native",
            [f"ucm_protocol/csrc/{name}.c" for name in ("module", "table", "ring", "blocks", "index", "records")],
            depends=["ucm_protocol/csrc/native.h"],
            optional=True,
            define_macros=_xxhash_header(),
            extra_compile_args=["-O2", "-std=gnu11", "-pthread", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            extra_link_args=["-pthread"],  # copy_pairs splits a large batch over two threads
        )
    ]
)
