"""Build hook (the project is described in pyproject.toml): the Triton model repository template, model_repository/,
goes into the wheel as manylora/deploy/model_repository, so that an installed manylora renders it
(python -m manylora.deploy render). An editable install renders the source tree's model_repository/ instead."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

TEMPLATE = Path(__file__).resolve().parent / "model_repository"


class BuildWithModelRepository(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        if not (TEMPLATE / "generator" / "config.pbtxt").is_file():
            raise FileNotFoundError(f"{TEMPLATE}/generator/config.pbtxt not found: the wheel carries the template")
        target = Path(self.build_lib) / "manylora" / "deploy" / "model_repository"
        shutil.copytree(TEMPLATE, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


setup(cmdclass={"build_py": BuildWithModelRepository})
