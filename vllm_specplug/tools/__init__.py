"""The tools around the plugin: what benchmarks, the simulator, the demo and tests use.

A server imports none of this.  The plugin (``vllm_specplug`` outside this
folder: ``plugin``, ``scheduler``, ``controller/``, ``profiling``,
``patches/``, ``config``, ``metrics``, ``trace``, ``serve``) never imports a
tool; the tools import the plugin.

- ``cli``: the ``vllm-specplug`` command (serve, models, data, trace, profile, vllm)
- ``models``, ``datasets``: the offline model cache and the public prompt sets
- ``bench``: the in-process and served benchmarks; ``demo``: their quick mode
- ``sim``: the simulator of a serving engine; ``sweeps``: its grids as Ray tasks
- ``profile_report``: ``vllm-specplug profile``, a deployment's profile shown
- ``testing``: tiny models made at test time, and helpers the tests share
"""
