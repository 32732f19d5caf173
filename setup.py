"""The one native part: packed_formats/_pixels.c, which parts an image's channels (HxWxC <-> CxHxW) in one
vectorised pass.  It is optional: where it cannot be built (no C compiler, no Python headers) pip says so
and installs the package without it, and packed_formats.native copies with numpy instead (about 3x
slower for that step).  The project's metadata and options are in setup.cfg."""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildExt(build_ext):
    """-O3 where the compiler takes it: the loops are vectorised from -O3 on (the usual -O2 does not)."""

    def build_extensions(self) -> None:
        if self.compiler.compiler_type == "unix":
            for extension in self.extensions:
                extension.extra_compile_args = [*extension.extra_compile_args, "-O3"]
        super().build_extensions()


setup(
    ext_modules=[Extension("packed_formats._pixels", ["packed_formats/_pixels.c"], optional=True)],
    cmdclass={"build_ext": BuildExt},
)
