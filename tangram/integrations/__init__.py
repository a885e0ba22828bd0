"""``tangram.integrations`` is ``tangram_sdk.integrations``'s old name: kept for existing
configs and imports, and will stay.

The framework adapters left the core's package with the rest of the SDK; each
module here (``tangram.integrations.verl``, ``.gym``, ``.skyrl``, ``.common``, ``.groups``,
``.teacher``) is the SDK's module of the same name under its old name, the same module
object, so old tool configs (``class_name: tangram.integrations.verl.TangramTool``),
``pkg://tangram.integrations.verl``, ``import tangram.integrations.gym`` and
``import tangram.integrations.skyrl`` run unchanged and register nothing twice. Like the
SDK's package, this one imports none of the frameworks.
"""
