"""Vision-language models through mlx-vlm (an optional extra, imported only when one
loads): the model behind the runner's interface (`model`), images in a prompt (`prompt`),
and the encoder's output cached by image digest (`features`)."""
