"""Only the C extension lives here; everything else is in pyproject.toml.

actcache._native (src/actcache/_native.c) is the loaders' copy kernel. It is optional: without a
C compiler the install still succeeds and the loaders fall back to numpy (slower; see
``actcache.loaders.native_info()``)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("actcache._native", ["src/actcache/_native.c"], extra_compile_args=["-O2"], optional=True),
    ]
)
