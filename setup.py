"""Build the optional compiled helper (``ucm_protocol._native``); everything else is in pyproject.toml.

``optional=True``: on a machine without a C compiler or Python headers the package still installs,
without the helper, and the local data plane stays off (clients use gRPC, as they always could).
Debian/Ubuntu: ``apt-get install gcc python3-dev`` gives it. ``make run`` and the container image
build it; ``python -c "import ucm_protocol._native"`` tells whether it is there.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "ucm_protocol._native",
            ["ucm_protocol/_native.c"],
            optional=True,
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        )
    ]
)
