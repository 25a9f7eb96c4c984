"""``vllm-specplug`` command: models cache, and (later) serve."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: vllm-specplug models {list,fetch,path} ...")
        return 0
    if argv[0] == "models":
        from vllm_specplug.models import main as models_main

        return models_main(argv[1:])
    print(f"vllm-specplug: unknown command {argv[0]!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
