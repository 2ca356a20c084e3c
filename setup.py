"""Build of gcache's optional C extension (everything else is in pyproject.toml).

``gcache._native`` (native/gcache_native.c) is built by every ``pip install`` of this
tree. It is optional: a machine without a C compiler or Python headers still installs,
``build_ext`` says why it skipped the module, and ``gcache.native`` then runs the
pure-Python twins, logging one line that says so (see native/README.md).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "gcache._native",
            sources=["native/gcache_native.c",
                     "native/third_party/xxhash/xxhash.c",
                     "native/third_party/xxhash/xxh_x86dispatch.c"],
            include_dirs=["native/third_party/xxhash"],
            extra_compile_args=["-O3", "-std=gnu11", "-fvisibility=hidden"],
            optional=True,  # a compiler failure never fails the install
        ),
    ],
)
