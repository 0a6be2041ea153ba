"""LM Studio behind the proxy: what the proxy does not serve passes through (`passthrough`,
`relay`, `websocket`, over `client`'s session with `headers`' filtering), its model list
merged with ours (`model_list`), its REST API (`lmstudio_rest`), and keeping one copy of
the weights (`one_copy`)."""
