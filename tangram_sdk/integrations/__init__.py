"""Drop-in adapters for RL frameworks, each importable without the others:

* ``tangram_sdk.integrations.verl.TangramTool``: a verl ``BaseTool`` (tool config YAML);
* ``tangram_sdk.integrations.gym.TangramEnv``: a ``gymnasium.Env`` (``tangram/Shell-v0``);
* ``tangram_sdk.integrations.skyrl.TangramTextEnv``: a SkyRL-gym ``BaseTextEnv`` (``tangram-shell``).

This package imports none of the frameworks; each module imports only its own.
"""
