"""LM Studio behind the proxy: what the proxy does not serve passes through (`passthrough`,
`relay`), its REST API (`lmstudio_rest`), and keeping one copy of the weights (`one_copy`)."""
