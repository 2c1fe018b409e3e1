"""Packaging beyond what pyproject.toml can say: the embedded default model's files
(examples/tiny-llama-default) go into the wheel beside pipeline/loading/default_model.py, which
looks for them there when there is no checkout around it (pipeline.loading.default_model.PACKAGED_DIR)."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

MODEL_FILES = Path(__file__).resolve().parent / "examples" / "tiny-llama-default"


class BuildWithDefaultModel(build_py):
    def run(self):
        super().run()
        if not self.editable_mode:  # an editable install reads them from the checkout
            self.copy_tree(str(MODEL_FILES), str(Path(self.build_lib) / "pipeline" / "loading" / "tiny-llama-default"))


setup(cmdclass={"build_py": BuildWithDefaultModel})
