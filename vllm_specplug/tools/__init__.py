"""The tools around the plugin: what benchmarks, the simulator, the demo and tests use.

The plugin (``vllm_specplug`` outside this folder: ``plugin``,
``scheduler``, ``controller/``, ``profiling/``, ``patches/``, ``config``,
``metrics``, ``trace``) never imports a tool; the tools import the plugin.
Only the ``vllm-specplug`` launcher runs here before it hands over to vLLM's
own CLI.

- ``cli``: the ``vllm-specplug`` command (serve, models, data, trace, profile, vllm)
- ``serve``: ``vllm-specplug serve`` and ``vllm-specplug vllm``, the set-up
  before vLLM's CLI (version lookup, multiprocess dir, model keys, KV cache)
- ``trace_report``: a decision trace read back, plotted, its calibration table
- ``models``, ``datasets``: the offline model cache and the public prompt sets
- ``bench``: the in-process and served benchmarks (``bench/reconfigure``: one
  engine switched between policies); ``demo``: their quick mode
- ``sim``: the simulator of a serving engine; ``sweeps``: its grids as Ray tasks
- ``profile_report``: ``vllm-specplug profile``, a deployment's profile shown
- ``testing``: tiny models made at test time, and helpers the tests share
"""
