"""``vllm-specplug`` command.

    vllm-specplug serve [vllm serve arguments...]   vLLM's server, on CPU or GPU builds
    vllm-specplug models {list,fetch,path} ...      the offline model cache
    vllm-specplug data {list,fetch,path} ...        public prompt sets (HumanEval, ShareGPT)
    vllm-specplug vllm [vllm arguments...]          vLLM's own CLI (e.g. bench serve) on CPU builds
    vllm-specplug trace plot TRACE.jsonl [-o PNG]   K over time per request from a trace
    vllm-specplug trace confidence TRACE.jsonl [-o PNG]   passes saved, calibration table and plot
    vllm-specplug profile --config FILE [--out DIR] the deployment's step-cost profile
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    if argv[0] == "serve":
        from vllm_specplug.tools.serve import main as serve_main
        from vllm_specplug.tools.models import resolve_model_keys

        return serve_main(argv[1:], resolve=resolve_model_keys)
    if argv[0] == "trace":
        from vllm_specplug.tools.trace_report import main as trace_main

        return trace_main(argv[1:])
    if argv[0] == "profile":
        from vllm_specplug.tools.serve import install_version_shim

        install_version_shim()
        from vllm_specplug.tools.profile_report import main as profile_main

        return profile_main(argv[1:])
    if argv[0] == "data":
        from vllm_specplug.tools.datasets import main as data_main

        return data_main(argv[1:])
    if argv[0] == "vllm":
        from vllm_specplug.tools.serve import vllm_cli

        return vllm_cli(argv[1:])
    if argv[0] == "models":
        from vllm_specplug.tools.models import main as models_main

        return models_main(argv[1:])
    print(f"vllm-specplug: unknown command {argv[0]!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
