"""elastic-slurm: right-sized and elastic distributed training on Slurm GPU clusters."""
from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="elastic-slurm",
    version="0.1.0",
    description="Submit-time right-sizing and in-process elasticity for torch.distributed jobs on Slurm",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["slurm_plugin*", "predictor*", "elastic_launcher*"]),
    package_data={
        "slurm_plugin": ["lua/*.lua"],
        # the measured public data predictor/datasets.py reads (each folder's SOURCE.md: origin, license)
        "predictor": ["*.yaml", "*.json", "data/*.md", "data/*.txt", "data/*/SOURCE.md", "data/*/*.csv", "data/*/*/*.csv",
                      "data/*/*/*/*.csv", "data/*/*.json.gz", "deploy/*.in"],
    },
    include_package_data=True,
    # The templates are read from the checkout in an editable install, from here otherwise.
    data_files=[("share/elastic-slurm/sbatch_templates", sorted(str(p) for p in Path("sbatch_templates").glob("*.sbatch")))],
    # torch must already be installed (`pip install torch==2.13.0` takes the CPU wheel on machines
    # without a GPU); a bare `torch` requirement resolves to a multi-GB CUDA build.
    install_requires=[
        "torch>=2.4",
        "flask>=3.0",
        "gunicorn>=22",
        "scikit-learn>=1.4",
        "scipy>=1.11",
        "numpy>=1.26",
        "sqlite-utils>=3.36",
        "nvidia-ml-py>=12",
        "click>=8.1",
        "requests>=2.31",
        "matplotlib>=3.8",
        "simpy>=4.1",  # the what-if replay's discrete-event engine (predictor/replay.py)
    ],
    extras_require={
        # a set that works together (schemathesis 4.32.5 with pytest 9.0.3, hypothesis 6.155.2, pytest-timeout
        # 2.4.0): schemathesis' pytest plugin fails under pytest 9.2, and tests/unit/test_api_fuzz.py uses the 4.x API
        "test": ["pytest>=8.4,<9.2", "pytest-timeout>=2.3,<3", "hypothesis>=6.130.12,<7", "schemathesis>=4.32,<5",
                 "pillow>=10",  # bench/vs_torchrun.py writes JPEGs (tests/unit/test_vs_torchrun_bench.py)
                 "pytest-xdist>=3.5,<4"],  # the fast tier runs on 2 processes (README: `-n 2`)
        "pyslurm": ["pyslurm"],
    },
    entry_points={
        "console_scripts": [
            "elastic-slurm=slurm_plugin.cli:main",
            "elastic-predictor=predictor.cli:main",
            "elastic-launch=elastic_launcher.cli:main",
        ]
    },
)
