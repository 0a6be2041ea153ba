"""The MLX thread: the step loop over every model (`scheduler`), one model's queue, prefill
and decode batch (`runner`), the admitted sequence (`sequence`), its sampling and output
rules, and speculative decoding (`speculation/`)."""
