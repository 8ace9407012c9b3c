"""Build the optional compiled helper (``ucm_protocol._native``); everything else is in pyproject.toml.

``optional=True``: on a machine without a C compiler or Python headers the package still installs,
without the helper, and the local data plane stays off (clients use gRPC, as they always could).
Debian/Ubuntu: ``apt-get install gcc python3-dev`` gives it. ``make run`` and the container image
build it; ``python -c "import ucm_protocol._native"`` tells whether it is there.
"""

from setuptools import Extension, setup

XXHASH = [("UCM_HAVE_XXHASH", "1")]
"""XXH3 without the GIL: xxHash's header is vendored (``ucm_protocol/csrc/vendor``, 0.8.4, the version
the ``xxhash`` package bundles; header-only, nothing to link), so the helper checksums blocks and
reads the Posix tier's packed records on every machine that builds it, not only where a system
package happened to put ``xxhash.h``. Leave it out and the helper builds without ``xxh3_64``."""


setup(
    ext_modules=[
        Extension(
            "ucm_protocol._native",
            [f"ucm_protocol/csrc/{name}.c" for name in ("module", "table", "ring", "blocks", "index", "records")],
            depends=["ucm_protocol/csrc/native.h", "ucm_protocol/csrc/vendor/xxhash.h"],
            optional=True,
            define_macros=XXHASH,
            extra_compile_args=["-O2", "-std=gnu11", "-pthread", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            extra_link_args=["-pthread"],  # copy_pairs splits a large batch over two threads
        )
    ]
)
