"""The package build's one hook: generate the gRPC stubs before build_py copies pdcluster/proto/.

Everything else is in pyproject.toml. The stubs are git-ignored and must match the grpcio-tools
the build runs with (a build requirement), so every wheel, sdist-built wheel and editable install
makes its own (scripts/gen_proto.py).
"""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts/gen_proto.py")
        gen_proto = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(gen_proto)
        gen_proto.generate(ROOT)
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs})
