"""dcp_ext.data: the data layer (tokenizers, .bin/.idx documents, batches, THD micro-batches).

Why a package of its own: the planner needs sample lengths before a batch forms, and the
runtime needs packed (THD) micro-batches; both come from here, over Megatron's own
`.bin/.idx` format. Modules are imported one by one (no re-exports) so that the pure ones
(`stats`, `batches`) stay free of torch and megatron.core.
"""
