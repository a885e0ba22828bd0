"""A verl ToolAgentLoop whose rollouts close their Tangram sandboxes when they end.

verl 0.9 creates and releases a tool instance for every tool call, so a rollout's
sandbox (tangram_sdk.integrations.verl.TangramTool) outlives the calls; this loop closes
it as soon as the rollout finishes (otherwise the tool's idle TTL does, later).
Select it with (see examples/verl_agent_loops.yaml):

    actor_rollout_ref.rollout.agent.agent_loop_config_path=examples/verl_agent_loops.yaml
    actor_rollout_ref.rollout.agent.default_agent_loop=tangram_tool_agent

Importing it needs verl's agent loop, i.e. verl with torch: Tangram's own test suite runs
torch-free and therefore tests `rollout_scope()` itself, not this subclass.
"""

from verl.experimental.agent_loop import ToolAgentLoop

from tangram_sdk.integrations.verl import rollout_scope


class TangramToolAgentLoop(ToolAgentLoop):
    async def run(self, sampling_params, **kwargs):
        async with rollout_scope():
            return await super().run(sampling_params, **kwargs)
