# Packaging for the adaptive-parallel Megatron fork.
#
# Ships two things: the `dcp_ext` engine (with its C++ kernels from csrc/) and the
# `megatron.training` namespace portion that sits next to the installed megatron.core.
# The repo must never add megatron/__init__.py: `megatron` stays a PEP 420 namespace.
import glob
import sys

from setuptools import find_namespace_packages, setup

try:
    from pybind11.setup_helpers import Pybind11Extension, build_ext
except ImportError:  # pybind11 missing: install without kernels (Python reference is used)
    Pybind11Extension, build_ext = None, None

ext_modules = []
cmdclass = {}
cpp_sources = sorted(glob.glob("csrc/*.cpp"))
if Pybind11Extension is not None and cpp_sources:
    ext_modules.append(
        Pybind11Extension(
            "dcp_ext.kernels._kernels",
            cpp_sources,
            cxx_std=17,
            # no FMA contraction: the C++ kernels must equal the Python reference bit for bit
            extra_compile_args=["-O3", "-ffp-contract=off"] if sys.platform != "win32" else [],
        )
    )
    # one line instead of a silent SIGBUS when a memory-mapped data file is cut short mid-run
    ext_modules.append(Pybind11Extension("dcp_ext.data._sigbus", ["csrc/guard/sigbus_guard.cpp"], cxx_std=17))
    cmdclass["build_ext"] = build_ext

setup(
    name="megatron-dcp",
    version="0.1.0",
    description="Adaptive-parallel Megatron-LM fork: per-iteration heterogeneous layouts "
    "for variable-length GPT training",
    python_requires=">=3.10",
    packages=find_namespace_packages(include=["dcp_ext", "dcp_ext.*", "megatron.training", "megatron.training.*"]),
    py_modules=["pretrain_gpt_dcp"],
    install_requires=[
        "torch>=2.6",
        "megatron-core==0.16.1",  # mcore_compat patches its internals: the version it is tested against
        "psutil",
        "numpy",
        "pyyaml",
        "pybind11>=2.12",
        "filelock",
    ],
    extras_require={
        # apex has no wheel on PyPI: build it from source (see docs/upstream.md) if you want its fused kernels.
        "gpu": ["transformer-engine[pytorch]", "flash-attn"],
        "test": ["pytest", "hypothesis", "matplotlib", "tensorboard", "tokenizers", "sentencepiece",
                 "transformers", "safetensors"],  # tools/checkpoint_hf.py and its tests
    },
    entry_points={
        "console_scripts": [
            "dcp-plan=dcp_ext.cli.plan:main",
            "dcp-simulate=dcp_ext.cli.simulate:main",
            "dcp-profile=megatron.training.adaptive.profiling:main",
            "dcp-preprocess-data=dcp_ext.data.preprocess:main",
            "dcp-dataset-stats=dcp_ext.data.stats_report:main",
        ]
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
