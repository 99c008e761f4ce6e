"""vLLM as a node's engine: the only code of the project that imports vllm.

- `engine.VllmEngine`: vLLM's `AsyncLLM` behind the node's engine interface
  (`engine.api.NodeEngine`), chosen by `EngineConfig(backend="vllm")` (node/engines.py).
- `connector.PdclusterConnector`: pdcluster's KV connector as a vLLM `KVConnectorBase_V1`
  (remote prefill over Mooncake with the project's side channel), which vLLM loads by module
  path inside its own processes.
- `events`, `stats`, `sampling`, `settings`, `handshake`, `lost`: what crosses between the
  node and vLLM (KV events, load figures, sampling options, engine arguments, the private
  folder, the router's word that a transfer's prefill node is lost); `failures`: vLLM's
  death as the node's `EngineFailure`; `async_llm`: vLLM's `AsyncLLM`, stopped again when
  its start fails part-way.

Nothing here is imported unless a node runs vLLM; `make setup-vllm` installs it
(docs/engines.md).
"""
